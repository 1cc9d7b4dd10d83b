"""Per-op-type ONNX lowering rules: an IR op name -> the ONNX nodes of one VNode.

The counterpart of the torch backend's ``ops.py``: the rule registry
(``LOWERINGS``, ``register_lowering``, what each rule declares about the
sequence axis), the per-node view a rule works with (``NodeLowering``; its
shared building blocks are in ``kernels.py``) and the rules of the built-in
catalog.  Rules are looked up by canonical op name, so a plugin op gets its
ONNX meaning from ``register_lowering("my_op")``; the driver is ``lower.py``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from vgraph import Graph, TensorType, VNode
from vgraph.ir.kv_cache import foreign_kv_reader, kv_source

from .builder import ModelBuilder
from .kernels import Kernels
from .names import PAST, CacheSlot, node_error, param_key, value_name

__all__ = ["NodeLowering", "Lowering", "LOWERINGS", "TRAITS", "LoweringTraits", "register_lowering", "traits_of"]


# ---------------------------------------------------------------------------
# The per-node view a lowering rule works with
# ---------------------------------------------------------------------------


class NodeLowering(Kernels):
    """What a lowering rule sees of one VNode, and how it emits ONNX nodes.

    A rule reads ``inputs`` (ONNX value names, one per input slot) and
    ``input_types`` (per-sample vgraph types), emits nodes with :meth:`op`,
    and returns one value name per output slot (``None`` for a slot nobody
    reads, see :meth:`needs`).  Returning an existing name (e.g. an input) is
    allowed: the value is simply shared.
    """

    def __init__(self, builder: ModelBuilder, node: VNode, inputs: list[str],
                 input_types: list[TensorType]) -> None:
        self._b = builder
        self.node = node
        self.cfg = node.cfg
        self.inputs = inputs
        self.input_types = input_types
        self.graph = builder.graph
        self._named_main = False

    # -- names ------------------------------------------------------------
    def out(self, slot: int = 0) -> str:
        """The canonical value name of output ``slot``: pass it as ``out=`` of the last op."""
        return value_name(self.node.id, slot)

    def needs(self, slot: int) -> bool:
        """Whether output ``slot`` is read (by an edge in the lowered set or as a graph output)."""
        return (self.node.id, slot) in self._b.needed

    @property
    def dynamic_sequence(self) -> bool:
        """Whether the sequence axis is symbolic (the inference export): no rule may bake in its length."""
        return self._b.sequence is not None

    @property
    def cache(self) -> CacheSlot | None:
        """This node's past/present key and value names when exporting a KV-cache decoder, else None."""
        return self._b.caches.get(self.node.id)

    @property
    def float_type(self) -> int:
        """ONNX element type of activations (float32)."""
        return TensorProto.FLOAT

    # -- emitting ------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], tag: str | None = None, *, out: str | None = None,
           outputs: int = 1, **attrs: Any) -> str | list[str]:
        """Emit one ONNX node; returns its output name (a list when ``outputs > 1``).

        ``out`` names the single output (use ``self.out(k)`` for an output
        slot); otherwise values are named ``"<vnode>/<tag>"``.
        """
        tag = tag or op_type.lower()
        if out is not None:
            names = [out]
        else:
            base = self._b.unique(f"{self.node.id}/{tag}")
            names = [base] if outputs == 1 else [f"{base}.{i}" for i in range(outputs)]
        if out is not None and out.startswith(f"{self.node.id}:") and not self._named_main:
            node_name = self._b.unique_node(self.node.id)
            self._named_main = True
        else:
            node_name = self._b.unique_node(f"{self.node.id}/{tag}")
        onnx_node = helper.make_node(op_type, list(inputs), names, name=node_name, **attrs)
        onnx_node.doc_string = self._b.doc_of(self.node)
        self._b.nodes.append(onnx_node)
        return names[0] if outputs == 1 else names

    def param(self, pname: str) -> str:
        """Value name of a parameter this node owns or reads through a weight tie."""
        tied = self.node.op.tied(self.cfg)
        if pname in tied:
            alias, shape = tied[pname]
            pub = self._b.publishers.get(alias)
            if pub is None:
                raise node_error(self.node, f"tie_weight_alias {alias!r} has no publisher")
            return self._b.param(param_key(pub.id, "weight"), shape, self.node)
        shapes = self.node.op.param_shapes(self.cfg)
        if pname not in shapes:
            raise node_error(self.node, f"a {self.node.type} has no parameter {pname!r}")
        return self._b.param(param_key(self.node.id, pname), shapes[pname], self.node)

    def const(self, name: str, value: np.ndarray) -> str:
        """A constant shared graph-wide under ``name`` (RoPE tables, masks): same name, same value."""
        return self._b.const(name, value)

    def local_const(self, tag: str, value: np.ndarray) -> str:
        """A constant of this node only, named ``"<vnode>/<tag>"``."""
        return self._b.const(self._b.unique(f"{self.node.id}/{tag}"), value)

    def float_const(self, name: str, value: Any) -> str:
        return self.const(name, np.asarray(value, dtype=np.float32))

    def int64s(self, tag: str, values: Sequence[int]) -> str:
        """A node-local int64 vector (Reshape targets, axes)."""
        return self.local_const(tag, np.asarray(list(values), dtype=np.int64))


