"""fuse-lm-head-ce: a weight-tied linear LM head feeding a ce_logits cost becomes one
`tied_lm_head_ce`, which computes the loss without materialising the logits.

Nothing a client reads is lost: the cost keeps its name (now output 0 of the
fused node), and an output or metric that read the logits now reads output 1,
which backends compute only when it is asked for.  The head's logits may not
feed any other VNode (that would materialise them anyway), so such a graph is
left alone.
"""
from __future__ import annotations

from collections import Counter

from vgraph.ir.graph import Graph, VNode
from vgraph.transform.rewrite import Match, P, Reject, RewritePass, Rule, RuleContext, RuleSet, fused, reads, replace


def _ce_logits(cost: VNode) -> bool | str:
    return cost.cfg["cost_function"] == "ce_logits" or f"cost_function is {cost.cfg['cost_function']}"


def _tied(head: VNode) -> bool | str:
    return bool(head.config.get("tie_weight_alias")) or "the linear has no tie_weight_alias"


LM_HEAD_CE = P("cost", "cost", P("linear", "head", where=_tied), where=_ce_logits)


def fuse(graph: Graph, m: Match, ctx: RuleContext) -> Counter | Reject:
    cost, head = m["cost"], m["head"]
    others = [e.dst for e in graph.out_edges(head.id) if e.dst != cost.id]
    if others:  # an endpoint may read the logits (output 1, computed on demand), another VNode may not
        return Reject(f"the logits of '{head.id}' also feed {', '.join(map(repr, others))}")
    cfg = {k: head.cfg[k] for k in ("in_dim", "out_dim", "tie_weight_alias")}
    cfg.update({k: cost.config[k] for k in ("cost_precision", "ignore_index") if k in cost.config})
    meta = dict(head.meta)
    if "precision" in cost.meta and "precision" in head.meta:
        meta["precision"] = {**head.meta["precision"], "loss": cost.meta["precision"].get("loss")}
    ce = fused("tied_lm_head_ce", f"{head.id}_ce", cfg, [head, cost],
               inputs=[reads(head, 0), reads(cost, 1)], meta=meta)
    return replace(graph, [cost, head], [ce], {cost.id: ce[0], head.id: ce[1]}, counts={"lm_head_ce_fused": 1})


RULES = RuleSet([Rule("fuse-lm-head-ce", LM_HEAD_CE, fuse)])


class FuseLMHeadCE(RewritePass):
    """Fuse a tied linear LM head and its ce_logits cost into tied_lm_head_ce (no logits in memory)."""

    name = "fuse-lm-head-ce"
    preserves_semantics = True  # the same loss and logits; `fused_from` maps the weights
    after = ("partition", "precision")

    rules = RULES
