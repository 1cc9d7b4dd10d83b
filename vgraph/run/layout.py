"""Checkpoint layouts across fusions.

A checkpoint is a flat map "<vnode_id>.<param>" -> tensor.  A fused VNode's
parameter is the concatenation, along dim 0, of parameters of the VNodes it
replaced (recorded in its `fused_from` config, so the mapping survives a
write to YAML and back).  These functions move a checkpoint between the
unfused layout and a graph's own layout exactly, for any array type: the
caller supplies concatenation and splitting (torch.cat, numpy.concatenate).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence, TypeVar

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import Graph

T = TypeVar("T")
Sources = dict[str, list[tuple[str, int]]]


def param_sources(graph: Graph) -> Sources:
    """For every parameter key of `graph`: its (unfused key, rows) pieces, in order."""
    out: Sources = {}
    for n in graph.nodes:
        shapes = n.op.param_shapes(n.cfg)
        fused = n.op.param_sources(n.cfg) if n.op.param_sources and n.config.get("fused_from") else {}
        for pname, shape in shapes.items():
            key = f"{n.id}.{pname}"
            out[key] = fused.get(pname) or [(key, shape[0] if shape else 1)]
    return out


def to_graph_layout(unfused: Mapping[str, T], graph: Graph, cat: Callable[[list[T]], T]) -> dict[str, T]:
    """An unfused-layout state -> the layout of `graph` (fused params concatenated)."""
    out: dict[str, T] = {}
    for key, pieces in param_sources(graph).items():
        missing = [k for k, _ in pieces if k not in unfused]
        if missing:
            raise VGraphError(f"checkpoint has no {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''} (needed for {key!r} of network "
                              f"{graph.name!r})")
        out[key] = unfused[pieces[0][0]] if len(pieces) == 1 and pieces[0][0] == key else \
            cat([unfused[k] for k, _ in pieces])
    return out


def to_unfused_layout(state: Mapping[str, T], graph: Graph,
                      split: Callable[[T, Sequence[int]], Sequence[T]]) -> dict[str, T]:
    """A state in `graph`'s layout -> the unfused layout (fused params split by rows)."""
    out: dict[str, T] = {}
    for key, pieces in param_sources(graph).items():
        if key not in state:
            raise VGraphError(f"checkpoint has no {key!r} (network {graph.name!r})")
        if len(pieces) == 1 and pieces[0][0] == key:
            out[key] = state[key]
            continue
        for (k, _), part in zip(pieces, split(state[key], [rows for _, rows in pieces])):
            out[k] = part
    return out
