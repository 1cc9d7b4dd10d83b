"""The ONNX subgraphs several lowerings share: linear, RoPE, attention with its causal mask and KV cache,
cross-entropy, windows of per-position tables.

The counterpart of the torch backend's ``kernels.py``: where the semantics of
an op are fixed (rotate-half RoPE, the additive causal mask, cross-entropy's
clamp), written once on the ONNX side.  They are methods of every
``ops.NodeLowering`` (a rule, a plugin's too, calls ``n.rope(...)``), mixed in
from here so the per-node view stays a short class.
"""
from __future__ import annotations

import math

import numpy as np

from .builder import ModelBuilder
from .names import CacheSlot

__all__ = ["Kernels", "CAUSAL_MASK_VALUE"]


def _rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[S, hd]`` of the rotate-half convention (see backends/torch/lowering/kernels.py)."""
    inv_freq = float(theta) ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


#: Added to scores of future keys.  Finite, so no runtime ever computes
#: ``-inf - -inf``; after the row max is subtracted ``exp`` underflows to an
#: exact 0 in float32, the same result as the reference's ``-inf`` fill.
CAUSAL_MASK_VALUE = -1e9


class Kernels:
    """The shared building blocks of ``NodeLowering``; they emit through its ``op`` and ``const``."""

    _b: ModelBuilder
    cache: CacheSlot | None

    def linear(self, x: str, weight: str, bias: str | None, tag: str, *, out: str | None = None) -> str:
        """``x @ weight.T + bias`` with ``weight`` stored ``[out, in]`` (the checkpoint layout)."""
        wt = self.op("Transpose", [weight], f"{tag}_weight_t", perm=[1, 0])
        if bias is None:
            return self.op("MatMul", [x, wt], f"{tag}_matmul", out=out)
        y = self.op("MatMul", [x, wt], f"{tag}_matmul")
        return self.op("Add", [y, bias], f"{tag}_bias", out=out)

    def length(self, x: str, axis: int, tag: str = "length") -> str:
        """The runtime length of ``x``'s ``axis`` as an int64 ``[1]`` value (one ``Shape`` per value and axis:
        the heads of a layer read one input, so they share it)."""
        end = {"end": axis + 1} if axis != -1 else {}
        return self._b.memo(("length", x, axis), lambda: self.op("Shape", [x], f"{tag}_length", start=axis, **end))

    def past_length(self) -> str:
        """Positions already in the KV cache, an int64 ``[1]`` value: 0 without a cache.

        Every cache of one call has the same past length, so it is read once,
        from the first cached node's past keys.
        """
        return self._b.past_length()

    def window(self, table: str, length: str, tag: str, *, axis: int = 0) -> str:
        """Rows ``[past, past + length)`` of a per-position constant (RoPE tables, causal mask, learned
        positions): the positions this call covers.  Shared by every reader of the same table and length.

        With the serving layout's ``position_ids`` the rows are those ids, ``[batch, sequence, ...]``: a
        left-padded prompt's first real token is position 0 whatever its index in the batch."""
        if self._b.position_ids is not None:
            if axis != 0:
                raise ValueError("position_ids select rows of axis 0 of a per-position table")
            return self._b.memo(("positions_of", table), lambda: self.op(
                "Gather", [table, self._b.position_ids], f"{tag}_rows", axis=0))

        def make() -> str:
            start = self.past_length()
            stop = self._b.memo(("stop", length), lambda: self.op("Add", [start, length], f"{tag}_stop"))
            return self.op("Slice", [table, start, stop, self.const(f"axes_{axis}", np.asarray([axis]))],
                           f"{tag}_window")

        return self._b.memo(("window", table, length, axis), make)

    def rope(self, x: str, seq_len: int, head_dim: int, theta: float, tag: str, *,
             positions: str | None = None, rank: int = 3) -> str:
        """Rotate-half RoPE (GPT-NeoX / Llama) of ``x[..., S, hd]`` with float64-built tables.

        The tables cover ``seq_len`` positions (the context length); a call
        takes the rows of its own positions, from the past length on: as many
        as ``positions`` (default ``x``) has along axis -2.  ``rank`` is
        ``x``'s, batch included (4 for ``[B, heads, S, hd]``): rows chosen by
        the serving layout's ``position_ids`` are ``[B, S, hd]`` and get the
        heads' axes so they broadcast per sample.
        """
        cos, sin = _rope_tables(seq_len, head_dim, theta)
        key = f"rope_s{seq_len}_d{head_dim}_theta{theta:g}"
        length = self.length(positions or x, -2)
        cos_name = self.window(self.const(f"{key}_cos", cos), length, "rope_cos")
        sin_name = self.window(self.const(f"{key}_sin", sin), length, "rope_sin")
        if self._b.position_ids is not None and rank > 3:
            axes = self.const(f"axes_1_to_{rank - 3}", np.arange(1, rank - 2))
            cos_name, sin_name = (self._b.memo(("per_sample_rows", t, rank), lambda t=t: self.op(
                "Unsqueeze", [t, axes], f"{t.rsplit('/', 1)[-1]}_heads_axes")) for t in (cos_name, sin_name))
        x1, x2 = self.op("Split", [x], f"{tag}_halves", outputs=2, axis=-1, num_outputs=2)
        neg = self.op("Neg", [x2], f"{tag}_neg")
        rotated = self.op("Concat", [neg, x1], f"{tag}_rotate_half", axis=-1)
        a = self.op("Mul", [x, cos_name], f"{tag}_cos")
        b = self.op("Mul", [rotated, sin_name], f"{tag}_sin")
        return self.op("Add", [a, b], f"{tag}_rope")

    def causal_mask(self, length: str) -> str:
        """The additive causal mask ``[length, past + length]`` of this call's queries (positions ``past ..
        past + length - 1``) over every key so far: ``CAUSAL_MASK_VALUE`` where the key comes later.

        Computed in the graph from two position ranges, not stored: a stored ``seq_len^2`` table made the
        file grow with the context's square (16 GB at 64K positions, a MemoryError at 200K).  Shared by
        every attention of the model."""
        def make() -> str:
            past = self.past_length()
            stop = self._b.memo(("stop", length), lambda: self.op("Add", [past, length], "mask_stop"))
            queries = self.positions(past, stop, "query_positions")
            keys = self.positions(self.const("axes_0_start", np.zeros(1, dtype=np.int64)), stop, "key_positions")
            column = self.op("Unsqueeze", [queries, self.const("axes_1", np.asarray([1]))], "query_column")
            future = self.op("Greater", [keys, column], "future_keys")
            return self.op("Where", [future, self.float_const("causal_mask_value", CAUSAL_MASK_VALUE),
                                     self.float_const("float32_zero", 0.0)], "causal_mask")

        return self._b.memo(("causal_mask", length), make)

    def padding_bias(self, rank: int) -> str:
        """The serving layout's ``attention_mask`` (int64 ``[B, past + S]``, 0 at padding) as an additive
        bias on scores of ``rank`` axes: ``CAUSAL_MASK_VALUE`` on padded keys, broadcast over heads and
        queries, so a left-padded prompt attends to its own tokens only.  One per rank, shared."""
        def make() -> str:
            padded = self.op("Equal", [self._b.attention_mask, self.const("int64_zero", np.asarray(0, np.int64))],
                             "padded_keys")
            bias = self.op("Where", [padded, self.float_const("causal_mask_value", CAUSAL_MASK_VALUE),
                                     self.float_const("float32_zero", 0.0)], "padding_bias")
            axes = self.const(f"axes_1_to_{rank - 2}", np.arange(1, rank - 1))
            return self.op("Unsqueeze", [bias, axes], f"padding_bias_rank{rank}")

        return self._b.memo(("padding_bias", rank), make)

    def positions(self, start: str, stop: str, tag: str) -> str:
        """int64 ``[stop - start]``: the positions ``start .. stop - 1`` (``start``, ``stop``: int64 ``[1]``)."""
        scalar = lambda v, t: self.op("Squeeze", [v, self.const("axes_0", np.asarray([0]))], t)  # noqa: E731
        return self.op("Range", [scalar(start, f"{tag}_start"), scalar(stop, f"{tag}_stop"),
                                 self.const("int64_one", np.asarray(1, dtype=np.int64))], tag)

    def cached(self, k: str, v: str) -> tuple[str, str]:
        """``k``, ``v`` (``[..., S, hd]``) after the past ones, returned as this node's present cache.

        Without a cache: ``k``, ``v`` unchanged.  Keys are cached after RoPE, so
        a past key is never rotated again.
        """
        slot = self.cache
        if slot is None:
            return k, v
        k = self.op("Concat", [slot.past_key, k], "present_key", out=slot.present_key, axis=-2)
        v = self.op("Concat", [slot.past_value, v], "present_value", out=slot.present_value, axis=-2)
        return k, v

    def attend(self, q: str, k: str, v: str, *, seq_len: int, head_dim: int, causal: bool,
               k_perm: list[int], out: str | None = None, positions: str | None = None) -> str:
        """softmax(q k^T / sqrt(hd) + causal_mask) v on ``[..., S, hd]`` operands.

        ``k`` and ``v`` may hold more positions than ``q`` (the cached past):
        query ``i`` is position ``past + i`` and sees keys ``0 .. past + i``.
        ``positions`` (default ``q``) has the queries along axis -2.
        """
        kt = self.op("Transpose", [k], "k_t", perm=k_perm)
        scores = self.op("MatMul", [q, kt], "scores")
        scale = self.float_const(f"attention_scale_d{head_dim}", 1.0 / math.sqrt(head_dim))
        scores = self.op("Mul", [scores, scale], "scaled_scores")
        if causal:
            length = self.length(positions or q, -2)
            scores = self.op("Add", [scores, self.causal_mask(length)], "masked_scores")
        if self._b.attention_mask is not None:
            scores = self.op("Add", [scores, self.padding_bias(len(k_perm))], "unpadded_scores")
        probs = self.op("Softmax", [scores], "probs", axis=-1)
        return self.op("MatMul", [probs, v], "attend", out=out)

    def cross_entropy(self, logits: str, targets: str, classes: int, *, from_probs: bool,
                      ignore_index: int, out: str) -> str:
        """Mean cross-entropy over all non-ignored rows of ``[B, ..., C]`` vs ``[B, ...]`` targets."""
        rows = self.op("Reshape", [logits, self.int64s("rows_shape", [-1, classes])], "rows")
        flat = self.op("Reshape", [targets, self.int64s("targets_shape", [-1])], "flat_targets")
        if from_probs:  # clamped as the torch backend does: p = 0 gives a large finite loss
            tiny = self.float_const("float32_tiny", np.finfo(np.float32).tiny)
            logp = self.op("Log", [self.op("Max", [rows, tiny], "clamped")], "log_probs")
            return self.op("NegativeLogLikelihoodLoss", [logp, flat], "nll", out=out,
                           reduction="mean", ignore_index=ignore_index)
        return self.op("SoftmaxCrossEntropyLoss", [rows, flat], "ce", out=out,
                       reduction="mean", ignore_index=ignore_index)
