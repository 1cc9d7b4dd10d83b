"""Lower the vgraph IR straight to an ONNX ``ModelProto`` (no tracing of the torch module).

Why lower from the IR: the ONNX file is an independent second implementation
of vgraph's op semantics, so agreement with the torch backend (see
``check.py``) is evidence that both are right, not that one was copied.

Conventions of the produced model (a user finds every VNode in Netron):

* The value of output slot ``k`` of VNode ``n`` is named ``"n:k"``; a network
  input (an input slot no edge feeds, e.g. token ids) is the graph input
  ``"n:in<k>"``; a value produced outside the lowered node set is the graph
  input ``"src:slot"`` (what ``subgraph.py`` uses for per-PNode parts).
* Every ONNX node is named after its VNode: ``"n"`` for the node that
  produces an output slot, ``"n/<step>"`` for the inner steps; intermediate
  values are ``"n/<step>"`` too.  A ``broadcast`` is pure fan-out and
  produces no node: its outputs reuse the input value's name.
* Parameters are initializers named like checkpoint keys ``"n.<param>"``; a
  tied weight reads its publisher's initializer (one tensor, two readers).
  With ``weights=None`` they become graph inputs of the same names instead,
  so a model of a 45M-parameter network can be built, checked and
  shape-inferred in milliseconds.
* Every graph input/output has ``"batch"`` as its (symbolic) first dimension
  and vgraph's per-sample shape after it; a cost's loss, a mean over the whole
  batch, is a scalar.  With ``sequence=`` (the inference export,
  ``inference.py``) the per-sample axis 0 of every input and output, the
  sequence, is symbolic too, from 1 up to the network's context length:
  position tables (RoPE, learned positions) and causal masks are built for the
  context length and sliced to the positions a call covers.
* With ``kv_cache=True`` every attention VNode whose lowering declares a
  cache takes its past keys and values as graph inputs ``"past_key:<vnode>"``
  and ``"past_value:<vnode>"`` and returns them extended by this call's
  positions as ``"present_key:<vnode>"`` and ``"present_value:<vnode>"``; the
  new positions start at the past length (RoPE angles and the causal mask
  are offset by it).  Every other VNode must be declared ``positionwise``
  (its output at a position reads only that position), else the export is
  refused naming it: running it on the new positions alone would be wrong.
* Computation is in float32 whatever precision the YAML declares (costs are
  float32 anyway): the export is for checking and running inference, and
  float32 is the precision every runtime supports on every device.

Lowering rules live in ``LOWERINGS``, keyed by canonical op name; a plugin op
adds its own with :func:`register_lowering`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from vgraph import Graph, TensorType, VGraphError, VNode
from vgraph.base.diagnostics import Diagnostic
from vgraph.plugins import require_lowering

__all__ = [
    "OPSET",
    "BATCH_DIM",
    "SEQUENCE_DIM",
    "PAST_DIM",
    "TOTAL_DIM",
    "PAST",
    "LOWERINGS",
    "TRAITS",
    "LoweringTraits",
    "CacheSlot",
    "NodeLowering",
    "register_lowering",
    "lower_network",
    "build_model",
    "value_name",
    "input_name",
    "param_key",
    "network_input_type",
    "context_length",
    "onnx_dims",
    "expected_param_shapes",
]

#: ONNX opset of the produced models: 20 has the exact (erf) ``Gelu`` and
#: ``LayerNormalization``; everything else needed is older.
OPSET = 20
#: Name of the symbolic batch dimension of every graph input and output.
BATCH_DIM = "batch"
#: Symbolic dimensions of the inference export: this call's positions, the cached ones, and both.
SEQUENCE_DIM = "sequence"
PAST_DIM = "past_sequence"
TOTAL_DIM = "total_sequence"
#: Marks the growing axis in a lowering's declared cache shape (see ``LoweringTraits.kv_cache``).
PAST = "past"

_ELEM_TYPE = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "string": TensorProto.STRING}


def value_name(node_id: str, slot: int) -> str:
    """ONNX name of output ``slot`` of VNode ``node_id`` (also a boundary tensor's name)."""
    return f"{node_id}:{slot}"


def input_name(node_id: str, slot: int) -> str:
    """ONNX name of the network input fed into input ``slot`` of VNode ``node_id``."""
    return f"{node_id}:in{slot}"


def param_key(node_id: str, param: str) -> str:
    """Initializer / checkpoint key of a parameter."""
    return f"{node_id}.{param}"


def _error(node: VNode, message: str) -> VGraphError:
    return VGraphError([Diagnostic(message, node.loc, node.id)])


def network_input_type(graph: Graph, node: VNode, slot: int) -> TensorType:
    """Per-sample type of an unconnected input slot, as vgraph's verifier infers it."""
    if node.input_shapes is not None and slot < len(node.input_shapes):
        kind = node.op.kind_of_input(node.cfg, slot)
        dtype = {"int": "int64", "str": "string"}.get(kind, "float32")
        return TensorType(tuple(node.input_shapes[slot]), dtype)
    known: list[TensorType | None] = []
    for s in range(slot):
        edge = graph.input_edge(node.id, s)
        if edge is not None:
            known.append(graph.node(edge.src).outputs[edge.src_slot])
        else:
            known.append(network_input_type(graph, node, s))
    t = node.op.network_input(node.cfg, slot, known) if node.op.network_input else None
    if t is None:
        raise _error(node, f"input {slot} is not connected and its type cannot be known")
    return t


def expected_param_shapes(graph: Graph, node_ids: Iterable[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter key the lowering of ``node_ids`` reads, with its shape.

    Tied weights appear under their publisher's key (``"<publisher>.weight"``),
    which is how checkpoints store them.
    """
    ids = [n.id for n in graph.nodes] if node_ids is None else list(node_ids)
    publishers = graph.publishers()
    out: dict[str, tuple[int, ...]] = {}
    for node_id in ids:
        node = graph.node(node_id)
        for pname, shape in node.op.param_shapes(node.cfg).items():
            out[param_key(node.id, pname)] = tuple(shape)
        for pname, (alias, shape) in node.op.tied(node.cfg).items():
            pub = publishers.get(alias)
            if pub is not None:
                out[param_key(pub.id, "weight")] = tuple(shape)
    return out


# ---------------------------------------------------------------------------
# The per-node view a lowering rule works with
# ---------------------------------------------------------------------------


class NodeLowering:
    """What a lowering rule sees of one VNode, and how it emits ONNX nodes.

    A rule reads ``inputs`` (ONNX value names, one per input slot) and
    ``input_types`` (per-sample vgraph types), emits nodes with :meth:`op`,
    and returns one value name per output slot (``None`` for a slot nobody
    reads, see :meth:`needs`).  Returning an existing name (e.g. an input) is
    allowed: the value is simply shared.
    """

    def __init__(self, builder: _ModelBuilder, node: VNode, inputs: list[str],
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
                raise _error(self.node, f"tie_weight_alias {alias!r} has no publisher")
            return self._b.param(param_key(pub.id, "weight"), shape, self.node)
        shapes = self.node.op.param_shapes(self.cfg)
        if pname not in shapes:
            raise _error(self.node, f"a {self.node.type} has no parameter {pname!r}")
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

    # -- shared building blocks ----------------------------------------------
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
        positions): the positions this call covers.  Shared by every reader of the same table and length."""
        def make() -> str:
            start = self.past_length()
            stop = self._b.memo(("stop", length), lambda: self.op("Add", [start, length], f"{tag}_stop"))
            return self.op("Slice", [table, start, stop, self.const(f"axes_{axis}", np.asarray([axis]))],
                           f"{tag}_window")

        return self._b.memo(("window", table, length, axis), make)

    def rope(self, x: str, seq_len: int, head_dim: int, theta: float, tag: str, *,
             positions: str | None = None) -> str:
        """Rotate-half RoPE (GPT-NeoX / Llama) of ``x[..., S, hd]`` with float64-built tables.

        The tables cover ``seq_len`` positions (the context length); a call
        takes the rows of its own positions, from the past length on: as many
        as ``positions`` (default ``x``) has along axis -2.
        """
        cos, sin = _rope_tables(seq_len, head_dim, theta)
        key = f"rope_s{seq_len}_d{head_dim}_theta{theta:g}"
        length = self.length(positions or x, -2)
        cos_name = self.window(self.const(f"{key}_cos", cos), length, "rope_cos")
        sin_name = self.window(self.const(f"{key}_sin", sin), length, "rope_sin")
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


def _reserve(taken: set[str], name: str) -> str:
    """`name`, or `name_1`, `name_2`, ... not in `taken`, which it joins."""
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


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


@dataclass(frozen=True)
class CacheSlot:
    """One cached VNode's graph inputs and outputs in a KV-cache decoder.

    ``shape`` is the per-sample cache shape with ``PAST`` at ``axis``; past
    and present tensors are ``[batch, *shape]``.
    """

    node: str
    shape: tuple[int | str, ...]

    @property
    def axis(self) -> int:
        return self.shape.index(PAST)

    @property
    def past_key(self) -> str:
        return f"past_key:{self.node}"

    @property
    def past_value(self) -> str:
        return f"past_value:{self.node}"

    @property
    def present_key(self) -> str:
        return f"present_key:{self.node}"

    @property
    def present_value(self) -> str:
        return f"present_value:{self.node}"

    def dims(self, growing: str, batch_dim: str = BATCH_DIM) -> list[int | str]:
        return [batch_dim, *(growing if d == PAST else d for d in self.shape)]

    def describe(self) -> dict[str, Any]:
        """The model metadata entry (``vgraph.kv_cache``) a runtime reads to feed and carry the cache."""
        return {"node": self.node, "past_key": self.past_key, "past_value": self.past_value,
                "present_key": self.present_key, "present_value": self.present_value,
                "shape": [PAST_DIM if d == PAST else d for d in self.shape], "axis": self.axis + 1}


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
# Building the model
# ---------------------------------------------------------------------------


@dataclass
class _ModelBuilder:
    graph: Graph
    weights: Mapping[str, np.ndarray] | None
    needed: set[tuple[str, int]]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: dict[str, onnx.TensorProto] = field(default_factory=dict)
    inputs: dict[str, onnx.ValueInfoProto] = field(default_factory=dict)
    used_names: set[str] = field(default_factory=set)
    node_names: set[str] = field(default_factory=set)
    const_values: dict[str, np.ndarray] = field(default_factory=dict)
    publishers: dict[str, VNode] = field(default_factory=dict)
    sequence: str | None = None  # the symbolic sequence dimension, None: shapes as the IR infers them
    caches: dict[str, CacheSlot] = field(default_factory=dict)  # VNode id -> its KV cache (decoder export)
    decoder: bool = False  # a KV-cache decoder: each call runs its new positions only
    _past: str | None = None

    _memo: dict[tuple, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.publishers = self.graph.publishers()

    def memo(self, key: tuple, make: Callable[[], str]) -> str:
        """A derived value (a length, a table window) made once per model and shared by every reader."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def past_length(self) -> str:
        """int64 [1]: the cache's past length (the first cache's growing axis), or a constant 0."""
        if self._past is None:
            if not self.caches:
                self._past = self.const("axes_0_start", np.zeros(1, dtype=np.int64))
            else:
                slot = next(iter(self.caches.values()))
                self._past = self.unique("past_length")
                node = helper.make_node("Shape", [slot.past_key], [self._past], name=self.unique_node("past_length"),
                                        start=slot.axis + 1, end=slot.axis + 2)
                node.doc_string = "positions already in the KV cache"
                self.nodes.append(node)
        return self._past

    def unique(self, name: str) -> str:
        return _reserve(self.used_names, name)

    def unique_node(self, name: str) -> str:
        return _reserve(self.node_names, name)

    @staticmethod
    def doc_of(node: VNode) -> str:
        where = f" ({node.loc})" if node.loc else ""
        return f"{node.type} '{node.id}'{where}"

    def param(self, key: str, shape: tuple[int, ...], reader: VNode) -> str:
        if key in self.initializers or key in self.inputs:
            return key
        shape = tuple(int(d) for d in shape)
        if self.weights is None:
            self.inputs[key] = helper.make_tensor_value_info(key, TensorProto.FLOAT, list(shape))
            return key
        if key not in self.weights:
            raise _error(reader, f"no weights for parameter {key!r} (expected shape {list(shape)}); "
                                 "the checkpoint does not match this network")
        array = np.asarray(self.weights[key])
        if tuple(array.shape) != shape:
            raise _error(reader, f"weights for {key!r} have shape {list(array.shape)} but the network "
                                 f"needs {list(shape)}")
        self.initializers[key] = numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), key)
        return key

    def const(self, name: str, value: np.ndarray) -> str:
        value = np.asarray(value)
        if name in self.const_values:
            if not np.array_equal(self.const_values[name], value):
                raise ValueError(f"constant {name!r} defined twice with different values")
            return name
        self.const_values[name] = value
        self.used_names.add(name)
        self.initializers[name] = numpy_helper.from_array(value, name)
        return name


def onnx_dims(graph: Graph, node_id: str, slot: int, batch_dim: str = BATCH_DIM) -> list[int | str]:
    """ONNX shape of output ``slot`` of ``node_id``: the batch dim, then the per-sample shape.

    The one exception is a cost's loss: a scalar mean over the whole batch,
    so it has no batch dimension.
    """
    node = graph.node(node_id)
    t = node.outputs[slot]
    if node.op.is_cost and t.shape == ():
        return []
    return [batch_dim, *t.shape]


def _value_info(name: str, t: TensorType, dims: list[int | str], doc: str = "") -> onnx.ValueInfoProto:
    dtype = t.dtype if t.kind != "float" else "float32"
    vi = helper.make_tensor_value_info(name, _ELEM_TYPE[dtype], dims)
    vi.doc_string = doc
    return vi


def build_model(
    graph: Graph,
    node_ids: Iterable[str] | None = None,
    *,
    weights: Mapping[str, np.ndarray] | None = None,
    outputs: Sequence[tuple[str, int]] | None = None,
    output_docs: Mapping[tuple[str, int], str] | None = None,
    batch_dim: str = BATCH_DIM,
    opset: int = OPSET,
    model_name: str | None = None,
    sequence: str | None = None,
    kv_cache: bool = False,
) -> onnx.ModelProto:
    """Lower the VNodes ``node_ids`` (default: all) of a verified ``graph`` to one ONNX model.

    Inputs are derived, in this order: values produced by VNodes outside
    ``node_ids`` (``"src:slot"``), unconnected input slots (``"n:in<k>"``)
    that some lowering reads, then parameters when ``weights`` is None
    (``"n.<param>"``), then past keys and values with ``kv_cache``.
    ``outputs`` lists the ``(node, slot)`` values to expose as graph outputs
    (named ``"node:slot"``); default: the network's outputs and costs.
    ``sequence`` names a symbolic sequence dimension (see the module doc);
    ``kv_cache`` needs it.
    """
    if opset < 18:
        raise ValueError(f"the ONNX lowering needs opset >= 18; got {opset}")
    if kv_cache and sequence is None:
        raise ValueError("a KV-cache decoder needs a symbolic sequence dimension (sequence=...)")
    order = _lowered_nodes(graph, node_ids)
    ids = {n.id for n in order}
    if outputs is None:
        outputs = [(ep.node, ep.slot) for ep in [*graph.outputs, *graph.costs]]
    outputs = list(dict.fromkeys((str(n), int(s)) for n, s in outputs))
    for node_id, slot in outputs:
        if node_id not in ids:
            raise VGraphError(f"output {node_id}:{slot} is produced by a VNode outside the exported set")

    needed = set(outputs)
    for n in order:
        for e in graph.in_edges(n.id):
            needed.add((e.src, e.src_slot))
    b = _ModelBuilder(graph, weights, needed, sequence=sequence)
    io = _GraphIO(b, batch_dim, context_length(graph, order) if sequence else None)
    if kv_cache:
        b.caches, b.decoder = _cache_slots(order), True
    env = _lower_nodes(b, io, order)
    graph_outputs = io.outputs(outputs, env, dict(output_docs or {}))
    onnx_graph = helper.make_graph(
        b.nodes, model_name or graph.name, io.graph_inputs(), graph_outputs,
        initializer=list(b.initializers.values()))
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(onnx_graph, opset_imports=opsets, producer_name="vgraph",
                              producer_version=_vgraph_version())
    model.ir_version = helper.find_min_ir_version_for(opsets)
    model.doc_string = f"network {graph.name!r} lowered by vgraph from its IR"
    return model


def _lower_nodes(b: _ModelBuilder, io: _GraphIO, order: Sequence[VNode]) -> dict[tuple[str, int], str]:
    """Run each VNode's rule in topological order; (node, slot) -> the ONNX value of that output."""
    ids = {n.id for n in order}
    env: dict[tuple[str, int], str] = {}
    for n in order:
        ins, types = io.inputs_of(n, ids, env)
        rule = require_lowering("onnx", n, LOWERINGS)
        for slot in range(n.num_outputs):
            b.used_names.add(value_name(n.id, slot))
        results = list(rule(NodeLowering(b, n, ins, types)))
        if len(results) != n.num_outputs:
            raise AssertionError(f"lowering of {n.type} returned {len(results)} values for "
                                 f"{n.num_outputs} outputs")
        for slot, name in enumerate(results):
            if name is None:
                if (n.id, slot) in b.needed:
                    raise AssertionError(f"lowering of {n.type} did not compute needed output {slot}")
                continue
            env[(n.id, slot)] = name
    return env


def _lowered_nodes(graph: Graph, node_ids: Iterable[str] | None) -> list[VNode]:
    """The VNodes to lower, in topological order; unknown ids and unverified nodes are errors."""
    ids = set(n.id for n in graph.nodes) if node_ids is None else set(node_ids)
    unknown = ids - {n.id for n in graph.nodes}
    if unknown:
        raise VGraphError(f"no such VNode(s) in network {graph.name!r}: {', '.join(sorted(unknown))}")
    order = [n for n in graph.topo_order() if n.id in ids]
    for n in order:
        if not n.outputs and n.num_outputs:
            raise _error(n, "node has no inferred types; run vgraph.verify(graph) first")
    return order


def context_length(graph: Graph, order: Sequence[VNode] | None = None) -> int:
    """The sequence length the network is built for: axis 0 of its first network input (of ``order``)."""
    for n in (graph.topo_order() if order is None else order):
        for slot in range(graph.num_inputs(n.id)):
            if graph.input_edge(n.id, slot) is None:
                t = network_input_type(graph, n, slot)
                if not t.shape:
                    raise _error(n, f"network input {slot} is a scalar: the model has no sequence axis")
                return int(t.shape[0])
    raise VGraphError(f"network {graph.name!r} has no network input, so no sequence axis to make dynamic")


def _cache_slots(order: Sequence[VNode]) -> dict[str, CacheSlot]:
    """Every cached VNode's slot; a VNode neither cached nor positionwise is refused, all named at once."""
    slots: dict[str, CacheSlot] = {}
    problems: list[Diagnostic] = []
    for n in order:
        require_lowering("onnx", n, LOWERINGS)  # loads a plugin's lowering, and with it its traits
        traits = traits_of(n)
        shape = traits.cache_shape(n)
        if shape is not None:
            if list(shape).count(PAST) != 1:
                raise _error(n, f"the onnx lowering of {n.type!r} declares a cache shape {list(shape)} "
                                f"without exactly one {PAST!r} axis")
            slots[n.id] = CacheSlot(n.id, tuple(shape))
        elif not traits.is_positionwise(n):
            why = ("it attends without a causal mask, so earlier outputs would change with later tokens"
                   if n.type in ("attention", "attention_head") else
                   f"its onnx lowering declares neither positionwise=True (each position computed from "
                   f"that position alone) nor a kv_cache")
            problems.append(Diagnostic(f"a {n.type} cannot run on new positions alone for a KV cache: {why}",
                                       n.loc, n.id))
    if problems:
        raise VGraphError(problems)
    return slots


class _GraphIO:
    """The graph inputs and outputs of a model being built, with their dims (symbolic sequence or not)."""

    def __init__(self, b: _ModelBuilder, batch_dim: str, context: int | None) -> None:
        self.b, self.batch_dim, self.context = b, batch_dim, context
        self.boundary: dict[str, onnx.ValueInfoProto] = {}  # values made by VNodes outside the set
        self.network: dict[str, onnx.ValueInfoProto] = {}  # unconnected input slots

    def dims(self, node: VNode, shape: Sequence[int], what: str) -> list[int | str]:
        """``[batch, *shape]``, with the sequence axis symbolic when the model has one."""
        if self.context is None:
            return [self.batch_dim, *shape]
        if not shape or shape[0] != self.context:
            raise _error(node, f"{what} has per-sample shape {list(shape)}, whose first axis is not the "
                               f"sequence (length {self.context}): the model cannot take a dynamic sequence")
        return [self.batch_dim, self.b.sequence, *shape[1:]]

    def inputs_of(self, n: VNode, ids: set[str], env: Mapping[tuple[str, int], str]
                  ) -> tuple[list[str], list[TensorType]]:
        graph, b = self.b.graph, self.b
        ins: list[str] = []
        types: list[TensorType] = []
        for slot in range(graph.num_inputs(n.id)):
            edge = graph.input_edge(n.id, slot)
            if edge is None:
                t = network_input_type(graph, n, slot)
                name = input_name(n.id, slot)
                if self.context is not None and t.kind == "float" and len(t.shape) < 2:
                    raise _error(n, f"network input {slot} has per-sample shape {list(t.shape)}: float inputs with "
                                    "a sequence are [sequence, features], so the model cannot take a dynamic "
                                    "sequence")
                if name not in self.network:
                    self.network[name] = _value_info(name, t, self.dims(n, t.shape, f"network input {slot}"),
                                                     f"network input {slot} of {b.doc_of(n)}")
                    b.used_names.add(name)
            else:
                t = graph.node(edge.src).outputs[edge.src_slot]
                key = (edge.src, edge.src_slot)
                if edge.src in ids:
                    name = env[key]
                else:
                    name = value_name(*key)
                    if name not in self.boundary:
                        dims = (onnx_dims(graph, *key, self.batch_dim) if self.context is None else
                                self.dims(graph.node(edge.src), t.shape, f"output {edge.src_slot}"))
                        self.boundary[name] = _value_info(name, t, dims, f"boundary tensor: output "
                                                                           f"{edge.src_slot} of '{edge.src}'")
                        b.used_names.add(name)
            ins.append(name)
            types.append(t)
        return ins, types

    def outputs(self, wanted: Sequence[tuple[str, int]], env: Mapping[tuple[str, int], str],
                docs: Mapping[tuple[str, int], str]) -> list[onnx.ValueInfoProto]:
        b, graph = self.b, self.b.graph
        out = []
        for node_id, slot in wanted:
            name = value_name(node_id, slot)
            if env[(node_id, slot)] != name:  # a shared (aliased) value: give it its own name
                node = helper.make_node("Identity", [env[(node_id, slot)]], [name],
                                        name=b.unique_node(f"{node_id}/out{slot}"))
                node.doc_string = b.doc_of(graph.node(node_id))
                b.nodes.append(node)
            dims = onnx_dims(graph, node_id, slot, self.batch_dim)
            if self.context is not None and dims:
                dims = self.dims(graph.node(node_id), graph.node(node_id).outputs[slot].shape, f"output {slot}")
            out.append(_value_info(name, graph.node(node_id).outputs[slot], dims, docs.get((node_id, slot), "")))
        for slot in b.caches.values():
            for name, what in ((slot.present_key, "keys"), (slot.present_value, "values")):
                vi = helper.make_tensor_value_info(name, TensorProto.FLOAT, slot.dims(TOTAL_DIM, self.batch_dim))
                vi.doc_string = f"{what} of '{slot.node}' for every position so far: the next call's past {what}"
                out.append(vi)
        return out

    def graph_inputs(self) -> list[onnx.ValueInfoProto]:
        """Every input some ONNX node reads (an unread network input, e.g. targets of a loss that is not
        exported, is left out), then parameters and past caches."""
        read = {name for node in self.b.nodes for name in node.input}
        inputs = [vi for vi in [*self.boundary.values(), *self.network.values()] if vi.name in read]
        caches = []
        for slot in self.b.caches.values():
            for name, what in ((slot.past_key, "keys"), (slot.past_value, "values")):
                vi = helper.make_tensor_value_info(name, TensorProto.FLOAT, slot.dims(PAST_DIM, self.batch_dim))
                vi.doc_string = f"cached {what} of '{slot.node}' (RoPE applied), {PAST_DIM} positions; empty at first"
                caches.append(vi)
        return [*inputs, *self.b.inputs.values(), *caches]


def _vgraph_version() -> str:
    import vgraph

    return vgraph.__version__


def lower_network(
    graph: Graph,
    weights: Mapping[str, np.ndarray] | None = None,
    *,
    batch_dim: str = BATCH_DIM,
    opset: int = OPSET,
) -> onnx.ModelProto:
    """The whole network as one ONNX model whose outputs are its outputs and costs.

    Graph outputs are named ``"node:slot"``; the endpoint names (``logits``,
    ``ce_loss``) are in each output's doc string and in the model metadata
    ``vgraph.endpoints`` (JSON ``{name: value}``).  Metrics are training-side
    quantities (learning rate, ...) and are not exported.
    """
    endpoints = {ep.name: value_name(ep.node, ep.slot) for ep in [*graph.outputs, *graph.costs]}
    docs: dict[tuple[str, int], str] = {}
    for ep in graph.outputs:
        docs[(ep.node, ep.slot)] = f"output {ep.name!r}"
    for ep in graph.costs:
        docs[(ep.node, ep.slot)] = f"cost {ep.name!r}"
    model = build_model(graph, weights=weights, output_docs=docs, batch_dim=batch_dim, opset=opset)
    helper.set_model_props(model, {"vgraph.network": graph.name,
                                   "vgraph.endpoints": json.dumps(endpoints, sort_keys=True),
                                   "vgraph.compute_dtype": "float32"})
    return model


# ---------------------------------------------------------------------------
# Constant tables (built in float64, as the torch kernels do)
# ---------------------------------------------------------------------------


def _rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[S, hd]`` of the rotate-half convention (see backends/torch/kernels.py)."""
    inv_freq = float(theta) ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


#: Added to scores of future keys.  Finite, so no runtime ever computes
#: ``-inf - -inf``; after the row max is subtracted ``exp`` underflows to an
#: exact 0 in float32, the same result as the reference's ``-inf`` fill.
CAUSAL_MASK_VALUE = -1e9


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
    source = graph.producer(head.id, 1)
    while source is not None and source.type == "broadcast":
        source = graph.producer(source.id, 0)
    if source is None or source.type != "kv_head":
        what = "a network input" if source is None else f"{source.type} '{source.id}'"
        raise _error(head, f"its keys and values come from {what}, not a kv_head, so a KV cache would not "
                           "hold their past positions")


def _check_kv_readers(graph: Graph, node: VNode) -> None:
    """With a cache a kv_head's value spans past and new positions: a reader other than a query head
    (through broadcasts) would get the wrong number of positions, so the export names it."""
    todo = [e.dst for e in graph.out_edges(node.id)]
    while todo:
        reader = graph.node(todo.pop())
        if reader.type == "broadcast":
            todo.extend(e.dst for e in graph.out_edges(reader.id))
        elif not (reader.type == "attention_head" and reader.cfg["kv_input"]):
            raise _error(node, f"a kv_head's keys and values are read by {reader.type} '{reader.id}', not only "
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
        q = n.rope(q, seq, hd, cfg["rope_theta"], "q", positions=x)
        k = n.rope(k, seq, hd, cfg["rope_theta"], "k", positions=x)
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
        raise _error(n.node, f"cannot export a reshape to an empty shape {shape}")
    if not n.dynamic_sequence:
        return [n.op("Reshape", [n.inputs[0], n.int64s("shape", [0, *shape])], out=n.out(0))]
    source = list(n.input_types[0].shape)
    if not (source and shape[0] == source[0]):
        raise _error(n.node, f"a reshape from {source} to {shape} changes the sequence axis (per-sample axis 0), "
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
    raise _error(n.node, f"a {n.node.type} is text I/O (BPE on strings) and has no ONNX lowering; "
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
