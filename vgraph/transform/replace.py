"""Declarative subgraph replacement: a rewrite says what a match becomes, not how to rewire it.

    ce = fused("tied_lm_head_ce", f"{head.id}_ce", cfg, [head, cost], inputs=[reads(head, 0), reads(cost, 1)])
    return replace(graph, [cost, head], [ce], {cost.id: ce[0], head.id: ce[1]})

`replace` removes the old nodes, adds the new ones and wires them: a new
node's input is a value an old node read (`reads(node, slot)`), an output
of another new node (`new[slot]`), or a kept node's output (`(id, slot)`);
every reader outside the old nodes of an old output (edges and endpoints)
is pointed at the new value the mapping gives for it.

Before it changes anything it looks at what would be orphaned, as torch.fx's
subgraph rewriter and onnxscript's rewriter make sure a match's intermediate
values do not escape: an old output read from outside the match with no
replacement, a shared weight an outside node ties to that no new node
publishes, or declared input/output shapes the new nodes could not keep.
Each is a `Reject` with the reason, and the graph is left untouched, so
`--explain` can say why a candidate stayed.  Mistakes in the rewrite itself
(a key that is not an old output, a new node reading a value the
replacement removes) are programming errors: `ReplaceError`.

A new node that takes the id of an old one is rebuilt in its place (same
position in the node order, so the YAML keeps its order): rewiring a
broadcast to fewer outputs is `rebuilt(fanout, ..., num_outputs=2)`.

Cycles are not searched for (that is a walk of the graph per match): only a
match with an outside node between two of its nodes can make one, and the
pass manager's verification names the pass if it does.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Mapping, Sequence, Union

from vgraph.base.diagnostics import SourceLoc, VGraphError
from vgraph.ir.graph import Graph, VNode


class ReplaceError(VGraphError):
    """A replacement that is wrong as written (not a refusal: a bug in the rewrite)."""


@dataclass(frozen=True)
class Reject:
    """Returned by a rewrite (or `replace`) that declines a match, with the reason."""

    reason: str


@dataclass(frozen=True)
class Reads:
    """The value that feeds input `slot` of `node` now (None when that input is a network input)."""

    node: str
    slot: int = 0


def reads(node: VNode | str, slot: int = 0) -> Reads:
    return Reads(node.id if isinstance(node, VNode) else node, slot)


@dataclass(frozen=True)
class NewOutput:
    """Output `slot` of a node the replacement creates."""

    node: "NewNode"
    slot: int


Source = Union[Reads, NewOutput, "tuple[str, int]", None]


@dataclass(eq=False)
class NewNode:
    """A node to create: what it is and what each of its input slots reads (None: left unconnected)."""

    type: str
    id: str
    config: dict[str, Any]
    inputs: Sequence[Source] = ()
    loc: SourceLoc | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, slot: int) -> NewOutput:
        return NewOutput(self, slot)


PLACEMENT_KEYS = ("colocate_group", "colocate_policy")
PRECISION_KEYS = ("precision", "param_precision", "activation_precision")
TRAINING_KEYS = ("optimizer", "learning_rate")
MEMORY_KEYS = ("remat",)  # what is kept for backward: the same function, computed twice or once


def inherited_config(node: VNode, keys: Sequence[str] = PLACEMENT_KEYS + PRECISION_KEYS + TRAINING_KEYS
                     ) -> dict:
    """The keys a fused node takes over from a node it replaces (placement, precision, training)."""
    return {k: node.config[k] for k in keys if k in node.config}


def fused(type_name: str, node_id: str, config: Mapping[str, Any], sources: Sequence[VNode],
          inputs: Sequence[Source], meta: dict[str, Any] | None = None) -> NewNode:
    """A node computing what `sources` computed together.

    It takes placement, precision and training keys, source line and
    annotations from the first source, and records `fused_from` (the sources'
    ids, in order), which is how checkpoints map its weights to theirs.
    """
    first = sources[0]
    cfg = {**config, **inherited_config(first), "fused_from": ",".join(s.id for s in sources)}
    return NewNode(type_name, node_id, cfg, tuple(inputs), first.loc, dict(first.meta) if meta is None else meta)


def rebuilt(node: VNode, inputs: Sequence[Source], **config: Any) -> NewNode:
    """`node` itself (same id, type, annotations, place in the order) reading `inputs`, with `config` changes."""
    cfg = {**node.config, **config}
    return NewNode(node.type, node.id, {k: v for k, v in cfg.items() if v is not None}, tuple(inputs),
                   node.loc, dict(node.meta))


def fresh_id(taken: Container[str], base: str) -> str:
    """`base`, or `base_2`, `base_3`, ... whichever is not in `taken` (a Graph or a set of names)."""
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


OldOutput = Union[VNode, str, "tuple[VNode | str, int]"]


def replace(graph: Graph, old: Iterable[VNode | str], new: Sequence[NewNode],
            outputs: Mapping[OldOutput, Source] | Iterable[tuple[OldOutput, Source]] | None = None, *,
            counts: Mapping[str, int] | None = None) -> Counter | Reject:
    """Replace the nodes `old` by `new`; `outputs` maps each old output read from outside to its value.

    Keys of `outputs` are `(node id, slot)` or a node id (its output 0); pairs
    `[(node, new[0]), ...]` may name VNodes (which are not hashable).  Returns
    `counts` (default: nodes removed and created), or a `Reject` and changes
    nothing when the replacement would orphan a reader.
    """
    old_ids = list(dict.fromkeys(n.id if isinstance(n, VNode) else n for n in old))
    gone = set(old_ids)
    for node_id in old_ids:
        graph.node(node_id)  # KeyError names an unknown node
    pairs = outputs.items() if isinstance(outputs, Mapping) else (outputs or ())
    wanted = {_old_output(k, gone): v for k, v in pairs}
    outs = {node_id: graph.out_edges(node_id) for node_id in old_ids}
    why = _orphans(graph, old_ids, outs, gone, wanted, new)
    if why is not None:
        return Reject(why)
    ids = _assign_ids(graph, new, gone)
    # Everything is resolved against the graph as it is, before the first change.
    plan = [[_resolve(graph, src, gone, ids) for src in n.inputs] for n in new]
    targets = {key: _resolve(graph, src, gone, ids) for key, src in wanted.items()}
    readers = [(e, targets[(e.src, e.src_slot)])
               for node_id in old_ids for e in outs[node_id] if e.dst not in gone]
    endpoints = [(kind, ep, targets[(ep.node, ep.slot)]) for kind, eps in graph.endpoints.items()
                 for ep in eps if (ep.node, ep.slot) in wanted]
    for reader, target in readers + [(ep, t) for _, ep, t in endpoints]:
        if target is None:
            raise ReplaceError(f"{reader} would read nothing: map it to a value, not to an unconnected input")
    for node_id in old_ids:  # an edge between two old nodes is an out-edge of one and an in-edge of another
        for e in outs[node_id]:
            graph.remove_edge(e)
    for node_id in old_ids:
        for e in graph.in_edges(node_id):  # those from outside (the others went above)
            graph.remove_edge(e)
    for kind, ep, target in endpoints:
        graph.set_endpoint(kind, ep.name, target[0], target[1])
    reused = {ids[id(n)] for n in new} & gone
    for node_id in old_ids:
        if node_id not in reused:
            graph.remove_node(node_id)
    for n in new:
        _place(graph, n, ids[id(n)], reused)
    for n, sources in zip(new, plan):
        for slot, src in enumerate(sources):
            if src is not None:
                graph.add_edge(src[0], src[1], ids[id(n)], slot, src[2])
    for e, target in readers:
        graph.add_edge(target[0], target[1], e.dst, e.dst_slot, e.loc)
    return Counter(counts) if counts is not None else Counter(removed=len(old_ids), created=len(new))


def _old_output(key: OldOutput, gone: set[str]) -> tuple[str, int]:
    node, slot = key if isinstance(key, tuple) else (key, 0)
    node_id = node.id if isinstance(node, VNode) else node
    if node_id not in gone:
        raise ReplaceError(f"outputs maps ({node_id!r}, {slot}), but '{node_id}' is not replaced")
    return node_id, slot


def _orphans(graph: Graph, old_ids: list[str], outs: Mapping[str, list], gone: set[str],
             wanted: Mapping[tuple[str, int], Source], new: Sequence[NewNode]) -> str | None:
    """Why the replacement would lose something a reader outside it needs (None: nothing)."""
    published = {n.config.get("shared_weight_alias") for n in new}
    for node_id in old_ids:
        node = graph.node(node_id)
        if node.input_shapes is not None or node.output_shapes is not None:
            return f"'{node_id}' declares input/output shapes, which the replacement would lose"
        for e in outs[node_id]:
            if e.dst not in gone and (node_id, e.src_slot) not in wanted:
                slot = f" (output {e.src_slot})" if e.src_slot else ""
                return f"'{node_id}'{slot} also feeds '{e.dst}'"
        alias = node.config.get("shared_weight_alias")
        if alias and alias not in published:
            for other in graph.nodes:
                if other.id not in gone and any(a == alias for a, _ in other.op.tied(other.cfg).values()):
                    return f"'{node_id}' publishes weight {alias!r}, which '{other.id}' ties to"
    for ep in graph.iter_endpoints():
        if ep.node in gone and (ep.node, ep.slot) not in wanted:
            return f"'{ep.node}' is read by {ep.name!r}"
    return None


def _assign_ids(graph: Graph, new: Sequence[NewNode], gone: set[str]) -> dict[int, str]:
    """Final ids: an old node's id is taken over in place; any other taken id gets a suffix."""
    ids: dict[int, str] = {}
    taken: set[str] = set()
    for n in new:
        node_id = n.id if n.id in gone and n.id not in taken else fresh_id(_Taken(graph, taken), n.id)
        ids[id(n)] = node_id
        taken.add(node_id)
    return ids