Lowering = Callable[[NodeLowering], Sequence[str | None]]

#: canonical op name -> lowering rule.
LOWERINGS: dict[str, Lowering] = {}


@dataclass(frozen=True)
class LoweringTraits:
    """What a lowering declares about the sequence axis (read by the KV-cache export).

    ``positionwise``: the node's output at a position reads only that position
    of its inputs (linear, layer norm, activations, residual adds): running it
    on a call's new positions alone is exact.  A bool, or a predicate of the
    VNode when it depends on the config (``stack`` along the sequence axis is
    not positionwise).

    ``kv_cache``: for a node that mixes positions through attention, the
    per-sample shape of its cached keys (values have the same), with
    :data:`PAST` marking the growing axis, e.g. ``(PAST, head_dim)``; ``None``
    for a config that cannot be cached (attention that is not causal).  Such a
    rule reads :attr:`NodeLowering.cache` and extends it with
    :meth:`NodeLowering.cached`.

    A node that is neither cannot run incrementally and the KV-cache export
    refuses it by name; the default (neither) is the safe one for a plugin.
    """

    positionwise: bool | Callable[[VNode], bool] = False
    kv_cache: Callable[[Mapping[str, Any]], tuple[int | str, ...] | None] | None = None

    def is_positionwise(self, node: VNode) -> bool:
        p = self.positionwise
        return bool(p(node) if callable(p) else p)

    def cache_shape(self, node: VNode) -> tuple[int | str, ...] | None:
        return self.kv_cache(node.cfg) if self.kv_cache is not None else None


#: canonical op name -> what its lowering declares (absent: ``LoweringTraits()``).
TRAITS: dict[str, LoweringTraits] = {}


def register_lowering(op_name: str, rule: Lowering | None = None, *, replace: bool = False,
                      positionwise: bool | Callable[[VNode], bool] = False,
                      kv_cache: Callable[[Mapping[str, Any]], tuple[int | str, ...] | None] | None = None):
    """Register the ONNX lowering of a VNode type (usable as a decorator).

    ``rule(n: NodeLowering)`` returns one value name per output slot.  A plugin
    that adds an op type with ``vgraph.register_op`` registers its lowering
    here under the same name.  ``positionwise`` and ``kv_cache`` declare how
    the rule treats the sequence axis (:class:`LoweringTraits`); they matter
    only to the KV-cache export, which refuses a node that declares neither.
    """
    def deco(fn: Lowering) -> Lowering:
        from vgraph.ops import REGISTRY

        canon = REGISTRY.canonical(op_name) or op_name
        if canon in LOWERINGS and not replace:
            raise ValueError(f"an ONNX lowering for {canon!r} is already registered")
        LOWERINGS[canon] = fn
        TRAITS[canon] = LoweringTraits(positionwise, kv_cache)
        return fn

    return deco(rule) if rule is not None else deco


