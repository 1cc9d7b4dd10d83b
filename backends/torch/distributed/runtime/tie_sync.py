"""Tied weights split over two ranks, synced on collectives: the gradient reduced to the owner, the weight
broadcast back.

A `weight_replica` whose publisher lives on another rank (plan.Tie.remote)
reads a copy of the owner's weight.  Every step the replica's gradient must be
added to the owner's before the owner's optimizer steps, and the updated
weight must come back.  Both are exactly a collective of the two ranks:
`dist.reduce` (sum, to the owner) adds the replica's gradient to the owner's
in place, and `dist.broadcast` from the owner writes the weight into the
replica.  Each tie gets a process group of its two ranks (per data-parallel
replica: the ranks offset by replica x P), created by every rank in the same
order, as torch requires.

The reduce is issued (asynchronously) at the schedule's `tie_grad` op, after
the rank's backward ops, and waited for at the end of the round; the
broadcasts after each optimizer step are issued together and waited for
together.  Waiting at the end lets the ties of a rank proceed in any order
without a deadlock, and the owner's gradient bucket (grad_sync.py) is
launched once the reduce has completed.

Bytes, counted by the sender: the weight in float32 each way, what
`plan.DistPlan.cut_bytes_per_step` and the cost model predict.  With gloo
and CUDA tensors (workers sharing a GPU), tensors go through host memory,
since gloo's reduce runs on CPU tensors only.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from vgraph.run.step_plan import DistPlan, Tie, weight_ops

__all__ = ["TieSync", "tie_groups"]


def tie_groups(plan: DistPlan, replicas: int, replica: int) -> dict[int, Any]:
    """Tie index -> the process group of its owner and replica ranks in `replica` (every rank creates all)."""
    P = plan.world_size
    mine: dict[int, Any] = {}
    for r in range(replicas):
        for tie in plan.ties:
            if not tie.remote:
                continue
            group = dist.new_group(sorted({tie.owner_rank + r * P, tie.replica_rank + r * P}))
            if r == replica:
                mine[tie.index] = group
    return mine


class TieSync:
    """This rank's remote ties: the owner side (`owner_params`) and the replica side (`replica_params`)."""

    def __init__(self, plan: DistPlan, rank: int, *, replica: int, groups: Mapping[int, Any],
                 owner_params: Mapping[int, torch.nn.Parameter], replica_params: Mapping[int, torch.nn.Parameter],
                 stage_through_cpu: bool = False) -> None:
        self.plan, self.rank = plan, rank
        self.offset = replica * plan.world_size
        self.groups = dict(groups)
        self.owner_params, self.replica_params = owner_params, replica_params
        self.stage = stage_through_cpu
        self.bytes_sent = 0
        self._grads: list[tuple[Tie, Any, torch.Tensor]] = []

    def _owner(self, tie: Tie) -> int:
        return tie.owner_rank + self.offset

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The float32 tensor the collective works on (the tensor itself when it already is one)."""
        wire = tensor.detach()
        if self.stage and wire.device.type != "cpu":
            wire = wire.cpu()
        return wire if wire.dtype == torch.float32 else wire.float()

    def grad(self, index: int) -> None:
        """The `tie_grad` op: start reducing the tie's gradient into the owner's (asynchronously)."""
        tie = self.plan.ties[index]
        if self.rank == tie.replica_rank:
            param = self.replica_params[index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            wire = self._wire(grad).contiguous()
            self.bytes_sent += wire.numel() * wire.element_size()
        else:
            param = self.owner_params[index]
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
            wire = self._wire(param.grad).contiguous() if param.requires_grad else torch.zeros(
                param.shape, dtype=torch.float32, device="cpu" if self.stage else param.device)
        work = dist.reduce(wire, dst=self._owner(tie), group=self.groups[index], async_op=True)
        self._grads.append((tie, work, wire))

    def finish_grads(self) -> list[torch.nn.Parameter]:
        """Wait for the round's reductions; the owner parameters whose gradients are now complete."""
        done = []
        for tie, work, wire in self._grads:
            work.wait()
            if self.rank == tie.replica_rank:
                self.replica_params[tie.index].grad = None
                continue
            param = self.owner_params[tie.index]
            if param.requires_grad:
                if wire.data_ptr() != param.grad.data_ptr():
                    param.grad.copy_(wire)
                done.append(param)
        self._grads.clear()
        return done

    def weights(self) -> None:
        """After an optimizer step: every owner's weight to its replica (waits until all have arrived)."""
        pending = []
        with torch.no_grad():
            for op in weight_ops(self.plan, self.rank):
                tie = self.plan.ties[op.tie]
                if self.rank == tie.owner_rank:
                    wire = self._wire(self.owner_params[tie.index])
                    self.bytes_sent += wire.numel() * wire.element_size()
                else:
                    param = self.replica_params[tie.index]
                    wire = self._wire(param)
                work = dist.broadcast(wire, src=self._owner(tie), group=self.groups[tie.index], async_op=True)
                pending.append((tie, work, wire))
            for tie, work, wire in pending:
                work.wait()
                if self.rank == tie.replica_rank:
                    param = self.replica_params[tie.index]
                    if wire.data_ptr() != param.data_ptr():
                        param.detach().copy_(wire)
