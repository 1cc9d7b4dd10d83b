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
"""
from __future__ import annotations

from pathlib import Path

import torch

from vgraph.backends.torch.checkpoint import load_checkpoint

ADAM_RTOL_PER_STEP = 4.7e-5 / 4  # the calibration below: 4.7e-5 after 4 Adam steps
ADAM_MAX_STEP = 3.2  # |update| / lr of one Adam step, at most (1 - beta1) / sqrt(1 - beta2) with the defaults


def _zero_gradient(key: str) -> bool:
    return key.split(":", 1)[0].endswith(".bk")


def assert_same_weights(a: str | Path, b: str | Path, *, steps: int = 0, lr: float = 0.0,
                        bitwise: bool = False) -> None:
    """The checkpoints `a` and `b` hold the same training's weights and optimizer state (see the docstring)."""
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
        if bitwise:
            assert torch.equal(x, y), f"{key}: differs (max {float((x - y).abs().max()):.3g})"
            continue
        diff = float((x.double() - y.double()).abs().max())
        if _zero_gradient(key):
            if ":" not in key:
                bound = 2 * ADAM_MAX_STEP * lr * steps
                assert diff <= bound, f"{key}: {diff:.3g} > Adam's bound {bound:.3g}"
            continue
        scale = float(y.double().abs().max())
        tol = rtol * (2 if key.endswith(":exp_avg_sq") else 1)
        assert diff <= tol * scale, f"{key}: differs by {diff:.3g}, {diff / max(scale, 1e-30):.3g} of its largest value"