def traits_of(node: VNode) -> LoweringTraits:
    return TRAITS.get(node.type, LoweringTraits())


# ---------------------------------------------------------------------------
# Lowering rules of the built-in catalog
# ---------------------------------------------------------------------------


def _per_sample_axis(axis: int) -> int:
    """A per-sample axis (batch excluded) as an axis of the batched tensor."""
    return axis + 1 if axis >= 0 else axis


def _optional(n: NodeLowering, pname: str) -> str | None:
    """A parameter the config may leave out (a bias with bias / qkv_bias false): None then."""
    return n.param(pname) if pname in n.node.op.param_shapes(n.cfg) else None


@register_lowering("linear", positionwise=True)
def _lower_linear(n: NodeLowering) -> list[str]:
    return [n.linear(n.inputs[0], n.param("weight"), _optional(n, "bias"), "linear", out=n.out(0))]


@register_lowering("embedder", positionwise=True)
def _lower_embedder(n: NodeLowering) -> list[str]:
    """Token rows, plus the rows of learned positions this call covers (from the past length on)."""
    if n.cfg["position_encoding"] != "learned":  # "rope" rotates inside the heads; "none" adds nothing
        return [n.op("Gather", [n.param("weight"), n.inputs[0]], "lookup", out=n.out(0), axis=0)]
    tokens = n.op("Gather", [n.param("weight"), n.inputs[0]], "lookup", axis=0)
    positions = n.window(n.param("position"), n.length(n.inputs[0], -1), "position")
    return [n.op("Add", [tokens, positions], "add_position", out=n.out(0))]


@register_lowering("layernorm", positionwise=True)
def _lower_layernorm(n: NodeLowering) -> list[str]:
    return [n.op("LayerNormalization", [n.inputs[0], n.param("weight"), n.param("bias")], "layernorm",
                 out=n.out(0), axis=-1, epsilon=float(n.cfg["eps"]))]


@register_lowering("rmsnorm", positionwise=True)
def _lower_rmsnorm(n: NodeLowering) -> list[str]:
    """x / sqrt(mean(x^2) + eps) * weight (opset 20 has no RMSNormalization; everything is float32 here)."""
    x = n.inputs[0]
    mean_square = n.op("ReduceMean", [n.op("Mul", [x, x], "square"), n.int64s("axes", [-1])], "mean_square",
                       keepdims=1)
    shifted = n.op("Add", [mean_square, n.local_const("eps", np.asarray(n.cfg["eps"], dtype=np.float32))], "plus_eps")
    normed = n.op("Div", [x, n.op("Sqrt", [shifted], "rms")], "normed")
    return [n.op("Mul", [normed, n.param("weight")], "scale", out=n.out(0))]


def _causal_cache(shape: Callable[[Mapping[str, Any]], tuple[int | str, ...]]):
    """A ``kv_cache`` declaration: ``shape(cfg)`` for causal attention; non-causal cannot be cached."""
    return lambda cfg: shape(cfg) if cfg["causal"] else None


def _query_head_traits(node: VNode) -> bool:
    """A query head of a GQA group caches nothing itself: its kv_head hands it every position's keys and
    values (the cached past included), so on a call's new positions alone its output is exact when causal."""
    return bool(node.cfg["kv_input"] and node.cfg["causal"])


def _head_cache(cfg: Mapping[str, Any]) -> tuple[int | str, ...] | None:
    return None if cfg["kv_input"] or not cfg["causal"] else (PAST, cfg["head_dim"])


