"""Check the ONNX lowering against the torch backend on the same weights and inputs.

This is the torch-facing side of the ONNX backend: it gets weights (from a
vgraph checkpoint, or seeded ones of a realistic scale), runs
``vgraph.backends.torch.compile_network`` and onnxruntime on the same random
inputs and reports, per network output and cost, the largest absolute and
relative difference.

**Weights and inputs that make a wrong lowering show.**  Two lowerings that
differ only in a nonlinearity's fine print (tanh-approximated GELU for the
exact one) agree to 1e-5 where that nonlinearity sees tiny inputs, which is
everywhere at the torch initialisation (weights N(0, 0.02)).  So without a
checkpoint the check runs on seeded weights of the scale a trained network
has (matrices N(0, 1/fan_in), so every layer's outputs are O(1) and every
activation works in its curved range; norm scales 1 + N(0, 0.1^2); biases
N(0, 0.1^2)), at several input scales (``DEFAULT_SCALES``: float network inputs
and the token embedding multiplied by 0.1, 1 and 10, from the near-linear
range to saturation).  With a trained checkpoint its weights are used as
they are.  Measured on the 6-layer production network: the exact lowering
agrees to a relative 1.7e-6 at every scale, a tanh-GELU lowering is off by
2.7e-4 or more at every scale (1.3e-5 at the torch initialisation of the
tiny fixture, where an element-wise 1e-4 let it pass).

Both sides compute in float32 whatever precision the YAML declares: the
question is whether the two lowerings mean the same thing, and at half
precision rounding differences between two correct implementations are far
above any useful tolerance (see ``TOLERANCES``).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from vgraph import Graph, VGraphError, verify

from .lower import expected_param_shapes, lower_network, network_input_type
from .names import input_name, value_name

__all__ = ["providers", "session", "random_feeds", "fp32_graph", "weights_from_checkpoint",
           "initial_weights", "random_weights", "scaled_weights", "torch_outputs", "onnx_outputs", "OutputError",
           "CheckReport", "Tolerance", "TOLERANCES", "DEFAULT_SCALES", "tolerance", "compare_outputs",
           "check_network"]


@dataclass(frozen=True)
class Tolerance:
    """``max |onnx - torch| <= atol + rtol * max |torch|`` over one output (see :func:`compare_outputs`)."""

    rtol: float
    atol: float


#: Tolerance by the dtype both sides compute an output in.  Why these numbers:
#:
#: * float32 (what the check runs: u = 2^-24): two correct lowerings differ by
#:   the order of their floating-point sums (matmul blocking, fused kernels).
#:   A dot product of K terms summed in two orders differs by at most about
#:   2 K u times the sum of the terms' magnitudes, typically sqrt(K) u; layer
#:   norms rescale, so depth adds rather than multiplies.  With K up to 2048 (the
#:   6-layer network's feed-forward) the bound is ~2^-12 and the typical error
#:   ~2^-18 of the output's scale; measured: 1.7e-6 (~2^-19) at every input
#:   scale on the 6-layer network, 7e-7 on the tiny fixtures.  rtol 2^-15
#:   (3.05e-5, 512 u) leaves 18x for deeper networks and trained weights, and
#:   stays 9x below the smallest real lowering error known (tanh-GELU: >= 2.7e-4).
#:   atol 2^-20 (9.5e-7) only matters for an output that is ~0 everywhere.
#:   The scale is the output's own maximum, not each element: an element near
#:   zero carries the rounding of terms as large as the others.
#: * float64 (u = 2^-53): the same 512 u, for a lowering a plugin computes in
#:   double.
#: * float16 (u = 2^-11) and bfloat16 (u = 2^-8): 512 u would be 25% and 200%,
#:   which checks nothing; that is why both sides compute in float32 whatever
#:   the YAML declares, and no half-precision row exists.
#: * int64, int32, bool (ids, masks): exactly equal.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=2.0 ** -15, atol=2.0 ** -20),
    "float64": Tolerance(rtol=2.0 ** -44, atol=2.0 ** -49),
    "int64": Tolerance(0.0, 0.0),
    "int32": Tolerance(0.0, 0.0),
    "bool": Tolerance(0.0, 0.0),
}
RTOL = TOLERANCES["float32"].rtol
ATOL = TOLERANCES["float32"].atol
#: Multipliers of the float network inputs and the token embedding (see the module doc).
DEFAULT_SCALES = (0.1, 1.0, 10.0)


def tolerance(dtype: np.dtype | str) -> Tolerance:
    """The tolerance of an output computed in ``dtype`` (``TOLERANCES``)."""
    name = np.dtype(dtype).name
    if name not in TOLERANCES:
        raise VGraphError(f"check-onnx compares float32, float64 and integer outputs; got one of dtype {name}")
    return TOLERANCES[name]


# ---------------------------------------------------------------------------
# onnxruntime
# ---------------------------------------------------------------------------


def providers() -> list[str | tuple[str, dict[str, str]]]:
    """CUDA when this machine has a usable GPU, else CPU (onnxruntime's ``providers=`` list).

    onnxruntime-gpu lists the CUDA provider even on machines without a GPU
    (and then falls back with a warning), so the device itself is asked.
    TF32 matmuls are off: they round inputs to 10 mantissa bits, far outside
    a float32 comparison's tolerance.
    """
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers() and _cuda_device_present():
        return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _cuda_device_present() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - torch is a dependency
        return False


def session(model: onnx.ModelProto | str | os.PathLike[str], *, threads: int | None = None):
    """An onnxruntime session on :func:`providers` with warnings silenced."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else os.fspath(model)
    return ort.InferenceSession(source, options, providers=providers())


def onnx_outputs(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """Run ``model``; returns (output name -> array, provider that ran it)."""
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    results = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, results)), sess.get_providers()[0]


