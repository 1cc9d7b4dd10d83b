"""Keyed dropout (backends/torch/lowering/dropout.py): counter-based masks, their statistics, and one graph.

The mask is specified by `mask_reference` in plain Python integers; the
vectorised tensor code must give the same bits.  Statistics are checked on
masks large enough that a broken hash (a correlated Weyl sequence, a lost
bit, a shared stream) misses the bounds by far: keep rate within 5 sigma,
pairwise correlations within 5/sqrt(n), and a chi-square on 4-element
patterns.  The masks are deterministic, so none of this can flake.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vgraph.backends.torch.lowering.dropout import (clear_dropout_key, current_dropout_key, dropout_key, keep_mask,
                                           keyed_dropout, mask_reference, node_stream, set_dropout_key)


def masks(seed: int, step: int, node: str, samples: int, elements: int, p: float, offset: int = 0) -> torch.Tensor:
    """Keep masks [samples, elements] (bool) as keyed_dropout draws them."""
    with dropout_key(seed, step, offset):
        out = keyed_dropout(torch.ones(samples, elements), p, node)
    return out != 0


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


# -- the definition -------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_tensor_masks_equal_the_python_integer_definition(p) -> None:
    seed, step, node, offset = 12345, 77, "block0_attn_dropout", 5
    got = masks(seed, step, node, 3, 40, p, offset)
    want = torch.tensor([[mask_reference(seed, step, node, offset + i, e, p) for e in range(40)] for i in range(3)])
    assert torch.equal(got, want)


def test_negative_and_huge_seeds_and_steps_are_keys_too() -> None:
    for seed, step in ((-1, 3), (2**70 + 5, 2**65), (0, -4)):
        got = masks(seed, step, "d", 2, 16, 0.5)
        want = torch.tensor([[mask_reference(seed, step, "d", i, e, 0.5) for e in range(16)] for i in range(2)])
        assert torch.equal(got, want)


def test_node_streams_do_not_depend_on_the_process() -> None:
    """No Python hash(): another interpreter with another hash seed draws the same masks."""
    code = ("from vgraph.backends.torch.lowering.dropout import node_stream, mask_reference;"
            "print(node_stream('block3_ffn_dropout'), [mask_reference(1, 2, 'block3_ffn_dropout', 0, e, 0.5) "
            "for e in range(8)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    here = [mask_reference(1, 2, "block3_ffn_dropout", 0, e, 0.5) for e in range(8)]
    assert out == f"{node_stream('block3_ffn_dropout')} {here}"
    assert node_stream("a") != node_stream("b") and 0 <= node_stream("a") < 2**63


# -- statistics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p) -> None:
    m = masks(3, 1, "drop", 64, 8192, p)
    n = m.numel()
    assert abs(float(m.float().mean()) - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_masks_are_uncorrelated_across_samples_elements_nodes_steps_and_seeds() -> None:
    p, samples, elements = 0.5, 32, 4096
    base = masks(1, 10, "drop", samples, elements, p)
    bound = 5 / math.sqrt(base.numel())
    others = {
        "next sample": masks(1, 10, "drop", samples, elements, p, offset=1),
        "other node": masks(1, 10, "drop2", samples, elements, p),
        "next step": masks(1, 11, "drop", samples, elements, p),
        "next seed": masks(2, 10, "drop", samples, elements, p),
    }
    for what, other in others.items():
        assert abs(corr(base[:-1] if what == "next sample" else base,
                        other[:-1] if what == "next sample" else other)) < bound, what
    # Within a sample: element e against e+1, e+2, e+64 (neighbours along every axis of a [S, D] row).
    for lag in (1, 2, 64):
        assert abs(corr(base[:, :-lag], base[:, lag:])) < 5 / math.sqrt(base[:, lag:].numel()), lag
    # Sample i against sample i+1 of the same call (Weyl segments of neighbouring samples).
    assert abs(corr(base[:-1], base[1:])) < 5 / math.sqrt(base[1:].numel())


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("across", ["elements", "samples"])
def test_four_mask_patterns_follow_the_binomial_law(p, across) -> None:
    """Chi-square over the 16 patterns of 4 consecutive elements of a sample, or of one element in 4
    consecutive samples (15 degrees of freedom)."""
    m = masks(9, 4, "drop", 16, 16384, p)
    m = (m.reshape(-1, 4) if across == "elements" else m.reshape(4, 4, -1).permute(0, 2, 1).reshape(-1, 4)).long()
    codes = m[:, 0] * 8 + m[:, 1] * 4 + m[:, 2] * 2 + m[:, 3]
    observed = torch.bincount(codes, minlength=16).double()
    keeps = torch.tensor([bin(c).count("1") for c in range(16)], dtype=torch.float64)
    expected = len(codes) * (1 - p) ** keeps * p ** (4 - keeps)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 50.0  # P(chi2_15 > 50) ~ 1e-5


# -- the same masks however the batch is cut -------------------------------------------------------

def test_whole_batch_equals_micro_batches_of_any_cut() -> None:
    x = torch.randn(11, 6, 8)
    with dropout_key(4, 2):
        whole = keyed_dropout(x, 0.3, "drop")
    for cut in ([11], [1] * 11, [3, 3, 5], [6, 5], [2, 9]):
        parts, start = [], 0
        for size in cut:
            with dropout_key(4, 2, offset=start):
                parts.append(keyed_dropout(x[start:start + size], 0.3, "drop"))
            start += size
        assert torch.equal(torch.cat(parts), whole), cut


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mask_does_not_depend_on_dtype_and_survivors_scale_like_f_dropout(dtype) -> None:
    x = torch.randn(4, 5, 6)
    with dropout_key(0, 1):
        ref = keyed_dropout(x, 0.25, "drop")
        low = keyed_dropout(x.to(dtype), 0.25, "drop")
    assert low.dtype == dtype
    assert torch.equal(low != 0, ref != 0)
    kept = ref != 0
    assert torch.equal(ref[kept], x[kept] * (1 / 0.75))
    torch.manual_seed(0)
    fd = F.dropout(x, 0.25, training=True)
    assert torch.equal(fd[fd != 0], x[fd != 0] * (1 / 0.75))  # the same scaling rule
    torch.testing.assert_close(low[kept].double(), ref[kept].double(), rtol=1e-2, atol=0)


def test_backward_is_the_mask_times_the_scale() -> None:
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    with dropout_key(2, 3):
        assert torch.autograd.gradcheck(lambda t: keyed_dropout(t, 0.4, "drop"), (x,))
        y = keyed_dropout(x, 0.4, "drop")
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, (y != 0).double() / 0.6)


def test_edge_rates_and_empty_batches() -> None:
    x = torch.randn(2, 3)
    with dropout_key(0, 1):
        assert torch.equal(keyed_dropout(x, 0.0, "d"), x)
        assert torch.equal(keyed_dropout(x, 1.0, "d"), torch.zeros_like(x))
        assert keyed_dropout(torch.ones(0, 3), 0.5, "d").shape == (0, 3)
        for bad in (-0.1, 1.5, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="dropout rate"):
                keyed_dropout(x, bad, "d")


def test_without_a_key_it_is_f_dropout_on_the_global_rng() -> None:
    clear_dropout_key()
    assert current_dropout_key() is None
    x = torch.randn(4, 16)
    torch.manual_seed(5)
    a = keyed_dropout(x, 0.5, "drop")
    torch.manual_seed(5)
    assert torch.equal(a, F.dropout(x, 0.5, training=True))


def test_the_key_context_restores_the_previous_key() -> None:
    set_dropout_key(1, 2)
    with dropout_key(3, 4, offset=5) as key:
        assert (key.seed, key.step, key.offset) == (3, 4, 5) and current_dropout_key() is key
    assert (current_dropout_key().seed, current_dropout_key().step) == (1, 2)
    clear_dropout_key()


def test_keep_mask_is_one_batch_of_tensor_ops() -> None:
    """No generator, no per-sample loop: the mask of 128 samples is the same handful of ops as of 1."""
    from torch.profiler import profile

    with dropout_key(0, 1) as key:
        keep_mask(key.values, node_stream("d"), 2, 64, 0.1)  # caches the keyless per-element hashes
        counts = []
        for batch in (1, 128):
            with profile() as prof:
                keep_mask(key.values, node_stream("d"), batch, 64, 0.1)
            counts.append(len([e for e in prof.events() if e.name.startswith("aten::")]))
    assert counts[0] == counts[1]


# -- one graph ------------------------------------------------------------------------------------

def test_traced_dropout_has_no_graph_break_and_no_recompile_per_step() -> None:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(t):
        return keyed_dropout(t, 0.3, "drop", node_stream("drop")) * 2.0

    x = torch.randn(4, 5, 6, requires_grad=True)
    torch._dynamo.reset()
    with dropout_key(1, 1, offset=2):
        explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    counter = CompileCounterWithBackend("aot_eager")  # functionalises the in-place int32 views too
    compiled = torch.compile(f, backend=counter)
    for step in range(1, 5):
        with dropout_key(1, step, offset=2):
            eager, traced = f(x), compiled(x)
        assert torch.equal(eager, traced), step
        assert torch.equal(*(torch.autograd.grad(y.sum(), x)[0] for y in (eager, traced)))
    assert counter.frame_count == 1  # a new step is new data for the same graph
    torch._dynamo.reset()