@register_lowering("attention_head", kv_cache=_head_cache, positionwise=_query_head_traits)
def _lower_attention_head(n: NodeLowering) -> list[str]:
    cfg, x = n.cfg, n.inputs[0]
    seq, hd = cfg["seq_len"], cfg["head_dim"]
    q = n.linear(x, n.param("wq"), _optional(n, "bq"), "q")
    if cfg["position_encoding"] == "rope":
        q = n.rope(q, seq, hd, cfg["rope_theta"], "q", positions=x)
    if cfg["kv_input"]:  # keys (rotated) and values of the group's kv_head, past positions included
        if n._b.decoder:
            _check_kv_source(n.graph, n.node)
        k, v = n.op("Split", [n.inputs[1]], "kv_split", outputs=2, axis=-1, num_outputs=2)
    else:
        k = n.linear(x, n.param("wk"), _optional(n, "bk"), "k")
        v = n.linear(x, n.param("wv"), _optional(n, "bv"), "v")
        if cfg["position_encoding"] == "rope":
            k = n.rope(k, seq, hd, cfg["rope_theta"], "k", positions=x)
        k, v = n.cached(k, v)
    return [n.attend(q, k, v, seq_len=seq, head_dim=hd, causal=cfg["causal"], k_perm=[0, 2, 1],
                     out=n.out(0), positions=x)]


@register_lowering("kv_head", kv_cache=lambda cfg: (PAST, cfg["head_dim"]))
def _lower_kv_head(n: NodeLowering) -> list[str]:
    """concat(K with RoPE, V); in a KV-cache decoder the cached past comes first, so the query heads
    reading it see every position so far (only they may read it: _check_kv_readers)."""
    cfg, x = n.cfg, n.inputs[0]
    k = n.linear(x, n.param("wk"), _optional(n, "bk"), "k")
    v = n.linear(x, n.param("wv"), _optional(n, "bv"), "v")
    if cfg["position_encoding"] == "rope":
        k = n.rope(k, cfg["seq_len"], cfg["head_dim"], cfg["rope_theta"], "k", positions=x)
    if n.cache is not None:
        _check_kv_readers(n.graph, n.node)
    k, v = n.cached(k, v)
    return [n.op("Concat", [k, v], "kv", out=n.out(0), axis=-1)]


def _check_kv_source(graph: Graph, head: VNode) -> None:
    """In a KV-cache decoder a query head sees past positions only through a cached kv_head (through
    broadcasts); keys and values from anything else would cover this call's positions alone."""
    source = kv_source(graph, head)
    if source is None or source.type != "kv_head":
        what = "a network input" if source is None else f"{source.type} '{source.id}'"
        raise node_error(head, f"its keys and values come from {what}, not a kv_head, so a KV cache would not "
                           "hold their past positions")


def _check_kv_readers(graph: Graph, node: VNode) -> None:
    """With a cache a kv_head's value spans past and new positions: a reader other than a query head
    (through broadcasts) would get the wrong number of positions, so the export names it."""
    reader = foreign_kv_reader(graph, node)
    if reader is not None:
        raise node_error(node, f"a kv_head's keys and values are read by {reader.type} '{reader.id}', not only "
                           "by attention_heads with kv_input, so it cannot run on new positions alone for a "
                           "KV cache")


@register_lowering("attention", kv_cache=_causal_cache(lambda cfg: (cfg.get("num_kv_heads") or cfg["num_heads"],
                                                                    PAST, cfg["head_dim"])))
