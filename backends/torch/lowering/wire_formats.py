"""The `compress` VNode in torch: wire formats, their round trip, and the error-feedback state.

One definition serves both executors, so that `vgraph train` (one process)
and `vgraph launch` (the tensor really on the wire) train the same numbers:

* `Codec.encode` turns a tensor of shape [b, *per-sample] into what travels:
  the tensor itself (`none`), a float16 or bfloat16 copy (`fp16`, `bf16`), or
  for `int8` one flat uint8 buffer holding the float32 scales, then the int8
  codes (scales first, so both are views at aligned offsets);
* `Codec.decode` is the receiver's side; `decode(encode(x))` is bit for bit
  what the one-process lowering computes (`compress_forward` /
  `CompressFunction`), because it is literally that;
* `Codec.wire` says what the receiver must post (shape and dtype), and
  `wire.numel() * wire.element_size()` is `vgraph.ops.boundary.wire_bytes`
  times the samples (the cost model's number; tests hold them equal).

int8 (the rules in vgraph/ops/boundary.py): a group is the last dimension
(`token`) or, per sample, one channel across the positions (`channel`); its
scale is max |x| / 127 in float32, its codes round(x / scale) half to even,
clamped to [-127, 127]; a zero group has scale 0 and codes 0; a group holding
NaN or infinity sends scale NaN and codes 0, so it decodes to NaN (loss
scaling then skips the step, an fp32 run stops with its non-finite loss)
instead of arriving as finite numbers nobody computed.

Error feedback (`error_feedback: true`): the sender of a gradient adds the
residual it kept for the same sample position (global index in the batch:
the dropout key's offset, so micro-batches and replicas address the same rows
as one process does), sends the rounding of the sum and keeps what the
rounding lost.  A non-finite sum keeps no residual for those rows (a skipped
step must not poison the next).  The residuals are per `compress` VNode, rows
of the global batch; `ErrorFeedback.state()` is what checkpoints store, in
both `vgraph train` and `vgraph launch` (their rows merge by summing: each
row is written by exactly one replica).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from vgraph.ops.boundary import CODEC_DTYPE, SCALE_BYTES

__all__ = ["Codec", "ErrorFeedback", "CompressState", "CompressFunction", "quantize_int8", "dequantize_int8",
           "boundary_state", "load_boundary_state", "merge_residuals", "compress_modules"]

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
QMAX = 127.0


def _group_dims(x: torch.Tensor, scale: str) -> tuple[int, ...]:
    """Dimensions of a batch-first tensor one int8 scale covers: the last (token), or per sample every one
    but the last (channel, per-sample rank 2 or more); a per-sample scalar is a group of its own."""
    if x.dim() <= 1:
        return ()
    if scale == "token" or x.dim() == 2:
        return (x.dim() - 1,)
    return tuple(range(1, x.dim() - 1))


def quantize_int8(x: torch.Tensor, scale: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of x's shape, float32 scales of `Codec.scale_shape(x.shape)`) for a batch-first x."""
    xf = x.detach().float().reshape(x.shape if x.dim() else (1,))
    dims = _group_dims(xf, scale)
    if dims:
        finite = torch.isfinite(xf).all(dim=dims, keepdim=True)
        amax = xf.abs().amax(dim=dims, keepdim=True)
    else:
        finite, amax = torch.isfinite(xf), xf.abs()
    usable = finite & (amax > 0)
    scales = torch.where(finite, amax / QMAX, torch.full_like(amax, float("nan")))
    safe = torch.where(usable, scales, torch.ones_like(scales))
    codes = torch.where(usable, torch.round(xf / safe).clamp_(-QMAX, QMAX), torch.zeros_like(xf))
    return codes.to(torch.int8).reshape(x.shape), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes x scale, in `dtype` (a NaN scale makes its whole group NaN)."""
    shape = codes.shape
    c = codes.reshape(1) if codes.dim() == 0 else codes
    return (c.float() * scales).to(dtype).reshape(shape)


@dataclass(frozen=True)
class Codec:
    """One direction's wire format: `codec` in none | fp16 | bf16 | int8, int8 groups by `scale`."""

    codec: str
    scale: str = "token"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the float32 scales of an int8 tensor of batch-first `shape` (see `_group_dims`)."""
        if len(shape) <= 1:
            return tuple(shape) or (1,)
        if self.scale == "token" or len(shape) == 2:
            return (*shape[:-1], 1)
        return (shape[0], *([1] * (len(shape) - 2)), shape[-1])

    def wire(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of what travels for a tensor of `shape` and `dtype`."""
        if self.codec == "none":
            return tuple(shape), dtype
        if self.codec in CODEC_DTYPE:
            return tuple(shape), _HALF[CODEC_DTYPE[self.codec]]
        numel = 1
        for d in shape:
            numel *= d
        scales = 1
        for d in self.scale_shape(tuple(shape)):
            scales *= d
        return (SCALE_BYTES * scales + numel,), torch.uint8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.codec == "none":
            return x
        if self.codec in CODEC_DTYPE:
            return x.to(_HALF[CODEC_DTYPE[self.codec]])
        codes, scales = quantize_int8(x, self.scale)
        return torch.cat([scales.contiguous().reshape(-1).view(torch.uint8), codes.reshape(-1).view(torch.uint8)])

    def decode(self, wire: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.codec == "none":
            return wire.to(dtype)
        if self.codec in CODEC_DTYPE:
            return wire.to(dtype)
        scale_shape = self.scale_shape(tuple(shape))
        count = 1
        for d in scale_shape:
            count *= d
        scales = wire[:SCALE_BYTES * count].view(torch.float32).reshape(scale_shape)
        codes = wire[SCALE_BYTES * count:].view(torch.int8).reshape(shape)
        return dequantize_int8(codes, scales, dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): what arrives (the one-process meaning of the wire)."""
        if self.codec == "none":
            return x
        return self.decode(self.encode(x), tuple(x.shape), x.dtype)


class ErrorFeedback:
    """Per sample position of the global batch, what the last rounding of a gradient lost (float32)."""

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None  # [rows, *per-sample]

    def _rows(self, offset: int, grad: torch.Tensor) -> torch.Tensor:
        need = offset + grad.shape[0]
        r = self.residual
        if r is None or r.shape[1:] != grad.shape[1:] or r.device != grad.device:
            r = torch.zeros((need, *grad.shape[1:]), dtype=torch.float32, device=grad.device)
        elif r.shape[0] < need:
            r = torch.cat([r, r.new_zeros((need - r.shape[0], *r.shape[1:]))])
        self.residual = r
        return r[offset:need]

    def encode(self, codec: Codec, grad: torch.Tensor, offset: int) -> torch.Tensor:
        """The wire of grad + residual; the residual becomes what this rounding loses."""
        rows = self._rows(offset, grad)
        total = grad.float() + rows
        wire = codec.encode(total.to(grad.dtype))
        sent = codec.decode(wire, tuple(grad.shape), torch.float32)
        lost = total - sent
        rows.copy_(torch.where(torch.isfinite(lost), lost, torch.zeros_like(lost)))
        return wire

    def state(self) -> torch.Tensor | None:
        return None if self.residual is None else self.residual.detach().cpu().clone()

    def load(self, residual: torch.Tensor | None, device: torch.device) -> None:
        self.residual = None if residual is None else residual.to(device=device, dtype=torch.float32).clone()


class CompressFunction(torch.autograd.Function):
    """Forward: the activation's wire round trip; backward: the gradient's (with error feedback)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, state: "CompressState", offset: int) -> torch.Tensor:
        ctx.state, ctx.offset, ctx.shape, ctx.dtype = state, offset, tuple(x.shape), x.dtype
        return state.forward_codec.round_trip(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        state = ctx.state
        if state.feedback is not None:
            wire = state.feedback.encode(state.backward_codec, grad, ctx.offset)
            return state.backward_codec.decode(wire, tuple(grad.shape), grad.dtype), None, None
        return state.backward_codec.round_trip(grad), None, None


class CompressState(nn.Module):
    """A `compress` VNode's own module: its codecs and error-feedback residuals (no parameters)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.forward_codec = Codec(cfg["activations"], cfg["scale"])
        self.backward_codec = Codec(cfg["gradients"], cfg["scale"])
        self.feedback = ErrorFeedback() if cfg.get("error_feedback") and cfg["gradients"] != "none" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .dropout import current_dropout_key

        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.forward_codec.round_trip(x)
        key = current_dropout_key()  # which samples of the global batch this call holds
        return CompressFunction.apply(x, self, key.offset if key is not None else 0)


def compress_modules(module: Any) -> dict[str, nn.Module]:
    """VNode id -> module of every `compress` VNode of a compiled network (a `VGraphModule`)."""
    return {n.id: module.namespace(n.id) for n in module.network.nodes_of_type("compress")}


def boundary_state(modules: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Error-feedback residuals of the `compress` VNodes among `modules` (VNode id -> module)."""
    out = {}
    for node_id, module in modules.items():
        if isinstance(module, CompressState) and module.feedback is not None:
            state = module.feedback.state()
            if state is not None:
                out[node_id] = state
    return out


def load_boundary_state(modules: Mapping[str, nn.Module], state: Mapping[str, torch.Tensor] | None,
                        device: torch.device) -> None:
    for node_id, module in modules.items():
        if isinstance(module, CompressState) and module.feedback is not None:
            module.feedback.load((state or {}).get(node_id), device)


def merge_residuals(parts: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Residual rows from several ranks (each row written by one replica; zero elsewhere): their sum."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            have = out.get(key)
            if have is None:
                out[key] = value.clone()
                continue
            rows = max(have.shape[0], value.shape[0])
            merged = have.new_zeros((rows, *have.shape[1:]))
            merged[:have.shape[0]] += have
            merged[:value.shape[0]] += value
            out[key] = merged
    return out
