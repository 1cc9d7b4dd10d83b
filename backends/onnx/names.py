"""The names of what an ONNX export exposes: values, network inputs, parameters, symbolic dimensions, caches.

One module for them because every part of the backend (the driver, the op
lowerings, subgraph pieces, the inference export and its runtime) must agree
on them; see ``lower.py``'s module doc for the conventions themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vgraph import VGraphError, VNode
from vgraph.base.diagnostics import Diagnostic

__all__ = ["ATTENTION_MASK", "POSITION_IDS", "BATCH_DIM", "SEQUENCE_DIM", "PAST_DIM", "TOTAL_DIM", "PAST", "CacheSlot", "value_name", "input_name",
           "param_key", "node_error"]

#: Name of the symbolic batch dimension of every graph input and output.
BATCH_DIM = "batch"
#: Symbolic dimensions of the inference export: this call's positions, the cached ones, and both.
SEQUENCE_DIM = "sequence"
PAST_DIM = "past_sequence"
TOTAL_DIM = "total_sequence"
#: The inputs of the serving layout (``serving.py``), named as Hugging Face's decoders name them.
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
#: Marks the growing axis in a lowering's declared cache shape (see ``LoweringTraits.kv_cache``).
PAST = "past"


def value_name(node_id: str, slot: int) -> str:
    """ONNX name of output ``slot`` of VNode ``node_id`` (also a boundary tensor's name)."""
    return f"{node_id}:{slot}"


def input_name(node_id: str, slot: int) -> str:
    """ONNX name of the network input fed into input ``slot`` of VNode ``node_id``."""
    return f"{node_id}:in{slot}"


def param_key(node_id: str, param: str) -> str:
    """Initializer / checkpoint key of a parameter."""
    return f"{node_id}.{param}"


def node_error(node: VNode, message: str) -> VGraphError:
    """The diagnostic of a VNode the export cannot lower, naming it and its YAML line."""
    return VGraphError([Diagnostic(message, node.loc, node.id)])


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
