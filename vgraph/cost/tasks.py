"""The tasks of a cut: what each stage of a pipeline runs at which depth, and the tensors between them.

A stage (one PNode of a replica) cannot always run its VNodes as one block: the embedder and the tied LM
head form one colocation group, so the stage holding them computes the start of the network, waits for
the blocks on the other stages, then computes the end.  The torch workers' step plan
(vgraph/run/step_plan.py) therefore cuts each stage's VNodes into *tasks* by depth: a VNode's depth is the
number of stage changes on the longest path reaching it (the one rule, vgraph/ir/depth.py), and a task is
one (stage, depth).  This module derives the same tasks from the cost model's columns, so the step cost
model can price the schedule the workers run over them (vgraph/cost/makespan.py); tests/test_makespan.py
checks that both sides find the same task graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from vgraph.cost.makespan import TaskEdge
from vgraph.ir.depth import depths
from vgraph.cost.schedule import ScheduledTask, TiedPair

__all__ = ["TaskLoads", "TaskGraphIndex", "chain_tasks"]

FORWARD_SHARE = 1 / 3  # of a task's time, when it has no FLOPs to tell (a training step is ~3 forwards)


@dataclass
class TaskLoads:
    """One pipeline's tasks, whoever runs them: per-sample work, the tensors between tasks."""

    stage: np.ndarray  # [T] the stage that runs task t (tasks in (depth, stage) order)
    depth: np.ndarray  # [T]
    flops: np.ndarray  # [T] training FLOPs per sample
    forward: np.ndarray  # [T] the forward's share of the task's time (forward / training FLOPs)
    kind_flops: np.ndarray | None  # [K, T] training FLOPs per sample by op kind (op_kinds.KINDS)
    kind_ops: np.ndarray | None  # [K, T] VNodes by op kind
    edges: tuple[TaskEdge, ...]
    act: np.ndarray  # [E] bytes per sample, src -> dst
    grad: np.ndarray  # [E] bytes per sample, dst -> src

    @property
    def count(self) -> int:
        return len(self.stage)

    @cached_property
    def scheduled(self) -> tuple[ScheduledTask, ...]:
        """The tasks as the core schedule sees them (ranks are stages), in forward order per rank."""
        reads: list[list[str]] = [[] for _ in range(self.count)]
        grads: list[list[str]] = [[] for _ in range(self.count)]
        ids = [f"{int(s)}#{int(d)}" for s, d in zip(self.stage, self.depth)]
        for e in self.edges:
            reads[e.dst].append(ids[e.src])
            if e.grad:
                grads[e.src].append(ids[e.dst])
        return tuple(ScheduledTask(ids[t], int(self.stage[t]), tuple(reads[t]), tuple(grads[t]))
                     for t in range(self.count))

    @staticmethod
    def tied_pairs(sync: np.ndarray) -> tuple[tuple[TiedPair, ...], list[tuple[int, int]]]:
        """The stage pairs that sync tied weights (a, b: a < b), as the schedule's tied pairs."""
        pairs = [(int(a), int(b)) for a, b in np.argwhere(np.triu(sync, 1) > 0)]
        return tuple(TiedPair(p, pair) for p, pair in enumerate(pairs)), pairs


class TaskGraphIndex:
    """A network's edges in an order that finds every cut's tasks with one pass (built once per cost model:
    the planner derives the tasks of dozens of cuts)."""

    def __init__(self, n: int, src: np.ndarray, dst: np.ndarray) -> None:
        self.n = n
        self.preds: list[list[int]] = [[] for _ in range(n)]
        for s, d in zip(src.tolist(), dst.tolist()):
            self.preds[d].append(s)
        self.order = self._topological(src, dst)

    def _topological(self, src: np.ndarray, dst: np.ndarray) -> list[int]:
        if not len(src) or bool((src < dst).all()):
            return list(range(self.n))  # the usual case: VNodes already in topological order
        indegree = np.bincount(dst, minlength=self.n).tolist()
        succ: list[list[int]] = [[] for _ in range(self.n)]
        for s, d in zip(src.tolist(), dst.tolist()):
            succ[s].append(d)
        ready = [v for v in range(self.n) if indegree[v] == 0]
        order = []
        while ready:
            v = ready.pop()
            order.append(v)
            for w in succ[v]:
                indegree[w] -= 1
                if indegree[w] == 0:
                    ready.append(w)
        if len(order) != self.n:
            raise ValueError("the cost model's edges have a cycle")
        return order

    def depth(self, where: np.ndarray) -> np.ndarray:
        """Per VNode, its depth when `where` places it (the one rule: vgraph/ir/depth.py)."""
        out = depths(self.order, self.preds, where.tolist())
        return np.fromiter((out[v] for v in range(self.n)), dtype=np.int64, count=self.n)


def chain_tasks(flops: np.ndarray, send: np.ndarray, kind_flops: np.ndarray | None = None,
                kind_ops: np.ndarray | None = None) -> TaskLoads:
    """One task per stage in stage order, each feeding the next (gradients back), and tensors wherever `send`
    [S, S] carries bytes from a lower stage to a higher one: the tasks of hand-made loads, which name no
    VNodes and are a pipeline in stage order."""
    S = len(flops)
    edges, act, grad = [], [], []
    for a in range(S):
        for b in range(a + 1, S):
            if b == a + 1 or send[a, b] > 0 or send[b, a] > 0:
                edges.append(TaskEdge(a, b, True))
                act.append(float(send[a, b]))
                grad.append(float(send[b, a]))
    stage = np.arange(S, dtype=np.int64)
    return TaskLoads(stage, stage.copy(), np.asarray(flops, dtype=float), np.full(S, FORWARD_SHARE), kind_flops,
                     kind_ops, tuple(edges), np.asarray(act, dtype=float), np.asarray(grad, dtype=float))
