"""The process groups of a run with data-parallel replicas, and the check that replicas really match.

World rank r x P + s runs plan rank s of replica r (launch.py).  Point-to-point
traffic of a replica goes to world ranks offset by r x P (comm.Transport); the
gradient all-reduce of plan rank s runs over its *stage group*, the R world
ranks {r x P + s}.  `stage_groups` creates those groups with
torch.distributed.new_group on the run's backend (gloo on CPUs, nccl on GPUs:
the all-reduce runs where the gradients are; every rank creates every group,
in the same order, as torch requires), and `check_same_layout` uses its own
group once at start: the R members must hold the same parameters (count,
elements per dtype, and every shape in the order the gradient buckets are
cut from them), or the bucketed all-reduce (grad_sync.py) would sum
unrelated tensors.  A mismatch (different vgraph versions or pass plugins on
the machines) stops the run with a message instead.
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["stage_groups", "check_same_layout", "check_replicas_agree", "ReplicaLayoutError"]


class ReplicaLayoutError(RuntimeError):
    """The replicas of one stage do not hold the same parameters."""


def stage_groups(replicas: int, plan_ranks: int, backend: str | None = None) -> list[Any]:
    """One process group per plan rank s: the world ranks r x P + s of every replica r (default backend)."""
    return [dist.new_group([r * plan_ranks + s for r in range(replicas)], backend=backend)
            for s in range(plan_ranks)]


def check_same_layout(group: Any, params: Sequence[torch.nn.Parameter],
                      device: torch.device | str = "cpu") -> None:
    """Every member of `group` holds as many parameter elements of each dtype, in as many tensors of the same
    shapes in the same order.  `device`: where the group's collectives run (a GPU for nccl)."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    shapes = zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())
    mine = torch.tensor([len(params)] + [sum(p.numel() for p in params if p.dtype == d) for d in dtypes]
                        + [shapes], dtype=torch.int64, device=device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ReplicaLayoutError(
            f"the replicas of this stage hold different parameters (tensors, elements per dtype, then a checksum "
            f"of their shapes: this rank {mine.tolist()}, least {low.tolist()}, most {high.tolist()}): every "
            f"machine must build the same network (same vgraph version and pass plugins)")


def check_replicas_agree(group: Any, named: Sequence[tuple[str, torch.Tensor]],
                         device: torch.device | str = "cpu") -> None:
    """Every member of the stage group holds the same values in `named` (weights and optimizer state).

    Replicas start equal and apply the same summed gradients, so they stay bit for bit equal; a broken
    gradient sum (one replica's all-reduce result differing from another's) would let them drift apart
    while each replica's loss still looks fine.  Compared at every checkpoint, before rank 0 saves replica
    0's share as everyone's: per tensor its float64 sum, sum of squares and count of NaNs, MIN and MAX over
    the group.  A sum that is NaN on every member compares equal (the same NaNs, or infinities of both
    signs), so the NaN count is what tells a replica with NaNs from one without: gloo's MIN and MAX of a
    NaN and a number are both NaN or both the number, depending on which member holds the NaN."""
    if not named:
        return
    with torch.no_grad():
        sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().pow(2).sum(),
                                         torch.isnan(t.detach()).sum().double()]) for _, t in named]).to(device)
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    differ = ((low != high) & ~(torch.isnan(low) & torch.isnan(high))).any(dim=1)
    if bool(differ.any()):
        names = [name for (name, _), bad in zip(named, differ.tolist()) if bad]
        raise ReplicaLayoutError(
            f"the data-parallel replicas of this stage no longer hold the same values ({len(names)} tensor(s), "
            f"e.g. {', '.join(names[:3])}): their gradient sums differed, which is a bug in the gradient sync; "
            f"the run stops before a checkpoint mixes them")
