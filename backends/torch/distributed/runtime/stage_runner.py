"""One rank's stages of a partitioned network, and one round of the pipeline schedule over them.

A `StageRunner` holds the rank's tasks (plan.py: PNode x stage), their
compiled modules and per-VNode optimizers, and the tied weights it owns or
replicates.  `run_round` executes the rank's ops of the micro-batch schedule
(1F1B or GPipe, plan.py): the forward of a task for a micro-batch receives
boundary activations and sends its own; its backward receives the gradients
of what it sent and sends those of what it received; then the tied-weight
gradients go to their owners (tie_sync.py, a reduce per tie).
`sync_tied_weights` broadcasts the owners' weights back after each optimizer
step.  With data-parallel replicas, `grad_sync` (grad_sync.py) is told which
backward is each task's last, so gradient buckets are all-reduced while the
rest of the backward runs; `sync_order` gives it the parameters in the order
their gradients become final.

A transfer with a `Compression` (plan.py) travels in its wire formats: the
sender of each tensor encodes it and the receiver decodes it
(`compression.Codec`), exactly the round trip the `compress` VNode computes
in one process; the gradient's sender (the consumer) keeps the
error-feedback residuals, per compress VNode and global sample row
(`feedback`, checkpointed by rank_zero.py).

Micro-batching is exact: a cost is a mean over its tokens, so micro-batch m's
loss is weighted by its share of the batch's counted tokens (targets equal to
`ignore_index` do not count), and dropout masks are keyed by the global
sample index (dropout.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch

from vgraph.base.diagnostics import Diagnostic

from .comm import Transport
from .grad_sync import GradientSync
from .loss_scaler import SharedLossScaler
from vgraph.run.step_plan import DistPlan, Message, Op, Task, message_order, schedule_ops
from .tie_sync import TieSync
from ...lowering.wire_formats import Codec, ErrorFeedback
from ...lowering.dropout import set_dropout_key
from ...lowering.lower import VGraphModule, compile_network
from ...training.optimizers import NodeOptimizers
from ...training.config import TrainingError

__all__ = ["StageRunner"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_CE_COSTS = ("ce", "ce_logits")


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


class StageRunner:
    """This rank's tasks with their modules and optimizers; runs the rank's part of each schedule round."""

    def __init__(self, plan: DistPlan, rank: int, world: int, device: torch.device, transport: Transport,
                 amp: Callable[[], ContextManager], scaler: SharedLossScaler, *, seed: int, lr: float,
                 pipeline: str = "1f1b", replica: int = 0, tie_groups: Mapping[int, Any] | None = None,
                 stage_through_cpu: bool = False, weight_decay: float = 0.0) -> None:
        self.plan, self.rank, self.world, self.device = plan, rank, world, device
        self.transport = transport
        self.amp = amp  # a fresh autocast context (or nullcontext) per forward
        self.scaler = scaler
        self.seed, self.pipeline = seed, pipeline
        self.replica = replica  # which data-parallel replica this rank belongs to (launch with replicas)
        self.traffic = 0  # bytes this rank sent for training since the last loss reduction
        self.grad_sync: GradientSync | None = None  # the replicas' gradient sum (set by the worker)
        self.tasks: list[Task] = plan.tasks_of(rank)
        self.modules: dict[str, VGraphModule] = {}
        self.optims: dict[str, NodeOptimizers] = {}
        for task in self.tasks:
            module = compile_network(task.graph, device=device, train=True, seed=seed)
            self.modules[task.id] = module
            self.optims[task.id] = NodeOptimizers(module, lr, weight_decay)
        self._link_replicas()
        self.ties = TieSync(plan, rank, replica=replica, groups=tie_groups or {}, owner_params=self.owner_params,
                            replica_params=self.replica_params, stage_through_cpu=stage_through_cpu)
        self.trainable = [p for o in self.optims.values() for p in o.trainable]
        # Error-feedback residuals of the compressed transfers whose gradient this rank sends back.
        self.feedback: dict[str, ErrorFeedback] = {
            tr.compression.node: ErrorFeedback() for tr in plan.transfers
            if tr.compression is not None and tr.compression.error_feedback and tr.dst_rank == rank}
        self._feeds = {task.id: self._feed_plan(task) for task in self.tasks}
        self._rounds: dict[tuple[tuple[int, ...], bool], tuple[list[Op], dict]] = {}

    def _link_replicas(self) -> None:
        """A replica on its owner's rank is the owner's Parameter; a remote one gets gradients to send."""
        self.replica_params: dict[int, torch.nn.Parameter] = {}
        self.owner_params: dict[int, torch.nn.Parameter] = {}
        for tie in self.plan.ties:
            if tie.owner_rank == self.rank:
                self.owner_params[tie.index] = self.modules[tie.owner_task].namespace(tie.owner_node).weight
            if tie.replica_rank != self.rank:
                continue
            namespace = self.modules[tie.replica_task].namespace(tie.replica_node)
            if not tie.remote:
                namespace._parameters["weight"] = self.owner_params[tie.index]
            else:
                namespace.weight.requires_grad_(True)  # optimizer "none": its gradient goes to the owner
                self.replica_params[tie.index] = namespace.weight

    def sync_order(self) -> tuple[list[torch.nn.Parameter], dict[str, list[torch.nn.Parameter]],
                                  list[torch.nn.Parameter]]:
        """For grad_sync: the trainable parameters in the order their gradients become final (later
        stages' tasks first, each task's parameters in reverse; the owners of remote ties last, as their
        gradients complete after the backward ops), the parameters each task uses, and those owners."""
        trainable = {id(p) for p in self.trainable}
        late = [self.owner_params[t.index] for t in self.plan.ties
                if t.remote and t.owner_rank == self.rank and id(self.owner_params[t.index]) in trainable]
        users = {task.id: [p for p in self.modules[task.id].parameters() if id(p) in trainable]
                 for task in self.tasks}
        order: dict[int, torch.nn.Parameter] = {}
        for task in reversed(self.tasks):
            for p in reversed(users[task.id]):
                order.setdefault(id(p), p)
        for p in late:
            order.pop(id(p), None)
        return [*order.values(), *late], users, late

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        """The rank's trainable weights and their optimizer state, named, in a fixed order (for comparing
        data-parallel replicas, replica_groups.check_replicas_agree)."""
        out: list[tuple[str, torch.Tensor]] = []
        for task in self.tasks:
            optim = self.optims[task.id]
            states = optim.state_by_key()
            for param in optim.trainable:
                key = optim.key_of[param]
                out.append((key, param))
                out.extend((f"{key}:{name}", value) for name, value in sorted(states.get(key, {}).items())
                           if isinstance(value, torch.Tensor))
        return out

    def _feed_plan(self, task: Task) -> list[tuple[str, str]] | None:
        """How each feed of the task's program is filled: ("recv", id) | ("tokens", "") | ("targets", "")."""
        if not task.want:
            return None
        module = self.modules[task.id]
        out = []
        for name in module.program_for(task.want, training=True).feeds:
            node_id, _, slot_text = name.rpartition(":in")
            node, slot = task.graph.node(node_id), int(slot_text)
            if node.type == "receive":
                out.append(("recv", node_id))
            elif node.type == "embedder" and slot == 0:
                out.append(("tokens", ""))
            elif slot == 1 and (node.type == "tied_lm_head_ce" or
                                (node.type == "cost" and node.cfg["cost_function"] in _CE_COSTS)):
                out.append(("targets", ""))
            else:
                raise TrainingError([Diagnostic(
                    f"input {slot} of this {node.type} is a network input that `vgraph launch` cannot feed: it "
                    f"feeds token ids to embedders and next-token targets to cross-entropy costs",
                    node.loc, node.id)])
        return out

    def _round(self, sizes: Sequence[int], train: bool) -> tuple[list[Op], dict]:
        """This rank's ops and the messages it expects, per peer, for a round of micro-batch `sizes`."""
        key = (tuple(sizes), train)
        if key not in self._rounds:
            ops_by_rank = schedule_ops(self.plan, len(sizes), train=train,
                                       pipeline=self.pipeline)
            self._rounds[key] = (ops_by_rank[self.rank], self._expected(ops_by_rank, sizes))
        return self._rounds[key]

    def _expected(self, ops_by_rank: dict[int, list[Op]], sizes: Sequence[int]) -> dict[int, list]:
        expected: dict[int, list] = {}
        for (src, dst), messages in message_order(self.plan, ops_by_rank).items():
            if dst != self.rank:
                continue
            rows = []
            for msg in messages:
                tr = self.plan.transfers[msg.index]
                rows.append((msg, *_codec(tr, msg.kind).wire((sizes[msg.micro], *tr.shape), _DTYPES[tr.dtype])))
            expected[src] = rows
        return expected

    def _cost_weights(self, task: Task, targets: list[torch.Tensor], sizes: Sequence[int],
                      whole: GlobalBatch | None = None) -> dict[str, list[float]]:
        """Per cost, each micro-batch's share of the batch's loss (token counts for cross-entropy).

        `whole`: the global batch when this rank's replica trains on a share of it: the shares are then of
        the global batch, so the replicas' gradients sum to the global batch's."""
        total = sum(sizes) if whole is None else whole.samples
        out = {}
        cost_node = {ep.name: ep.node for ep in task.graph.costs}
        for name in task.costs:
            node = task.graph.node(cost_node[name])
            ce = node.type == "tied_lm_head_ce" or (node.type == "cost" and node.cfg["cost_function"] in _CE_COSTS)
            if ce and task.graph.input_edge(node.id, 1) is None:
                ignore = int(node.cfg.get("ignore_index", -100))
                counts = [int((t != ignore).sum()) for t in targets]
                denominator = sum(counts) if whole is None else whole.counted_tokens(ignore)
                if denominator > 0:
                    out[name] = [c / denominator for c in counts]
                    continue
            out[name] = [b / total for b in sizes]
        return out

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
        weights = {t.id: self._cost_weights(t, targets_mb, sizes, whole) for t in self.tasks}
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
        feeds = self._feeds[task.id]
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
