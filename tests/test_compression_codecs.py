"""The wire formats of a `compress` VNode (backends/torch/lowering/wire_formats.py) against a reference written out here.

The reference quantizes group by group in NumPy float32 with the rules of vgraph/ops/boundary.py (scale
max |x| / 127, codes round half to even clamped to +-127, a zero group all zero, a group holding NaN or
infinity all NaN), so a wrong group axis, rounding mode, clamp or NaN rule shows.  Hypothesis draws the
shapes (per-sample rank 0 to 3), the scales (token, channel), values over twelve orders of magnitude with
zeros, NaN and infinities mixed in.  The bytes that travel equal the core's `wire_bytes` (what the cost model
prices), and error feedback loses nothing over a run: what was sent plus the residual is what was given.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgraph.backends.torch.lowering.wire_formats import (Codec, CompressState, ErrorFeedback, dequantize_int8,
                                               merge_residuals, quantize_int8)
from vgraph.ops.boundary import wire_bytes

SETTINGS = settings(derandomize=True, max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def groups_of(shape: tuple[int, ...], scale: str) -> list[tuple]:
    """Index tuples of the elements of each int8 group of a batch-first tensor of `shape`."""
    idx = list(np.ndindex(*shape))
    if len(shape) <= 1:
        key = lambda i: i  # noqa: E731  every element its own group
    elif scale == "token" or len(shape) == 2:
        key = lambda i: i[:-1]  # noqa: E731
    else:
        key = lambda i: (i[0], i[-1])  # noqa: E731  sample and channel
    out: dict = {}
    for i in idx:
        out.setdefault(key(i), []).append(i)
    return list(out.values())


def reference_int8(x: np.ndarray, scale: str) -> np.ndarray:
    """What arrives, group by group, in float32."""
    y = np.zeros_like(x, dtype=np.float32)
    for members in groups_of(x.shape, scale):
        values = np.array([x[i] for i in members], dtype=np.float32)
        if not np.all(np.isfinite(values)):
            for i in members:
                y[i] = np.nan
            continue
        s = np.float32(np.max(np.abs(values))) / np.float32(127.0)
        for i in members:
            y[i] = np.float32(0.0) if s == 0 else np.float32(np.clip(np.round(x[i] / s), -127, 127)) * s
    return y


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)
anything = st.one_of(finite, finite.map(lambda v: v * 1e-6), st.just(0.0), st.just(float("nan")),
                     st.just(float("inf")), st.just(float("-inf")))


@st.composite
def tensors(draw, special: bool = True):
    per_sample = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    shape = (draw(st.integers(1, 3)), *per_sample)
    n = int(np.prod(shape))
    values = draw(st.lists(anything if special else finite, min_size=n, max_size=n))
    return np.array(values, dtype=np.float32).reshape(shape)


@SETTINGS
@given(tensors(), st.sampled_from(["token", "channel"]))
def test_int8_round_trip_equals_the_reference(x, scale):
    codec = Codec("int8", scale)
    got = codec.round_trip(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, reference_int8(x, scale))  # NaN where the reference has NaN
    codes, scales = quantize_int8(torch.from_numpy(x), scale)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and int(codes.int().abs().max()) <= 127
    np.testing.assert_array_equal(dequantize_int8(codes, scales).numpy(), got)


@SETTINGS
@given(tensors(), st.sampled_from(["token", "channel"]), st.sampled_from(["none", "fp16", "bf16", "int8"]))
def test_what_travels_is_the_cost_models_bytes_and_decodes_to_the_round_trip(x, scale, name):
    codec = Codec(name, scale)
    t = torch.from_numpy(x)
    wire = codec.encode(t)
    shape, dtype = codec.wire(tuple(x.shape), torch.float32)
    assert tuple(wire.shape) == shape and wire.dtype == dtype  # what the receiver posts
    per_sample = wire_bytes(tuple(x.shape[1:]), "float32", name, scale)
    assert wire.numel() * wire.element_size() == per_sample * x.shape[0]
    decoded = codec.decode(wire.clone(), tuple(x.shape), torch.float32)  # a received copy, not a view of x
    np.testing.assert_array_equal(decoded.numpy(), codec.round_trip(t).numpy())


@SETTINGS
@given(tensors(special=False), st.sampled_from(["fp16", "bf16"]))
def test_halves_are_the_plain_casts(x, name):
    t = torch.from_numpy(x)
    half = torch.float16 if name == "fp16" else torch.bfloat16
    assert torch.equal(Codec(name).round_trip(t), t.to(half).float())


@SETTINGS
@given(tensors(special=False))
def test_int8_error_is_at_most_half_a_step_of_its_group(x):
    got = Codec("int8").round_trip(torch.from_numpy(x)).numpy()
    for members in groups_of(x.shape, "token"):
        step = max(abs(float(x[i])) for i in members) / 127
        assert all(abs(float(got[i]) - float(x[i])) <= step * 0.5 * (1 + 1e-5) + 1e-30 for i in members)


def test_a_non_finite_group_arrives_as_nan_and_spares_its_neighbours():
    x = torch.tensor([[[1.0, 2.0], [float("inf"), 1.0], [0.0, 0.0], [float("nan"), 3.0]]])
    got = Codec("int8", "token").round_trip(x)
    assert torch.equal(got[0, 0], torch.from_numpy(reference_int8(x.numpy(), "token")[0, 0]))
    assert got[0, 0, 1] == 2.0 and abs(float(got[0, 0, 0]) - 1.0) <= 1 / 127
    assert torch.isnan(got[0, 1]).all() and torch.isnan(got[0, 3]).all()
    assert torch.equal(got[0, 2], torch.zeros(2))  # a zero group: scale 0, nothing divided by it


def test_error_feedback_loses_nothing_over_a_run():
    """sum of what was sent + the residual = sum of what was given (per row), whatever the rounding: the
    telescoping sum that makes error feedback unbiased over a run."""
    torch.manual_seed(0)
    codec, fb = Codec("int8"), ErrorFeedback()
    given_sum = torch.zeros(4, 3, 8, dtype=torch.float64)
    sent_sum = torch.zeros_like(given_sum)
    for step in range(20):
        for offset in (0, 2):  # two micro-batches of 2 rows each, as a pipeline sends them
            g = torch.randn(2, 3, 8) * (10.0 ** (step % 5 - 2))
            wire = fb.encode(codec, g, offset)
            given_sum[offset:offset + 2] += g.double()
            sent_sum[offset:offset + 2] += codec.decode(wire, (2, 3, 8), torch.float32).double()
    # exact up to float32 rounding of each step's sum (a few ulps of the largest gradient, ~300)
    torch.testing.assert_close(sent_sum + fb.residual.double(), given_sum, rtol=0, atol=1e-4)
    assert fb.residual.abs().max() > 0


def test_error_feedback_keeps_no_residual_from_a_non_finite_step():
    fb = ErrorFeedback()
    fb.encode(Codec("int8"), torch.tensor([[1.0, 0.3]]), 0)
    fb.encode(Codec("int8"), torch.tensor([[float("inf"), 0.3]]), 0)
    assert torch.equal(fb.residual, torch.zeros(1, 2))


def test_the_autograd_function_rounds_both_ways_and_feeds_back_per_row():
    state = CompressState({"activations": "int8", "gradients": "fp16", "scale": "token", "error_feedback": True})
    x = torch.randn(3, 4, 5, requires_grad=True)
    y = state(x)
    assert torch.equal(y.detach(), Codec("int8").round_trip(x.detach()))
    g = torch.randn(3, 4, 5) * 1e-3
    y.backward(g)
    assert torch.equal(x.grad, g.half().float())
    assert torch.equal(state.feedback.residual, g - g.half().float())
    with torch.no_grad():  # validation: the forward round trip only, no feedback touched
        assert torch.equal(state(x), y.detach())


def test_residuals_of_several_ranks_merge_by_rows():
    a = {"c": torch.tensor([[1.0], [0.0], [0.0]])}
    b = {"c": torch.tensor([[0.0], [0.0], [0.0], [4.0]]), "d": torch.ones(1, 1)}
    merged = merge_residuals([a, b])
    assert torch.equal(merged["c"], torch.tensor([[1.0], [0.0], [0.0], [4.0]])) and torch.equal(merged["d"], b["d"])


@pytest.mark.parametrize("shape, scale, expected", [((5,), "token", 1 * 5 + 4), ((), "token", 1 + 4),
                                                     ((16, 32), "token", 512 + 16 * 4),
                                                     ((16, 32), "channel", 512 + 32 * 4),
                                                     ((2, 3, 4), "channel", 24 + 4 * 4)])
def test_wire_bytes_by_hand(shape, scale, expected):
    assert wire_bytes(shape, "float32", "int8", scale) == expected
    assert wire_bytes(shape, "float32", "fp16", scale) == 2 * math.prod(shape)
    assert wire_bytes(shape, "bfloat16", "none", scale) == 2 * math.prod(shape)