# ---------------------------------------------------------------------------
# Inputs and weights
# ---------------------------------------------------------------------------


def _int_input_bound(graph: Graph, node_id: str, slot: int) -> int:
    """Exclusive upper bound of valid ids at an int input: vocabulary or class count."""
    node = graph.node(node_id)
    cfg = node.cfg
    if cfg.get("vocab_size"):
        return int(cfg["vocab_size"])
    if node.type == "tied_lm_head_ce":
        return int(cfg["out_dim"])
    if node.op.is_cost and slot == 1:  # targets: one class id per row of the predictions
        edge = graph.input_edge(node_id, 0)
        pred = (graph.node(edge.src).outputs[edge.src_slot] if edge is not None
                else network_input_type(graph, node, 0))
        return int(pred.shape[-1])
    raise VGraphError(f"cannot tell the range of integer input {slot} of '{node_id}' ({node.type})")


def random_feeds(graph: Graph, batch: int, seed: int = 0, node_ids: Sequence[str] | None = None, *,
                 scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random network inputs ``"n:in<k>"``: ids in ``[0, vocab)``, floats normal with standard deviation ``scale``."""
    rng = np.random.default_rng(seed)
    ids = set(node_ids) if node_ids is not None else None
    feeds: dict[str, np.ndarray] = {}
    for node_id, slot in graph.network_inputs():
        if ids is not None and node_id not in ids:
            continue
        t = network_input_type(graph, graph.node(node_id), slot)
        shape = (batch, *t.shape)
        if t.kind == "int":
            feeds[input_name(node_id, slot)] = rng.integers(0, _int_input_bound(graph, node_id, slot), shape,
                                                            dtype=np.int64)
        elif t.kind == "float":
            feeds[input_name(node_id, slot)] = (scale * rng.standard_normal(shape)).astype(np.float32)
        else:
            raise VGraphError(f"'{node_id}' takes text input {slot}; check-onnx runs on token ids")
    return feeds


def fp32_graph(graph: Graph) -> Graph:
    """A copy with every precision declaration and annotation removed (so both sides run fp32)."""
    g = graph.copy()
    for key in ("precision", "param_precision", "activation_precision"):
        g.attrs.pop(key, None)
    g.meta.pop("precision", None)
    for n in g.nodes:
        n.meta.pop("precision", None)
        n.set_config(precision=None, param_precision=None, activation_precision=None)
    return verify(g)


@dataclass
class SavedWeights:
    """A checkpoint as read for ONNX: its weights (unfused layout), and the network it was trained on when it
    carries it (every checkpoint `vgraph train` writes does; a bare ``.safetensors`` file does not)."""

    path: Path
    state: dict
    network_yaml: str | None = None
    run: dict = field(default_factory=dict)
    tokenizer_json: str | None = None

    def network(self) -> Graph:
        """The network these weights were trained on (a VGraphError when the checkpoint does not carry it)."""
        from vgraph import loads
        from vgraph.plugins import naming_missing_plugins

        if not self.network_yaml:
            raise VGraphError(f"{self.path}: this checkpoint does not carry its network; name the network YAML and "
                              f"pass the checkpoint with --checkpoint")
        return naming_missing_plugins(self.run, lambda: loads(self.network_yaml, file=f"{self.path}/network.yml"))


def read_checkpoint(path: str | os.PathLike[str]) -> SavedWeights:
    """A checkpoint directory, a run directory (its latest, through the torch backend's one resolver) or a
    ``.safetensors`` file, read."""
    from safetensors import SafetensorError

    from vgraph.backends.torch import CheckpointError, load_checkpoint, resolve_checkpoint

    p = Path(path)
    try:
        if p.is_file():
            from safetensors.torch import load_file

            return SavedWeights(p, load_file(os.fspath(p)))
        if not p.is_dir():
            raise VGraphError(f"{p}: no such checkpoint file or directory")
        saved = load_checkpoint(resolve_checkpoint(p))
    except (CheckpointError, OSError, ValueError, SafetensorError) as exc:
        raise VGraphError(f"{p}: cannot read checkpoint: {exc}") from None
    return SavedWeights(saved.path, saved.model_state, saved.extra.get("network_yaml"), saved.extra.get("run") or {},
                        saved.extra.get("tokenizer_json"))


def weights_from_checkpoint(path: str | os.PathLike[str] | SavedWeights, graph: Graph | None = None, *,
                            given: str | None = None) -> dict[str, np.ndarray]:
    """Float32 numpy weights ``"<vnode>.<param>"`` from a checkpoint.

    With ``graph`` given, a checkpoint that carries its network (every one
    ``vgraph train`` writes) is refused unless it was trained on that network
    (``vgraph.run.network_match``; ``given`` names it in the message), so weights
    never silently describe another function.

    ``path`` is a checkpoint directory, a run directory (its ``latest``), a
    ``.safetensors`` file, or what :func:`read_checkpoint` read.  Checkpoints store the unfused layout; with
    ``graph`` given, the weights come back in that graph's layout (a fused
    ``attention`` gets the concatenation of its heads', see ``vgraph.run.layout``).
    """
    import torch

    saved = path if isinstance(path, SavedWeights) else read_checkpoint(path)
    if graph is not None and saved.network_yaml:  # the checkpoint says what it was trained on: it must be `graph`
        from vgraph.backends.torch import checked_tokenizer, network_vocab
        from vgraph.run.network_match import require_match

        trained = saved.network()
        require_match(trained, graph, checkpoint=str(saved.path),
                      given_label=given or f"network {graph.name!r}", changes=saved.run.get("semantic_changes") or ())
        if saved.tokenizer_json:  # ids past the vocabulary: a Gather error in onnxruntime otherwise
            checked_tokenizer(saved.tokenizer_json, network_vocab(trained), str(saved.path))
    weights = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in saved.state.items()}
    if graph is None or set(expected_param_shapes(graph)) <= set(weights):
        return weights
    from vgraph.run import layout
    return layout.to_graph_layout(weights, graph, lambda parts: np.concatenate(parts, axis=0))


def random_weights(graph: Graph, seed: int = 0, node_ids: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Seeded float32 weights of a trained network's scale, without torch (the check, tests, benchmarks).

    Matrices ~ N(0, 1/fan_in) so activations stay O(1) through deep stacks
    and every nonlinearity sees its curved range; vectors ~ 1 + N(0, 0.1^2)
    for norm scales (params named ``weight`` of rank 1) and N(0, 0.1^2)
    otherwise.  Not the torch backend's initialisation (N(0, 0.02), zero
    biases, unit norms), under which a wrong nonlinearity hides: use
    :func:`initial_weights` for that.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for key, shape in sorted(expected_param_shapes(graph, node_ids).items()):
        if len(shape) >= 2:
            out[key] = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
        elif key.endswith(".weight"):
            out[key] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[key] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


def scaled_weights(graph: Graph, weights: Mapping[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """``weights`` with every embedder's token and position tables times ``scale``: the token network's
    input scale (the first activations are those rows)."""
    out = dict(weights)
    for node in graph.nodes_of_type("embedder"):
        for pname in node.op.param_shapes(node.cfg):
            key = f"{node.id}.{pname}"
            if key in out:
                out[key] = (np.asarray(out[key]) * np.float32(scale)).astype(np.float32)
    return out


def _compile_network():
    try:
        from vgraph.backends.torch import compile_network
    except ImportError as exc:
        raise VGraphError("the torch backend (vgraph.backends.torch.compile_network) is not available "
                          f"in this build: {exc}") from exc
    return compile_network


def _compile(graph: Graph, seed: int, weights: Mapping[str, np.ndarray] | None = None):
    """The torch backend's module for ``graph`` in float32 eval mode.

    Parameters are ``weights`` (this graph's layout) when given, else the
    backend's initialisation from ``seed``.
    """
    import torch

    from vgraph.run import layout
    unfused = None
    if weights is not None:
        _check_weight_keys(graph, weights)
        state = {k: torch.from_numpy(np.ascontiguousarray(weights[k], dtype=np.float32))
                 for k in expected_param_shapes(graph)}
        unfused = layout.to_unfused_layout(
            state, graph, lambda t, rows: torch.split(t, list(rows), dim=0))
    module = _compile_network()(graph, device="cpu", train=False, seed=seed, unfused_state=unfused)
    return module.float().eval()


def _state_numpy(module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().cpu().numpy() for k, v in module.state_dict().items()}


def initial_weights(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """The torch backend's seeded initialisation, as float32 numpy arrays."""
    return _state_numpy(_compile(fp32_graph(graph), seed))


def _run_module(module, feeds: Mapping[str, np.ndarray], want: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Endpoint name -> array; ``want`` limits the endpoints (and with them the feeds needed)."""
    import torch

    with torch.no_grad():
        out = module({k: torch.from_numpy(v) for k, v in feeds.items()}, want=tuple(want) if want else None)
    return {k: v.detach().float().cpu().numpy() for k, v in out.items()}


def torch_outputs(graph: Graph, weights: Mapping[str, np.ndarray],
                  feeds: Mapping[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    """Endpoint name -> array from the torch backend in float32 eval mode on ``weights``."""
    return _run_module(_compile(fp32_graph(graph), seed, weights), feeds)


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputError:
    """Agreement of one output in one case: worst absolute and relative error, and the verdict."""

    name: str
    value: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool
    case: str = ""


@dataclass
class CheckReport:
    network: str
    batch: int
    provider: str
    rtol: float
    atol: float
    outputs: list[OutputError] = field(default_factory=list)
    weights: str = ""
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # a model that could not be built or run

    @property
    def ok(self) -> bool:
        return bool(self.outputs) and all(o.ok for o in self.outputs) and not self.failures

    def format(self) -> str:
        w = max([24, *(len(o.case) for o in self.outputs)])
        lines = [f"network {self.network!r}, batch {self.batch}, float32, onnxruntime {self.provider}"
                 + (f", {self.weights}" if self.weights else ""),
                 f"tolerance per output: max |onnx - torch| <= {self.atol:.3g} + {self.rtol:.3g} * max |torch| "
                 "(rel err = max abs err / max |torch|)",
                 f"{'case':<{w}} {'output':<14} {'value':<20} {'shape':<16} {'max abs err':>11} {'max rel err':>11}"
                 "  result"]
        for o in self.outputs:
            lines.append(f"{o.case:<{w}} {o.name:<14} {o.value:<20} {str(list(o.shape)):<16} {o.max_abs:>11.3e} "
                         f"{o.max_rel:>11.3e}  {'ok' if o.ok else 'FAIL'}")
        lines += [f"note: {n}" for n in self.notes] + [f"FAIL: {f}" for f in self.failures]
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def compare_outputs(name: str, value: str, got: np.ndarray, want: np.ndarray, *,
                    rtol: float | None = None, atol: float | None = None, case: str = "") -> OutputError:
    """Errors of ``got`` (onnx) against ``want`` (torch) and the verdict.

    max abs = max |got - want|; max rel = max |got - want| / max |want|, the
    error relative to the output's scale.  The verdict is ``max abs <= atol +
    rtol * max |want|``, everything finite, with the tolerance of ``want``'s
    dtype (``TOLERANCES``) unless given.  Relative to the output's scale, not
    element-wise: rounding in a sum is relative to its terms, so an element
    near zero carries errors as large as its neighbours' and an element-wise
    test either fails correct lowerings (at large scales) or needs an rtol
    loose enough to pass wrong ones.
    """
    tol = tolerance(np.asarray(want).dtype)
    rtol = tol.rtol if rtol is None else rtol
    atol = tol.atol if atol is None else atol
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return OutputError(name, value, tuple(want.shape), math.inf, math.inf, False, case)
    diff = np.abs(got - want)
    finite = bool(np.all(np.isfinite(got)) and np.all(np.isfinite(want)))
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(want).max()) if want.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    ok = finite and max_abs <= atol + rtol * scale
    return OutputError(name, value, tuple(want.shape), max_abs, max_rel, ok, case)


def _has_float_inputs(graph: Graph) -> bool:
    return any(network_input_type(graph, graph.node(n), s).kind == "float" for n, s in graph.network_inputs())


CHECK_COPIES = 3  # the torch run's activations, onnxruntime's, and the outputs compared: each per sample


def _refuse_batch_beyond_memory(graph: Graph, batch: int) -> None:
    """A VGraphError when `batch` samples cannot fit this machine's memory (numpy's MemoryError traceback
    for 11.6 TiB of inputs, or an out-of-memory kill, before): float32 activation bytes per sample (the
    core's analysis) for the torch run, onnxruntime and the comparison, against the available memory."""
    from vgraph.cost.analyze import analyze
    from vgraph.cost.host_memory import available_host_memory

    free, source = available_host_memory()
    if free is None:
        return
    per_sample = max(1, analyze(graph).activation_bytes) * CHECK_COPIES
    if batch * per_sample > free:
        raise VGraphError(f"--batch {batch}: the check needs about {batch * per_sample / 2**30:,.1f} GiB of "
                          f"activations ({per_sample:,} bytes per sample, torch and onnxruntime), more than the "
                          f"{free / 2**30:,.1f} GiB available ({source}); use --batch {max(1, free // per_sample)} "
                          f"or less")


def check_network(graph: Graph, *, weights: Mapping[str, np.ndarray] | None = None, batch: int = 1,
                  seed: int = 0, rtol: float | None = None, atol: float | None = None,
                  scales: Sequence[float] = DEFAULT_SCALES) -> CheckReport:
    """Run the torch backend and onnxruntime on the same random inputs; compare every output.

    ``weights`` (a checkpoint's, in ``graph``'s layout) are used as given;
    without them, seeded weights of a realistic scale (:func:`random_weights`)
    at every input scale of ``scales`` (:func:`scaled_weights`).  Float
    network inputs are drawn at each scale either way.  The inference export
    adds its own comparisons (``inference_check.check_network_and_export``).
    """
    if batch < 1:
        raise VGraphError(f"batch must be >= 1; got {batch}")
    bad = [s for s in scales if not (math.isfinite(s) and s > 0)]
    if not scales or bad:
        raise VGraphError(f"input scales must be finite and > 0; got {list(scales)}")
    graph = fp32_graph(graph)
    _refuse_batch_beyond_memory(graph, batch)
    trained = weights is not None
    base = dict(weights) if trained else random_weights(graph, seed)
    _check_weight_keys(graph, base)
    if trained and not _has_float_inputs(graph):
        scales = (1.0,)
    tol = TOLERANCES["float32"]
    report = CheckReport(graph.name, batch, "", tol.rtol if rtol is None else rtol, tol.atol if atol is None else atol,
                         weights="weights: the checkpoint's" if trained else
                         f"weights: seeded (seed {seed}), matrices N(0, 1/fan_in); input scales "
                         f"{', '.join(f'{s:g}' for s in scales)}")
    for scale in scales:
        w = base if trained else scaled_weights(graph, base, scale)
        feeds = random_feeds(graph, batch, seed, scale=scale)
        reference = _run_module(_compile(graph, seed, w), feeds)
        got, report.provider = onnx_outputs(lower_network(graph, w), feeds)
        for ep in [*graph.outputs, *graph.costs]:
            value = value_name(ep.node, ep.slot)
            if ep.name not in reference:
                raise VGraphError(f"the torch backend returned no {ep.name!r} (it returned "
                                  f"{', '.join(sorted(reference))})")
            report.outputs.append(compare_outputs(ep.name, value, got[value], reference[ep.name], rtol=report.rtol,
                                                  atol=report.atol, case=f"training graph, x{scale:g}"))
    return report


def _check_weight_keys(graph: Graph, weights: Mapping[str, np.ndarray]) -> None:
    need = expected_param_shapes(graph)
    missing = sorted(set(need) - set(weights))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise VGraphError(f"the weights do not match network {graph.name!r}: {len(missing)} parameter(s) "
                          f"missing ({shown})")
