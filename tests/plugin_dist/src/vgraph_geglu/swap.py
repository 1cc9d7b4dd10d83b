"""swap-swiglu-for-geglu: every SwiGLU feed-forward `linear -> swiglu -> linear` becomes one `geglu`.

An architecture swap: GELU gating is not SiLU gating, so the network
computes another function afterwards and the pass says so
(`preserves_semantics = False`); `vgraph train` then stores the network it
actually trained.  The new node records `fused_from`, so it starts from (and
checkpoints as) the two linears it replaced: the parameter shapes are the same.
"""
from __future__ import annotations

from vgraph.ir.graph import Graph, VNode
from vgraph.pass_api import Option
from vgraph.rewrite import Match, P, Reject, RewritePass, Rule, RuleContext, fused, reads, replace


def plain(up: VNode) -> bool | str:
    """A predicate: True accepts; a string refuses, and is what `--explain` prints."""
    return not up.config.get("tie_weight_alias") or "the up projection reads a tied weight"


SWIGLU_FFN = P("linear", "down", P("swiglu", "act", P("linear", "up", where=plain)))


def swap(graph: Graph, m: Match, ctx: RuleContext):
    """The match becomes one geglu; `replace` refuses by itself if an inner value is read elsewhere."""
    up, act, down = m["up"], m["act"], m["down"]
    if len({n.meta.get("pnode") for n in (up, act, down)}) > 1:
        return Reject("the feed-forward spans PNodes")
    cfg = {"dim": up.cfg["in_dim"], "hidden": up.cfg["out_dim"] // 2, "out_dim": down.cfg["out_dim"],
           "approximate": ctx.opts["approximate"]}
    geglu = fused("geglu", f"{act.id}_geglu", cfg, [up, act, down], inputs=[reads(up, 0)])
    return replace(graph, [up, act, down], [geglu], {down.id: geglu[0]}, counts={"swapped": 1})


class SwapSwiGLUForGEGLU(RewritePass):
    """Replace each SwiGLU feed-forward (linear, swiglu, linear) with one geglu VNode (changes the function)."""

    name = "swap-swiglu-for-geglu"
    preserves_semantics = False  # GELU gating computes another function than SiLU gating
    after = ("partition",)  # when both run: the swap keeps the placement of the nodes it replaces
    options = {"approximate": Option(str, "none", "GELU form of the new nodes", choices=("none", "tanh"))}
    rules = [Rule("swap-swiglu-for-geglu", SWIGLU_FFN, swap)]
