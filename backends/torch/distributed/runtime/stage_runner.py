"""One round of the pipeline schedule over a rank's stage: the rank's forwards, backwards and messages.

A `StageRunner` is the rank's stage (rank_stage.py: its tasks, one per depth
of the stage's VNodes, with their modules, optimizers and tied weights) and
runs its part of each round.  `run_round` executes the rank's ops of the
micro-batch schedule (1F1B or GPipe, vgraph/cost/schedule.py through
step_plan.py): the forward of a task for a micro-batch receives boundary
activations and sends its own; its backward receives the gradients of what
it sent and sends those of what it received; then the tied-weight gradients
go to their owners (tie_sync.py, a reduce per tie).  `sync_tied_weights`
broadcasts the owners' weights back after each optimizer step.  With
data-parallel replicas, `grad_sync` (grad_sync.py) is told which backward is
each task's last, so gradient buckets are all-reduced while the rest of the
backward runs; `sync_order` gives it the parameters in the order their
gradients become final.

A transfer with a `Compression` (step_plan.py) travels in its wire formats:
the sender of each tensor encodes it and the receiver decodes it
(`wire_formats.Codec`), exactly the round trip the `compress` VNode computes
in one process; the gradient's sender (the consumer) keeps the
error-feedback residuals, per compress VNode and global sample row
(`feedback`, checkpointed by rank_zero.py).

Micro-batching is exact: a cost is a mean over its tokens, so micro-batch m's
loss is weighted by its share of the batch's counted tokens (targets equal to
`ignore_index` do not count, `cost_weights`), and dropout masks are keyed by
the global sample index (dropout.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch

from vgraph.run.step_plan import DistPlan, Message, Op, Task, message_order, schedule_ops

from .comm import Transport
from .grad_sync import GradientSync
from .loss_scaler import SharedLossScaler
from .rank_stage import CE_COSTS, RankStage
from ...lowering.wire_formats import Codec
from ...lowering.dropout import set_dropout_key

__all__ = ["StageRunner", "GlobalBatch", "cost_weights"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}


_PLAIN = Codec("none")


def _codec(tr: Any, kind: str) -> Codec:
    """The wire format of a transfer's message kind ('a' activation, 'g' gradient)."""
    c = tr.compression
    return _PLAIN if c is None else Codec(c.codec(kind), c.scale)


@dataclass(frozen=True)
class GlobalBatch:
    """The global batch a replica trains a share of: what its losses are weighted against.

    `counted_tokens(ignore_index)`: how many of the global batch's target tokens a cross-entropy cost with
    that ignore_index counts.  A function rather than the targets themselves, so a replica reads the other
    replicas' samples only when an ignored id can occur in them at all."""

    samples: int
    counted_tokens: Callable[[int], int]


def cost_weights(task: Task, targets: list[torch.Tensor], sizes: Sequence[int],
                 whole: GlobalBatch | None = None) -> dict[str, list[float]]:
    """Per cost, each micro-batch's share of the batch's loss (token counts for cross-entropy).

    `whole`: the global batch when this rank's replica trains on a share of it: the shares are then of
    the global batch, so the replicas' gradients sum to the global batch's."""
    total = sum(sizes) if whole is None else whole.samples
    out = {}
    cost_node = {ep.name: ep.node for ep in task.graph.costs}
    for name in task.costs:
        node = task.graph.node(cost_node[name])
        ce = node.type == "tied_lm_head_ce" or (node.type == "cost" and node.cfg["cost_function"] in CE_COSTS)
        if ce and task.graph.input_edge(node.id, 1) is None:
            ignore = int(node.cfg.get("ignore_index", -100))
            counts = [int((t != ignore).sum()) for t in targets]
            denominator = sum(counts) if whole is None else whole.counted_tokens(ignore)
            if denominator > 0:
                out[name] = [c / denominator for c in counts]
                continue
        out[name] = [b / total for b in sizes]
    return out