@dataclass(frozen=True)
class _Taken:
    graph: Graph
    extra: set[str]

    def __contains__(self, name: object) -> bool:
        return name in self.graph or name in self.extra


def _resolve(graph: Graph, src: Source, gone: set[str], ids: Mapping[int, str]
             ) -> tuple[str, int, SourceLoc | None] | None:
    """(node, slot, edge source line) a source stands for, in the graph after the replacement."""
    if src is None:
        return None
    if isinstance(src, NewOutput):
        if id(src.node) not in ids:
            raise ReplaceError(f"an input reads node {src.node.id!r}, which is not among the new nodes")
        return ids[id(src.node)], src.slot, None
    if isinstance(src, Reads):
        edge = graph.input_edge(src.node, src.slot)
        if edge is None:
            return None
        if edge.src in gone:
            raise ReplaceError(f"reads({src.node!r}, {src.slot}) is '{edge.src}', which the replacement "
                               f"removes; read a new node's output instead")
        return edge.src, edge.src_slot, edge.loc
    node, slot = src
    node_id = node.id if isinstance(node, VNode) else node
    if node_id in gone:
        raise ReplaceError(f"({node_id!r}, {slot}) is an output the replacement removes; read a new "
                           f"node's output or reads(...) instead")
    graph.node(node_id)
    return node_id, slot, None


def _place(graph: Graph, n: NewNode, node_id: str, reused: set[str]) -> None:
    """Add the new node, or rebuild the old node whose id it takes over, in its place."""
    if node_id not in reused:
        graph.add_node(VNode(node_id, n.type, dict(n.config), loc=n.loc, meta=dict(n.meta)))
        return
    graph.rebuild_node(node_id, n.type, n.config, loc=n.loc, meta=n.meta)
