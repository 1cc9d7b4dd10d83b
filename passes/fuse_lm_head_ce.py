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

from vgraph.ir import Graph, VNode
from vgraph.pass_api import PassContext
from vgraph.rewrite import Match, P, Reject, RewritePass, Rule, RuleSet, fresh_id, inherited_config


def _ce_logits(cost: VNode) -> bool | str:
    return cost.cfg["cost_function"] == "ce_logits" or f"cost_function is {cost.cfg['cost_function']}"


def _tied(head: VNode) -> bool | str:
    return bool(head.config.get("tie_weight_alias")) or "the linear has no tie_weight_alias"


LM_HEAD_CE = P("cost", "cost", P("linear", "head", where=_tied), where=_ce_logits)


def fuse(graph: Graph, m: Match, ctx: PassContext) -> Counter | Reject:
    cost, head = m["cost"], m["head"]
    others = [e.dst for e in graph.out_edges(head.id) if e.dst != cost.id]
    if others:
        return Reject(f"the logits of '{head.id}' also feed {', '.join(map(repr, others))}")
    if cost.input_shapes or head.input_shapes or cost.output_shapes or head.output_shapes:
        return Reject("declared input/output shapes would be lost")
    hidden = graph.input_edge(head.id, 0)
    if hidden is None:
        return Reject(f"the input of '{head.id}' is not connected")
    targets = graph.input_edge(cost.id, 1)
    cfg = {"in_dim": head.cfg["in_dim"], "out_dim": head.cfg["out_dim"],
           "tie_weight_alias": head.cfg["tie_weight_alias"]}
    cfg.update({k: cost.config[k] for k in ("cost_precision", "ignore_index") if k in cost.config})
    cfg.update(inherited_config(head), fused_from=f"{head.id},{cost.id}")
    meta = dict(head.meta)
    if "precision" in cost.meta and "precision" in head.meta:
        meta["precision"] = {**head.meta["precision"], "loss": cost.meta["precision"].get("loss")}
    fused = graph.add_node(VNode(fresh_id(graph, f"{head.id}_ce"), "tied_lm_head_ce", cfg,
                                 loc=head.loc, meta=meta))
    for e in graph.in_edges(cost.id) + graph.in_edges(head.id):
        graph.remove_edge(e)
    graph.add_edge(hidden.src, hidden.src_slot, fused.id, 0, hidden.loc)
    if targets is not None:
        graph.add_edge(targets.src, targets.src_slot, fused.id, 1, targets.loc)
    graph.replace_uses((cost.id, 0), (fused.id, 0))
    graph.replace_uses((head.id, 0), (fused.id, 1))
    graph.remove_node(cost.id)
    graph.remove_node(head.id)
    return Counter(lm_head_ce_fused=1)


RULES = RuleSet([Rule("fuse-lm-head-ce", LM_HEAD_CE, fuse)])


class FuseLMHeadCE(RewritePass):
    """Fuse a tied linear LM head and its ce_logits cost into tied_lm_head_ce (no logits in memory)."""

    name = "fuse-lm-head-ce"
    preserves_semantics = True  # the same loss and logits; `fused_from` maps the weights
    after = ("partition", "precision")

    rules = RULES