def _lower_attention(n: NodeLowering) -> list[str]:
    """Fused heads: qkv rows are [q heads, k heads, v heads]; head h is columns h*hd:(h+1)*hd.

    With fewer K/V heads (GQA) the queries are grouped ``[B, KV, H/KV, S, hd]``
    against keys and values ``[B, KV, 1, T, hd]``: MatMul broadcasts each K/V
    head over its group, query head ``h`` reading K/V head ``h // (H/KV)``
    without a copy, and the cache holds the KV heads only.
    """
    cfg, x = n.cfg, n.inputs[0]
    seq, heads, hd = cfg["seq_len"], cfg["num_heads"], cfg["head_dim"]
    kv_heads = cfg.get("num_kv_heads") or heads
    qkv = n.linear(x, n.param("qkv_weight"), _optional(n, "qkv_bias"), "qkv")
    sizes = n.int64s("qkv_sizes", [heads * hd, kv_heads * hd, kv_heads * hd])
    parts = n.op("Split", [qkv, sizes], "qkv_split", outputs=3, axis=-1)
    per_head = []
    for name, part, count in zip("qkv", parts, (heads, kv_heads, kv_heads)):
        shaped = n.op("Reshape", [part, n.int64s(f"{name}_heads_shape", [0, 0, count, hd])], f"{name}_heads")
        per_head.append(n.op("Transpose", [shaped], f"{name}_bhsd", perm=[0, 2, 1, 3]))
    q, k, v = per_head
    if cfg["position_encoding"] == "rope":
        q = n.rope(q, seq, hd, cfg["rope_theta"], "q", positions=x, rank=4)
        k = n.rope(k, seq, hd, cfg["rope_theta"], "k", positions=x, rank=4)
    k, v = n.cached(k, v)
    if kv_heads == heads:
        ctx = n.attend(q, k, v, seq_len=seq, head_dim=hd, causal=cfg["causal"], k_perm=[0, 1, 3, 2], positions=x)
    else:
        grouped = n.op("Reshape", [q, n.int64s("q_groups_shape", [0, kv_heads, heads // kv_heads, -1, hd])],
                       "q_groups")
        k, v = (n.op("Unsqueeze", [t, n.int64s(f"{name}_group_axis", [2])], f"{name}_groups")
                for name, t in (("k", k), ("v", v)))
        ctx = n.attend(grouped, k, v, seq_len=seq, head_dim=hd, causal=cfg["causal"], k_perm=[0, 1, 2, 4, 3],
                       positions=x)
        ctx = n.op("Reshape", [ctx, n.int64s("heads_shape", [0, heads, -1, hd])], "ungroup")
    ctx = n.op("Transpose", [ctx], "bshd", perm=[0, 2, 1, 3])
    merged_shape = n.int64s("merged_shape", [0, 0, heads * hd])
    if not cfg["output_projection"]:
        return [n.op("Reshape", [ctx, merged_shape], "merge_heads", out=n.out(0))]
    merged = n.op("Reshape", [ctx, merged_shape], "merge_heads")
    return [n.linear(merged, n.param("out_weight"), n.param("out_bias"), "out", out=n.out(0))]


@register_lowering("tied_lm_head_ce", positionwise=True)
def _lower_tied_lm_head_ce(n: NodeLowering) -> list[str | None]:
    """Inference meaning: logits ``x W^T`` (tied W), mean cross-entropy; each only when read.

    Positionwise as far as the logits go (the loss, a mean over positions, is
    never part of a KV-cache decoder); without the loss the targets input is
    not read, so the model does not ask for it.
    """
    x, targets = n.inputs
    wt = n.op("Transpose", [n.param("weight")], "weight_t", perm=[1, 0])
    want_logits = n.needs(1)
    logits = n.op("MatMul", [x, wt], "logits", out=n.out(1) if want_logits else None)
    if not n.needs(0):
        return [None, logits]
    loss = n.cross_entropy(logits, targets, n.cfg["out_dim"], from_probs=False,
                           ignore_index=n.cfg["ignore_index"], out=n.out(0))
    return [loss, logits if want_logits else None]


@register_lowering("cost")
def _lower_cost(n: NodeLowering) -> list[str]:
    """The inference meaning of a loss: its value on the given predictions and targets."""
    pred, targets = n.inputs
    function = n.cfg["cost_function"]
    if function == "mse":
        diff = n.op("Sub", [pred, targets], "diff")
        sq = n.op("Mul", [diff, diff], "squared")
        return [n.op("ReduceMean", [sq], "mean", out=n.out(0), keepdims=0)]
    classes = n.input_types[0].shape[-1]
    return [n.cross_entropy(pred, targets, classes, from_probs=function == "ce",
                            ignore_index=n.cfg["ignore_index"], out=n.out(0))]


@register_lowering("relu", positionwise=True)
def _lower_relu(n: NodeLowering) -> list[str]:
    return [n.op("Relu", [n.inputs[0]], out=n.out(0))]


@register_lowering("gelu", positionwise=True)
def _lower_gelu(n: NodeLowering) -> list[str]:
    return [n.op("Gelu", [n.inputs[0]], out=n.out(0), approximate=n.cfg["approximate"])]


@register_lowering("silu", positionwise=True)
def _lower_silu(n: NodeLowering) -> list[str]:
    gate = n.op("Sigmoid", [n.inputs[0]], "sigmoid")
    return [n.op("Mul", [n.inputs[0], gate], "silu", out=n.out(0))]


@register_lowering("swiglu", positionwise=True)
def _lower_swiglu(n: NodeLowering) -> list[str]:
    value, gate = n.op("Split", [n.inputs[0]], "halves", outputs=2, axis=-1, num_outputs=2)
    sig = n.op("Sigmoid", [gate], "sigmoid")
    silu = n.op("Mul", [gate, sig], "silu")
    return [n.op("Mul", [value, silu], "gate", out=n.out(0))]


@register_lowering("dropout", positionwise=True)
def _lower_dropout(n: NodeLowering) -> list[str]:
    """Identity at inference; an explicit node so the VNode is visible in Netron."""
    return [n.op("Identity", [n.inputs[0]], out=n.out(0))]


@register_lowering("broadcast", positionwise=True)
def _lower_broadcast(n: NodeLowering) -> list[str]:
    """Fan-out: every output is the input value itself (no ONNX node)."""
    return [n.inputs[0]] * n.node.num_outputs


def _off_sequence_axis(node: VNode) -> bool:
    """A stack joins along the sequence axis (per-sample axis 0) or along features."""
    rank = len(node.outputs[0].shape) if node.outputs else 0
    return rank > 0 and node.cfg["axis"] % rank != 0


@register_lowering("stack", positionwise=_off_sequence_axis)
def _lower_stack(n: NodeLowering) -> list[str]:
    return [n.op("Concat", n.inputs, out=n.out(0), axis=_per_sample_axis(n.cfg["axis"]))]


@register_lowering("add", positionwise=True)
def _lower_add(n: NodeLowering) -> list[str]:
    return [n.op("Add", n.inputs, out=n.out(0))]


# Positionwise: with a symbolic sequence the lowering accepts only a reshape that keeps the sequence axis.
@register_lowering("reshape", positionwise=True)
def _lower_reshape(n: NodeLowering) -> list[str]:
    """Target = 0 (copy the batch dim) + the inferred per-sample shape (any -1 resolved).

    With a symbolic sequence the sequence axis is copied too (a second 0), so
    only a reshape that keeps per-sample axis 0 can be exported that way.
    """
    shape = list(n.node.outputs[0].shape)
    if 0 in shape:
        raise node_error(n.node, f"cannot export a reshape to an empty shape {shape}")
    if not n.dynamic_sequence:
        return [n.op("Reshape", [n.inputs[0], n.int64s("shape", [0, *shape])], out=n.out(0))]
    source = list(n.input_types[0].shape)
    if not (source and shape[0] == source[0]):
        raise node_error(n.node, f"a reshape from {source} to {shape} changes the sequence axis (per-sample axis 0), "
                             "so the model cannot take a dynamic sequence")
    return [n.op("Reshape", [n.inputs[0], n.int64s("shape", [0, 0, *shape[1:]])], out=n.out(0))]


@register_lowering("mask")
def _lower_mask(n: NodeLowering) -> list[str]:
    """Causal: future keys get ``mask_val``; random masking is training-only, so off here.

    The mask is computed for the scores' runtime ``[.., Sq, Sk]`` from two
    position ranges, so it serves any sequence length and the file does not
    grow with ``Sq x Sk``.  Not positionwise: the scores of a KV-cache call
    would need the past length, which a mask node does not see.
    """
    x = n.inputs[0]
    if not n.cfg["causal"]:
        return [n.op("Identity", [x], out=n.out(0))]
    zero = n.const("axes_0_start", np.zeros(1, dtype=np.int64))
    rows = n.positions(zero, n.length(x, -2, "rows"), "rows")
    keys = n.positions(zero, n.length(x, -1, "keys"), "keys")
    column = n.op("Unsqueeze", [rows, n.const("axes_1", np.asarray([1]))], "row_column")
    cut = n.op("Greater", [keys, column], "future")  # computed, not a stored [Sq, Sk] table
    fill = n.local_const("mask_val", np.asarray(n.cfg["mask_val"], dtype=np.float32))
    return [n.op("Where", [cut, fill, x], out=n.out(0))]


def _text_io(n: NodeLowering) -> list[str]:
    raise node_error(n.node, f"a {n.node.type} is text I/O (BPE on strings) and has no ONNX lowering; "
                         "export the network from its token ids on")


register_lowering("tokenizer", _text_io)
register_lowering("detokenizer", _text_io)


# ---------------------------------------------------------------------------
# Boundary VNodes of a partitioned network's part (vgraph/ops/boundary.py)
# ---------------------------------------------------------------------------


@register_lowering("send", positionwise=True)
def _lower_send(n: NodeLowering) -> list[str]:
    """The tensor handed to the peer PNode: the part's output under the send's id."""
    return [n.op("Identity", [n.inputs[0]], out=n.out(0))]


@register_lowering("receive", positionwise=True)
def _lower_receive(n: NodeLowering) -> list[str]:
    """The tensor from the peer PNode arrives as this part's graph input "<id>:in0"."""
    return [n.op("Identity", [n.inputs[0]], out=n.out(0))]


@register_lowering("weight_replica", positionwise=True)
def _lower_weight_replica(n: NodeLowering) -> list[str]:
    """No computation: tied readers resolve the alias to this node's `weight` initializer."""
    return []


def _per_position_codec(node: VNode) -> bool:
    """int8 with one scale per channel spans positions; every other wire format rounds each position alone."""
    return node.cfg["activations"] != "int8" or node.cfg["scale"] == "token"


@register_lowering("compress", positionwise=_per_position_codec)
def _lower_compress(n: NodeLowering) -> list[str]:
    """The activation's wire round trip (inference has no gradient): casts for fp16/bf16; for int8 the
    torch backend's arithmetic op for op (compression.py: max |x| / 127 per group, Round is half to even
    in both, a group holding NaN or infinity becomes NaN), so both give the same bits."""
    x, codec = n.inputs[0], n.cfg["activations"]
    if codec == "none":
        return [n.op("Identity", [x], out=n.out(0))]
    if codec in ("fp16", "bf16"):
        half = n.op("Cast", [x], "wire", to=TensorProto.FLOAT16 if codec == "fp16" else TensorProto.BFLOAT16)
        return [n.op("Cast", [half], out=n.out(0), to=TensorProto.FLOAT)]
    rank = 1 + len(n.input_types[0].shape)
    axes = ([] if rank == 1 else [rank - 1] if n.cfg["scale"] == "token" or rank == 2
            else list(range(1, rank - 1)))
    amax = n.op("Abs", [x], "abs")
    bad = n.op("Cast", [n.op("Or", [n.op("IsNaN", [x], "is_nan"), n.op("IsInf", [x], "is_inf")], "bad")],
               "bad_float", to=TensorProto.FLOAT)
    if axes:
        amax = n.op("ReduceMax", [amax, n.int64s("axes", axes)], "amax", keepdims=1)
        bad = n.op("ReduceMax", [bad, n.int64s("bad_axes", axes)], "group_bad", keepdims=1)
    zero = n.float_const("float32_zero", 0.0)
    scale = n.op("Div", [amax, n.float_const("int8_qmax", 127.0)], "scale")
    usable = n.op("Greater", [scale, zero], "usable")
    safe = n.op("Where", [usable, scale, n.float_const("float32_one", 1.0)], "safe_scale")
    codes = n.op("Clip", [n.op("Round", [n.op("Div", [x, safe], "ratio")], "rounded"),
                          n.float_const("int8_qmin", -127.0), n.float_const("int8_qmax", 127.0)], "codes")
    codes = n.op("Where", [usable, codes, zero], "codes_or_zero")
    y = n.op("Mul", [codes, scale], "dequantized")
    nan = n.local_const("nan", np.asarray(np.nan, dtype=np.float32))  # NaN != NaN: not a shared constant
    return [n.op("Where", [n.op("Greater", [bad, zero], "group_not_finite"), nan, y], out=n.out(0))]
