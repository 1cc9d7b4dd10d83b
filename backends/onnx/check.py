"""Check the ONNX lowering against the torch backend on the same weights and inputs.

This is the torch-facing side of the ONNX backend: it gets weights (from a
vgraph checkpoint, or from the torch backend's seeded initialisation), runs
``vgraph.backends.torch.compile_network`` and onnxruntime on the same random
inputs and reports, per network output and cost, the largest absolute and
relative difference.

Both sides compute in float32 whatever precision the YAML declares: the
question is whether the two lowerings mean the same thing, and at half
precision rounding differences between two correct implementations are far
above any useful tolerance.  The tolerance is ``|onnx - torch| <= atol +
rtol * |torch|`` element-wise with rtol 1e-4, atol 1e-5 by default.
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

from .lower import expected_param_shapes, input_name, lower_network, network_input_type, value_name

__all__ = ["providers", "session", "random_feeds", "fp32_graph", "weights_from_checkpoint",
           "initial_weights", "random_weights", "torch_outputs", "onnx_outputs", "OutputError", "CheckReport",
           "compare_outputs", "check_network"]

RTOL = 1e-4
ATOL = 1e-5


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


def random_feeds(graph: Graph, batch: int, seed: int = 0,
                 node_ids: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Random network inputs ``"n:in<k>"``: ids in ``[0, vocab)``, floats standard normal."""
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
            feeds[input_name(node_id, slot)] = rng.standard_normal(shape).astype(np.float32)
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


def weights_from_checkpoint(path: str | os.PathLike[str], graph: Graph | None = None, *,
                            given: str | None = None) -> dict[str, np.ndarray]:
    """Float32 numpy weights ``"<vnode>.<param>"`` from a checkpoint.

    With ``graph`` given, a checkpoint that carries its network (every one
    ``vgraph train`` writes) is refused unless it was trained on that network
    (``vgraph.run.network_match``; ``given`` names it in the message), so weights
    never silently describe another function.

    ``path`` is a checkpoint directory, a run directory (its ``latest``) or a
    ``.safetensors`` file.  Checkpoints store the unfused layout; with
    ``graph`` given, the weights come back in that graph's layout (a fused
    ``attention`` gets the concatenation of its heads', see ``vgraph.run.layout``).
    """
    import torch
    from safetensors import SafetensorError

    from vgraph.backends.torch import CheckpointError, latest_checkpoint, load_checkpoint

    p = Path(path)
    trained_yaml = None
    try:
        if p.is_file():
            from safetensors.torch import load_file

            state = load_file(os.fspath(p))
        elif p.is_dir():
            latest = latest_checkpoint(p) if not (p / "state.json").is_file() else None
            saved = load_checkpoint(latest or p)
            state = saved.model_state
            trained_yaml = saved.extra.get("network_yaml")
        else:
            raise VGraphError(f"{p}: no such checkpoint file or directory")
    except (CheckpointError, OSError, ValueError, SafetensorError) as exc:
        raise VGraphError(f"{p}: cannot read checkpoint: {exc}") from None
    if graph is not None and trained_yaml:  # the checkpoint says what it was trained on: it must be `graph`
        from vgraph import loads
        from vgraph.run.network_match import require_match

        trained = loads(trained_yaml, file=f"{p}/network.yml")
        require_match(trained, graph, checkpoint=str(p), given_label=given or f"network {graph.name!r}",
                      changes=(saved.extra.get("run") or {}).get("semantic_changes") or ())
    weights = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in state.items()}
    if graph is None or set(expected_param_shapes(graph)) <= set(weights):
        return weights
    from vgraph.run import layout
    return layout.to_graph_layout(weights, graph, lambda parts: np.concatenate(parts, axis=0))


