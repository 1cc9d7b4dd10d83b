"""The micro-batch schedule of a partitioned training step: which ops each rank runs, and in which order.

One definition serves the two sides that must agree on it: the torch backend's workers run these orders
(vgraph/run/step_plan.py turns its tasks into `ScheduledTask`s, stage_runner.py executes the
ops), and the step cost model prices a pipeline as the makespan of the same orders (vgraph/cost/makespan.py
gives every op its duration).  A model that priced some other schedule (a linear chain's bubble, as
stepcost.py did) mispredicted exactly where the workers' schedule differs from it: on the testbed, a cut
whose first rank also runs the last task (the tied LM head next to the embedder: rank 0 -> 1 -> 0) ran
near the serial sum of its stages, 1.2x to 2.5x the bubble formula (docs/benchmarks-history.md).

**Tasks.**  A rank may run several tasks (a PNode's VNodes at different depths of the network: step_plan.py),
listed here in forward order.  A task's forward reads the forward outputs of the tasks in `reads`; its
backward needs the gradients that the tasks in `grads_from` send back for what they read from it.

**1F1B** (the default): every rank runs a ready backward when it has one, else a ready forward, and starts
a new micro-batch (in order) only while fewer than min(M, ranks) are in flight on it, so a rank holds the
activations the cost model budgets (`CostModel.resident_samples`).  The per-rank orders come from a
deterministic simulation in unit time.  **GPipe**: all forwards (task by task), then all backwards in
reverse.  Either way every op only needs ops that come before it in one global order, and sends never
block, so executing the orders with blocking receives cannot deadlock on any placement.  After the
backwards, each rank syncs the gradients of its remote tied weights (`tie_grad`, one per tie, in tie
order); `tie_weight` ops (the updated weights back) follow the optimizer step.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

__all__ = ["Op", "OpKind", "ScheduledTask", "TiedPair", "PIPELINES", "schedule", "weight_round"]

OpKind = Literal["fwd", "bwd", "tie_grad", "tie_weight"]
PIPELINES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Op:
    kind: OpKind
    task: str | None  # fwd / bwd
    micro: int  # fwd / bwd
    tie: int | None = None  # tie_grad / tie_weight


@dataclass(frozen=True)
class ScheduledTask:
    """A task as the schedule sees it: which rank runs it and which tasks it waits for."""

    id: str
    rank: int
    reads: tuple[str, ...] = ()  # tasks whose forward outputs its forward reads
    grads_from: tuple[str, ...] = ()  # tasks whose gradients its backward needs (they read its outputs)


@dataclass(frozen=True)
class TiedPair:
    """A tied weight whose publisher and replica run on two different ranks: synced every step."""

    index: int
    ranks: tuple[int, int]


def schedule(tasks: Sequence[ScheduledTask], ranks: int, micro_batches: int, *, train: bool,
             pipeline: str = "1f1b", ties: Sequence[TiedPair] = ()) -> dict[int, list[Op]]:
    """Every rank's ops of one round (a training step, or a forward-only evaluation), in execution order.

    `tasks`: in forward order on each rank; `ranks`: how many ranks the round spans (the in-flight cap of
    1F1B); `ties`: the remote tied weights (their `tie_grad` ops end a training round)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(PIPELINES)}, not {pipeline!r}")
    if micro_batches < 1:
        raise ValueError(f"a round needs at least one micro-batch, got {micro_batches}")
    cached = _schedule(tuple(tasks), ranks, micro_batches, train, pipeline, tuple(ties))
    return {r: list(ops) for r, ops in cached.items()}


@lru_cache(maxsize=512)
def _schedule(tasks: tuple[ScheduledTask, ...], ranks: int, micro_batches: int, train: bool, pipeline: str,
              ties: tuple[TiedPair, ...]) -> dict[int, tuple[Op, ...]]:
    """`schedule`, cached: the planner prices the same task graph and micro-batch count many times."""
    if train and pipeline == "1f1b":
        ops = _one_f_one_b(tasks, ranks, micro_batches)
    else:
        ops = {}
        for rank in range(ranks):
            mine = [t for t in tasks if t.rank == rank]
            ops[rank] = [Op("fwd", t.id, m) for t in mine for m in range(micro_batches)]
            if train:
                ops[rank] += [Op("bwd", t.id, m) for t in reversed(mine) for m in range(micro_batches)]
    if train:
        for rank in ops:
            ops[rank] += [Op("tie_grad", None, 0, tie.index) for tie in ties if rank in tie.ranks]
    return {r: tuple(seq) for r, seq in ops.items()}


def weight_round(ties: Sequence[TiedPair], rank: int) -> list[Op]:
    """The rank's part of a tie-weight round (owners -> replicas), run after every optimizer step."""
    return [Op("tie_weight", None, 0, tie.index) for tie in ties if rank in tie.ranks]


