"""Pure tensor functions that define the semantics of vgraph ops in PyTorch.

Everything here is stateless: parameters are passed in explicitly, so the
same function serves the eager executor, the reference checks and any
module wrapper built on top.  All activations carry the batch dimension
first (``[B, ...]``); "per-sample" axes and shapes exclude it.

Conventions fixed here (other backends must agree with them):

* **RoPE** uses the rotate-half (GPT-NeoX / Llama) layout: the head
  dimension is split into two halves ``x1 = x[..., :hd/2]`` and
  ``x2 = x[..., hd/2:]`` and frequency ``i`` rotates the pair
  ``(x1[i], x2[i])``.  It is *not* the interleaved GPT-J layout that
  rotates ``(x[2i], x[2i+1])``.
* **Fused QKV weight** ``[(H + 2*KV)*hd, D]`` holds all query heads, then all key
  heads, then all value heads, each head a block of ``hd`` rows (``KV = H``
  without grouped-query attention, so ``[3*H*hd, D]``).  With ``KV < H`` query
  head ``h`` reads K/V head ``h // (H / KV)`` (Hugging Face's ``repeat_kv`` order).
* **Multi-head output** ``[B, S, H*hd]`` puts head ``h`` in columns
  ``h*hd:(h+1)*hd``, i.e. the per-head outputs concatenated in head order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = [
    "rope_cos_sin",
    "apply_rope",
    "attention_head",
    "multihead_attention",
    "rms_norm",
    "swiglu",
    "add_positions",
    "apply_mask",
    "TiedLMHeadCE",
    "tied_lm_head_ce",
    "default_ce_chunk_size",
    "logits_chunk",
    "matmul_dtype",
    "mm_fp32",
    "stack",
    "reshape",
]

#: Upper bound on the fp32 logits of one chunk in :func:`tied_lm_head_ce` (CPU).
CE_CHUNK_BUDGET_BYTES = 32 * 1024 * 1024
#: The same on a GPU, where each chunk costs kernel launches (see :func:`default_ce_chunk_size`).
CE_CHUNK_BUDGET_BYTES_GPU = 1024 * 1024 * 1024


def _accum_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Precision for reductions: float32, or float64 when an input is float64.

    Softmax and cross-entropy sums lose accuracy in half precision, while
    float64 inputs (gradcheck) must not be silently truncated to float32.
    """
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


