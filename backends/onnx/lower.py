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

This module is the driver (which VNodes, in which order, the graph's inputs
and outputs); the rules live in ``ops.py`` (``LOWERINGS``, keyed by canonical
op name; a plugin op adds its own with ``register_lowering``), the building
blocks they share in ``kernels.py``, the model under construction in
``builder.py`` and the names of what a model exposes in ``names.py``.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from vgraph import Graph, TensorType, VGraphError, VNode
from vgraph.base.diagnostics import Diagnostic
from vgraph.plugins import require_lowering

from .builder import ModelBuilder
from .names import (ATTENTION_MASK, BATCH_DIM, PAST, PAST_DIM, POSITION_IDS, TOTAL_DIM, CacheSlot, input_name,
                    node_error, param_key, value_name)
from .ops import LOWERINGS, NodeLowering, traits_of

__all__ = [
    "OPSET",
    "lower_network",
    "build_model",
    "network_input_type",
    "context_length",
    "onnx_dims",
    "expected_param_shapes",
]

#: ONNX opset of the produced models: 20 has the exact (erf) ``Gelu`` and
#: ``LayerNormalization``; everything else needed is older.
OPSET = 20

_ELEM_TYPE = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "string": TensorProto.STRING}


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
        raise node_error(node, f"input {slot} is not connected and its type cannot be known")
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
    padding: bool = False,
) -> onnx.ModelProto:
    """Lower the VNodes ``node_ids`` (default: all) of a verified ``graph`` to one ONNX model.

    Inputs are derived, in this order: values produced by VNodes outside
    ``node_ids`` (``"src:slot"``), unconnected input slots (``"n:in<k>"``)
    that some lowering reads, then parameters when ``weights`` is None
    (``"n.<param>"``), then past keys and values with ``kv_cache``.
    ``outputs`` lists the ``(node, slot)`` values to expose as graph outputs
    (named ``"node:slot"``); default: the network's outputs and costs.
    ``sequence`` names a symbolic sequence dimension (see the module doc);
    ``kv_cache`` needs it.  ``padding`` adds the inputs ``position_ids``
    ``[batch, sequence]`` and ``attention_mask`` ``[batch, total_sequence]``
    (int64), through which a batch of left-padded prompts of different
    lengths runs as each prompt would alone (``serving.py``); it needs
    ``kv_cache``.
    """
    if opset < 18:
        raise ValueError(f"the ONNX lowering needs opset >= 18; got {opset}")
    if kv_cache and sequence is None:
        raise ValueError("a KV-cache decoder needs a symbolic sequence dimension (sequence=...)")
    if padding and not kv_cache:
        raise ValueError("position_ids and attention_mask are inputs of a KV-cache decoder (kv_cache=True)")
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
    b = ModelBuilder(graph, weights, needed, sequence=sequence)
    io = _GraphIO(b, batch_dim, context_length(graph, order) if sequence else None)
    if kv_cache:
        b.caches, b.decoder = _cache_slots(order), True
    if padding:
        b.position_ids, b.attention_mask = POSITION_IDS, ATTENTION_MASK
        b.used_names.update((POSITION_IDS, ATTENTION_MASK))
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


def _lower_nodes(b: ModelBuilder, io: _GraphIO, order: Sequence[VNode]) -> dict[tuple[str, int], str]:
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
            raise node_error(n, "node has no inferred types; run vgraph.verify(graph) first")
    return order


def context_length(graph: Graph, order: Sequence[VNode] | None = None) -> int:
    """The sequence length the network is built for: axis 0 of its first network input (of ``order``)."""
    for n in (graph.topo_order() if order is None else order):
        for slot in range(graph.num_inputs(n.id)):
            if graph.input_edge(n.id, slot) is None:
                t = network_input_type(graph, n, slot)
                if not t.shape:
                    raise node_error(n, f"network input {slot} is a scalar: the model has no sequence axis")
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
                raise node_error(n, f"the onnx lowering of {n.type!r} declares a cache shape {list(shape)} "
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

    def __init__(self, b: ModelBuilder, batch_dim: str, context: int | None) -> None:
        self.b, self.batch_dim, self.context = b, batch_dim, context
        self.boundary: dict[str, onnx.ValueInfoProto] = {}  # values made by VNodes outside the set
        self.network: dict[str, onnx.ValueInfoProto] = {}  # unconnected input slots

    def dims(self, node: VNode, shape: Sequence[int], what: str) -> list[int | str]:
        """``[batch, *shape]``, with the sequence axis symbolic when the model has one."""
        if self.context is None:
            return [self.batch_dim, *shape]
        if not shape or shape[0] != self.context:
            raise node_error(node, f"{what} has per-sample shape {list(shape)}, whose first axis is not the "
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
                    raise node_error(n, f"network input {slot} has per-sample shape {list(t.shape)}: float inputs with "
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
        padding = [helper.make_tensor_value_info(name, TensorProto.INT64, dims)
                   for name, dims in ((self.b.attention_mask, [self.batch_dim, TOTAL_DIM]),
                                      (self.b.position_ids, [self.batch_dim, self.b.sequence])) if name]
        return [*inputs, *padding, *self.b.inputs.values(), *caches]


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
