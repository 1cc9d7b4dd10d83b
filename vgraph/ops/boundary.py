"""Boundary op types: what a per-PNode part of a partitioned network uses at its cuts.

`vgraph partition` writes one network per PNode; every edge cut by the
placement becomes a `send` on the producer's PNode and a `receive` on the
consumer's, each naming its peer (PNode, VNode, slot), so the parts can be
stitched back into the original network and an orchestrator knows what to
wire.  A tied weight read on a PNode other than its publisher's becomes a
`weight_replica` there, which publishes the same alias.

- `send`: input 0 is the tensor to hand over; output 0 is the same tensor.
  The part lists every send among its outputs, so it is live (dead-nodes keeps
  it) and a backend that runs the part returns it under the send's id.
- `receive`: output 0 is the tensor from the peer; its one input slot is left
  unconnected, so the value arrives as a network input of the part (fed as
  "<receive id>:in0" by the backends' convention).  Config `shape` (per
  sample, e.g. "[512, 512]", "[]" for a scalar) and `dtype` give its type.
- `weight_replica`: no inputs or outputs; owns a `weight` of config `shape`
  (optimizer "none": the owner updates it and sends it back every step).
- `compress`: what crosses one cut edge, compressed (the `compress-boundary`
  pass puts one on the producer's side of every cut edge it compresses).  Its
  output is its input after a round trip through the wire format of
  `activations`; in backward, the gradient after a round trip through the
  format of `gradients` (with `error_feedback`, the sender of the gradient adds
  what the previous rounding lost).  `vgraph train` computes exactly that in
  one process; `vgraph launch` sends the wire format itself (the transport
  encodes and decodes, step_plan.py), so both train the same numbers.  It holds no
  weights: a checkpoint of a compressed run is a checkpoint of the network
  without it.

Wire formats (`wire_bytes` is what the cost model prices and the workers count):
`none` the tensor as it is; `fp16` / `bf16` two bytes an element; `int8` one
byte an element plus one float32 scale per group: per *token* (a group is the
last dimension: one scale per sample and position) or per *channel* (a group
is one channel of one sample across its positions: per-sample rank 2 or more).
A group's scale is max |x| / 127 and an element travels as round(x / scale)
(half to even) clamped to [-127, 127]; a group holding NaN or infinity
travels as scale NaN, so it arrives as NaN rather than as a finite lie.
"""
from __future__ import annotations

from math import prod

from vgraph.ops.registry import Config, InferCtx, OpDef, OpExample, register_op
from vgraph.ops.schema import F, Schema
from vgraph.types import DTYPE_BYTES, ShapeError, TensorType

DTYPES = ("float32", "float16", "bfloat16", "int64", "string")
_PEER = (F("peer_pnode", required=True, doc="the PNode on the other side of the cut"),
         F("peer_node", required=True, doc="the VNode on the other side"),
         F("peer_slot", "int", 0, min=0, doc="its output slot (for a receive) or input slot (for a send)"))


def parse_shape_text(text: str) -> tuple[int, ...]:
    """'[512, 512]' -> (512, 512); '[]' -> ()."""
    body = str(text).strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise ShapeError(f"shape {text!r} must be written like [512, 512] (or [] for a scalar)")
    parts = [p.strip() for p in body[1:-1].split(",") if p.strip()]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise ShapeError(f"shape {text!r} must list whole numbers") from None
    if any(d < 1 for d in dims):
        raise ShapeError(f"shape {text!r} must have positive dimensions")
    return dims


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def received_type(cfg: Config) -> TensorType:
    return TensorType(parse_shape_text(cfg["shape"]), cfg["dtype"])


register_op(OpDef(
    "send", "boundary", "hands its input to a VNode on another PNode; output 0 is the same tensor",
    schema=Schema(_PEER), input_kind="any", infer=lambda ctx: [ctx.single()],
    examples=(OpExample({"peer_pnode": "b", "peer_node": "y"}, ((8, 16),)),),
))


def _receive_infer(ctx: InferCtx) -> list[TensorType]:
    return [received_type(ctx.cfg)]


register_op(OpDef(
    "receive", "boundary",
    "a tensor from a VNode on another PNode, arriving as this part's network input '<id>:in0'",
    schema=Schema((*_PEER, F("shape", required=True, doc="per-sample shape, e.g. [512, 512]"),
                   F("dtype", required=True, choices=DTYPES, doc="dtype of the received tensor"))),
    num_inputs=1, input_kind="any",
    network_input=lambda cfg, slot, ins: received_type(cfg),
    infer=_receive_infer,
    examples=(OpExample({"peer_pnode": "a", "peer_node": "x", "shape": "[8, 16]", "dtype": "float32"}),),
))