def _one_f_one_b(tasks: Sequence[ScheduledTask], ranks: int, micro_batches: int) -> dict[int, list[Op]]:
    """1F1B by simulation: each rank runs a ready backward if it has one, else a ready forward, and
    starts a new micro-batch (in order) only while fewer than min(M, ranks) are in flight on it.

    Every op takes one time unit; the simulated start order of each rank is its schedule.  Executing
    those orders with blocking receives cannot deadlock: the simulated timeline is a global order in
    which every op comes after the ops it needs.  The cap can never stall the simulation either: the
    oldest unfinished micro-batch is in flight on every rank that has started it, and a rank that has
    not has nothing older in flight, so it may start it.
    """
    cap = max(1, min(micro_batches, ranks))
    state = _Progress(tasks, ranks, micro_batches)
    total = 2 * micro_batches * len(tasks)
    while state.done < total:
        chosen = [(r, op) for r in range(ranks) if (op := state.next_op(r, cap)) is not None]
        if not chosen:
            raise RuntimeError("1F1B schedule simulation stalled (a bug in vgraph/cost/schedule.py)")
        for r, op in chosen:  # all ranks' choices of this time unit complete together
            state.complete(r, op)
    return state.order


class _Progress:
    """What the 1F1B simulation has done so far, and each rank's next choice.

    The rule, as each rank applies it in every time unit: the oldest in-flight micro-batch's ready backward,
    the rank's last task first; else the ready forward of the oldest micro-batch it may run (one in flight,
    or the next one while fewer than the cap are), its first task first.  An op is ready when what it needs
    is done: a forward, the forwards it reads and its own forward of the micro-batch before; a backward,
    its own forward and the backwards of the tasks that read it.  Ready ops wait in per-rank heaps ordered
    by that rule (counting what each op still needs), so a time unit costs a heap look-up per rank rather
    than a scan of every task and micro-batch: the planner schedules pipelines of up to 64 stages."""

    def __init__(self, tasks: Sequence[ScheduledTask], ranks: int, micro_batches: int) -> None:
        self.M = micro_batches
        self.rank = {t.id: t.rank for t in tasks}
        pos: dict[str, int] = {}
        for r in range(ranks):  # each task's place in its rank's forward order
            pos.update((t.id, i) for i, t in enumerate(x for x in tasks if x.rank == r))
        self.pos = pos
        self.readers: dict[str, list[str]] = {t.id: [] for t in tasks}  # forwards waiting for t's forward
        self.graders: dict[str, list[str]] = {t.id: [] for t in tasks}  # backwards waiting for t's backward
        for t in tasks:
            for src in t.reads:
                self.readers[src].append(t.id)
            for dst in t.grads_from:
                self.graders[dst].append(t.id)
        self.fwd_wait = {(t.id, m): len(t.reads) + (m > 0) for t in tasks for m in range(micro_batches)}
        self.bwd_wait = {(t.id, m): 1 + len(t.grads_from) for t in tasks for m in range(micro_batches)}
        self.ready_fwd: dict[int, list[tuple[int, int, str]]] = {r: [] for r in range(ranks)}  # (m, pos, task)
        self.ready_bwd: dict[int, list[tuple[int, int, str]]] = {r: [] for r in range(ranks)}  # (m, -pos, task)
        for (tid, m), wait in self.fwd_wait.items():
            if wait == 0:
                heapq.heappush(self.ready_fwd[self.rank[tid]], (m, pos[tid], tid))
        self.in_flight: dict[int, set[int]] = {r: set() for r in range(ranks)}
        self.next_start = dict.fromkeys(range(ranks), 0)
        self.left = {(r, m): sum(1 for t in tasks if t.rank == r) for r in range(ranks) for m in range(micro_batches)}
        self.order: dict[int, list[Op]] = {r: [] for r in range(ranks)}
        self.done = 0

    def next_op(self, r: int, cap: int) -> Op | None:
        """Rank r's choice in this time unit (taken off its heap), or None."""
        if self.ready_bwd[r]:
            m, _, tid = heapq.heappop(self.ready_bwd[r])
            return Op("bwd", tid, m)
        heap = self.ready_fwd[r]
        # The smallest ready micro-batch: one in flight, or the next one while there is room (the others in
        # the heap are later still, never in flight: micro-batches start in order).
        if heap and (heap[0][0] in self.in_flight[r]
                     or (heap[0][0] == self.next_start[r] and len(self.in_flight[r]) < cap)):
            m, _, tid = heapq.heappop(heap)
            return Op("fwd", tid, m)
        return None

    def complete(self, r: int, op: Op) -> None:
        self.order[r].append(op)
        self.done += 1
        tid, m = str(op.task), op.micro
        if op.kind == "fwd":
            if m not in self.in_flight[r]:
                self.in_flight[r].add(m)
                self.next_start[r] += 1
            woken = [(x, m) for x in self.readers[tid]] + ([(tid, m + 1)] if m + 1 < self.M else [])
            for key in woken:
                self.fwd_wait[key] -= 1
                if self.fwd_wait[key] == 0:
                    heapq.heappush(self.ready_fwd[self.rank[key[0]]], (key[1], self.pos[key[0]], key[0]))
            self._wake_bwd(tid, m)
        else:
            self.left[(r, m)] -= 1
            if self.left[(r, m)] == 0:
                self.in_flight[r].discard(m)
            for x in self.graders[tid]:
                self._wake_bwd(x, m)

    def _wake_bwd(self, tid: str, m: int) -> None:
        self.bwd_wait[(tid, m)] -= 1
        if self.bwd_wait[(tid, m)] == 0:
            heapq.heappush(self.ready_bwd[self.rank[tid]], (m, -self.pos[tid], tid))
