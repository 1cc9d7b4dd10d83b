"""The `geglu` op type: what it means to the IR (schema, inference, parameters, FLOPs, checkpoint mapping).

    y = down(value * gelu(gate)),  [value | gate] = up(x)

One VNode holds the whole feed-forward: `up` ([2*hidden, dim] weight and
bias), the gated GELU, and `down` ([out_dim, hidden]).  Registered by the
`vgraph.ops` entry point `geglu = "vgraph_geglu.op:register"`.
"""
from __future__ import annotations

from vgraph.ops import F, InferCtx, OpDef, OpExample, Schema, register_op
from vgraph.types import ShapeError, TensorType


def infer(ctx: InferCtx) -> list[TensorType]:
    """[.., dim] -> [.., out_dim]; a wrong last dimension is the user's error, said with the key."""
    x = ctx.single()
    if not x.shape:
        raise ShapeError("input is a scalar but a feed-forward needs [.., dim]")
    ctx.require_last_dim(0, ctx.cfg["dim"], "dim")
    return [TensorType(x.shape[:-1] + (ctx.cfg["out_dim"],), ctx.dtype)]


def params(cfg) -> dict[str, tuple[int, ...]]:
    hidden, dim, out = cfg["hidden"], cfg["dim"], cfg["out_dim"]
    return {"up_weight": (2 * hidden, dim), "up_bias": (2 * hidden,),
            "down_weight": (out, hidden), "down_bias": (out,)}


def flops(cfg, ins, outs) -> int:
    """Two matmuls, plus about 10 FLOPs per hidden unit for the GELU and the gating product."""
    rows = outs[0].numel // cfg["out_dim"]
    return rows * (2 * cfg["dim"] * 2 * cfg["hidden"] + 2 * cfg["hidden"] * cfg["out_dim"] + 10 * cfg["hidden"])


def param_sources(cfg) -> dict[str, list[tuple[str, int]]]:
    """Checkpoint mapping: with `fused_from: "<up>,<act>,<down>"` the parameters are those two linears'.

    vgraph keeps checkpoints in this "unfused" layout, so a geglu made from a
    SwiGLU feed-forward starts from (and saves as) the linears it replaced.
    """
    up, _act, down = cfg["fused_from"].split(",")
    return {"up_weight": [(f"{up}.weight", 2 * cfg["hidden"])], "up_bias": [(f"{up}.bias", 2 * cfg["hidden"])],
            "down_weight": [(f"{down}.weight", cfg["out_dim"])], "down_bias": [(f"{down}.bias", cfg["out_dim"])]}


GEGLU = OpDef(
    "geglu", "layer", "GEGLU feed-forward: down(value * gelu(gate)) with [value | gate] = up(x)",
    schema=Schema((
        F("dim", "int", required=True, min=1, doc="input features"),
        F("hidden", "int", required=True, min=1, doc="gated hidden units (up has 2*hidden outputs)"),
        F("out_dim", "int", required=True, min=1, doc="output features"),
        F("approximate", default="none", choices=("none", "tanh"), doc="GELU form: exact (erf) or tanh"),
    )),
    infer=infer, params=params, flops=flops, param_sources=param_sources,
    # What `vgraph check-onnx --ops geglu` runs (each GELU form), like PyTorch's OpInfo samples.
    examples=tuple(OpExample({"dim": 16, "hidden": 24, "out_dim": 12, "approximate": a}, ((8, 16),), a)
                   for a in ("none", "tanh")),
)


def register() -> None:
    """Entry point of group `vgraph.ops`: make `geglu` known to the IR."""
    register_op(GEGLU)
