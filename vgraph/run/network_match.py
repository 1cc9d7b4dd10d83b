"""Do trained weights fit a network?  The check behind every command that loads a checkpoint.

A checkpoint's keys and shapes are not enough: a pass that swaps SwiGLU for
GEGLU keeps every parameter shape, so weights trained for one load silently
into the other, and the model "works" while computing a function nobody
trained.  So a checkpoint carries the network it was trained on (its
*definition*: the YAML as given, or the graph after a pass that changed what
it computes) and a network is compared with it here, node by node.

Two networks match when they compute the same function with the same weight
layout: the same VNodes (id, type, and the config keys that define the
computation: placement, training and precision keys do not), the same
edges and the same outputs and costs.  A fused network matches the network
it was fused from: when the direct comparison fails, both sides are first
brought to a common form by every registered pass that keeps what the network
computes and fuses (declares `preserves_semantics` and `fuses`, which rule-based
passes do: `fused(...)` records `fused_from`), a plugin's as well as the
built-in ones, after `dead-nodes`.  `difference` names the first node, key or
edge that differs.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import Graph
from vgraph.transform.replace import MEMORY_KEYS, PLACEMENT_KEYS, PRECISION_KEYS, TRAINING_KEYS

#: Config keys that do not change what a network computes (nor its weight layout).
NON_FUNCTIONAL = frozenset(PLACEMENT_KEYS + PRECISION_KEYS + TRAINING_KEYS + MEMORY_KEYS)
#: Run first on both sides: what no endpoint reads has no weights a comparison should see.
FIRST_PASSES = ("dead-nodes",)


@dataclass(frozen=True)
class Signature:
    """What a network computes, as comparable data."""

    nodes: dict[str, tuple[str, tuple[tuple[str, Any], ...]]]  # id -> (type, functional config)
    edges: frozenset[tuple[str, int, str, int]]
    endpoints: tuple[tuple[str, str, str, int], ...]  # (kind, name, node, slot)
    # node ids in the file's order, for the first difference a message names; not compared: two fusions
    # applied in another order (or a fused file written by `optimize`) list the same VNodes differently
    order: tuple[str, ...] = field(compare=False)


def signature(graph: Graph) -> Signature:
    nodes = {n.id: (n.type, tuple(sorted((k, v) for k, v in n.config.items() if k not in NON_FUNCTIONAL)))
             for n in graph.nodes}
    edges = frozenset((e.src, e.src_slot, e.dst, e.dst_slot) for e in graph.edges)
    endpoints = tuple(sorted((kind, ep.name, ep.node, ep.slot) for kind, eps in graph.endpoints.items()
                             for ep in eps))
    return Signature(nodes, edges, endpoints, tuple(n.id for n in graph.nodes))


def canonical_passes() -> list[str]:
    """`dead-nodes`, then every available pass that preserves semantics and fuses (built-in ones first, then
    by name; the pipeline orders them by their declarations)."""
    from vgraph.transform.pipeline import available_passes

    installed = available_passes()
    fusions = []
    for name in sorted(installed, key=lambda n: (not installed[n].builtin, n)):
        if name in FIRST_PASSES:
            continue
        cls = installed[name].load()  # imported, not announced: only a pass that runs says it overrides
        if cls.preserves_semantics and cls.fuses:
            fusions.append(name)
    return [n for n in FIRST_PASSES if n in installed] + fusions


def canonical(graph: Graph) -> Graph:
    """A copy of `graph` in its common fused form (`canonical_passes`)."""
    from vgraph.transform.pipeline import run_pipeline

    copy = graph.copy()
    run_pipeline(copy, canonical_passes())
    return copy


def fingerprint(graph: Graph) -> str:
    """A digest of what `graph` computes: equal for a network and its fused forms."""
    sig = signature(canonical(graph))
    payload = (sorted(sig.nodes.items()), sorted(sig.edges), sig.endpoints)
    return hashlib.sha256(pickle.dumps(payload, protocol=4)).hexdigest()[:32]


def difference(trained: Graph, given: Graph) -> str | None:
    """Why weights trained for `trained` do not fit `given` (None: they do), naming the node or key."""
    a, b = signature(trained), signature(given)
    if a == b:
        return None
    try:
        fa, fb = signature(canonical(trained)), signature(canonical(given))
    except VGraphError:  # a side the fusions cannot run on (not a valid network): compare as written
        return _describe(a, b)
    if fa == fb:
        return None
    # Same VNodes as written: the difference is clearest there (a changed key can stop a fusion on one
    # side, which the fused forms would report as a missing fused node).
    return _describe(a, b) if a.nodes.keys() == b.nodes.keys() else _describe(fa, fb)


def _describe(trained: Signature, given: Signature) -> str:
    for node_id in trained.order:
        if node_id not in given.nodes:
            return (f"node '{node_id}' ({trained.nodes[node_id][0]}) is in the checkpoint's network but "
                    f"not in this one")
    for node_id in given.order:
        if node_id not in trained.nodes:
            return (f"node '{node_id}' ({given.nodes[node_id][0]}) is in this network but not in the "
                    f"checkpoint's")
    for node_id in trained.order:
        (t_type, t_cfg), (g_type, g_cfg) = trained.nodes[node_id], given.nodes[node_id]
        if t_type != g_type:
            return f"node '{node_id}' is a {t_type} in the checkpoint's network, a {g_type} in this one"
        t, g = dict(t_cfg), dict(g_cfg)
        for key in sorted(set(t) | set(g)):
            if t.get(key) != g.get(key):
                return (f"node '{node_id}': config {key!r} is {_shown(t, key)} in the checkpoint's network, "
                        f"{_shown(g, key)} in this one")
    for src, s_slot, dst, d_slot in sorted(trained.edges ^ given.edges):
        where = "the checkpoint's network" if (src, s_slot, dst, d_slot) in trained.edges else "this network"
        return f"only {where} has the edge '{src}':{s_slot} -> '{dst}':{d_slot}"
    extra = sorted(set(trained.endpoints) ^ set(given.endpoints))
    kind, name, node, slot = extra[0]
    where = "the checkpoint's network" if extra[0] in trained.endpoints else "this network"
    return f"only {where} has the {kind[:-1] if kind.endswith('s') else kind} {name!r} = '{node}':{slot}"


def _shown(cfg: dict[str, Any], key: str) -> str:
    return repr(cfg[key]) if key in cfg else "unset"


class NetworkMismatch(VGraphError):
    """A checkpoint refused because it was trained on another network."""


def require_match(trained: Graph, given: Graph, *, checkpoint: str, given_label: str,
                  changes: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse (NetworkMismatch) when weights trained for `trained` do not fit `given`."""
    why = difference(trained, given)
    if why is None:
        return
    hint = (f"; it was trained after {', '.join(map(repr, changes))} changed the network: give the network "
            f"it stores (the run's network.yml)" if changes else "")
    raise NetworkMismatch(f"checkpoint {checkpoint} was trained on another network than {given_label}: "
                          f"{why}{hint}")
