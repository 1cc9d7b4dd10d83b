"""Lower `remat: recompute` marks: each region of vgraph/cost/remat.py becomes one checkpointed submodule.

Why cut the lowered fx graph rather than lower each VNode under its own
checkpoint: a VNode's output is only freed if its readers are recomputed with
it, so the unit of recomputation is the region (marked VNodes and the readers
that rebuild what they saved), exactly as the core cost model counts it.  A
region is a contiguous run of the topological order, so its fx nodes are
contiguous too and it can be cut out as a GraphModule: its inputs (values
from outside) are kept, its outputs (values read outside) are returned, and
everything inside runs again in backward.

The region's fx nodes are copied unchanged, so the fused kernels (multi-head
attention, the chunked tied LM-head cross-entropy) and the float32 regions
stay what they were.  Checkpointing is non-reentrant (`use_reentrant=False`):
it works with parameters that are not inputs, keeps autocast state and nests
with autograd Functions.  Keyed dropout draws from the thread's dropout key;
the key is captured when the region runs forward and set again while it is
recomputed, so backward draws the same masks even from another thread or
after the trainer moved on.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from vgraph.cost.remat import remat_layout
from vgraph.ir.graph import Graph

from .dropout import DropoutKey, clear_dropout_key, current_dropout_key, set_dropout_key

__all__ = ["CheckpointRegion", "outline_remat_regions"]


def _set_key(key: DropoutKey | None) -> None:
    if key is None:
        clear_dropout_key()
    else:
        set_dropout_key(key.seed, key.step, key.offset)


def _run_keyed(body: nn.Module, key: DropoutKey | None, *args: Any) -> Any:
    """`body(*args)` with this thread's dropout key set to `key` (the forward's), then the previous one."""
    previous = current_dropout_key()
    _set_key(key)
    try:
        return body(*args)
    finally:
        _set_key(previous)


class CheckpointRegion(nn.Module):
    """A region's GraphModule, run under non-reentrant activation checkpointing when gradients flow."""

    def __init__(self, body: fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(_run_keyed, self.body, current_dropout_key(), *args, use_reentrant=False)


def outline_remat_regions(graph: Graph, fxg: fx.Graph, root: dict[str, Any],
                          created: Mapping[str, Iterable[fx.Node]]) -> int:
    """Replace each remat region's fx nodes (`created`: VNode id -> its fx nodes) by a checkpointed
    submodule added to `root`; returns how many regions were cut out."""
    layout = remat_layout(graph)
    count = 0
    for members in layout.regions:
        if not any(m in layout.recomputed for m in members):
            continue  # every marked output is read outside: nothing would be freed
        region = {n for m in members for n in created.get(m, ())}
        if not region:
            continue
        name = f"remat_{count}"
        while name in root:
            name += "_"
        _outline(fxg, root, region, name, members[0])
        count += 1
    return count


def _outline(fxg: fx.Graph, root: dict[str, Any], region: set[fx.Node], name: str, first: str) -> None:
    ordered = [n for n in fxg.nodes if n in region]
    inputs: list[fx.Node] = []
    for n in ordered:
        for a in n.all_input_nodes:
            if a not in region and a.op != "get_attr" and a not in inputs:
                inputs.append(a)
    outputs = [n for n in ordered if any(u not in region for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
    sub_root: dict[str, Any] = {}
    for n in ordered:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = sub.get_attr(a.target)
                sub_root[a.target] = root[a.target]
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    root[name] = CheckpointRegion(fx.GraphModule(sub_root, sub, class_name=f"Remat_{first}"))
    with fxg.inserting_after(ordered[-1]):
        call = fxg.call_module(name, tuple(inputs))
    last = call
    for i, o in enumerate(outputs):
        with fxg.inserting_after(last):
            last = fxg.call_function(operator.getitem, (call, i))
        o.replace_all_uses_with(last, delete_user_cb=lambda user: user not in region)
    for n in reversed(ordered):
        fxg.erase_node(n)
    for n in list(fxg.nodes):  # parameters only the region read
        if n.op == "get_attr" and not n.users:
            fxg.erase_node(n)
