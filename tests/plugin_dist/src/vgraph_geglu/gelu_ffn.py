"""The `gelu_ffn` op type and `fuse-gelu-ffn`, a fusion that keeps what the network computes.

    y = down(gelu(up(x)))

One VNode holds a plain GELU feed-forward (`linear -> gelu -> linear`).
Unlike `swap-swiglu-for-geglu`, the fusion computes the same function with
the same weights, so it declares `preserves_semantics = True` and the node
records `fused_from`: a run trained fused continues unfused and back, and
vgraph's network matching brings a fused and an unfused network to one form
by running this pass on both (the reason a checkpoint of either fits the other).
"""
from __future__ import annotations

from vgraph.ir import Graph, VNode
from vgraph.ops import F, OpDef, OpExample, Schema, register_op
from vgraph.rewrite import Match, P, RewritePass, Rule, RuleContext, fused, reads, replace

from .op import infer  # [.., dim] -> [.., out_dim], as geglu


def params(cfg) -> dict[str, tuple[int, ...]]:
    return {"up_weight": (cfg["hidden"], cfg["dim"]), "up_bias": (cfg["hidden"],),
            "down_weight": (cfg["out_dim"], cfg["hidden"]), "down_bias": (cfg["out_dim"],)}


def flops(cfg, ins, outs) -> int:
    rows = outs[0].numel // cfg["out_dim"]
    return rows * (2 * cfg["dim"] * cfg["hidden"] + 2 * cfg["hidden"] * cfg["out_dim"] + 8 * cfg["hidden"])


def param_sources(cfg) -> dict[str, list[tuple[str, int]]]:
    """Checkpoint mapping: the fused parameters are the two linears' (`fused_from: "<up>,<act>,<down>"`)."""
    up, _act, down = cfg["fused_from"].split(",")
    return {"up_weight": [(f"{up}.weight", cfg["hidden"])], "up_bias": [(f"{up}.bias", cfg["hidden"])],
            "down_weight": [(f"{down}.weight", cfg["out_dim"])], "down_bias": [(f"{down}.bias", cfg["out_dim"])]}


GELU_FFN = OpDef(
    "gelu_ffn", "layer", "GELU feed-forward in one VNode: down(gelu(up(x))), gelu exact (erf)",
    schema=Schema((
        F("dim", "int", required=True, min=1, doc="input features"),
        F("hidden", "int", required=True, min=1, doc="hidden units"),
        F("out_dim", "int", required=True, min=1, doc="output features"),
    )),
    infer=infer, params=params, flops=flops, param_sources=param_sources,
    examples=(OpExample({"dim": 16, "hidden": 24, "out_dim": 12}, ((8, 16),)),),
)


def register() -> None:
    """Entry point of group `vgraph.ops`."""
    register_op(GELU_FFN)


def plain(up: VNode) -> bool | str:
    return not up.config.get("tie_weight_alias") or "the up projection reads a tied weight"


GELU_FFN_PATTERN = P("linear", "down", P("gelu", "act", P("linear", "up", where=plain)))


def fuse(graph: Graph, m: Match, ctx: RuleContext):
    up, act, down = m["up"], m["act"], m["down"]
    cfg = {"dim": up.cfg["in_dim"], "hidden": up.cfg["out_dim"], "out_dim": down.cfg["out_dim"]}
    node = fused("gelu_ffn", f"{act.id}_ffn", cfg, [up, act, down], inputs=[reads(up, 0)])
    return replace(graph, [up, act, down], [node], {down.id: node[0]}, counts={"fused": 1})


class FuseGeluFFN(RewritePass):
    """Fuse each GELU feed-forward (linear, gelu, linear) into one gelu_ffn VNode (same function)."""

    name = "fuse-gelu-ffn"
    preserves_semantics = True  # the same function; `fused_from` maps the weights
    after = ("partition",)
    rules = [Rule("fuse-gelu-ffn", GELU_FFN_PATTERN, fuse)]
