"""The inference export against the torch backend: what ``vgraph check-onnx`` adds for a served model.

The training graph's check (``check.py``) runs at the context length; the
inference export's own machinery is what it does not reach: the symbolic
sequence (position tables and causal masks cut to a call's length) and the
KV cache (positions offset by the past length, keys and values carried
between calls).  So, on the same weights:

* the logits-only model at sequence lengths 1, about half the context and the
  context length, against the torch backend run at the same length;
* the KV-cache decoder fed the first half of a context at once and then one
  token per call, its logits concatenated, against the torch backend on the
  whole context.  A network that cannot have a decoder (an op that is neither
  positionwise nor cached) gets a note saying why, not a failure: the
  logits-only model still serves it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from vgraph import Graph, VGraphError

from .check import (DEFAULT_SCALES, CheckReport, _compile, _run_module, check_network, compare_outputs, fp32_graph,
                    random_feeds, random_weights, session)
from .inference import lower_inference
from .lower import context_length
from .names import value_name

__all__ = ["check_network_and_export", "check_inference", "sequence_lengths"]


def check_network_and_export(graph: Graph, *, weights: Mapping[str, np.ndarray] | None = None, batch: int = 1,
                             seed: int = 0, rtol: float | None = None, atol: float | None = None,
                             scales: Sequence[float] = DEFAULT_SCALES) -> CheckReport:
    """What ``vgraph check-onnx FILE`` compares: the training graph (``check.check_network``), then the
    inference export on the same weights (the checkpoint's, or the seeded ones at input scale 1)."""
    report = check_network(graph, weights=weights, batch=batch, seed=seed, rtol=rtol, atol=atol, scales=scales)
    graph = fp32_graph(graph)
    check_inference(report, graph, weights if weights is not None else random_weights(graph, seed), batch=batch,
                    seed=seed)
    return report


def sequence_lengths(context: int) -> list[int]:
    """1, about half the context, and the context: the edges of the symbolic axis and one length between."""
    return sorted({1, context // 2 + 1, context})


def check_inference(report: CheckReport, graph: Graph, weights: Mapping[str, np.ndarray], *, batch: int,
                    seed: int) -> None:
    """Append the inference export's comparisons (and notes) to ``report``; ``graph`` is float32."""
    if not graph.outputs:
        report.notes.append("inference export: the network declares no outputs; nothing to serve")
        return
    try:
        model = lower_inference(graph, weights)
    except VGraphError as exc:
        report.failures.append(f"inference export: {exc}")
        return
    module = _compile(graph, seed, weights)
    context = context_length(graph)
    full = random_feeds(graph, batch, seed + 1)
    wanted = {vi.name for vi in model.graph.input}
    sess = session(model)
    names = [value_name(ep.node, ep.slot) for ep in graph.outputs]
    reference: dict[str, np.ndarray] = {}
    for length in sequence_lengths(context):
        feeds = {k: v[:, :length] for k, v in full.items() if k in wanted}
        want = _run_module(module, feeds, [ep.name for ep in graph.outputs])
        got = dict(zip(names, sess.run(names, feeds)))
        for ep, value in zip(graph.outputs, names):
            report.outputs.append(compare_outputs(ep.name, value, got[value], want[ep.name], rtol=report.rtol,
                                                  atol=report.atol, case=f"inference, sequence {length}"))
        reference = want  # the last length is the whole context
    _check_decoder(report, graph, weights, {k: v for k, v in full.items() if k in wanted}, reference)


def _check_decoder(report: CheckReport, graph: Graph, weights: Mapping[str, np.ndarray],
                   feeds: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> None:
    """Half the context at once, then a token per call: the logits must be those of the whole context."""
    try:
        model = lower_inference(graph, weights, kv_cache=True)
    except VGraphError as exc:
        report.notes.append(f"KV-cache decoder not checked: it cannot be exported: {exc}")
        return
    sess = session(model)
    pasts = [vi for vi in model.graph.input if vi.name.startswith(("past_key:", "past_value:"))]
    batch, context = next(iter(feeds.values())).shape[:2]
    state = {vi.name: np.zeros([batch, *(0 if d.dim_param else d.dim_value for d in
                                         vi.type.tensor_type.shape.dim[1:])], dtype=np.float32) for vi in pasts}
    names = [value_name(ep.node, ep.slot) for ep in graph.outputs]
    presents = [vi.name.replace("past_", "present_", 1) for vi in pasts]
    pieces: list[list[np.ndarray]] = [[] for _ in names]
    prefill = max(1, context // 2)
    for start, stop in [(0, prefill), *((t, t + 1) for t in range(prefill, context))]:
        results = sess.run(names + presents, {**{k: v[:, start:stop] for k, v in feeds.items()}, **state})
        for piece, r in zip(pieces, results):
            piece.append(r)
        state = dict(zip((vi.name for vi in pasts), results[len(names):]))
    for ep, value, piece in zip(graph.outputs, names, pieces):
        report.outputs.append(compare_outputs(ep.name, value, np.concatenate(piece, axis=1), reference[ep.name],
                                              rtol=report.rtol, atol=report.atol,
                                              case=f"KV cache, {prefill}+1x{context - prefill}"))

