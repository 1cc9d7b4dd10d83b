"""ONNX backend: lower the vgraph IR (or one PNode's part of it) to ONNX, and check it.

* ``lower``: IR -> ``onnx.ModelProto`` straight from the IR (the driver); weights
  are a plain ``{"<vnode>.<param>": numpy array}`` mapping, so lowering needs no torch.
* ``ops``: one rule per op type (``register_lowering`` adds a plugin op's rule)
  and the per-node view they write through; ``kernels``: the building blocks
  rules share (RoPE, attention, cross-entropy); ``builder``: the model under
  construction; ``names``: the names of what a model exposes.
* ``subgraph``: any set of VNodes as its own model, boundary tensors named
  ``"<producer>:<slot>"``; splitting a partition into runnable pieces.
* ``inference``: the served model (logits, dynamic batch and sequence, a KV
  cache) and ``Decoder``, which samples through it.
* ``serving``: that decoder in the layout Optimum and onnxruntime-genai read
  (``export-onnx --serving``), the configs beside it, and ``ServingDecoder``.
* ``check``: the torch backend vs onnxruntime on the same inputs.
* ``cli``: ``vgraph export-onnx`` and ``vgraph check-onnx``.
"""
from __future__ import annotations

from .lower import OPSET, build_model, context_length, expected_param_shapes, lower_network, onnx_dims
from .names import BATCH_DIM, PAST, SEQUENCE_DIM, input_name, param_key, value_name
from .ops import LOWERINGS, NodeLowering, register_lowering
from .inference import Decoder, inference_outputs, lower_inference
from .serving import ServingDecoder, lower_serving
from .subgraph import (Boundary, Piece, boundary, export_pieces, export_subgraph, run_in_sequence,
                       split_topological, runnable_pieces)

__all__ = ["BATCH_DIM", "LOWERINGS", "OPSET", "PAST", "SEQUENCE_DIM", "NodeLowering", "context_length",
           "build_model", "expected_param_shapes", "input_name", "lower_network", "onnx_dims", "param_key", "register_lowering", "value_name",
           "Boundary", "Piece", "boundary", "export_pieces", "export_subgraph", "run_in_sequence",
           "split_topological", "runnable_pieces", "Decoder", "inference_outputs", "lower_inference",
           "ServingDecoder", "lower_serving"]
