"""Comparing two trainings by what they produced: the final weights and optimizer state, not the losses.

Equal losses are weak evidence of equal training (issue 27): over a few steps at a small learning rate a
wrong gradient barely moves the loss.  Two runs that should be the same training are compared here tensor
by tensor, in the unfused checkpoint layout both write:

* weights and Adam's first moments within `rtol` of each tensor's largest magnitude, second moments
  within 2 x `rtol` (a sum of squared gradients: twice a gradient's relative rounding).  `rtol` grows
  with the steps: micro-batches and replicas sum each step's gradient in another order, Adam's
  normalised update m / sqrt(v) carries that rounding into the weights, and the weights' differences
  feed back into later gradients.  Calibration (issues 25 and 27): the held-out 3-block network, 2 x 2
  replicas against one process after 4 Adam steps, differs by at most 4.7e-5 of each tensor's largest
  value, so `rtol` is 4.7e-5 / 4 per step (at least 4 steps' worth).  Measured on the tiny test
  networks: at most 5e-6 after 6 steps with replicas, 1.0e-4 in a second moment after 20 steps of a
  pipeline (tolerances 7e-5 and 4.7e-4); a sync bug moves tensors by percents.
* attention key biases (`.bk`) against Adam's step bound instead: their gradient is analytically zero (a
  key bias adds the same amount to every logit of a query, which softmax ignores), so in both runs it is
  rounding noise, and Adam turns noise into steps of up to about (1 - beta1) / sqrt(1 - beta2) = 3.2 x
  lr in any direction; two runs can differ by twice that per step.  Their moments are that noise too and
  are not compared.
* `step` counters exactly; the same keys on both sides.

`bitwise=True` is for runs that must be identical (a resume against an uninterrupted run, replicas
against the same micro-batches on one worker).

A checkpoint of a launch holds replica 0's share of every stage only.  `replicas_recorded` sees the
others: every launch worker started inside it saves its stage's weights and optimizer state each time it
checks its replicas before a checkpoint (worker.check_replicas_agree, wrapped by a `--plugin` file every
worker imports), and `assert_replicas_identical` compares them, bit for bit, across the replicas of each
stage: replicas start equal and apply the same summed gradients, so nothing else is right.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from tools.same_training import bitwise_equal as same_bytes  # dtype, shape and bytes: one rule for both
from vgraph.backends.torch.training.checkpoint import load_checkpoint

ADAM_RTOL_PER_STEP = 4.7e-5 / 4  # the calibration below: 4.7e-5 after 4 Adam steps
ADAM_MAX_STEP = 3.2  # |update| / lr of one Adam step, at most (1 - beta1) / sqrt(1 - beta2) with the defaults


def _zero_gradient(key: str) -> bool:
    return key.split(":", 1)[0].endswith(".bk")


def assert_same_weights(a: str | Path, b: str | Path, *, steps: int = 0, lr: float = 0.0,
                        bitwise: bool = False, flips: float = 0.0) -> None:
    """The checkpoints `a` and `b` hold the same training's weights and optimizer state (see the docstring).

    `flips`: the largest relative change a flipped rounding on the wire can make to a gradient (an int8
    quantum, 1/127: tests/test_distributed_compression.py derives it); it widens each moment's bound by
    `flips` of its largest value (second moments: twice, a square) and each weight's by Adam's update
    off by that much every step, 2 x flips x ADAM_MAX_STEP x lr x steps."""
    ca, cb = load_checkpoint(a, map_location="cpu"), load_checkpoint(b, map_location="cpu")
    assert ca.model_state.keys() == cb.model_state.keys() and ca.model_state
    assert ca.optimizer_states.keys() == cb.optimizer_states.keys() and ca.optimizer_states
    rtol = ADAM_RTOL_PER_STEP * max(steps, 4)
    pairs = [(k, ca.model_state[k], cb.model_state[k]) for k in sorted(cb.model_state)]
    for key in sorted(cb.optimizer_states):
        sa, sb = ca.optimizer_states[key], cb.optimizer_states[key]
        assert sa.keys() == sb.keys(), key
        for name in sorted(sb):
            if name == "step":
                assert float(sa[name]) == float(sb[name]), f"{key}: Adam's step {sa[name]} != {sb[name]}"
            elif isinstance(sb[name], torch.Tensor):
                pairs.append((f"{key}:{name}", sa[name], sb[name]))
    for key, x, y in pairs:
        assert x.shape == y.shape and x.dtype == y.dtype, key
        if bitwise:  # the bytes: torch.equal compares values, taking -0.0 for 0.0 and a NaN for unequal to itself
            assert same_bytes(x, y), f"{key}: differs (max {float((x.double() - y.double()).abs().max()):.3g})"
            continue
        diff = float((x.double() - y.double()).abs().max())
        if _zero_gradient(key):
            if ":" not in key:
                bound = 2 * ADAM_MAX_STEP * lr * steps
                assert diff <= bound, f"{key}: {diff:.3g} > Adam's bound {bound:.3g}"
            continue
        scale = float(y.double().abs().max())
        square = 2 if key.endswith(":exp_avg_sq") else 1
        bound = rtol * square * scale
        if flips:
            bound += square * flips * scale if ":" in key else 2 * flips * ADAM_MAX_STEP * lr * steps
        assert diff <= bound, (f"{key}: differs by {diff:.3g}, {diff / max(scale, 1e-30):.3g} of its largest value "
                               f"(bound {bound / max(scale, 1e-30):.3g})")


# Imported by every launch worker (a --plugin file; RECORD is written above it): before each check of the
# replicas (worker.py, at every checkpoint) this rank's weights and optimizer state go to RECORD/rank<r>-<n>.pt.
_REPLICA_SPY = '''
import itertools
import torch
import torch.distributed as dist
from vgraph.backends.torch.distributed.runtime import worker as _worker

_check = _worker.check_replicas_agree
_count = itertools.count()

def _recording(group, named, device="cpu"):
    state = {name: t.detach().to("cpu", copy=True) for name, t in named}
    torch.save(state, f"{RECORD}/rank{dist.get_rank()}-{next(_count)}.pt")
    return _check(group, named, device=device)

_worker.check_replicas_agree = _recording
'''


@contextlib.contextmanager
def replicas_recorded(directory: Path) -> Iterator[Path]:
    """Launches inside record every rank's state at each checkpoint into `directory` (see the docstring).
    The path is written into the plugin file: workers fork from a forkserver that an earlier launch may
    have started with its own environment."""
    from vgraph import plugins
    from vgraph.backends.torch.distributed.runtime import worker

    directory.mkdir(parents=True, exist_ok=True)
    spy = directory / "replica_spy.py"
    spy.write_text(f"RECORD = {str(directory)!r}\n" + _REPLICA_SPY, encoding="utf-8")
    saved_check, saved_files = worker.check_replicas_agree, dict(plugins._FILES)
    plugins.load_file(spy)  # the launcher forwards every plugin file this process loaded to its workers
    try:
        yield directory
    finally:  # this process imported the spy too: the real check and the plugin list come back
        worker.check_replicas_agree = saved_check
        plugins._FILES.clear()
        plugins._FILES.update(saved_files)


def assert_replicas_identical(directory: Path, replicas: int) -> int:
    """Every replica of every stage held the same weights and optimizer state, bit for bit, at every
    checkpoint recorded in `directory` (world rank r x P + s: stage s of replica r).  Returns how many
    checkpoints each rank recorded."""
    records: dict[int, list[Path]] = {}
    for path in directory.glob("rank*-*.pt"):
        rank, n = (int(x) for x in path.stem[len("rank"):].split("-"))
        records.setdefault(rank, []).append(path)
    world = len(records)
    assert replicas >= 2 and world % replicas == 0 and world >= replicas, sorted(records)
    per_rank = {len(v) for v in records.values()}
    assert len(per_rank) == 1 and min(per_rank) >= 1, {r: len(v) for r, v in records.items()}
    P = world // replicas
    for s in range(P):
        for n in range(min(per_rank)):
            first = torch.load(directory / f"rank{s}-{n}.pt")
            assert first, f"stage rank {s} recorded no state"
            for r in range(1, replicas):
                other = torch.load(directory / f"rank{r * P + s}-{n}.pt")
                assert other.keys() == first.keys(), (s, r)
                for key, value in first.items():
                    assert same_bytes(other[key], value), \
                        f"replica {r} of stage rank {s}, checkpoint {n}: {key} differs from replica 0's"
    return min(per_rank)