def _expected(plan: DistPlan, rank: int, ops_by_rank: dict[int, list[Op]], sizes: Sequence[int]) -> dict[int, list]:
    """Per peer, the messages `rank` receives in a round, in the sender's order, with their wire shapes."""
    expected: dict[int, list] = {}
    for (src, dst), messages in message_order(plan, ops_by_rank).items():
        if dst != rank:
            continue
        rows = []
        for msg in messages:
            tr = plan.transfers[msg.index]
            rows.append((msg, *_codec(tr, msg.kind).wire((sizes[msg.micro], *tr.shape), _DTYPES[tr.dtype])))
        expected[src] = rows
    return expected


class StageRunner(RankStage):
    """This rank's stage (RankStage) and the rank's part of each schedule round over it."""

    def __init__(self, plan: DistPlan, rank: int, world: int, device: torch.device, transport: Transport,
                 amp: Callable[[], ContextManager], scaler: SharedLossScaler, *, seed: int, lr: float,
                 pipeline: str = "1f1b", replica: int = 0, tie_groups: Mapping[int, Any] | None = None,
                 stage_through_cpu: bool = False, weight_decay: float = 0.0) -> None:
        super().__init__(plan, rank, device, seed=seed, lr=lr, replica=replica, tie_groups=tie_groups,
                         stage_through_cpu=stage_through_cpu, weight_decay=weight_decay)
        self.world = world
        self.transport = transport
        self.amp = amp  # a fresh autocast context (or nullcontext) per forward
        self.scaler = scaler
        self.pipeline = pipeline
        self.traffic = 0  # bytes this rank sent for training since the last loss reduction
        self.grad_sync: GradientSync | None = None  # the replicas' gradient sum (set by the worker)
        self._rounds: dict[tuple[tuple[int, ...], bool], tuple[list[Op], dict]] = {}

    def _round(self, sizes: Sequence[int], train: bool) -> tuple[list[Op], dict]:
        """This rank's ops and the messages it expects, per peer, for a round of micro-batch `sizes`."""
        key = (tuple(sizes), train)
        if key not in self._rounds:
            ops_by_rank = schedule_ops(self.plan, len(sizes), train=train,
                                       pipeline=self.pipeline)
            self._rounds[key] = (ops_by_rank[self.rank], _expected(self.plan, self.rank, ops_by_rank, sizes))
        return self._rounds[key]

    def run_round(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, sizes: Sequence[int], *,
                  train: bool, offset: int = 0, whole: GlobalBatch | None = None) -> dict[str, torch.Tensor]:
        """One round (forward+backward of a step, or a forward-only evaluation); returns this rank's costs,
        each the weighted sum over micro-batches (float32).

        A replica trains on samples `offset`.. of the global batch `whole` (dropout is keyed by the global
        sample index, losses weighted by shares of the global batch)."""
        ops, expected = self._round(sizes, train)
        sent_before = self.transport.bytes_sent + self.ties.bytes_sent
        tokens = list(torch.split(inputs.to(self.device), list(sizes)))
        targets_mb = list(torch.split(targets.to(self.device), list(sizes)))
        offsets = [offset + sum(sizes[:m]) for m in range(len(sizes))]
        weights = {t.id: cost_weights(t, targets_mb, sizes, whole) for t in self.tasks}
        costs: dict[str, torch.Tensor] = {}
        stash: dict[tuple[str, int], tuple[dict, dict]] = {}
        local: dict[tuple[str, int, int], torch.Tensor] = {}
        transport = self.transport
        transport.begin(expected)
        sync = self.grad_sync if train else None
        if sync is not None:
            sync.begin()
        last = len(sizes) - 1
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        with grad_mode:
            for op in ops:
                if op.kind == "fwd":
                    task = self.plan.tasks[op.task]
                    m = op.micro
                    outs, received = self._forward(task, m, step, offsets[m], tokens[m], targets_mb[m], local, train)
                    for name in task.costs:
                        value = outs[name].detach().float() * weights[task.id][name][m]
                        costs[name] = value if name not in costs else costs[name] + value
                    if train:
                        stash[(task.id, m)] = (outs, received)
                elif op.kind == "bwd":
                    task = self.plan.tasks[op.task]
                    final = (sync.last_backward(task.id) if sync is not None and op.micro == last
                             else contextlib.nullcontext())
                    with final:  # the task's last backward: its gradients are final (grad_sync.py)
                        self._backward(task, op.micro, weights[task.id], *stash.pop((task.id, op.micro)), local,
                                       offsets[op.micro])
                elif op.kind == "tie_grad":
                    self.ties.grad(op.tie)
        transport.end()
        if train:
            for param in self.ties.finish_grads():  # an owner's gradient is complete: its bucket may go
                if sync is not None:
                    sync.ready(param)
            self.traffic += transport.bytes_sent + self.ties.bytes_sent - sent_before
        return costs

    def _forward(self, task: Task, m: int, step: int, offset: int, tokens: torch.Tensor, targets: torch.Tensor,
                 local: dict, train: bool) -> tuple[dict, dict]:
        received: dict[str, torch.Tensor] = {}
        for i in task.receives:
            tr = self.plan.transfers[i]
            if tr.remote:
                value = self.transport.recv(tr.src_rank, Message("a", i, m))
                value = _codec(tr, "a").decode(value, (tokens.shape[0], *tr.shape), _DTYPES[tr.dtype])
            else:
                value = local.pop(("a", i, m))
            if train and tr.grad:
                value = value.detach().requires_grad_(True)
            received[tr.recv_id] = value
        outs: dict[str, torch.Tensor] = {}
        feeds = self.feeds[task.id]
        if feeds is not None:
            program = self.modules[task.id].program(task.want, training=train)
            args = [received[ref] if kind == "recv" else tokens if kind == "tokens" else targets
                    for kind, ref in feeds]
            set_dropout_key(self.seed, step, offset)
            with self.amp():
                outs = program(*args)
        for i in task.sends:
            tr = self.plan.transfers[i]
            value = outs[task.send_outputs[tr.send_id]].detach().to(_DTYPES[tr.dtype])
            codec = _codec(tr, "a")
            if tr.remote:
                self.transport.send(tr.dst_rank, Message("a", i, m), codec.encode(value))
            else:
                local[("a", i, m)] = codec.round_trip(value)
        return outs, received

    def _backward(self, task: Task, m: int, weights: dict[str, list[float]], outs: dict, received: dict,
                  local: dict, offset: int) -> None:
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for name in task.costs:
            value = outs[name]
            if value.requires_grad:
                roots.append(value * (weights[name][m] * self.scaler.scale))
                grads.append(None)
        by_value: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in task.sends:
            tr = self.plan.transfers[i]
            if not tr.grad:
                continue
            value = outs[task.send_outputs[tr.send_id]]
            if tr.remote:
                grad = self.transport.recv(tr.dst_rank, Message("g", i, m))
                grad = _codec(tr, "g").decode(grad, (value.shape[0], *tr.shape), _DTYPES[tr.dtype])
            else:
                grad = local.pop(("g", i, m))
            if value.requires_grad:
                grad = grad.to(value.dtype)
                seen = by_value.get(id(value))
                by_value[id(value)] = (value, grad if seen is None else seen[1] + grad)
        for value, grad in by_value.values():
            roots.append(value)
            grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)
        for i in task.receives:
            tr = self.plan.transfers[i]
            if not tr.grad:
                continue
            leaf = received[tr.recv_id]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            codec = _codec(tr, "g")
            feedback = self.feedback.get(tr.compression.node) if tr.compression is not None else None
            wire = feedback.encode(codec, grad, offset) if feedback is not None else codec.encode(grad)
            if tr.remote:
                self.transport.send(tr.src_rank, Message("g", i, m), wire)
            else:
                local[("g", i, m)] = codec.decode(wire, tuple(grad.shape), grad.dtype)

    def finish_gradients(self) -> None:
        """After a training round: wait for the replicas' gradient sums (grad_sync.py); their bytes count
        as the step's traffic."""
        if self.grad_sync is not None:
            self.traffic += self.grad_sync.finish()

    def sync_tied_weights(self) -> None:
        """Owners broadcast tied weights to their replicas on other ranks (after every optimizer step)."""
        before = self.ties.bytes_sent
        self.ties.weights()
        self.traffic += self.ties.bytes_sent - before