def random_weights(graph: Graph, seed: int = 0, node_ids: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Seeded float32 weights of the right shapes, without torch (tests, benchmarks, shapes).

    Matrices ~ N(0, 1/fan_in) so activations stay O(1) through deep stacks;
    vectors ~ 1 + N(0, 0.1^2) for norm scales (params named ``weight`` of rank
    1) and N(0, 0.1^2) otherwise.  Not the torch backend's initialisation:
    use :func:`initial_weights` for that.
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


def _run_module(module, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch

    with torch.no_grad():
        out = module({k: torch.from_numpy(v) for k, v in feeds.items()})
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
    """Agreement of one output: worst absolute and relative error, and the verdict."""

    name: str
    value: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class CheckReport:
    network: str
    batch: int
    provider: str
    rtol: float
    atol: float
    outputs: list[OutputError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.outputs) and all(o.ok for o in self.outputs)

    def format(self) -> str:
        lines = [f"network {self.network!r}, batch {self.batch}, float32, onnxruntime {self.provider}, "
                 f"tolerance |onnx - torch| <= {self.atol:g} + {self.rtol:g} * |torch| "
                 "(rel err = max abs err / max |torch|)",
                 f"{'output':<16} {'value':<22} {'shape':<18} {'max abs err':>12} {'max rel err':>12}  result"]
        for o in self.outputs:
            lines.append(f"{o.name:<16} {o.value:<22} {str(list(o.shape)):<18} {o.max_abs:>12.3e} "
                         f"{o.max_rel:>12.3e}  {'ok' if o.ok else 'FAIL'}")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def compare_outputs(name: str, value: str, got: np.ndarray, want: np.ndarray, *,
                    rtol: float = RTOL, atol: float = ATOL) -> OutputError:
    """Errors of ``got`` (onnx) against ``want`` (torch) and the verdict.

    max abs = max |got - want|; max rel = max |got - want| / max |want|, the
    error relative to the output's scale (element-wise ratios are noise
    where ``want`` is near zero, which is what ``atol`` is for).  The verdict
    is element-wise ``|got - want| <= atol + rtol * |want|``, all finite.
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return OutputError(name, value, tuple(want.shape), math.inf, math.inf, False)
    diff = np.abs(got - want)
    finite = bool(np.all(np.isfinite(got)) and np.all(np.isfinite(want)))
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(want).max()) if want.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    ok = finite and bool(np.all(diff <= atol + rtol * np.abs(want)))
    return OutputError(name, value, tuple(want.shape), max_abs, max_rel, ok)


def check_network(graph: Graph, *, weights: Mapping[str, np.ndarray] | None = None, batch: int = 1,
                  seed: int = 0, rtol: float = RTOL, atol: float = ATOL) -> CheckReport:
    """Run the torch backend and onnxruntime on the same random inputs; compare every output."""
    if batch < 1:
        raise VGraphError(f"batch must be >= 1; got {batch}")
    graph = fp32_graph(graph)
    module = _compile(graph, seed, weights)
    if weights is None:
        weights = _state_numpy(module)
    _check_weight_keys(graph, weights)
    feeds = random_feeds(graph, batch, seed)
    reference = _run_module(module, feeds)
    del module
    model = lower_network(graph, weights)
    got, provider = onnx_outputs(model, feeds)
    report = CheckReport(graph.name, batch, provider, rtol, atol)
    for ep in [*graph.outputs, *graph.costs]:
        value = value_name(ep.node, ep.slot)
        if ep.name not in reference:
            raise VGraphError(f"the torch backend returned no {ep.name!r} (it returned "
                              f"{', '.join(sorted(reference))})")
        report.outputs.append(compare_outputs(ep.name, value, got[value], reference[ep.name],
                                              rtol=rtol, atol=atol))
    return report


def _check_weight_keys(graph: Graph, weights: Mapping[str, np.ndarray]) -> None:
    need = expected_param_shapes(graph)
    missing = sorted(set(need) - set(weights))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise VGraphError(f"the weights do not match network {graph.name!r}: {len(missing)} parameter(s) "
                          f"missing ({shown})")
