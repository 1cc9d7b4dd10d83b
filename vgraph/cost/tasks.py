"""The tasks of a cut: what each stage of a pipeline runs at which depth, and the tensors between them.

A stage (one PNode of a replica) cannot always run its VNodes as one block: the embedder and the tied LM
head form one colocation group, so the stage holding them computes the start of the network, waits for
the blocks on the other stages, then computes the end.  The torch workers' step plan
(vgraph/run/step_plan.py) therefore cuts each stage's VNodes into *tasks* by depth: a VNode's depth is the
number of stage changes on the longest path reaching it (the one rule, vgraph/ir/depth.py), and a task is
one (stage, depth).  This module derives the same tasks from the cost model's columns, so the step cost
model can price the schedule the workers run over them (vgraph/cost/makespan.py); tests/test_makespan.py
checks that both sides find the same task graph.

It is also where a cut becomes one value (`stage_loads` -> `StageLoads`): the cost model's columns read
once (`LoadColumns`), each stage's loads, its tasks and its tied pairs, all derived here, so the step cost
(vgraph/cost/stepcost.py) prices a plan by reading that value and never calls back into the cut.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

import numpy as np

from vgraph.cost.costmodel import CostModel
from vgraph.cost.makespan import TaskEdge
from vgraph.cost.op_kinds import KINDS, op_kind
from vgraph.ir.depth import depths
from vgraph.cost.schedule import ScheduledTask, TiedPair

__all__ = ["TaskLoads", "TaskGraphIndex", "chain_tasks", "StageLoads", "LoadColumns", "stage_loads", "vnode_kinds"]

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


@dataclass
class StageLoads:
    """One pipeline's stages, whoever runs them: per-sample work and traffic, per-step sync, memory."""

    flops: np.ndarray  # [S] training FLOPs per sample
    p2p: np.ndarray  # [S, S] bytes per sample between stages (activation + gradient), symmetric
    sync: np.ndarray  # [S, S] bytes per step of tied-weight sync, symmetric
    grad_bytes: np.ndarray  # [S] gradients a stage all-reduces across replicas
    static_bytes: np.ndarray  # [S] parameters + gradients + optimizer state (+ tied-weight replicas)
    activation_bytes: np.ndarray  # [S] kept for backward, per sample
    kind_flops: np.ndarray | None = None  # [K, S] training FLOPs per sample by op kind (op_kinds.KINDS)
    kind_ops: np.ndarray | None = None  # [K, S] VNodes by op kind
    # Gradient compression (vgraph/cost/grad_compression.py), with replicas only: FLOPs a stage member spends
    # compressing its gradients per step, the memory it keeps for that, all-reduces per bucket.
    reduce_flops: np.ndarray | None = None  # [S]
    reduce_memory: np.ndarray | None = None  # [S] bytes
    reduce_rounds: int = 1
    send: np.ndarray | None = None  # [S, S] bytes per sample stage a sends stage b (p2p = send + send.T)
    # The stages' tasks (below): what the workers schedule; None for hand-made loads, which are then one
    # task per stage in a chain, derived on construction.
    tasks: TaskLoads | None = None
    params: np.ndarray | None = None  # [S] parameters a stage trains (its ranks' optimizer step); None: 0
    # The stage pairs that sync tied weights, as the schedule's tied pairs and as (a, b) (`TaskLoads.tied_pairs`).
    tied: tuple[tuple[TiedPair, ...], list[tuple[int, int]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Everything the pricing reads is derived here, once, so the step cost only reads this value."""
        if self.tasks is None:
            send = self.send if self.send is not None else self.p2p / 2
            self.tasks = chain_tasks(self.flops, send, self.kind_flops, self.kind_ops)
        self.tied = TaskLoads.tied_pairs(self.sync)

    @property
    def stages(self) -> int:
        return len(self.flops)

    def task_view(self) -> TaskLoads:
        """The tasks the workers run for these stages (one per stage in a chain when none were derived)."""
        return self.tasks


def vnode_kinds(cm: CostModel) -> np.ndarray:
    """Each VNode's op kind (an index into op_kinds.KINDS), in the cost model's order."""
    at = {k: i for i, k in enumerate(KINDS)}
    return np.fromiter((at[op_kind(t, f)] for t, f in zip(cm.node_columns["type"], cm.node_columns["flops"])),
                       dtype=np.int64, count=len(cm.node_columns["id"]))


class LoadColumns:
    """A cost model's per-VNode and per-edge numbers as numpy columns, read once; `loads` aggregates them
    into any cut of the network into stages (a planner prices dozens of cuts of a 100k-VNode network)."""

    def __init__(self, cm: CostModel) -> None:
        col = cm.column
        self.ids: list[str] = cm.node_columns["id"]
        self.flops = cm.train_flops_per_sample()  # forward + backward (+ recomputed forwards, remat)
        self.forward_flops = col("flops").astype(float)
        # What a stage all-reduces, the compression's FLOPs and memory (the cost model's; plain: the gradients).
        self.rounds = 3 if cm.grad_compress.enabled else 1
        self.grad = col("reduce_bytes").astype(float)
        self.reduce_flops = col("reduce_flops").astype(float)
        self.reduce_memory = col("reduce_memory").astype(float)
        self.static = (col("param_bytes") + col("grad_bytes") + col("master_bytes") + col("adam_bytes")).astype(float)
        self.act = col("activation_bytes").astype(float)
        self.params = col("params").astype(float)
        if len(cm.edge_columns["src"]):
            self.src = col("edge:src").astype(np.int64)
            self.dst = col("edge:dst").astype(np.int64)
            self.edge_act = col("edge:bytes_per_sample").astype(float)  # forward, src -> dst (its wire format)
            self.edge_grad = col("edge:back_bytes_per_sample").astype(float)  # backward, dst -> src
            self.edge_flops = col("edge:codec_flops").astype(float)
            self.edge_has_grad = col("edge:gradient").astype(bool)
        else:
            self.src = self.dst = np.zeros(0, dtype=np.int64)
            self.edge_act = self.edge_grad = self.edge_flops = np.zeros(0)
            self.edge_has_grad = np.zeros(0, dtype=bool)
        self.graph_index = TaskGraphIndex(len(self.ids), self.src, self.dst)
        self.kind = vnode_kinds(cm)
        at = {nid: i for i, nid in enumerate(self.ids)} if cm.ties else {}
        self.ties = [(at[t.publisher], at[t.user], float(t.sync_bytes_per_step), float(t.replica_bytes))
                     for t in cm.ties]

    def where(self, stage_of: Mapping[str, int]) -> np.ndarray:
        """VNode -> stage as an array over the cost model's VNodes."""
        return np.fromiter((stage_of[i] for i in self.ids), dtype=np.int64, count=len(self.ids))

    def loads(self, where: np.ndarray, stages: int) -> StageLoads:
        """The stages' loads when VNode i (cost model order) is in stage `where[i]`."""
        flops = np.bincount(where, weights=self.flops, minlength=stages)
        grad = np.bincount(where, weights=self.grad, minlength=stages)
        static = np.bincount(where, weights=self.static, minlength=stages)
        act = np.bincount(where, weights=self.act, minlength=stages)
        kind_flops = np.zeros((len(KINDS), stages))
        kind_ops = np.zeros((len(KINDS), stages))
        np.add.at(kind_flops, (self.kind, where), self.flops)
        np.add.at(kind_ops, (self.kind, where), 1.0)
        send = np.zeros((stages, stages))
        if len(self.src):
            s, t = where[self.src], where[self.dst]
            cut = s != t
            np.add.at(send, (s[cut], t[cut]), self.edge_act[cut])
            np.add.at(send, (t[cut], s[cut]), self.edge_grad[cut])
            codec = np.bincount(s[cut], weights=self.edge_flops[cut], minlength=stages)  # compressed edges
            flops = flops + codec
            kind_flops[KINDS.index("elementwise")] += codec
        p2p = send + send.T
        sync = np.zeros((stages, stages))
        for pub, user, sync_bytes, replica_bytes in self.ties:
            a, b = where[pub], where[user]
            if a != b:
                sync[a, b] += sync_bytes
                sync[b, a] += sync_bytes
                static[b] += replica_bytes
        return StageLoads(flops, p2p, sync, grad, static, act, kind_flops, kind_ops,
                          reduce_flops=np.bincount(where, weights=self.reduce_flops, minlength=stages),
                          reduce_memory=np.bincount(where, weights=self.reduce_memory, minlength=stages),
                          reduce_rounds=self.rounds, send=send, tasks=self.tasks(where, stages),
                          params=np.bincount(where, weights=self.params, minlength=stages))

    def tasks(self, where: np.ndarray, stages: int) -> TaskLoads:
        """The tasks of the cut `where` (vgraph/cost/tasks.py): per (stage, depth), its work; per pair of
        tasks, the bytes between them (a cut edge's compression FLOPs go to its producer's task)."""
        depth = self.graph_index.depth(where)
        keys, task_of = np.unique(depth * stages + where, return_inverse=True)
        T = len(keys)
        flops = np.bincount(task_of, weights=self.flops, minlength=T)
        forward = np.bincount(task_of, weights=self.forward_flops, minlength=T)
        share = np.divide(forward, flops, out=np.full(T, FORWARD_SHARE), where=flops > 0)
        kind_flops, kind_ops = np.zeros((len(KINDS), T)), np.zeros((len(KINDS), T))
        np.add.at(kind_flops, (self.kind, task_of), self.flops)
        np.add.at(kind_ops, (self.kind, task_of), 1.0)
        edges: tuple[TaskEdge, ...] = ()
        act = grad = np.zeros(0)
        if len(self.src):
            a, b = task_of[self.src], task_of[self.dst]
            cross = a != b
            codec = np.bincount(a[cross], weights=self.edge_flops[cross], minlength=T)
            flops = flops + codec
            kind_flops[KINDS.index("elementwise")] += codec
            pairs, inv = np.unique(a[cross] * T + b[cross], return_inverse=True)
            act = np.bincount(inv, weights=self.edge_act[cross], minlength=len(pairs))
            grad = np.bincount(inv, weights=self.edge_grad[cross], minlength=len(pairs))
            flows = np.bincount(inv, weights=self.edge_has_grad[cross], minlength=len(pairs)) > 0
            edges = tuple(TaskEdge(int(p // T), int(p % T), bool(g)) for p, g in zip(pairs.tolist(), flows))
        return TaskLoads(keys % stages, keys // stages, flops, share, kind_flops, kind_ops, edges, act, grad)


def stage_loads(cm: CostModel, stage_of: Mapping[str, int], stages: int) -> StageLoads:
    """Aggregate the cost model's VNodes and edges into `stages` stages (`stage_of`: VNode -> stage)."""
    cols = LoadColumns(cm)
    return cols.loads(cols.where(stage_of), stages)
