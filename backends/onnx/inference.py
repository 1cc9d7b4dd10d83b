"""The inference export: a model that serves logits, with a dynamic batch and sequence, and a KV cache.

``vgraph export-onnx`` writes this model by default.  What the training
graph computes beside the logits (losses, and the targets they read) is left
out, because a model that needs targets cannot be served; ``with_loss=True``
keeps the costs (and their targets input) for evaluation.

* Axes: ``batch`` and ``sequence`` are symbolic.  A call may cover 1 up to
  the network's context length (the ``seq_len`` its YAML declares, which
  sizes the RoPE tables, learned positions and causal masks).
* KV cache (``kv_cache=True``; ``serving.py`` renames and groups it into the
  layout Hugging Face Optimum and onnxruntime-genai read): every attention VNode, per head
  (``attention_head``) or fused (``attention``), takes ``past_key:<vnode>`` /
  ``past_value:<vnode>`` and returns ``present_key:<vnode>`` /
  ``present_value:<vnode>``, the past extended by this call's positions.
  Grouped-query attention caches its K/V heads only: a fused ``attention``
  with ``num_kv_heads`` holds ``[num_kv_heads, past, head_dim]``, and per head
  each ``kv_head`` holds its own, which the query heads of its group read
  (they cache nothing themselves).  The
  first call passes empty pasts (length 0); positions continue from the past
  length, so RoPE angles and the causal mask are those of the full sequence.
  The model metadata ``vgraph.kv_cache`` lists every cache (names, per-sample
  shape, growing axis) for a runtime.

:class:`Decoder` runs either model in onnxruntime for ``vgraph generate
--backend onnx``.  Its contract is the torch backend's: the logits at the
last position of a context of at most the context length, computed as if the
whole context were run at once; with a cache it only runs the positions the
cache does not hold yet, and starts over when the context is not an
extension of what it holds (the window slid past the context length).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from vgraph import Graph, VGraphError
from vgraph.base.diagnostics import printable
from vgraph.base.jsonio import loads

from .lower import build_model, context_length
from .names import BATCH_DIM, PAST_DIM, SEQUENCE_DIM, value_name

__all__ = ["inference_outputs", "lower_inference", "Decoder"]


def inference_outputs(graph: Graph, *, with_loss: bool = False) -> list[tuple[str, int]]:
    """The values an inference model returns: the network's outputs, and its costs with ``with_loss``."""
    endpoints = [*graph.outputs, *(graph.costs if with_loss else ())]
    if not endpoints:
        raise VGraphError(f"network {graph.name!r} declares no outputs, so an inference model would return "
                          "nothing (export it --with-loss for its costs)")
    return list(dict.fromkeys((ep.node, ep.slot) for ep in endpoints))


def _ancestors(graph: Graph, values: Sequence[tuple[str, int]]) -> set[str]:
    """Every VNode some of ``values`` depends on (itself included), following edges backwards."""
    seen: set[str] = set()
    todo = [node for node, _ in values]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(e.src for e in graph.in_edges(node))
    return seen


def lower_inference(graph: Graph, weights: Mapping[str, np.ndarray] | None = None, *, with_loss: bool = False,
                    kv_cache: bool = False, batch_dim: str = BATCH_DIM, padding: bool = False) -> onnx.ModelProto:
    """The inference model of a verified float32 ``graph`` (see the module doc); ``padding`` adds the
    ``attention_mask`` and ``position_ids`` inputs of the serving layout (``serving.py``)."""
    if kv_cache and with_loss:
        raise VGraphError("a KV-cache decoder returns logits only: a loss over the positions of one call is not "
                          "the network's loss (export --with-loss without --kv-cache)")
    outputs = inference_outputs(graph, with_loss=with_loss)
    docs = {(ep.node, ep.slot): f"output {ep.name!r}" for ep in graph.outputs}
    docs.update({(ep.node, ep.slot): f"cost {ep.name!r}" for ep in (graph.costs if with_loss else ())})
    model = build_model(graph, _ancestors(graph, outputs), weights=weights, outputs=outputs, output_docs=docs,
                        batch_dim=batch_dim, sequence=SEQUENCE_DIM, kv_cache=kv_cache, padding=padding)
    endpoints = {ep.name: value_name(ep.node, ep.slot)
                 for ep in [*graph.outputs, *(graph.costs if with_loss else ())]}
    props = {"vgraph.network": graph.name, "vgraph.endpoints": json.dumps(endpoints, sort_keys=True),
             "vgraph.compute_dtype": "float32", "vgraph.context_length": str(context_length(graph)),
             "vgraph.kv_cache": json.dumps(_cache_metadata(model))}
    helper.set_model_props(model, props)
    return model


