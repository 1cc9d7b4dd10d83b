"""fuse-heads: broadcast -> N x attention_head -> stack becomes multi-head `attention`.

Batching the heads of a block into one VNode is where the production GPU
speed-up came from.  The rewrite is conservative: every head must be an
exclusive consumer of one broadcast and an exclusive producer for one stack
(concatenating on the last axis), and all heads' configs must be identical.
Placement is respected: heads assigned to different PNodes (meta "pnode",
set by `partition`) are fused per contiguous run on one PNode, never across,
so the stack still sees the heads' columns in their original order.

Grouped-query attention written per head (query heads with `kv_input`, each
reading the keys and values of its group's `kv_head`, docs/network-yaml.md)
fuses the same way into one `attention` with `num_kv_heads`: the kv_heads
must read the heads' broadcast too, the query heads come in groups of equal
size in kv_head order (head i reads kv_head i // group), and a group never
spans two PNodes (a run is whole groups).  `fused_from` then names the query
heads followed by the kv_heads, which is how the checkpoint maps wk/wv.
"""
from __future__ import annotations

from collections import Counter
from itertools import groupby

from vgraph.ir.graph import Graph, VNode
from vgraph.transform.rewrite import (Each, Match, NewNode, P, Reject, RewritePass, Rule, RuleContext, RuleSet, Source,
                                      fused, reads, rebuilt, replace)

# What a kv_head must share with the query heads of its group for the fused layer to compute the same.
_SHARED_WITH_KV = ("head_dim", "input_dim", "seq_len", "position_encoding", "rope_theta", "qkv_bias")


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
    if ref.cfg["kv_input"]:
        return _fuse_grouped(graph, m, heads)
    runs = [list(run) for _, run in groupby(heads, key=lambda h: h.meta.get("pnode"))]
    if all(len(run) == 1 for run in runs):
        return Reject("no two neighbouring heads are on the same PNode")
    base = stack.id[: -len("_stack")] if stack.id.endswith("_stack") else stack.id
    fusing = [run for run in runs if len(run) > 1]
    counts = {"heads_fused": sum(map(len, fusing)), "attention_created": len(fusing)}
    if len(runs) == 1:  # one attention node: the broadcast and the stack are no longer needed
        attn = _attention(f"{base}_attention", heads, [], reads(fanout, 0))
        return replace(graph, m.nodes, [attn], {stack.id: attn[0]}, counts=counts)
    fan = rebuilt(fanout, [reads(fanout, 0)], num_outputs=len(runs))
    parts = [_attention(f"{base}_attention{i}", run, [], fan[i]) if len(run) > 1 else rebuilt(run[0], [fan[i]])
             for i, run in enumerate(runs)]  # the stack still reads the heads' columns in order
    new_stack = rebuilt(stack, [part[0] for part in parts])
    return replace(graph, m.nodes, [fan, *parts, new_stack], {stack.id: new_stack[0]}, counts=counts)


def _kv_groups(graph: Graph, heads: list[VNode], fanout: VNode) -> list[VNode] | Reject:
    """The kv_heads of `heads`, in group order, when the heads form equal groups read in that order."""
    kvs: list[VNode] = []
    for h in heads:
        kv = graph.producer(h.id, 1)
        if kv is None or kv.type != "kv_head":
            what = "nothing" if kv is None else f"{kv.type} '{kv.id}'"
            return Reject(f"head '{h.id}' reads its keys and values from {what}, not a kv_head")
        if all(k is not kv for k in kvs):
            kvs.append(kv)
    size = len(heads) // len(kvs)
    for i, h in enumerate(heads):
        kv = graph.producer(h.id, 1)
        if len(heads) % len(kvs) or kv is not kvs[i // size]:
            return Reject(f"the heads are not in groups of equal size in kv_head order: head '{h.id}' reads "
                          f"kv_head '{kv.id}'")
    for kv in kvs:
        if graph.producer(kv.id, 0) is not fanout:
            return Reject(f"kv_head '{kv.id}' does not read the heads' broadcast '{fanout.id}'")
        if kv.config != kvs[0].config:
            keys = sorted(k for k in set(kv.config) | set(kvs[0].config) if kv.config.get(k) != kvs[0].config.get(k))
            return Reject(f"kv_head '{kv.id}' differs from '{kvs[0].id}' in {', '.join(keys)}")
    differ = [k for k in _SHARED_WITH_KV if kvs[0].cfg[k] != heads[0].cfg[k]]
    if differ:
        return Reject(f"kv_head '{kvs[0].id}' differs from head '{heads[0].id}' in {', '.join(differ)}")
    return kvs


def _fuse_grouped(graph: Graph, m: Match, heads: list[VNode]) -> Counter | Reject:
    """Query heads and their kv_heads -> `attention` with num_kv_heads, per run of whole groups on one PNode."""
    stack, fanout = m["stack"], m["fanout"]
    kvs = _kv_groups(graph, heads, fanout)
    if isinstance(kvs, Reject):
        return kvs
    size = len(heads) // len(kvs)
    groups = [(kv, heads[g * size:(g + 1) * size]) for g, kv in enumerate(kvs)]
    for kv, members in groups:
        if len({n.meta.get("pnode") for n in (kv, *members)}) > 1:
            return Reject(f"kv_head '{kv.id}' and its query heads are on different PNodes")
    runs = [list(run) for _, run in groupby(groups, key=lambda group: group[0].meta.get("pnode"))]
    base = stack.id[: -len("_stack")] if stack.id.endswith("_stack") else stack.id
    counts = {"heads_fused": len(heads), "attention_created": len(runs)}

    def attention(node_id: str, run: list, source: Source) -> NewNode:
        return _attention(node_id, [h for _, members in run for h in members], [kv for kv, _ in run], source)

    old = [*m.nodes, *kvs]
    if len(runs) == 1:
        attn = attention(f"{base}_attention", runs[0], reads(fanout, 0))
        return replace(graph, old, [attn], {stack.id: attn[0]}, counts=counts)
    fan = rebuilt(fanout, [reads(fanout, 0)], num_outputs=len(runs))
    parts = [attention(f"{base}_attention{i}", run, fan[i]) for i, run in enumerate(runs)]
    new_stack = rebuilt(stack, [part[0] for part in parts])
    return replace(graph, old, [fan, *parts, new_stack], {stack.id: new_stack[0]}, counts=counts)


def _attention(node_id: str, heads: list[VNode], kvs: list[VNode], source: Source) -> NewNode:
    """The fused node; `kvs` (the kv_heads of grouped query heads, or none) follow the heads in fused_from."""
    cfg = heads[0].cfg
    extra = {"num_kv_heads": len(kvs)} if kvs else {}
    if not cfg["qkv_bias"]:
        extra["qkv_bias"] = False
    return fused("attention", node_id, {
        "num_heads": len(heads), "head_dim": cfg["head_dim"], "dim": cfg["input_dim"],
        "seq_len": cfg["seq_len"], "causal": cfg["causal"], "position_encoding": cfg["position_encoding"],
        "rope_theta": cfg["rope_theta"], "output_projection": False, **extra}, [*heads, *kvs], inputs=[source])


RULES = RuleSet([Rule("fuse-heads", HEADS, fuse)])


class FuseHeads(RewritePass):
    """Fuse co-located attention heads (broadcast -> heads -> stack) into multi-head attention VNodes."""

    name = "fuse-heads"
    preserves_semantics = True  # the same function; `fused_from` maps the weights
    after = ("partition", "precision")

    rules = RULES
