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
"""
from __future__ import annotations

from vgraph.ops.registry import Config, InferCtx, OpDef, register_op
from vgraph.ops.schema import F, Schema
from vgraph.types import ShapeError, TensorType

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

BOUNDARY_TYPES = ("send", "receive", "weight_replica")