# --------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the RoPE ``(cos, sin)`` tables, each of shape ``[seq_len, head_dim]``.

    Convention (rotate-half, as in GPT-NeoX and Llama)::

        inv_freq[i] = theta ** (-2 i / head_dim)        i in [0, head_dim / 2)
        angle[p, i] = p * inv_freq[i]                    p in [0, seq_len)
        cos[p]      = cat(cos(angle[p]), cos(angle[p]))  # duplicated halves
        sin[p]      = cat(sin(angle[p]), sin(angle[p]))

    The angles are computed in float64 on the CPU and only then cast, so the
    tables are accurate to ``dtype`` precision even at large positions
    (a float32 ``p * inv_freq`` loses ~1e-4 rad at p=4096) and work on devices
    without float64 support.

    Results are cached per ``(seq_len, head_dim, theta, device, dtype)``
    because every attention layer of every step asks for the same tables.
    The returned tensors are shared between callers: treat them as read-only.
    Under ``torch.compile`` they come from the opaque custom op
    ``vgraph::rope_tables`` (a copy of the cached tables): traced as plain
    tensor code, the compiler inlined the float64 table computation into the
    rotation and recomputed ``cos``/``sin`` per element of q and k, every
    step, which made the compiled 6-layer training step ~40% slower than
    eager on the CPU.
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"RoPE needs a positive, even head_dim; got head_dim={head_dim}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0; got {seq_len}")
    if not theta > 0:
        raise ValueError(f"RoPE theta must be > 0; got {theta}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (int(seq_len), int(head_dim), float(theta), device, dtype)
    if torch.compiler.is_compiling():
        # A Python-level cache would be bypassed (with a warning) while tracing.
        return _rope_tables_op(*key)
    return _rope_cos_sin_cached(*key)


def _build_rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = theta**-exponents
    positions = torch.arange(seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _rope_cos_sin_cached(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # inference_mode(False): a table first built during evaluation must still
    # be usable (and savable for backward) when training later hits the cache.
    with torch.inference_mode(False), torch.no_grad():
        return _build_rope_tables(seq_len, head_dim, theta, device, dtype)


@torch.library.custom_op("vgraph::rope_tables", mutates_args=())
def _rope_tables_op(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached tables as a graph-opaque op (copies: an op's outputs must not alias globals)."""
    cos, sin = _rope_cos_sin_cached(seq_len, head_dim, theta, device, dtype)
    return cos.clone(), sin.clone()


@_rope_tables_op.register_fake
def _rope_tables_shapes(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(seq_len, head_dim, device=device, dtype=dtype),
            torch.empty(seq_len, head_dim, device=device, dtype=dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


class _RoPE(torch.autograd.Function):
    """``x * cos + swap_halves(x) * signed_sin``, with ``signed_sin = cat(-sin1, sin2)``.

    The same numbers as ``x * cos + rotate_half(x) * sin`` (the sign moves
    from ``x`` to the table), in three kernels instead of five, and a
    hand-written backward: the rotation is linear with transpose
    ``g -> swap_halves(g * signed_sin)``, so the input gradient is
    ``g * cos + swap_halves(g * signed_sin)``, three kernels where autograd
    through ``cat``/``neg``/slices runs about ten (zero-filled slice
    gradients included).  RoPE runs on q and k of every attention layer.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.addcmul(x * cos, _swap_halves(x), signed_sin)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        return torch.addcmul(_swap_halves(grad * signed_sin), grad, cos), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., S, hd]`` by position: ``x * cos + rotate_half(x) * sin``.

    ``rotate_half(x) = cat(-x2, x1)`` with ``x1, x2`` the two halves of the
    last dimension (see :func:`rope_cos_sin` for the convention).  ``cos`` and
    ``sin`` are ``[S, hd]`` and broadcast over every leading dimension, so the
    same call serves ``[B, S, hd]`` and ``[B, H, S, hd]`` layouts.  With
    constant tables of ``x``'s dtype (the usual case) it runs as
    :class:`_RoPE`; otherwise as the expression above, through autograd.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"RoPE needs an even last dimension; got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.shape[-2:] != x.shape[-2:]:
        raise ValueError(
            f"RoPE tables {tuple(cos.shape)} / {tuple(sin.shape)} do not match the "
            f"last two dims [S, hd] of x with shape {tuple(x.shape)}"
        )
    if cos.requires_grad or sin.requires_grad or not (x.dtype == cos.dtype == sin.dtype):
        return x * cos + _rotate_half(x) * sin  # autograd, and type promotion, as written
    half = sin.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return _RoPE.apply(x, cos, signed_sin)


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------


def attention_head(
    x: torch.Tensor,
    wq: torch.Tensor,
    bq: torch.Tensor | None,
    wk: torch.Tensor,
    bk: torch.Tensor | None,
    wv: torch.Tensor,
    bv: torch.Tensor | None,
    *,
    causal: bool,
    rope_theta: float | None,
) -> torch.Tensor:
    """One attention head, written out step by step: the reference path.

    ``x`` is ``[B, S, D]``, ``w*`` are ``[hd, D]`` and ``b*`` are ``[hd]`` (or
    ``None``).  Returns ``[B, S, hd]``.

    The math is explicit (matmul, ``masked_fill(-inf)``, softmax) rather than
    a fused kernel so that it is obviously correct and can be used to check
    the fast paths.  Softmax runs in (at least) float32 and is cast back,
    which keeps half-precision runs from losing the small attention weights.
    """
    if x.dim() != 3:
        raise ValueError(f"attention_head expects x of shape [B, S, D]; got {tuple(x.shape)}")
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(
                f"{name} must be [hd, D={x.shape[-1]}]; got {tuple(w.shape)}"
            )
    if not (wq.shape == wk.shape == wv.shape):
        raise ValueError(
            f"wq, wk, wv must share a shape; got {tuple(wq.shape)}, {tuple(wk.shape)}, {tuple(wv.shape)}"
        )
    head_dim = wq.shape[0]
    seq_len = x.shape[1]

    q = F.linear(x, wq, bq)
    k = F.linear(x, wk, bk)
    v = F.linear(x, wv, bv)
    if rope_theta is not None:
        cos, sin = rope_cos_sin(seq_len, head_dim, rope_theta, q.device, q.dtype)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.to(_accum_dtype(scores)), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def multihead_attention(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    out_weight: torch.Tensor | None,
    out_bias: torch.Tensor | None,
    *,
    num_heads: int,
    head_dim: int,
    causal: bool,
    rope_theta: float | None,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """All heads of an attention layer in one fused projection + SDPA call.

    ``x`` is ``[B, S, D]``; ``qkv_weight`` is ``[(H + 2*KV)*hd, D]`` laid out as
    ``[q_head0 .. q_head{H-1}, k_head0 .. k_head{KV-1}, v_head0 .. v_head{KV-1}]``
    (each block ``hd`` rows), i.e. the per-head ``wq`` stacked in head order,
    then all ``wk``, then all ``wv``; ``qkv_bias`` follows the same layout.
    ``KV`` is ``num_kv_heads`` (default ``H``); with fewer K/V heads than query
    heads (GQA, MQA) query head ``h`` attends with K/V head ``h // (H / KV)``.
    This makes the layer exactly equal to running :func:`attention_head` on
    the corresponding weight slices and concatenating the outputs, which is
    how a graph pass may merge per-head nodes into one.

    The attention itself goes through
    :func:`torch.nn.functional.scaled_dot_product_attention` so PyTorch can
    pick a flash / memory-efficient kernel.  The result is ``[B, S, H*hd]``
    with head ``h`` in columns ``h*hd:(h+1)*hd``, followed by the optional
    output projection ``out_weight [D_out, H*hd]`` / ``out_bias [D_out]``.
    """
    if x.dim() != 3:
        raise ValueError(f"multihead_attention expects x of shape [B, S, D]; got {tuple(x.shape)}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads <= 0 or head_dim <= 0 or kv_heads <= 0 or num_heads % kv_heads:
        raise ValueError(f"num_heads, head_dim and num_kv_heads must be positive, num_heads a multiple of "
                         f"num_kv_heads; got {num_heads}, {head_dim}, {kv_heads}")
    width = num_heads * head_dim
    rows = (num_heads + 2 * kv_heads) * head_dim
    if tuple(qkv_weight.shape) != (rows, x.shape[-1]):
        raise ValueError(
            f"qkv_weight must be [(H + 2*KV)*hd, D] = {[rows, x.shape[-1]]} for H={num_heads}, "
            f"KV={kv_heads}, hd={head_dim}; got {list(qkv_weight.shape)}"
        )
    if qkv_bias is not None and tuple(qkv_bias.shape) != (rows,):
        raise ValueError(f"qkv_bias must be [{rows}]; got {list(qkv_bias.shape)}")
    if out_weight is None and out_bias is not None:
        raise ValueError("out_bias given without out_weight")

    batch, seq_len, _ = x.shape
    qkv = F.linear(x, qkv_weight, qkv_bias)
    if kv_heads == num_heads:
        # [B, S, 3, H, hd] -> [3, B, H, S, hd]: index 0/1/2 selects q/k/v, matching
        # the row blocks of qkv_weight.
        qkv = qkv.view(batch, seq_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
    else:
        q, k, v = (part.view(batch, seq_len, heads, head_dim).transpose(1, 2) for part, heads in zip(
            qkv.split([width, kv_heads * head_dim, kv_heads * head_dim], dim=-1), (num_heads, kv_heads, kv_heads)))
    if rope_theta is not None:
        cos, sin = rope_cos_sin(seq_len, head_dim, rope_theta, q.device, q.dtype)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
    if kv_heads != num_heads:
        # Each K/V head repeated for the consecutive query heads of its group (repeat_kv); SDPA's
        # enable_gqa does this without the copy but needs torch 2.5, and vgraph supports 2.4.
        k = k.repeat_interleave(num_heads // kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // kv_heads, dim=1)

    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = out.transpose(1, 2).reshape(batch, seq_len, width)
    if out_weight is not None:
        out = F.linear(out, out_weight, out_bias)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, normalised in float32 and cast back, as Llama does.

    The mean square of half-precision activations overflows (fp16) or loses
    digits (bf16), so the normalisation runs in float32 (float64 stays float64)
    whatever autocast says; the result is cast back to ``x``'s dtype before the
    scale, as Hugging Face's ``LlamaRMSNorm`` computes it, and returned in ``x``'s dtype.
    """
    acc = _accum_dtype(x)
    with torch.autocast(device_type=x.device.type, enabled=False):
        wide = x.to(acc)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        return weight.to(x.dtype) * normed.to(x.dtype)


# --------------------------------------------------------------------------
# Activations and masks
# --------------------------------------------------------------------------


def add_positions(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``x[B, S, D]`` plus the first ``S`` rows of a learned ``[S_max, D]`` position table.

    A sequence shorter than the declared one (an inference call, see the ONNX
    export's dynamic sequence) gets the positions it covers, as the
    rotary tables of :func:`rope_cos_sin` do; at the declared length this is
    ``x + position``.
    """
    return x + position[: x.shape[-2]]


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: split the last dim into ``value, gate`` and return ``value * silu(gate)``.

    The first half is the value and the second the gate, so a single fused
    up-projection of width ``2*F`` feeds it and the output has width ``F``.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu needs an even last dimension; got shape {tuple(x.shape)}")
    value, gate = x.chunk(2, dim=-1)
    return value * F.silu(gate)


def apply_mask(
    x: torch.Tensor,
    *,
    causal: bool,
    mask_val: float,
    random_prob: float = 0.0,
    seed: int = 0,
    training: bool = False,
    keep_diagonal: bool = True,
) -> torch.Tensor:
    """Mask entries of score matrices ``x[..., Sq, Sk]`` with ``mask_val``.

    * ``causal``: entries above the diagonal (key after query) are masked.
    * ``random_prob > 0`` and ``training``: each entry is additionally
      masked with probability ``random_prob``.  The draw uses a fresh
      :class:`torch.Generator` seeded with ``seed`` on ``x``'s device, so the
      mask is a pure function of ``(shape, seed, device)``: reproducible and
      independent of the global RNG.  Callers wanting a new mask per step
      must vary ``seed`` (e.g. mix in the step number).
    * ``keep_diagonal`` (default) exempts the diagonal from random masking:
      with ``mask_val=-inf`` a row with every entry masked turns into NaN
      after softmax, and the diagonal is never causally masked, so keeping it
      guarantees at least one live entry per row.

    Outside training, random masking is off (like dropout).
    """
    if x.dim() < 2:
        raise ValueError(f"apply_mask expects x of shape [..., Sq, Sk]; got {tuple(x.shape)}")
    if not 0.0 <= random_prob < 1.0:
        raise ValueError(f"random_prob must be in [0, 1); got {random_prob}")
    sq, sk = x.shape[-2:]
    mask: torch.Tensor | None = None
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    if training and random_prob > 0.0:
        generator = torch.Generator(device=x.device)
        generator.manual_seed(int(seed))
        drop = torch.rand(x.shape, generator=generator, device=x.device) < random_prob
        if keep_diagonal:
            drop &= ~torch.eye(sq, sk, dtype=torch.bool, device=x.device)
        mask = drop if mask is None else (mask | drop)
    if mask is None:
        return x
    return x.masked_fill(mask, mask_val)


# --------------------------------------------------------------------------
# Tied LM head + cross-entropy without materialising the logits
# --------------------------------------------------------------------------


def default_ce_chunk_size(vocab_size: int, budget_bytes: int | None = None,
                          device: torch.device | str | None = None, dim: int | None = None) -> int:
    """Rows per chunk so that one chunk's fp32 logits ``[rows, V]`` fit ``budget_bytes``.

    The default budget is :data:`CE_CHUNK_BUDGET_BYTES` (32 MiB) on the CPU.
    On a GPU every chunk costs a dozen kernel launches, so the budget there
    is 1/64 of the device's memory, at most :data:`CE_CHUNK_BUDGET_BYTES_GPU`
    (1 GiB: 8192 rows at vocab 32k, so a 64k-token batch is 8 chunks, not 256).
    With ``dim`` (the hidden size D) a chunk has at least D rows: every chunk
    reads and writes the whole ``[V, D]`` weight-gradient accumulator, so
    thinner chunks spend more time on it than on their own logits (at vocab
    32k, D 512 on 2 CPU threads: 256-row chunks ran as fast as the plain loss,
    1024-row ones 0.87x); D rows of logits are no larger than the ``[V, D]``
    float32 tensors the loss holds anyway.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive; got {vocab_size}")
    if budget_bytes is None:
        budget_bytes = _device_ce_budget(torch.device(device)) if device is not None else CE_CHUNK_BUDGET_BYTES
    return max(1, budget_bytes // (4 * vocab_size), dim or 0)


def _device_ce_budget(device: torch.device) -> int:
    if device.type != "cuda":
        return CE_CHUNK_BUDGET_BYTES
    return _cuda_ce_budget(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_ce_budget(index: int) -> int:
    total = torch.cuda.get_device_properties(index).total_memory
    return max(CE_CHUNK_BUDGET_BYTES, min(CE_CHUNK_BUDGET_BYTES_GPU, total // 64))


_REDUCED = (torch.float16, torch.bfloat16)
_mm_out_dtype_works = True


def matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a product of ``x`` and ``weight`` is computed in.

    Autocast's dtype where autocast is on for the device (the production
    policy's compute dtype: an LM head is a matmul like any other), else the
    promotion of the two; float64 always stays float64.
    """
    if torch.float64 in (x.dtype, weight.dtype):
        return torch.float64
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D, one dtype) accumulated and returned in float32; float64 stays float64.

    fp16/bf16 operands: on CUDA one tensor-core GEMM with a float32 output
    (``torch.mm(..., out_dtype=torch.float32)``); on the CPU the operands are
    upcast, which forms the same exact products and float32 sums.  A CUDA
    torch without ``out_dtype`` gets the reduced-precision product upcast
    (the rounding every autocast model's logits have).
    """
    global _mm_out_dtype_works
    if a.dtype not in _REDUCED:
        return torch.mm(a, b)
    if a.is_cuda:
        if _mm_out_dtype_works:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError, NotImplementedError):
                _mm_out_dtype_works = False
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


def logits_chunk(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits ``x @ weight.T`` accumulated and returned in float32 (float64 for float64 inputs).

    ``x`` is ``[..., D]`` and ``weight`` ``[V, D]``.  This is the single place
    logits are formed: the fused loss does the same on row chunks, and a graph
    that explicitly asks for a logits output calls it on the whole activation
    (which does materialise ``[..., V]``, so only do that when the logits are
    really needed).  The operands are taken in the compute dtype
    (:func:`matmul_dtype`: under bf16 autocast the product runs on bf16
    tensor cores) but the sums and the result are float32, so the softmax
    and loss after it see full-precision logits.
    """
    compute = matmul_dtype(x, weight)
    with torch.autocast(device_type=x.device.type, enabled=False):
        x2d = x.reshape(-1, x.shape[-1]).to(compute)
        logits = mm_fp32(x2d, weight.to(compute).t())
    return logits.view(*x.shape[:-1], weight.shape[0])


class TiedLMHeadCE(torch.autograd.Function):
    """Mean cross-entropy of ``x @ weight.T`` against ``targets``, chunked over rows.

    The full logits ``[N, V]`` (N = B*S) dominate the memory of LM training
    (e.g. 8k tokens x 128k vocab x 4 bytes = 4 GiB), and autograd would keep
    them for backward.  This function never holds more than one chunk of
    logits, and forms each chunk exactly once:

    * forward, per chunk: logits (one matmul), ``log_softmax`` (the loss rows),
      and, when a gradient is wanted, ``softmax - onehot`` in place of the
      log-probabilities, turned at once into the chunk's rows of ``grad_x``
      and its share of ``grad_weight`` (two matmuls);
    * backward: the saved gradients times ``grad_output`` (the loss is linear
      in its upstream gradient, so nothing is recomputed).

    That is the three matmuls of the plain ``F.linear`` + ``F.cross_entropy``
    and no recompute (an earlier version recomputed the logits in backward:
    a fourth matmul, ~17% slower than the plain loss at vocab 10k), while the
    plain loss writes and rereads the ``[N, V]`` logits, log-probabilities and
    their gradient several times; chunk by chunk they stay small.  Measured on
    the 6-layer network's head (1024 rows, vocab 10k, 2 CPU threads): 0.89x
    the time of the plain loss, forward + backward.

    Precision: the matmul operands are taken in ``compute_dtype`` (bf16/fp16
    under autocast, see :func:`matmul_dtype`), products are accumulated in
    float32 (:func:`mm_fp32`), and the softmax, the loss and both gradient
    accumulators are float32 for every input dtype, float64 if an input is
    float64 (which is what makes ``gradcheck`` meaningful).

    What lives from forward to backward: ``grad_x [N, D]`` and the
    ``grad_weight [V, D]`` accumulator, both float32 (the accumulator the
    backward-recompute design allocated anyway; float32 also keeps ``grad_x``
    from underflowing under fp16 loss scaling, since the scale is applied in
    backward).  Without a gradient (eval, ``no_grad``) only the loss is
    computed.

    Inputs: ``x [B, S, D]`` (any float dtype), ``weight [V, D]``,
    ``targets [B, S]`` int64, ``chunk_size`` (rows), ``ignore_index``,
    ``need_x`` / ``need_weight`` (which gradients to form), ``compute_dtype``.
    Output: a float32 scalar (float64 for float64 inputs), the mean over
    non-ignored rows; like
    :func:`torch.nn.functional.cross_entropy` it is NaN if every row is
    ignored.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        need_x: bool,
        need_weight: bool,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        acc = _accum_dtype(x, weight)
        reduced = compute_dtype in _REDUCED
        x2d = x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        flat_targets = targets.reshape(-1)
        valid = flat_targets != ignore_index
        safe_targets = torch.where(valid, flat_targets, torch.zeros_like(flat_targets))
        weight_c = weight.to(compute_dtype if reduced else acc)
        count = valid.sum()
        # d(mean)/d(row loss): 1/count for valid rows, 0 for ignored ones.
        row_scale = valid.to(acc) / count
        valid_c = valid.to(weight_c.dtype)[:, None]
        target_logp = torch.empty(rows, dtype=acc, device=x.device)
        grad_x = torch.empty((rows, x2d.shape[1]), dtype=acc, device=x.device) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=x.device) if need_weight else None
        with torch.autocast(device_type=x.device.type, enabled=False):
            for start in range(0, rows, chunk_size):
                stop = min(start + chunk_size, rows)
                x_chunk = x2d[start:stop].to(weight_c.dtype)
                chunk_targets = safe_targets[start:stop, None]
                log_probs = torch.log_softmax(mm_fp32(x_chunk, weight_c.t()), dim=-1)
                target_logp[start:stop] = log_probs.gather(1, chunk_targets).squeeze(1)
                if grad_x is None and grad_w is None:
                    continue
                # softmax - onehot, built in place of the log-probabilities.
                grad_logits = log_probs.exp_()
                grad_logits.scatter_add_(1, chunk_targets, torch.full(chunk_targets.shape, -1.0, dtype=acc,
                                                                      device=x.device))
                scale = row_scale[start:stop, None]
                if reduced:
                    # Tensor-core products; ignored rows are zeroed in x (exact) and
                    # 1/count is applied once, in float32, after the loop.
                    grad_logits = grad_logits.to(compute_dtype)
                    if grad_x is not None:
                        grad_x[start:stop] = mm_fp32(grad_logits, weight_c) * scale
                    if grad_w is not None:
                        grad_w += mm_fp32(grad_logits.t(), x_chunk * valid_c[start:stop])
                else:
                    # The per-row 1/count goes on the thin [rows, D] operands.
                    if grad_x is not None:
                        torch.mm(grad_logits, weight_c, out=grad_x[start:stop])
                        grad_x[start:stop].mul_(scale)
                    if grad_w is not None:
                        grad_w.addmm_(grad_logits.t(), x_chunk * scale)
                del grad_logits, log_probs
            if reduced and grad_w is not None:
                grad_w /= count
        ctx.save_for_backward(*(g for g in (grad_x, grad_w) if g is not None))
        ctx.need = (need_x, need_weight)
        ctx.x_meta = (x.shape, x.dtype)
        ctx.weight_dtype = weight.dtype
        return -torch.where(valid, target_logp, 0.0).sum() / count

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        saved = list(ctx.saved_tensors)
        need_x, need_w = ctx.need
        grad_x = grad_w = None
        if need_x:
            x_shape, x_dtype = ctx.x_meta
            grad_x = (saved.pop(0) * grad_output).to(x_dtype).view(x_shape)
        if need_w:
            grad_w = (saved.pop(0) * grad_output).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def tied_lm_head_ce(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Fused tied LM head + mean cross-entropy; see :class:`TiedLMHeadCE`.

    ``x [B, S, D]``, ``weight [V, D]`` (the tied embedding matrix),
    ``targets [B, S]`` int64 with ``ignore_index`` marking rows that do not
    count.  ``chunk_size`` defaults to :func:`default_ce_chunk_size` for
    ``x``'s device and hidden size (on the CPU: ~32 MiB of fp32 logits, and
    at least D rows).
    The matmuls run in :func:`matmul_dtype` (autocast's dtype under autocast).
    Returns a float32 scalar (float64 if an input is float64).
    """
    if x.dim() < 2:
        raise ValueError(f"x must be [B, S, D]; got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [V, D={x.shape[-1]}]; got {tuple(weight.shape)}"
        )
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal x's leading dims {tuple(x.shape[:-1])}"
        )
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64; got {targets.dtype}")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"x and weight must be floating point; got {x.dtype}, {weight.dtype}")
    if chunk_size is None:
        chunk_size = default_ce_chunk_size(weight.shape[0], device=x.device, dim=weight.shape[1])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    # Gradients are formed in forward, so forward must know which ones are wanted.
    grad_on = torch.is_grad_enabled()
    return TiedLMHeadCE.apply(x, weight, targets, int(chunk_size), int(ignore_index),
                              grad_on and x.requires_grad, grad_on and weight.requires_grad,
                              matmul_dtype(x, weight))


# --------------------------------------------------------------------------
# Shape ops with per-sample axes
# --------------------------------------------------------------------------


def _batch_axis(axis: int, sample_ndim: int) -> int:
    """Map a per-sample axis (batch excluded, negative from the end) to a tensor dim."""
    if not -sample_ndim <= axis < sample_ndim:
        raise ValueError(
            f"per-sample axis {axis} is out of range for {sample_ndim} per-sample dims"
        )
    return axis + 1 if axis >= 0 else axis


def stack(tensors: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
    """Join per-sample tensors along an *existing* per-sample axis.

    Despite the IR name this concatenates (no new axis): ``N x [B, S, hd]``
    with ``axis=-1`` gives ``[B, S, N*hd]``, which is how per-head outputs
    become the model width.  ``axis`` counts per-sample dims (the batch dim
    is excluded, so ``axis=0`` is the first dim after the batch; negative
    values count from the end).
    """
    if len(tensors) == 0:
        raise ValueError("stack needs at least one tensor")
    ndim = tensors[0].dim()
    if ndim < 2:
        raise ValueError(f"stack inputs need a batch dim plus per-sample dims; got ndim={ndim}")
    if any(t.dim() != ndim for t in tensors):
        raise ValueError(f"stack inputs differ in rank: {[tuple(t.shape) for t in tensors]}")
    return torch.cat(list(tensors), dim=_batch_axis(axis, ndim - 1))


def reshape(x: torch.Tensor, target_shape: Sequence[int]) -> torch.Tensor:
    """Reshape each sample to ``target_shape`` (batch dim kept; one ``-1`` allowed)."""
    target = tuple(int(d) for d in target_shape)
    per_sample = math.prod(x.shape[1:])
    known = math.prod(d for d in target if d != -1)
    wildcards = sum(1 for d in target if d == -1)
    if wildcards > 1 or any(d < -1 for d in target):
        raise ValueError(f"invalid target shape {list(target)}: at most one -1 and no other negatives")
    fits = (per_sample % known == 0) if (wildcards and known) else (per_sample == known)
    if not fits:
        raise ValueError(
            f"cannot reshape per-sample shape {list(x.shape[1:])} ({per_sample} elements) "
            f"to {list(target)}"
        )
    return x.reshape(x.shape[0], *target)
