"""fuse-heads: broadcast -> N x attention_head -> stack becomes multi-head `attention`.

Batching the heads of a block into one VNode is where the production GPU
speed-up came from.  The rewrite is conservative: every head must be an
exclusive consumer of one broadcast and an exclusive producer for one stack
(concatenating on the last axis), and all heads' configs must be identical.
Placement is respected: heads assigned to different PNodes (meta "pnode",
set by `partition`) are fused per contiguous run on one PNode, never across,
so the stack still sees the heads' columns in their original order.
"""
from __future__ import annotations

from collections import Counter
from itertools import groupby

from vgraph.ir.graph import Graph, VNode
from vgraph.transform.rewrite import (Each, Match, NewNode, P, Reject, RewritePass, Rule, RuleContext, RuleSet, Source,
                                      fused, reads, rebuilt, replace)


def _concat_last_axis(stack: VNode) -> bool | str:
    return stack.cfg["axis"] in (-1, 1) or f"stack axis {stack.cfg['axis']} is not the head axis (-1)"


HEADS = P("stack", "stack", Each(P("attention_head", "heads", P("broadcast", "fanout")), min=2),
          where=_concat_last_axis)


def fuse(graph: Graph, m: Match, ctx: RuleContext) -> Counter | Reject:
    stack, heads, fanout = m["stack"], m["heads"], m["fanout"]
    if len({h.id for h in heads}) != len(heads):
        return Reject("a head feeds the stack more than once")
    ref = heads[0]
    for h in heads[1:]:
        if h.config != ref.config:
            keys = sorted(k for k in set(h.config) | set(ref.config) if h.config.get(k) != ref.config.get(k))
            return Reject(f"head '{h.id}' differs from '{ref.id}' in {', '.join(keys)}")
    runs = [list(run) for _, run in groupby(heads, key=lambda h: h.meta.get("pnode"))]
    if all(len(run) == 1 for run in runs):
        return Reject("no two neighbouring heads are on the same PNode")
    base = stack.id[: -len("_stack")] if stack.id.endswith("_stack") else stack.id
    fusing = [run for run in runs if len(run) > 1]
    counts = {"heads_fused": sum(map(len, fusing)), "attention_created": len(fusing)}
    if len(runs) == 1:  # one attention node: the broadcast and the stack are no longer needed
        attn = _attention(f"{base}_attention", heads, reads(fanout, 0))
        return replace(graph, m.nodes, [attn], {stack.id: attn[0]}, counts=counts)
    fan = rebuilt(fanout, [reads(fanout, 0)], num_outputs=len(runs))
    parts = [_attention(f"{base}_attention{i}", run, fan[i]) if len(run) > 1 else rebuilt(run[0], [fan[i]])
             for i, run in enumerate(runs)]  # the stack still reads the heads' columns in order
    new_stack = rebuilt(stack, [part[0] for part in parts])
    return replace(graph, m.nodes, [fan, *parts, new_stack], {stack.id: new_stack[0]}, counts=counts)


def _attention(node_id: str, heads: list[VNode], source: Source) -> NewNode:
    cfg = heads[0].cfg
    return fused("attention", node_id, {
        "num_heads": len(heads), "head_dim": cfg["head_dim"], "dim": cfg["input_dim"],
        "seq_len": cfg["seq_len"], "causal": cfg["causal"], "position_encoding": cfg["position_encoding"],
        "rope_theta": cfg["rope_theta"], "output_projection": False}, heads, inputs=[source])


RULES = RuleSet([Rule("fuse-heads", HEADS, fuse)])


class FuseHeads(RewritePass):
    """Fuse co-located attention heads (broadcast -> heads -> stack) into multi-head attention VNodes."""

    name = "fuse-heads"
    preserves_semantics = True  # the same function; `fused_from` maps the weights
    after = ("partition", "precision")

    rules = RULES
