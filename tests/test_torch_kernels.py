"""Tests for the pure PyTorch op kernels (vgraph.backends.torch.lowering.kernels)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vgraph.backends.torch.lowering import kernels as K

DIM = 32
HEADS = 2
HEAD_DIM = 16
VOCAB = 97


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------


def test_rope_tables_follow_rotate_half_convention() -> None:
    seq, hd, theta = 7, 8, 10000.0
    cos, sin = K.rope_cos_sin(seq, hd, theta, "cpu", torch.float64)
    assert cos.shape == sin.shape == (seq, hd)
    for p in range(seq):
        for i in range(hd // 2):
            angle = p * theta ** (-2 * i / hd)
            for j in (i, i + hd // 2):  # duplicated over both halves
                assert cos[p, j].item() == pytest.approx(math.cos(angle), abs=1e-12)
                assert sin[p, j].item() == pytest.approx(math.sin(angle), abs=1e-12)


def test_rope_tables_are_cached() -> None:
    a = K.rope_cos_sin(5, 8, 500.0, "cpu", torch.float32)
    b = K.rope_cos_sin(5, 8, 500.0, torch.device("cpu"), torch.float32)
    assert a[0] is b[0] and a[1] is b[1]


def test_rope_tables_cached_in_inference_mode_still_train() -> None:
    with torch.inference_mode():
        K.rope_cos_sin(9, 8, 321.0, "cpu", torch.float32)
    cos, sin = K.rope_cos_sin(9, 8, 321.0, "cpu", torch.float32)
    assert not cos.is_inference() and not sin.is_inference()
    x = torch.randn(1, 9, 8, requires_grad=True)
    K.apply_rope(x, cos, sin).sum().backward()
    assert x.grad is not None


def test_rope_rejects_odd_head_dim() -> None:
    with pytest.raises(ValueError, match="even"):
        K.rope_cos_sin(4, 7, 10000.0, "cpu", torch.float32)
    with pytest.raises(ValueError, match="even"):
        K.apply_rope(torch.zeros(1, 4, 7), torch.zeros(4, 7), torch.zeros(4, 7))


def test_apply_rope_rotates_half_pairs() -> None:
    seq, hd = 6, 8
    x = torch.randn(2, seq, hd, generator=_gen(), dtype=torch.float64)
    cos, sin = K.rope_cos_sin(seq, hd, 100.0, "cpu", torch.float64)
    out = K.apply_rope(x, cos, sin)
    half = hd // 2
    for p in range(seq):
        for i in range(half):
            c, s = cos[p, i], sin[p, i]
            x1, x2 = x[:, p, i], x[:, p, i + half]
            torch.testing.assert_close(out[:, p, i], x1 * c - x2 * s)
            torch.testing.assert_close(out[:, p, i + half], x2 * c + x1 * s)
    # Position 0 is the identity.
    torch.testing.assert_close(out[:, 0], x[:, 0])


def test_rope_scores_depend_only_on_relative_position() -> None:
    hd = 8
    q = torch.randn(hd, generator=_gen(1), dtype=torch.float64)
    k = torch.randn(hd, generator=_gen(2), dtype=torch.float64)
    cos, sin = K.rope_cos_sin(12, hd, 10000.0, "cpu", torch.float64)

    def score(m: int, n: int) -> float:
        qm = K.apply_rope(q.expand(12, hd), cos, sin)[m]
        kn = K.apply_rope(k.expand(12, hd), cos, sin)[n]
        return float(qm @ kn)

    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-10)
    assert score(3, 3) == pytest.approx(float(q @ k), rel=1e-10)


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------


def _naive_head(x, wq, bq, wk, bk, wv, bv, causal):
    """Per-batch, per-query loop: independent of the kernel's tensor tricks."""
    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    out = torch.zeros_like(q)
    seq = x.shape[1]
    for b in range(x.shape[0]):
        for i in range(seq):
            keys = range(i + 1) if causal else range(seq)
            scores = torch.stack([q[b, i] @ k[b, j] for j in keys]) / math.sqrt(q.shape[-1])
            probs = torch.softmax(scores, dim=0)
            out[b, i] = sum(p * v[b, j] for p, j in zip(probs, keys))
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_head_matches_naive_loop(causal: bool) -> None:
    g = _gen(3)
    x = torch.randn(2, 5, DIM, generator=g)
    ws = [torch.randn(HEAD_DIM, DIM, generator=g) / math.sqrt(DIM) for _ in range(3)]
    bs = [torch.randn(HEAD_DIM, generator=g) for _ in range(3)]
    got = K.attention_head(x, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], causal=causal, rope_theta=None)
    want = _naive_head(x, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], causal)
    assert got.shape == (2, 5, HEAD_DIM)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_head_causal_ignores_future_tokens() -> None:
    g = _gen(4)
    x = torch.randn(1, 6, DIM, generator=g)
    ws = [torch.randn(HEAD_DIM, DIM, generator=g) for _ in range(3)]
    out_a = K.attention_head(x, ws[0], None, ws[1], None, ws[2], None, causal=True, rope_theta=10000.0)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(1, 2, DIM, generator=g)
    out_b = K.attention_head(x2, ws[0], None, ws[1], None, ws[2], None, causal=True, rope_theta=10000.0)
    torch.testing.assert_close(out_a[:, :4], out_b[:, :4])
    assert not torch.allclose(out_a[:, 4:], out_b[:, 4:])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rope_theta", [None, 10000.0])
