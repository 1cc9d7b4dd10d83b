"""How long one round of a pipeline schedule takes: the makespan of the workers' own op orders.

The step cost model (stepcost.py) used to price a replica's pipeline as (M + S - 1) / M x its slowest
stage, the bubble of a linear chain of S equal stages.  The workers run something else whenever a rank
holds several tasks (step_plan.py: the embedder and the tied LM head in one colocation group put the first
rank at both ends, rank 0 -> 1 -> 0), and 1F1B's in-flight cap then serialises much of the step: on the
netlab testbed such 2-stage plans ran 1.2x to 2.5x slower than that formula (docs/benchmarks-history.md).  This module
prices the schedule the workers actually run (vgraph/cost/schedule.py, the orders step_plan.py hands them), given
every op's duration:

- a rank runs its ops in order; an op starts when the rank is free and every tensor it reads has arrived
  (receives block), and takes its duration (compute only: sends do not block it);
- a tensor to another rank leaves when its op ends, on the sender's uplink: the messages of one rank go
  out one after another in the order it sends them (a rank's traffic is serialised on its link, as the
  closed form charged a stage its busier direction), each for bytes / bandwidth, and arrives a latency
  later; a tensor between two tasks of one rank is there when its op ends;
- a link with a burst (a token bucket, `PNode.burst`: what a rate limiter such as tbf, or a provider's
  shaper, passes at once after idling) holds up to `bucket` seconds of its bandwidth's bytes, refilled
  while the link idles: a message passes at once as far as the bucket covers it and at the bandwidth for
  the rest.  The testbed measured why: tb-small's 16 KiB messages at 20 Mbit/s crossed within netlab's
  16 KiB bucket, and charging each bytes / rate predicted its pipelines 1.41x and 1.73x slower than they
  ran, while tb-medium's 64 KiB ones, back to back, pay the rate;
- a tied pair's sync (`tie_grad`) starts when both its ranks and their links are free and takes its
  duration on all four;
- a rank on a CPU quota (`PNode.cpu_burst`, vgraph/cost/cpu_quota.py) computes from a token bucket, the
  CPU twin of the link's: empty when the round starts, refilled at the quota's rate, an op runs at the
  CPU's own speed while tokens last (a pipeline stage refills while it waits for its neighbour).

With fixed op orders and fixed message orders on each uplink, every start time is a longest path in a
DAG, so one pass over the ops in a dependency-respecting order computes it (no event queue).  The pass
runs on numpy rows, n pipelines at once (the R replicas of a plan share a schedule): one compiled
`Program` per (task graph, micro-batch count, schedule kind), cached.  On uniform chains with no traffic
the makespan is the closed form exactly ((M + S - 1) x (forward + backward) of a micro-batch, GPipe and
1F1B alike, for a backward at least as long as its forward, as the cost model's always is:
tests/test_makespan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from vgraph.cost.cpu_quota import burst_seconds
from vgraph.cost.schedule import ScheduledTask, TiedPair, schedule

__all__ = ["TaskEdge", "Durations", "Program", "compile_program", "makespan"]


@dataclass(frozen=True)
class TaskEdge:
    """Tensors from task `src` to task `dst` (indices into the task list), and whether gradients flow back."""

    src: int
    dst: int
    grad: bool


@dataclass(frozen=True)
class Durations:
    """Seconds of every op of a round, for n pipelines at once (rows)."""

    forward: np.ndarray  # [n, T, M] task t's forward of micro-batch m
    backward: np.ndarray  # [n, T, M]
    send: np.ndarray  # [n, E, M] edge e's activations on the producer's uplink (unused between tasks of one rank)
    send_back: np.ndarray  # [n, E, M] its gradients on the consumer's uplink
    latency: np.ndarray  # [n, E] added to every message of edge e, either way
    tie: np.ndarray  # [n, P] tied pair p's sync, on both its ranks
    bucket: np.ndarray | None = None  # [n, ranks] seconds of its link's bandwidth a rank's burst holds (None: 0)
    cpu_speedup: np.ndarray | None = None  # [n, ranks] a CPU quota's speed after idling (cpu_quota.py; None: 1)
    cpu_bucket: np.ndarray | None = None  # [n, ranks] seconds of work at that speed its quota passes (None: 0)


@dataclass(frozen=True)
class Program:
    """A schedule as the simulation walks it: steps in an order where every step comes after what it needs.

    An op step is (rank, backward?, task, micro-batch, message slots it waits for, messages it sends: (slot,
    edge, gradient?, remote?)); a tie step is (-1, rank a, rank b, pair)."""

    ranks: int
    messages: int
    steps: tuple[tuple, ...]


def compile_program(tasks: Sequence[ScheduledTask], edges: Sequence[TaskEdge], ranks: int, micro_batches: int,
                    pipeline: str = "1f1b", ties: Sequence[TiedPair] = ()) -> Program:
    """The training round's schedule of `tasks` (the core's, as the workers run it) as a `Program`."""
    return _compile(tuple(tasks), tuple(edges), ranks, micro_batches, pipeline, tuple(ties))


@lru_cache(maxsize=512)
def _compile(tasks: tuple[ScheduledTask, ...], edges: tuple[TaskEdge, ...], ranks: int, micro_batches: int,
             pipeline: str, ties: tuple[TiedPair, ...]) -> Program:
    ops = schedule(tasks, ranks, micro_batches, train=True, pipeline=pipeline, ties=ties)
    index = {t.id: i for i, t in enumerate(tasks)}
    rank_of = [t.rank for t in tasks]
    into = [[e for e, edge in enumerate(edges) if edge.dst == t] for t in range(len(tasks))]
    out_of = [[e for e, edge in enumerate(edges) if edge.src == t] for t in range(len(tasks))]
    slot = {}  # (edge, gradient?, micro) -> message slot
    for e, edge in enumerate(edges):
        for m in range(micro_batches):
            slot[(e, False, m)] = len(slot)
            if edge.grad:
                slot[(e, True, m)] = len(slot)
    pair = {tie.index: p for p, tie in enumerate(ties)}
    steps: list[tuple] = []
    done: set[int] = set()
    pos = dict.fromkeys(ops, 0)

    def step_of(rank: int, op) -> tuple | None:
        t, m = index[op.task], op.micro
        back = op.kind == "bwd"
        needs = ([slot[(e, True, m)] for e in out_of[t] if edges[e].grad] if back
                 else [slot[(e, False, m)] for e in into[t]])
        if not all(k in done for k in needs):
            return None
        sent = ([(slot[(e, True, m)], e, True, rank_of[edges[e].src] != rank) for e in into[t] if edges[e].grad]
                if back else [(slot[(e, False, m)], e, False, rank_of[edges[e].dst] != rank) for e in out_of[t]])
        return (rank, back, t, m, tuple(needs), tuple(sent))

    while any(pos[r] < len(ops[r]) for r in ops):
        progress = False
        for r in ops:
            while pos[r] < len(ops[r]):
                op = ops[r][pos[r]]
                if op.kind == "tie_grad":
                    a, b = ties[pair[op.tie]].ranks
                    other = b if r == a else a
                    if pos[other] >= len(ops[other]) or ops[other][pos[other]] != op:
                        break
                    steps.append((-1, a, b, pair[op.tie]))
                    pos[r] += 1
                    pos[other] += 1
                else:
                    step = step_of(r, op)
                    if step is None:
                        break
                    steps.append(step)
                    done.update(k for k, *_ in step[5])
                    pos[r] += 1
                progress = True
        if not progress:
            raise RuntimeError("the schedule waits for itself (a bug in vgraph/cost/schedule.py)")
    return Program(ranks, len(slot), tuple(steps))


def makespan(program: Program, d: Durations) -> np.ndarray:
    """[n] seconds from the first op of the round to the last, per pipeline (row of `d`)."""
    n = d.forward.shape[0]
    free = [np.zeros(n) for _ in range(program.ranks)]  # when each rank is next idle
    uplink = [np.zeros(n) for _ in range(program.ranks)]  # when each rank's link is next idle
    bursts = d.bucket is not None and bool(np.any(d.bucket > 0))  # else the planner's hot loop skips the bucket
    bucket = d.bucket if bursts else np.zeros((n, program.ranks))
    tokens = [bucket[:, r].copy() for r in range(program.ranks)]  # full: the links idled before the round
    arrive: list[np.ndarray | None] = [None] * program.messages
    quota = d.cpu_bucket is not None and bool(np.any(d.cpu_bucket > 0))
    if quota:  # a CPU quota's bucket (cpu_quota.py): empty at the start (the previous step's update drained it)
        cpu_tokens = [np.zeros(n) for _ in range(program.ranks)]
        cpu_at = [np.zeros(n) for _ in range(program.ranks)]  # when each rank's tokens were last counted
    for step in program.steps:
        if step[0] < 0:  # a tied pair's sync: both ranks and their links, from when the later one is free
            _, a, b, p = step
            end = np.maximum(np.maximum(free[a], free[b]), np.maximum(uplink[a], uplink[b])) + d.tie[:, p]
            free[a] = free[b] = uplink[a] = uplink[b] = end
            if bursts:
                tokens[a], tokens[b] = np.zeros(n), np.zeros(n)  # its bytes drained the buckets
            continue
        rank, back, t, m, needs, sent = step
        start = free[rank]
        for k in needs:
            start = np.maximum(start, arrive[k])
        seconds = (d.backward if back else d.forward)[:, t, m]
        if quota:  # refilled at the quota's rate since last counted (ties included: the CPU idles in them)
            speed = d.cpu_speedup[:, rank]
            held = np.minimum(d.cpu_bucket[:, rank], cpu_tokens[rank] + (start - cpu_at[rank]) / speed)
            seconds, cpu_tokens[rank] = burst_seconds(seconds, held, speed)
            cpu_at[rank] = start + seconds
        end = start + seconds
        free[rank] = end
        for k, e, grad, remote in sent:
            if not remote:
                arrive[k] = end
                continue
            leave = np.maximum(end, uplink[rank])
            seconds = (d.send_back if grad else d.send)[:, e, m]
            if bursts:
                held = np.minimum(bucket[:, rank], tokens[rank] + (leave - uplink[rank]))  # refilled while idle
                tokens[rank] = np.maximum(held - seconds, 0.0)
                seconds = np.maximum(seconds - held, 0.0)
            uplink[rank] = leave + seconds
            arrive[k] = uplink[rank] + d.latency[:, e]
    return np.maximum.reduce(free) if program.ranks else np.zeros(n)
