"""The launch's shared loss scaler (distributed/runtime/loss_scaler.py) against torch's GradScaler, the one `vgraph train`
uses: the same scale and growth tracker after every step of any sequence of overflows and good steps (halving
on an overflow, doubling after 2000 good steps in a row), the same state_dict, and each one's state loads into
the other, so checkpoints move between `vgraph train` and `vgraph launch`.  The launch-level behaviour (one
decision on every rank, resume) is in test_launch_fp16.py; this is the rule itself, in milliseconds."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph.backends.torch.distributed.runtime.loss_scaler import SharedLossScaler


class TorchScaler:
    """torch.amp.GradScaler on the CPU, driven by real gradients: an overflow is an infinite gradient."""

    def __init__(self, init_scale: float) -> None:
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        self.param = torch.nn.Parameter(torch.zeros(2))
        self.optim = torch.optim.SGD([self.param], lr=0.0)

    def step(self, overflow: bool) -> None:
        self.optim.zero_grad()
        loss = (self.param * torch.tensor([1.0, float("inf") if overflow else 1.0])).sum()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optim)
        self.scaler.update()

    @property
    def state(self) -> dict:
        return self.scaler.state_dict()


def _same(ours: SharedLossScaler, theirs: TorchScaler) -> None:
    assert ours.state_dict() == theirs.state
    assert ours.scale == theirs.scaler.get_scale()


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.sampled_from([1.0, 2.0 ** 16, 2.0 ** 24]))
def test_every_step_decides_like_torchs_grad_scaler(overflows, init_scale):
    ours, theirs = SharedLossScaler(True, init_scale), TorchScaler(init_scale)
    for overflow in overflows:
        ours.update(overflow)
        theirs.step(overflow)
        _same(ours, theirs)


def test_2000_good_steps_double_the_scale_and_an_overflow_halves_it():
    ours, theirs = SharedLossScaler(True, 8.0), TorchScaler(8.0)
    for step in range(1, 4002):
        overflow = step == 2001  # halfway through the second interval: the tracker starts again
        ours.update(overflow)
        theirs.step(overflow)
        if step in (1999, 2000, 2001, 2002, 4001):
            _same(ours, theirs)
    assert ours.scale == 8.0 * 2 * 0.5 * 2 and ours.tracker == 0  # doubled at 2000, halved at 2001, doubled at 4001


@pytest.mark.parametrize("overflows", [[True, False, False], [False] * 5, [True, True]])
def test_state_moves_between_train_and_launch(overflows):
    """A `vgraph train` checkpoint's GradScaler state resumes a launch's scaler and the other way round."""
    theirs = TorchScaler(2.0 ** 24)
    for overflow in overflows:
        theirs.step(overflow)
    ours = SharedLossScaler(True, 1.0)
    ours.load_state_dict(theirs.state)
    _same(ours, theirs)
    back = TorchScaler(1.0)
    back.scaler.load_state_dict(ours.state_dict())
    for overflow in (False, True, False):
        ours.update(overflow)
        back.step(overflow)
        theirs.step(overflow)
        _same(ours, back)
        _same(ours, theirs)


def test_a_disabled_scaler_is_one_and_saves_nothing():
    off = SharedLossScaler(False, 2.0 ** 16)
    off.update(True)
    off.load_state_dict({"scale": 4.0, "_growth_tracker": 3})
    assert off.scale == 1.0 and off.state_dict() is None
    on = SharedLossScaler(True, 2.0 ** 16)
    on.load_state_dict(None)  # a checkpoint of a run without loss scaling: the initial scale stays
    assert on.scale == 2.0 ** 16 and on.tracker == 0
    on.load_state_dict({"scale": 4.0})  # no growth tracker saved: counting starts at 0, as a fresh GradScaler's
    assert on.scale == 4.0 and on.tracker == 0