@pytest.mark.parametrize("with_out_proj", [False, True])
def test_multihead_equals_concatenated_heads(causal: bool, rope_theta: float | None, with_out_proj: bool) -> None:
    g = _gen(5)
    width = HEADS * HEAD_DIM
    x = torch.randn(3, 7, DIM, generator=g)
    qkv_w = torch.randn(3 * width, DIM, generator=g) / math.sqrt(DIM)
    qkv_b = torch.randn(3 * width, generator=g)
    out_w = torch.randn(DIM, width, generator=g) if with_out_proj else None
    out_b = torch.randn(DIM, generator=g) if with_out_proj else None

    got = K.multihead_attention(
        x, qkv_w, qkv_b, out_w, out_b,
        num_heads=HEADS, head_dim=HEAD_DIM, causal=causal, rope_theta=rope_theta,
    )

    def rows(kind: int, h: int) -> slice:
        start = kind * width + h * HEAD_DIM
        return slice(start, start + HEAD_DIM)

    heads = [
        K.attention_head(
            x,
            qkv_w[rows(0, h)], qkv_b[rows(0, h)],
            qkv_w[rows(1, h)], qkv_b[rows(1, h)],
            qkv_w[rows(2, h)], qkv_b[rows(2, h)],
            causal=causal, rope_theta=rope_theta,
        )
        for h in range(HEADS)
    ]
    want = torch.cat(heads, dim=-1)
    if with_out_proj:
        want = F.linear(want, out_w, out_b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_multihead_rejects_wrong_qkv_shape() -> None:
    x = torch.zeros(1, 3, DIM)
    with pytest.raises(ValueError, match=r"\(H \+ 2\*KV\)\*hd"):
        K.multihead_attention(
            x, torch.zeros(2 * HEADS * HEAD_DIM, DIM), None, None, None,
            num_heads=HEADS, head_dim=HEAD_DIM, causal=True, rope_theta=None,
        )


# --------------------------------------------------------------------------
# swiglu / masks
# --------------------------------------------------------------------------


def test_swiglu_value_times_silu_gate() -> None:
    x = torch.randn(2, 3, 8, generator=_gen(6))
    value, gate = x[..., :4], x[..., 4:]
    torch.testing.assert_close(K.swiglu(x), value * gate * torch.sigmoid(gate))
    with pytest.raises(ValueError, match="even"):
        K.swiglu(torch.zeros(2, 3))


def test_apply_mask_causal() -> None:
    x = torch.zeros(2, 4, 4)
    out = K.apply_mask(x, causal=True, mask_val=-1.0, random_prob=0.0, seed=0, training=True)
    expected_row = torch.tensor([[0, -1, -1, -1], [0, 0, -1, -1], [0, 0, 0, -1], [0, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(out[0], expected_row) and torch.equal(out[1], expected_row)


def test_apply_mask_random_is_seeded_and_training_only() -> None:
    x = torch.zeros(2, 2, 16, 16)
    kw = dict(causal=False, mask_val=-5.0, random_prob=0.3)
    a = K.apply_mask(x, seed=11, training=True, **kw)
    b = K.apply_mask(x, seed=11, training=True, **kw)
    c = K.apply_mask(x, seed=12, training=True, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    frac = (a == -5.0).float().mean().item()
    assert 0.2 < frac < 0.4
    assert torch.all(torch.diagonal(a, dim1=-2, dim2=-1) == 0.0)
    assert torch.equal(K.apply_mask(x, seed=11, training=False, **kw), x)
    # Random masking does not consume the global RNG.
    state = torch.get_rng_state()
    K.apply_mask(x, seed=1, training=True, **kw)
    assert torch.equal(state, torch.get_rng_state())


def test_apply_mask_causal_plus_random_never_yields_nan_softmax() -> None:
    x = torch.randn(1, 8, 8, generator=_gen(7))
    out = K.apply_mask(x, causal=True, mask_val=float("-inf"), random_prob=0.9, seed=3, training=True)
    assert torch.isfinite(torch.softmax(out, dim=-1)).all()
    assert torch.all(torch.isinf(out[0].triu(1)[torch.ones(8, 8, dtype=torch.bool).triu(1)]))


# --------------------------------------------------------------------------
# Tied LM head cross-entropy
# --------------------------------------------------------------------------


def _ce_case(b: int, s: int, d: int, v: int, dtype=torch.float32, seed: int = 8):
    g = _gen(seed)
    x = torch.randn(b, s, d, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, d, generator=g, dtype=dtype) / math.sqrt(d)).requires_grad_()
    targets = torch.randint(0, v, (b, s), generator=g)
    return x, w, targets


@pytest.mark.parametrize("chunk_size", [None, 7, 1, 1000])
def test_tied_ce_matches_reference(chunk_size: int | None) -> None:
    x, w, targets = _ce_case(3, 11, DIM, VOCAB)  # 33 rows: 7 does not divide it
    targets[0, :4] = -100
    targets[2, 5] = -100
    loss = K.tied_lm_head_ce(x, w, targets, chunk_size=chunk_size)
    gx, gw = torch.autograd.grad(loss, (x, w))

    ref = F.cross_entropy((x @ w.T).reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    rgx, rgw = torch.autograd.grad(ref, (x, w))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(gx, rgx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, rgw, rtol=1e-5, atol=1e-7)
    assert torch.all(gx[0, :4] == 0)


def test_tied_ce_custom_ignore_index_and_upstream_grad() -> None:
    x, w, targets = _ce_case(2, 5, DIM, VOCAB, seed=9)
    targets[1, 2] = 3
    loss = K.tied_lm_head_ce(x, w, targets, chunk_size=3, ignore_index=3) * 2.5
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref = 2.5 * F.cross_entropy((x @ w.T).reshape(-1, VOCAB), targets.reshape(-1), ignore_index=3)
    rgx, rgw = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(gx, rgx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, rgw, rtol=1e-5, atol=1e-7)


def test_tied_ce_half_precision_inputs_keep_dtypes() -> None:
    x, w, targets = _ce_case(2, 4, DIM, VOCAB, seed=10)
    xb = x.detach().bfloat16().requires_grad_()
    wb = w.detach().bfloat16().requires_grad_()
    loss = K.tied_lm_head_ce(xb, wb, targets, chunk_size=3)
    loss.backward()
    assert loss.dtype == torch.float32
    assert xb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    ref = F.cross_entropy((xb.float() @ wb.float().T).reshape(-1, VOCAB), targets.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)


def test_tied_ce_gradcheck_float64() -> None:
    x, w, targets = _ce_case(2, 3, 4, 6, dtype=torch.float64, seed=11)
    targets[0, 1] = -100
    assert torch.autograd.gradcheck(
        lambda a, b: K.tied_lm_head_ce(a, b, targets, chunk_size=4), (x, w), eps=1e-6, atol=1e-6
    )


def test_tied_ce_rejects_bad_inputs() -> None:
    x, w, targets = _ce_case(1, 2, DIM, VOCAB)
    with pytest.raises(TypeError, match="int64"):
        K.tied_lm_head_ce(x, w, targets.int())
    with pytest.raises(ValueError, match="targets shape"):
        K.tied_lm_head_ce(x, w, targets[:, :1])
    with pytest.raises(ValueError, match=r"\[V, D"):
        K.tied_lm_head_ce(x, w[:, :5], targets)


def test_default_chunk_size_bounds_chunk_logits() -> None:
    for vocab in (100, 32768, 128256, 10**8):
        rows = K.default_ce_chunk_size(vocab)
        assert rows >= 1
        assert rows == 1 or rows * vocab * 4 <= 32 * 2**20


class _LargestTensor(TorchDispatchMode):
    """Records the element count of every tensor any aten op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.max_numel = max(self.max_numel, leaf.numel())
        return out


def test_tied_ce_never_materialises_full_logits() -> None:
    """Every tensor produced in forward and backward, and every tensor saved
    for backward, is far smaller than the [N, V] logits."""
    b, s, d, v = 2, 1024, 64, 32768
    n = b * s
    x, w, targets = _ce_case(b, s, d, v, seed=12)
    chunk = K.default_ce_chunk_size(v)
    assert chunk < n

    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    tracker = _LargestTensor()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
        loss = K.tied_lm_head_ce(x, w, targets)
        loss.backward()

    assert torch.isfinite(loss)
    assert x.grad is not None and w.grad is not None
    assert saved and max(saved) < n * v // 8
    assert tracker.ops > 0
    # The largest intermediates are one chunk of logits or the [V, D] fp32
    # weight / gradient accumulator; never the [N, V] logits.
    assert tracker.max_numel <= max(chunk * v, v * d)
    assert tracker.max_numel < n * v // 4


def test_logits_chunk_is_fp32_matmul() -> None:
    x, w, _ = _ce_case(2, 3, DIM, VOCAB)
    logits = K.logits_chunk(x.detach().bfloat16(), w.detach().bfloat16())
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, VOCAB)
    torch.testing.assert_close(logits, x.detach().bfloat16().float() @ w.detach().bfloat16().float().T)


# --------------------------------------------------------------------------
# stack / reshape
# --------------------------------------------------------------------------


def test_stack_concatenates_along_per_sample_axis() -> None:
    parts = [torch.randn(2, 5, HEAD_DIM, generator=_gen(i)) for i in range(3)]
    out = K.stack(parts, axis=-1)
    assert out.shape == (2, 5, 3 * HEAD_DIM)
    torch.testing.assert_close(out[..., HEAD_DIM : 2 * HEAD_DIM], parts[1])
    assert torch.equal(K.stack(parts, axis=1), out)
    out0 = K.stack(parts, axis=0)
    assert out0.shape == (2, 15, HEAD_DIM)
    with pytest.raises(ValueError, match="out of range"):
        K.stack(parts, axis=2)
    with pytest.raises(ValueError, match="out of range"):
        K.stack(parts, axis=-3)


def test_reshape_keeps_batch() -> None:
    x = torch.arange(2 * 6 * 4).reshape(2, 6, 4)
    out = K.reshape(x, [3, 8])
    assert out.shape == (2, 3, 8)
    assert torch.equal(out[1].flatten(), x[1].flatten())
    assert K.reshape(x, [-1]).shape == (2, 24)
    with pytest.raises(ValueError, match="cannot reshape"):
        K.reshape(x, [5, 5])
    with pytest.raises(ValueError, match="at most one -1"):
        K.reshape(x, [-1, -1])


def test_rope_hand_written_backward_equals_autograd() -> None:
    """_RoPE's backward (the transpose of the rotation) against autograd through the plain formula."""
    torch.manual_seed(0)
    cos, sin = K.rope_cos_sin(6, 8, 10000.0, dtype=torch.float64)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: K.apply_rope(t, cos, sin), (x,))
    g = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    (fast,) = torch.autograd.grad(K.apply_rope(x, cos, sin), x, g)
    (plain,) = torch.autograd.grad(x * cos + K._rotate_half(x) * sin, x, g)
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-12)


def test_tied_ce_under_cpu_autocast_keeps_an_fp32_loss() -> None:
    """Under autocast the LM-head matmuls run in bf16 with fp32 sums; the loss stays fp32 and close."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, requires_grad=True)
    w = (0.1 * torch.randn(96, 32)).requires_grad_()
    t = torch.randint(0, 96, (2, 8))
    ref = F.cross_entropy((x @ w.T).reshape(-1, 96), t.reshape(-1))
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = K.tied_lm_head_ce(x, w, t)
    assert loss.dtype == torch.float32
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, ref_gx, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(gw, ref_gw, rtol=5e-2, atol=5e-3)
