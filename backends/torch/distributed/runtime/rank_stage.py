"""One rank's stage of a partitioned network: its tasks, their compiled modules and optimizers, its tied weights.

A *stage* is the VNodes one PNode holds in a pipeline; its rank runs them as *tasks*, one per depth
(vgraph/run/step_plan.py: the embedder and the tied LM head share a stage, before and after the blocks).
`RankStage` is what the rank holds across steps: one compiled module and one set of per-VNode optimizers
per task, the tied weights it owns or replicates (a replica on its owner's rank is the owner's Parameter,
a remote one gets gradients to send, tie_sync.py), the error-feedback residuals of the compressed
transfers whose gradient it sends back, and how each task's program is fed.  Running the schedule over
it is stage_runner.py's job (`StageRunner` extends this with the round); the checkpoints and grad_sync
read its parameters and state in the fixed orders `sync_order` and `named_state` give.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from vgraph.base.diagnostics import Diagnostic
from vgraph.run.step_plan import DistPlan, Task

from .tie_sync import TieSync
from ...lowering.wire_formats import ErrorFeedback
from ...lowering.lower import VGraphModule, compile_network
from ...training.optimizers import NodeOptimizers
from ...training.config import TrainingError

__all__ = ["RankStage", "CE_COSTS"]

CE_COSTS = ("ce", "ce_logits")


class RankStage:
    """This rank's tasks with their modules, optimizers, tied weights and error-feedback residuals."""

    def __init__(self, plan: DistPlan, rank: int, device: torch.device, *, seed: int, lr: float, replica: int = 0,
                 tie_groups: Mapping[int, Any] | None = None, stage_through_cpu: bool = False,
                 weight_decay: float = 0.0) -> None:
        self.plan, self.rank, self.device, self.seed = plan, rank, device, seed
        self.replica = replica  # which data-parallel replica this rank belongs to (launch with replicas)
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
        self.feeds = {task.id: self._feed_plan(task) for task in self.tasks}

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
        tasks (the deeper first), each task's parameters in reverse; the owners of remote ties last, as their
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
                                (node.type == "cost" and node.cfg["cost_function"] in CE_COSTS)):
                out.append(("targets", ""))
            else:
                raise TrainingError([Diagnostic(
                    f"input {slot} of this {node.type} is a network input that `vgraph launch` cannot feed: it "
                    f"feeds token ids to embedders and next-token targets to cross-entropy costs",
                    node.loc, node.id)])
        return out

