"""The process groups of a run with data-parallel replicas, and the check that replicas really match.

World rank r x P + s runs plan rank s of replica r (launch.py).  Point-to-point
traffic of a replica goes to world ranks offset by r x P (comm.Transport); the
gradient all-reduce of plan rank s runs over its *stage group*, the R world
ranks {r x P + s}.  `stage_groups` creates those groups with
torch.distributed.new_group (every rank creates every group, in the same
order, as torch requires; gloo, so the check below runs on CPU tensors
whatever the training backend), and `check_same_layout` uses its own group
once at start: the R members must hold the same number of trainable
parameters in the same dtypes, or the ring all-reduce (gradient_ring.py)
would sum unrelated tensors.  A mismatch (different vgraph versions or pass
plugins on the machines) stops the run with a message instead.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["stage_groups", "check_same_layout", "ReplicaLayoutError"]


class ReplicaLayoutError(RuntimeError):
    """The replicas of one stage do not hold the same parameters."""


def stage_groups(replicas: int, plan_ranks: int) -> list[Any]:
    """One gloo process group per plan rank s: the world ranks r x P + s of every replica r."""
    return [dist.new_group([r * plan_ranks + s for r in range(replicas)], backend="gloo")
            for s in range(plan_ranks)]


def check_same_layout(group: Any, params: Sequence[torch.nn.Parameter]) -> None:
    """Every member of `group` holds as many parameter elements of each dtype, in as many tensors."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    mine = torch.tensor([len(params)] + [sum(p.numel() for p in params if p.dtype == d) for d in dtypes],
                        dtype=torch.int64)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ReplicaLayoutError(
            f"the replicas of this stage hold different parameters (tensors, then elements per dtype: this "
            f"rank {mine.tolist()}, least {low.tolist()}, most {high.tolist()}): every machine must build the "
            f"same network (same vgraph version and pass plugins)")