register_op(OpDef(
    "weight_replica", "boundary",
    "a copy of a tied weight owned on another PNode, published under the same alias",
    schema=Schema((F("peer_pnode", required=True, doc="the PNode that owns the weight"),
                   F("peer_node", required=True, doc="the VNode that publishes it"),
                   F("shape", "shape", required=True, doc="shape of the weight"))),
    num_inputs=0, num_outputs=0, infer=lambda ctx: [],
    params=lambda cfg: {"weight": tuple(cfg["shape"])},
))

BOUNDARY_TYPES = ("send", "receive", "weight_replica")  # what exists only in a per-PNode part

# -- compression of what crosses a cut ------------------------------------------------------------

CODECS = ("none", "fp16", "bf16", "int8")
SCALES = ("token", "channel")
CODEC_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}
SCALE_BYTES = 4  # an int8 group's scale travels as float32
# FLOPs per element of one encode and decode (int8: |x|, the group max, the division, the rounding, the
# clamp, the product back; a cast each way for the halves): the cost model's compute of a `compress`.
CODEC_FLOPS = {"none": 0, "fp16": 2, "bf16": 2, "int8": 6}
COMPRESSION_PASS = "compress-boundary"  # the pass that adds `compress` VNodes


def scale_count(shape: tuple[int, ...], scale: str) -> int:
    """float32 scales an int8 tensor of per-sample `shape` sends per sample."""
    if not shape:
        return 1  # a per-sample scalar is a group of its own
    if scale == "token" or len(shape) < 2:  # channel needs positions to span (the op refuses it, the pass
        return prod(shape) // shape[-1] if shape[-1] else 0  # falls back to token)
    return shape[-1]


def wire_bytes(shape: tuple[int, ...], dtype: str, codec: str, scale: str = "token") -> int:
    """Bytes per sample of a `dtype` tensor of per-sample `shape` in wire format `codec`."""
    numel = prod(shape)
    if codec == "none":
        return numel * DTYPE_BYTES[dtype]
    if codec in CODEC_DTYPE:
        return numel * DTYPE_BYTES[CODEC_DTYPE[codec]]
    if codec == "int8":
        return numel + SCALE_BYTES * scale_count(shape, scale)
    raise ValueError(f"unknown codec {codec!r}: one of {', '.join(CODECS)}")


def compress_label(cfg: Config) -> str:
    """What a `compress` VNode sends, in words (drawings, listings)."""
    def one(codec: str) -> str:
        return f"{codec}/{cfg['scale']}" if codec == "int8" else codec
    ef = " + error feedback" if cfg.get("error_feedback") and cfg["gradients"] != "none" else ""
    return f"fwd {one(cfg['activations'])}, bwd {one(cfg['gradients'])}{ef}"


def _compress_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.single()
    uses_int8 = "int8" in (ctx.cfg["activations"], ctx.cfg["gradients"])
    if uses_int8 and ctx.cfg["scale"] == "channel" and len(x.shape) < 2:
        raise ShapeError(f"scale=channel needs a per-sample rank of 2 or more (one scale per channel across "
                         f"positions), the input is {list(x.shape)}: use scale=token")
    return [x]


def _compress_advice(cfg: Config) -> list[str]:
    if cfg.get("error_feedback") and cfg["gradients"] == "none":
        return ["error_feedback has no effect with gradients=none (nothing is rounded on the way back)"]
    return []


register_op(OpDef(
    "compress", "boundary",
    "what crosses a cut edge, sent in a smaller wire format (activations forward, gradients back)",
    schema=Schema((
        F("activations", default="int8", choices=CODECS, doc="wire format of the tensor sent forward"),
        F("gradients", default="int8", choices=CODECS, doc="wire format of its gradient sent back"),
        F("scale", default="token", choices=SCALES,
          doc="int8 groups: token (one scale per position) or channel (per channel across positions)"),
        F("error_feedback", "bool", False,
          doc="the gradient's sender adds what the previous rounding lost (per sample position)"),
        F("peer_pnode", doc="the PNode the tensor goes to (set by the pass; informational)"))),
    infer=_compress_infer,
    flops=lambda cfg, ins, outs: prod(ins[0].shape) * CODEC_FLOPS[cfg["activations"]],
    advice=_compress_advice,
    examples=(OpExample({"activations": "int8", "scale": "token"}, ((8, 16),), "int8-token"),
              OpExample({"activations": "int8", "scale": "channel"}, ((3, 8, 16),), "int8-channel"),
              OpExample({"activations": "int8"}, ((16,),), "int8-vector"),
              OpExample({"activations": "fp16"}, ((8, 16),), "fp16"),
              OpExample({"activations": "bf16"}, ((8, 16),), "bf16"),
              OpExample({"activations": "none", "gradients": "int8"}, ((8, 16),), "none")),
))
