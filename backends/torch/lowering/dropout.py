"""Keyed dropout: masks that are a pure function of (seed, step, VNode, sample, element).

Why keyed: a partitioned run (`vgraph launch`) computes a step as several
micro-batches on several processes, in an order the pipeline schedule picks.
Dropout drawn from the global RNG would then see a different stream than the
single-process trainer, and the two runs would stop being the same training.
With a key set, whether element `e` of sample `i` survives at VNode `n` in
step `s` depends on (seed, s, n, i, e) alone, so

* a micro-batch holding samples `offset .. offset+b-1` draws exactly the
  masks the whole batch would have drawn for them (the trainers say which
  samples a call holds with `offset`);
* nothing depends on the global RNG, so a resumed run replays the same masks
  without restoring any RNG state.

Why counter-based: the masks are computed, not drawn.  A 64-bit
xorshift-multiply hash in int64 tensor arithmetic turns each element's
counter into 64 random bits in a handful of vectorised ops: no Python loop
per sample, no generator state, the same bits on CPU and CUDA (two's-complement
int64 multiplication wraps the same way on both), and nothing `torch.compile`
cannot trace, so a training step stays one graph.
The step-dependent part of the key lives in a small int64 tensor (not in
Python ints the compiled graph would specialise on), so a new step is new
data for the same graph, never a recompile.

How the counter is built (`mask_reference` is the same in plain Python ints,
the specification the tests hold the tensor code to):

    k_step   = mix(mix(seed) ^ step)                       # Python, per step
    k_node   = mix(k_step ^ stream(n))                      # stream: blake2b of the VNode id
    b_i      = mix(k_node + (offset + j) * GOLDEN)          # sample j of the call: [B] values
    w_e      = mix((e + 1) * GOLDEN)                        # element e: [E] values, keyless
    u_{i,e}  = round(b_i ^ w_e)                              # the only [B, E] work
    keep     = int64(u) >= -2**63 + round(p * 2**64)        # P(keep) = 1 - p

`mix(z)` is degski's 64-bit hash: twice `round(z)` (`z ^= z >> 32; z *= C`),
then `z ^= z >> 32`.  Why this shape: per element of the `[B, E]` mask there
is one xor, one round and one comparison; the full hashing is done on the
`B` per-sample bases and the `E` per-element values (the latter keyless, so
cached per size and device when not traced).  Both are bijective mixes of
distinct counters, so every (sample, element) pair combines two well-mixed
64-bit values, and the last round (xorshift + multiply) makes the
comparison nonlinear in both.  A shift by exactly 32 is the other half of the
speed: on an int64 tensor it is "xor the high int32 word into the low one"
through an int32 view of the same memory, one in-place op with no temporary
and no sign-extension masking (an arithmetic right shift of int64 would need
one).  Together they make the mask cheaper than `F.dropout`'s Bernoulli draw
on a CPU (benchmarks/bench_dropout.py).

The key is per thread (`set_dropout_key` / `clear_dropout_key` or the
`dropout_key` context manager).  Without a key, dropout falls back to
`torch.nn.functional.dropout` on the global RNG, which is what a module called
outside a trainer does.  Backward keeps the boolean mask (1 byte per element,
like `F.dropout`).
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["DropoutKey", "set_dropout_key", "clear_dropout_key", "current_dropout_key", "dropout_key",
           "keyed_dropout", "node_stream", "keep_mask", "mask_reference"]

_U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the Weyl increment of SplitMix64
_C = 0xD6E8FEB86659FD93  # degski's multiplier


def _signed(v: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    v &= _U64
    return v - (1 << 64) if v >> 63 else v


def _round(z: int) -> int:
    """One xorshift-multiply round on Python ints (unsigned 64-bit)."""
    z &= _U64
    return ((z ^ (z >> 32)) * _C) & _U64


def _mix(z: int) -> int:
    """degski's 64-bit hash on Python ints."""
    z = _round(_round(z))
    return z ^ (z >> 32)


