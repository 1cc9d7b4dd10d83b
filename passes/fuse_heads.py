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

from vgraph.ir import Graph, VNode
from vgraph.pass_api import PassContext
from vgraph.rewrite import (Each, Match, P, Reject, RewritePass, Rule, RuleSet, fresh_id, inherited_config,
                            only_feeds)


def _concat_last_axis(stack: VNode) -> bool | str:
    return stack.cfg["axis"] in (-1, 1) or f"stack axis {stack.cfg['axis']} is not the head axis (-1)"


HEADS = P("stack", "stack", Each(P("attention_head", "heads", P("broadcast", "fanout")), min=2),
          where=_concat_last_axis)


def fuse(graph: Graph, m: Match, ctx: PassContext) -> Counter | Reject:
    stack, heads, fanout = m["stack"], m["heads"], m["fanout"]
    if len({h.id for h in heads}) != len(heads):
        return Reject("a head feeds the stack more than once")
    why = only_feeds(graph, fanout, heads) or next(
        (r for r in (only_feeds(graph, h, [stack]) for h in heads) if r), None)
    if why:
        return Reject(why)
    if len(graph.out_edges(fanout.id)) != len(heads) or graph.input_edge(fanout.id, 0) is None:
        return Reject(f"broadcast '{fanout.id}' does not feed exactly these {len(heads)} heads")
    ref = heads[0]
    for h in heads[1:]:
        if h.config != ref.config:
            keys = sorted(k for k in set(h.config) | set(ref.config) if h.config.get(k) != ref.config.get(k))
            return Reject(f"head '{h.id}' differs from '{ref.id}' in {', '.join(keys)}")
        if h.input_shapes or h.output_shapes or ref.input_shapes or ref.output_shapes:
            return Reject("heads declare input/output shapes, which the fused node could not keep")
    runs = [list(run) for _, run in groupby(heads, key=lambda h: h.meta.get("pnode"))]
    if all(len(run) == 1 for run in runs):
        return Reject("no two neighbouring heads are on the same PNode")

    src = graph.input_edge(fanout.id, 0)
    base = stack.id[: -len("_stack")] if stack.id.endswith("_stack") else stack.id
    parts: list[tuple[str, int]] = []  # what the stack reads, in order
    created = 0
    for i, run in enumerate(runs):
        if len(run) == 1:
            parts.append((run[0].id, 0))
            continue
        node_id = fresh_id(graph, f"{base}_attention" if len(runs) == 1 else f"{base}_attention{i}")
        cfg = ref.cfg
        attn = VNode(node_id, "attention", {
            "num_heads": len(run), "head_dim": cfg["head_dim"], "dim": cfg["input_dim"],
            "seq_len": cfg["seq_len"], "causal": cfg["causal"],
            "position_encoding": cfg["position_encoding"], "rope_theta": cfg["rope_theta"],
            "output_projection": False, "fused_from": ",".join(h.id for h in run),
            **inherited_config(ref)}, loc=ref.loc, meta=dict(run[0].meta))
        graph.add_node(attn)
        parts.append((node_id, 0))
        created += 1

    for e in graph.in_edges(stack.id) + graph.out_edges(fanout.id):
        graph.remove_edge(e)
    fused = [h for run in runs if len(run) > 1 for h in run]
    for h in fused:
        graph.remove_node(h.id)
    consumers = [node for node, _ in parts]
    if len(consumers) == 1:  # one attention node: the broadcast and the stack are no longer needed
        graph.add_edge(src.src, src.src_slot, consumers[0], 0, src.loc)
        graph.remove_node(fanout.id)
        graph.replace_uses((stack.id, 0), parts[0])
        graph.remove_node(stack.id)
    else:
        fanout.set_config(num_outputs=len(consumers))
        for slot, node in enumerate(consumers):
            graph.add_edge(fanout.id, slot, node, 0)
        for slot, (node, out) in enumerate(parts):
            graph.add_edge(node, out, stack.id, slot)
    return Counter(heads_fused=len(fused), attention_created=created)


RULES = RuleSet([Rule("fuse-heads", HEADS, fuse)])


class FuseHeads(RewritePass):
    """Fuse co-located attention heads (broadcast -> heads -> stack) into multi-head attention VNodes."""

    name = "fuse-heads"
    preserves_semantics = True  # the same function; `fused_from` maps the weights
    after = ("partition", "precision")

    rules = RULES
