"""Graph breaks of the training step under `torch.compile`: one graph per step is the goal.

Why count them: each break in a compiled training step ends one graph and
starts another, which on a GPU is a device sync plus a fresh set of kernel
launches every step (issue 12: keyed dropout's old per-sample loop cost 9).
`torch._dynamo.explain` traces a program's forward exactly as `torch.compile`
would, with the trainer's autocast and dropout key in place, but compiles
nothing, so counting is cheap enough for the test suite on the tiny networks
and for the production networks in `benchmarks/bench_graph_breaks.py`.

* `training_breaks(graph, ...)`: the program `vgraph train --compile` compiles
  (all costs, training mode) of an already prepared graph;
* `stage_breaks(placed, ...)`: every stage program of `vgraph launch`'s
  workers (one per PNode x stage, feeds are received activations, token ids
  and targets).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from vgraph.ir.graph import Graph

from .dropout import dropout_key
from .lower import VGraphModule, compile_network, compute_dtype

__all__ = ["BreakReport", "explain_program", "training_breaks", "stage_breaks"]

_WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64}


@dataclass
class BreakReport:
    """What dynamo made of one program: graphs, breaks and why each break happened."""

    name: str
    graphs: int
    breaks: int
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = f"{self.name}: {self.graphs} graph(s), {self.breaks} graph break(s)"
        return "\n".join([head, *(f"  {r}" for r in self.reasons)])


def explain_program(name: str, program: torch.nn.Module, args: Sequence[Any], *, dtype: torch.dtype,
                    device_type: str = "cpu", reset: bool = True) -> BreakReport:
    """Trace `program(*args)` as `vgraph train` calls it (autocast to `dtype`, a dropout key set).

    `reset` clears dynamo's caches before and after (a clean count); a caller
    that keeps other compiled programs warm (a benchmark) passes False.
    """
    import torch._dynamo

    amp = (torch.autocast(device_type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    if reset:
        torch._dynamo.reset()
    try:
        with dropout_key(0, 1), amp:
            explained = torch._dynamo.explain(program)(*args)
    finally:
        if reset:
            torch._dynamo.reset()
    reasons = []
    for br in explained.break_reasons:
        where = br.user_stack[-1] if br.user_stack else None
        at = f" at {where.filename}:{where.lineno}" if where is not None else ""
        reasons.append(f"{br.reason.splitlines()[0][:200]}{at}")
    return BreakReport(name, explained.graph_count, explained.graph_break_count, reasons)


def _token_shape(graph: Graph) -> tuple[int, int]:
    embedder = graph.nodes_of_type("embedder")[0]
    return int(embedder.cfg["seq_len"]), int(embedder.cfg["vocab_size"])


def training_breaks(graph: Graph, *, name: str | None = None, batch: int = 2) -> BreakReport:
    """Graph breaks of the training program of `graph` (prepared: passes already run)."""
    module = compile_network(graph, train=True, seed=0)
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    seq_len, vocab = _token_shape(graph)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    return explain_program(name or graph.name, program.module, [ids] * len(program.feeds),
                           dtype=compute_dtype(graph))


def _stage_args(module: VGraphModule, task: Any, plan: Any, batch: int, ids: torch.Tensor) -> list[torch.Tensor]:
    """Example feeds of a stage program: received activations, token ids or next-token targets."""
    received = {plan.transfers[i].recv_id: plan.transfers[i] for i in task.receives}
    args = []
    for feed in module.program_for(task.want, training=True).feeds:
        node_id = feed.rpartition(":in")[0]
        if node_id in received:
            tr = received[node_id]
            dtype = _WIRE_DTYPES[tr.dtype]
            args.append(torch.randn(batch, *tr.shape).to(dtype) if dtype.is_floating_point
                        else torch.zeros(batch, *tr.shape, dtype=dtype))
        else:
            args.append(ids)
    return args


def stage_breaks(placed: Graph, assignment: dict[str, str], ranks: Sequence[str], *,
                 batch: int = 2) -> list[BreakReport]:
    """Graph breaks of every stage program `vgraph launch` runs for a placed graph."""
    from vgraph.run.step_plan import make_plan

    plan = make_plan(placed, assignment, list(ranks))
    seq_len, vocab = _token_shape(placed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    reports = []
    for task in plan.tasks.values():
        if not task.want:
            continue
        module = compile_network(task.graph, train=True, seed=0)
        program = module.program(task.want, training=True)
        reports.append(explain_program(task.id, program, _stage_args(module, task, plan, batch, ids),
                                       dtype=compute_dtype(task.graph)))
    return reports
