"""The chunked tied LM-head cross-entropy on its production path: half-precision matmuls, ignored rows.

The fp32 tests of :mod:`test_torch_kernels` never enter the reduced-precision branch of
``TiedLMHeadCE`` (tensor-core operands, ignored rows zeroed in ``x``, ``1/count`` applied once after the
loop), which is the branch a GPU run takes.  Here that branch runs under CPU autocast (bf16 and fp16)
and with half-precision inputs, with ignored target rows spread over several chunks, and the loss and
BOTH gradients are compared with the oracle: float32 ``F.cross_entropy`` of ``x @ w.T`` on the same
operands rounded to the compute dtype (so the comparison measures the kernel's own error, not the
rounding of its inputs).

Tolerances, from the arithmetic: the logits are exact products of the rounded operands summed in
float32, so the loss agrees to float32 rounding (atol 1e-5 on a loss ~5).  The gradient path rounds
``softmax - onehot`` to the compute dtype once before its two matmuls, so each gradient is off by about
the dtype's unit roundoff (bf16 2^-9, fp16 2^-12) in relative norm; the bound is 4x that.  A row that
should be ignored but leaks into a gradient contributes a term as large as a real row's: relative error
of order 1/valid-rows, tens of times the bound.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vgraph.backends.torch.lowering import kernels as K

B, S, D, V = 3, 11, 32, 97
# Relative-norm bound on each gradient: 4 x the unit roundoff of the compute dtype.
GRAD_RTOL = {torch.bfloat16: 4 * 2.0**-9, torch.float16: 4 * 2.0**-12}


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5
    t = torch.randint(0, V, (B, S), generator=g)
    t[0, :4] = -100            # a run of ignored rows at the start (a whole chunk for small chunks)
    t[1, ::3] = -100           # scattered ones
    t[2, S - 1] = -100         # the last row (the short last chunk)
    return x, w, t


def _reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, dtype: torch.dtype):
    """fp32 F.cross_entropy on the operands rounded to `dtype`: loss, grad_x, grad_w."""
    xr = x.to(dtype).float().requires_grad_()
    wr = w.to(dtype).float().requires_grad_()
    loss = F.cross_entropy((xr @ wr.T).reshape(-1, V), t.reshape(-1), ignore_index=-100)
    gx, gw = torch.autograd.grad(loss, (xr, wr))
    return loss.detach(), gx, gw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 16, None])
def test_tied_ce_under_autocast_with_ignored_rows_matches_fp32_cross_entropy(dtype, chunk_size) -> None:
    x0, w0, t = _case(seed=21)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        loss = K.tied_lm_head_ce(x, w, t, chunk_size=chunk_size)
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref, rgx, rgw = _reference(x0, w0, t, dtype)

    assert loss.dtype == torch.float32 and gx.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=1e-5)
    assert _rel(gx, rgx) < GRAD_RTOL[dtype], _rel(gx, rgx)
    assert _rel(gw, rgw) < GRAD_RTOL[dtype], _rel(gw, rgw)
    ignored = t == -100
    assert torch.all(gx[ignored] == 0)  # ignored rows get exactly no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("chunk_size", [3, 33])
def test_tied_ce_half_inputs_with_ignored_rows_and_upstream_grad(dtype, chunk_size) -> None:
    """Half-precision parameters (no autocast) take the same branch; the upstream gradient scales both."""
    x0, w0, t = _case(seed=22)
    x, w = x0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
    upstream = 3.0  # what a loss scaler or a summed second cost sends back
    loss = K.tied_lm_head_ce(x, w, t, chunk_size=chunk_size)
    gx, gw = torch.autograd.grad(loss, (x, w), torch.tensor(upstream))
    ref, rgx, rgw = _reference(x0, w0, t, dtype)

    assert gx.dtype == dtype and gw.dtype == dtype
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=1e-5)
    # One more rounding: the gradients are returned in `dtype`.
    assert _rel(gx, upstream * rgx) < 2 * GRAD_RTOL[dtype]
    assert _rel(gw, upstream * rgw) < 2 * GRAD_RTOL[dtype]
    assert torch.all(gx[t == -100] == 0)


def test_tied_ce_reduced_precision_all_but_one_row_ignored() -> None:
    """With one valid row the weight gradient is that row's outer product alone: a leak would dominate it."""
    x0, w0, t = _case(seed=23)
    t.fill_(-100)
    t[1, 6] = 5
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = K.tied_lm_head_ce(x, w, t, chunk_size=4)
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref, rgx, rgw = _reference(x0, w0, t, torch.bfloat16)
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=1e-5)
    assert _rel(gw, rgw) < GRAD_RTOL[torch.bfloat16]
    assert _rel(gx, rgx) < GRAD_RTOL[torch.bfloat16]


def test_tied_ce_names_what_is_wrong_with_its_inputs() -> None:
    x0, w0, t = _case(seed=24)
    with pytest.raises(ValueError, match=r"weight must be \[V, D=32\]; got \(3104,\)"):
        K.tied_lm_head_ce(x0, w0.reshape(-1), t)
    with pytest.raises(ValueError, match=r"weight must be \[V, D=32\]; got \(97, 16\)"):
        K.tied_lm_head_ce(x0, w0[:, :16], t)
    with pytest.raises(ValueError, match=r"weight must be \[V, D=32\]; got \(97, 64\)"):
        K.tied_lm_head_ce(x0, torch.cat([w0, w0], dim=1), t)
    with pytest.raises(ValueError, match=r"weight must be \[V, D=32\]; got \(97, 32, 1\)"):
        K.tied_lm_head_ce(x0, w0[:, :, None], t)  # 3-D, though its second dimension is D
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"chunk_size must be positive; got {bad}"):
            K.tied_lm_head_ce(x0, w0, t, chunk_size=bad)
    with pytest.raises(ValueError, match=r"targets shape \(3, 10\) must equal x's leading dims \(3, 11\)"):
        K.tied_lm_head_ce(x0, w0, t[:, :10])
    for x, w in ((x0, w0.long()), (x0.long(), w0)):  # either operand not floating point
        with pytest.raises(TypeError, match="must be floating point"):
            K.tied_lm_head_ce(x, w, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tied_ce_without_gradients_reads_every_chunk(dtype) -> None:
    """Validation runs under no_grad: only the loss is formed, and it must still cover every chunk."""
    x0, w0, t = _case(seed=25)
    ref, _, _ = _reference(x0, w0, t, dtype)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = K.tied_lm_head_ce(x0, w0, t, chunk_size=4)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)


def test_tied_ce_takes_rows_without_a_batch_axis() -> None:
    x0, w0, t = _case(seed=26)
    x2d, t1d = x0.reshape(-1, D), t.reshape(-1)
    torch.testing.assert_close(K.tied_lm_head_ce(x2d, w0, t1d, chunk_size=5),
                               F.cross_entropy(x2d @ w0.T, t1d, ignore_index=-100), rtol=1e-6, atol=0)


def test_default_chunk_size_is_a_whole_number_of_rows() -> None:
    for vocab, dim in ((97, None), (32_768, 8), (10_000, 512), (3, None)):
        rows = K.default_ce_chunk_size(vocab, dim=dim)
        assert isinstance(rows, int) and rows >= max(1, dim or 0), (vocab, dim, rows)
