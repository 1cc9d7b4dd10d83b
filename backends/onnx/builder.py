"""The ONNX model under construction: its nodes, initializers, parameter inputs and unique names.

Shared by the driver (``lower.py``, which creates one per model) and the
per-node view the op lowerings write through (``ops.NodeLowering``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from vgraph import Graph, VNode

from .names import CacheSlot, node_error

__all__ = ["ModelBuilder"]


def _reserve(taken: set[str], name: str) -> str:
    """`name`, or `name_1`, `name_2`, ... not in `taken`, which it joins."""
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


@dataclass
class ModelBuilder:
    """One model being built; names are made unique here, constants deduplicated by name."""

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
    # The serving layout's inputs (``serving.py``): int64 [batch, sequence] positions of this call's tokens and
    # int64 [batch, past + sequence] 1/0 for real/padding keys; None: positions from the past length, no padding.
    position_ids: str | None = None
    attention_mask: str | None = None
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
            raise node_error(reader, f"no weights for parameter {key!r} (expected shape {list(shape)}); "
                                 "the checkpoint does not match this network")
        array = np.asarray(self.weights[key])
        if tuple(array.shape) != shape:
            raise node_error(reader, f"weights for {key!r} have shape {list(array.shape)} but the network "
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