def node_stream(node: str) -> int:
    """A VNode id's stream number: stable across processes and runs (no Python `hash()`)."""
    return int.from_bytes(hashlib.blake2b(node.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _threshold(p: float) -> int:
    """The int64 a hash must reach for its element to be kept with probability 1 - p."""
    return _signed(min(round(p * 2.0**64), _U64) + (1 << 63))


@dataclass(frozen=True)
class DropoutKey:
    """What a dropout mask is a function of, besides the VNode id and the sample's place."""

    seed: int
    step: int
    offset: int = 0  # global index of the first sample of the batch being computed
    # [mix(mix(seed) ^ step), offset] as int64 on the CPU: what the (possibly compiled) graph reads,
    # so that the graph never specialises on the step.
    values: torch.Tensor = field(init=False, compare=False, repr=False)
    _on: dict = field(init=False, default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        step_key = _mix(_mix(self.seed) ^ (self.step & _U64))
        object.__setattr__(self, "values", torch.tensor([_signed(step_key), self.offset], dtype=torch.int64))

    def on(self, device: torch.device) -> torch.Tensor:
        """`values` on `device` (copied once per key and device)."""
        if device.type == "cpu":
            return self.values
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.values.to(device, non_blocking=True)
        return t


_STATE = threading.local()


def set_dropout_key(seed: int, step: int, offset: int = 0) -> None:
    _STATE.key = DropoutKey(int(seed), int(step), int(offset))


def clear_dropout_key() -> None:
    _STATE.key = None


def current_dropout_key() -> DropoutKey | None:
    return getattr(_STATE, "key", None)


@contextmanager
def dropout_key(seed: int, step: int, offset: int = 0) -> Iterator[DropoutKey]:
    """Dropout inside the block is keyed; the previous key (or none) comes back afterwards."""
    previous = current_dropout_key()
    set_dropout_key(seed, step, offset)
    try:
        yield current_dropout_key()  # type: ignore[misc]
    finally:
        _STATE.key = previous


# --------------------------------------------------------------------------
# The tensor code
# --------------------------------------------------------------------------

def _xor_high_into_low_(z: torch.Tensor) -> None:
    """z ^= z >>> 32 in place, on a contiguous int64 tensor: its high int32 words xor into its low ones.

    Little-endian memory (every platform torch runs on) puts the low word first.
    """
    words = z.view(torch.int32).view(*z.shape, 2)
    words[..., 0].bitwise_xor_(words[..., 1])


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """`_mix` on a contiguous int64 tensor, in place."""
    for _ in range(2):
        _xor_high_into_low_(z)
        z.mul_(_signed(_C))
    _xor_high_into_low_(z)
    return z


_ELEMENT_HASHES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _element_hashes(per_sample: int, device: torch.device) -> torch.Tensor:
    """w_e = mix((e + 1) * GOLDEN) for e < per_sample: keyless, so cached per size and device (eager)."""
    tracing = torch.compiler.is_compiling()
    w = None if tracing else _ELEMENT_HASHES.get((per_sample, device))
    if w is None:
        w = _mix_(torch.arange(1, per_sample + 1, dtype=torch.int64, device=device).mul_(_signed(GOLDEN)))
        if not tracing:
            if len(_ELEMENT_HASHES) >= 32:  # a handful of activation sizes per network
                _ELEMENT_HASHES.clear()
            _ELEMENT_HASHES[(per_sample, device)] = w
    return w


def keep_mask(key: torch.Tensor, stream: int, batch: int, per_sample: int, p: float) -> torch.Tensor:
    """Boolean keep mask `[batch, per_sample]` of a call whose `DropoutKey.values` are `key`."""
    device = key.device
    k_node = _mix_(key[0:1] ^ stream)
    samples = torch.arange(batch, dtype=torch.int64, device=device).add_(key[1])
    bases = _mix_(samples.mul_(_signed(GOLDEN)).add_(k_node))
    z = bases.view(batch, 1) ^ _element_hashes(per_sample, device).view(1, per_sample)
    _xor_high_into_low_(z)
    return z.mul_(_signed(_C)) >= _threshold(p)


def mask_reference(seed: int, step: int, node: str, sample: int, element: int, p: float) -> bool:
    """Whether element `element` of global sample `sample` survives at `node`: the definition, in Python ints."""
    k_node = _mix(_mix(_mix(seed) ^ (step & _U64)) ^ node_stream(node))
    base = _mix(k_node + sample * GOLDEN)
    return _signed(_round(base ^ _mix((element + 1) * GOLDEN))) >= _threshold(p)


def keyed_dropout(x: torch.Tensor, p: float, node: str, stream: int | None = None) -> torch.Tensor:
    """Training-mode dropout of `x` ([batch, ...]) at VNode `node`, keyed if a key is set.

    `stream` is `node_stream(node)`, passed by the lowering so that a traced
    graph does not hash the id at run time.
    """
    if not 0.0 <= p <= 1.0:  # also NaN
        raise ValueError(f"dropout rate of {node!r} must be between 0 and 1, got {p}")
    key = current_dropout_key()
    if key is None:
        return F.dropout(x, p=p, training=True)
    if p >= 1.0:
        return x * 0.0
    if stream is None:
        stream = node_stream(node)
    batch = x.shape[0]
    # Traced, the device copy is an op of the graph; eager, it is made once per key.
    values = key.values.to(x.device) if torch.compiler.is_compiling() else key.on(x.device)
    keep = keep_mask(values, stream, batch, x.numel() // batch if batch else 0, p)
    return torch.where(keep.view(x.shape), x, 0.0) * (1.0 / (1.0 - p))
