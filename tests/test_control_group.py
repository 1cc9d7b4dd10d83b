"""The control collectives (comm.ControlGroup): a world of one answers without torch.distributed (a one-PNode
launch paid 1.25 ms a step for gloo calls to itself); a larger world still goes through it."""
from __future__ import annotations

import math

import pytest
import torch

from vgraph.backends.torch.distributed.runtime import comm
from vgraph.backends.torch.distributed.runtime.comm import ControlGroup


class NoDist:
    """torch.distributed for a world of one: any call is a failure."""

    def __getattr__(self, name: str):
        raise AssertionError(f"a world of one called torch.distributed.{name}")


class TwoRanks:
    """torch.distributed as rank 0 of two sees it: the other rank holds `peer`."""

    def __init__(self, peer_values: list[float], peer_obj: object) -> None:
        self.peer_values, self.peer_obj, self.calls = peer_values, peer_obj, []

    def all_reduce(self, t: torch.Tensor, group=None) -> None:
        self.calls.append("all_reduce")
        t += torch.tensor(self.peer_values, dtype=t.dtype)

    def gather_object(self, obj, out, dst=0, group=None) -> None:
        self.calls.append("gather_object")
        out[0], out[1] = obj, self.peer_obj


def test_a_world_of_one_answers_locally(monkeypatch) -> None:
    monkeypatch.setattr(comm, "dist", NoDist())
    ctrl = ControlGroup(0, 1)
    sums = ctrl.all_reduce([1.5, 2, float("nan"), float("inf"), 3])
    assert sums[:2] == [1.5, 2.0] and all(isinstance(x, float) for x in sums)
    assert math.isnan(sums[2]) and sums[3] == math.inf and sums[4] == 3.0
    row = {"loss": 1.0, "pnodes": {"h0": [1, 2]}}
    gathered = ctrl.gather(row)
    assert gathered == [row] and gathered[0] is row  # in rank order, one rank: nothing copied
    assert ctrl.scatter([{"share": 3}]) == {"share": 3}
    assert ctrl.all_reduce([]) == []


@pytest.mark.parametrize("objs", [None, [], [1, 2]])
def test_a_world_of_one_refuses_a_scatter_of_other_than_one_object(monkeypatch, objs) -> None:
    monkeypatch.setattr(comm, "dist", NoDist())
    with pytest.raises(ValueError, match="list of one object"):
        ControlGroup(0, 1).scatter(objs)


def test_a_world_of_two_goes_through_torch_distributed(monkeypatch) -> None:
    fake = TwoRanks([0.25, 10.0], {"peer": 1})
    monkeypatch.setattr(comm, "dist", fake)
    ctrl = ControlGroup(0, 2)
    assert ctrl.all_reduce([1.0, 2.0]) == [1.25, 12.0]
    assert ctrl.gather({"me": 0}) == [{"me": 0}, {"peer": 1}]
    assert fake.calls == ["all_reduce", "gather_object"]