def _cache_metadata(model: onnx.ModelProto) -> list[dict]:
    """The caches of a decoder, read back from its inputs and outputs (names and dims)."""
    outputs = {o.name for o in model.graph.output}
    out = []
    for vi in model.graph.input:
        if not vi.name.startswith("past_key:"):
            continue
        node = vi.name.split(":", 1)[1]
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        names = {"past_key": f"past_key:{node}", "past_value": f"past_value:{node}",
                 "present_key": f"present_key:{node}", "present_value": f"present_value:{node}"}
        if not {names["present_key"], names["present_value"]} <= outputs:
            raise AssertionError(f"decoder has past keys of {node!r} but does not return its present ones")
        out.append({"node": node, **names, "shape": dims[1:], "axis": dims.index(PAST_DIM)})
    return out


class Decoder:
    """Next-token logits of an inference model in onnxruntime, keeping its KV cache between calls.

    ``logits`` is the graph output holding ``[batch, sequence, vocab]``
    logits and ``tokens`` the token-id input.  One sequence at a time (batch 1),
    which is what sampling needs.
    """

    def __init__(self, model: onnx.ModelProto | str | os.PathLike[str], *, logits: str, tokens: str,
                 context: int, threads: int | None = None) -> None:
        from .check import session

        if isinstance(model, onnx.ModelProto):
            props = {p.key: p.value for p in model.metadata_props}
        else:
            props = {p.key: p.value for p in onnx.load(os.fspath(model), load_external_data=False).metadata_props}
        where = "the model" if isinstance(model, onnx.ModelProto) else printable(os.fspath(model))
        self.caches = loads(props.get("vgraph.kv_cache") or "[]", f"{where} (metadata vgraph.kv_cache)")
        if not isinstance(self.caches, list) or not all(isinstance(c, dict) for c in self.caches):
            raise VGraphError(f"{where}: metadata vgraph.kv_cache is not a list of caches (not a model vgraph "
                              f"exported?)")
        self.logits_name, self.tokens_name, self.context = logits, tokens, int(context)
        self.session = session(model, threads=threads)
        self.held: list[int] = []  # the tokens the cache holds, in order
        self.state: dict[str, np.ndarray] = {}
        self.positions_run = 0  # positions the model computed, for tests and the benchmark

    @classmethod
    def for_network(cls, graph: Graph, weights: Mapping[str, np.ndarray], *, kv_cache: bool,
                    logits_output: str, threads: int | None = None) -> "Decoder":
        """The decoder of ``graph`` (any precision annotations dropped: it runs float32) and its weights."""
        from .check import fp32_graph

        graph = fp32_graph(graph)
        ep = next((ep for ep in graph.outputs if ep.name == logits_output), None)
        if ep is None:
            raise VGraphError(f"network {graph.name!r} has no output {logits_output!r}")
        model = lower_inference(graph, weights, kv_cache=kv_cache)
        caches = {name for c in _cache_metadata(model) for name in (c["past_key"], c["past_value"])}
        feeds = [vi.name for vi in model.graph.input if vi.name not in caches]
        if len(feeds) != 1:
            raise VGraphError(f"network {graph.name!r}: its outputs read {len(feeds)} inputs ({', '.join(feeds)}); "
                              "a decoder feeds token ids only")
        return cls(model, logits=value_name(ep.node, ep.slot), tokens=feeds[0], context=context_length(graph),
                   threads=threads)

    def reset(self) -> None:
        self.held, self.state = [], {}

    def _empty_caches(self) -> dict[str, np.ndarray]:
        feeds = {}
        for c in self.caches:
            shape = [1, *(0 if d == PAST_DIM else int(d) for d in c["shape"])]
            feeds[c["past_key"]] = feeds[c["past_value"]] = np.zeros(shape, dtype=np.float32)
        return feeds

    def last_logits(self, context: Sequence[int]) -> np.ndarray:
        """Logits ``[vocab]`` at the last of ``context`` (1 up to the context length token ids)."""
        context = [int(t) for t in context]
        if not 1 <= len(context) <= self.context:
            raise VGraphError(f"a context holds 1 to {self.context} tokens; got {len(context)}"
                              + (": past the network's context length (its seq_len); slide the window or "
                                 "start over" if context else ""))
        if not self.caches:
            return self._run(context, {})[0, -1]
        if self.held != context[: len(self.held)] or len(self.held) >= len(context):
            self.reset()
        new = context[len(self.held):]
        feeds = self.state or self._empty_caches()
        logits = self._run(new, feeds)
        self.held = context
        return logits[0, -1]

    def _run(self, ids: Sequence[int], past: Mapping[str, np.ndarray]) -> np.ndarray:
        feeds = {self.tokens_name: np.asarray([ids], dtype=np.int64), **past}
        names = [self.logits_name] + [c[k] for c in self.caches for k in ("present_key", "present_value")]
        results = self.session.run(names, feeds)
        self.positions_run += len(ids)
        self.state = {}
        for i, c in enumerate(self.caches):  # this call's present is the next call's past
            self.state[c["past_key"]], self.state[c["past_value"]] = results[1 + 2 * i], results[2 + 2 * i]
        return results[0]
