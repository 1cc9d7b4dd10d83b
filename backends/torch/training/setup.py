"""Setting a training run up: the config checked, the device, the graph prepared, the run directory, the data.

Everything `vgraph train` decides before its first step, in the order it
decides it (`set_up_run`), and the pieces `vgraph launch` shares with it
(device resolution, graph loading and preparation, the run's data).

* **Graph**: the file is loaded, then the pass pipeline runs for the device
  (`prepare_graph`: the default production pipeline, `--passes SPEC`, or
  `--no-fuse`); the `precision` pass's annotation picks the compute dtype.
* **Memory** is checked before anything large is allocated.
* **Seeds**: Python's, NumPy's and torch's global generators are seeded just
  before the weights are initialised (`seed_everything`).
"""
from __future__ import annotations

import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from vgraph.base.diagnostics import Diagnostic, VGraphError, quote
from vgraph.base.safeio import check_output_dir
from vgraph.ir.graph import Graph
from vgraph.plugins import loaded_files
from vgraph.run.compiled_graph import (NO_FUSE_PIPELINE, plugin_distributions,  # shared with `vgraph report`
                                       training_spec)
from vgraph.run.files import RunLock, refuse_foreign
from vgraph.run.network_match import fingerprint
from vgraph.transform.pipeline import semantic_changes
from vgraph.yamlio import dumps, load

from . import checkpoint as ckpt
from ..lowering.lower import VGraphModule, compute_dtype
from .memory import available_memory, check_memory
from .peak_memory import estimate_record
from .run_checkpoints import clean_stale
from .run_files import run_slug
from .run_network import trained_network_yaml
from .config import TrainConfig, TrainingError
from .options import check_train_config
from .corpus import PreparedData, prepare_data

__all__ = ["phase", "NO_FUSE_PIPELINE", "device_target", "prepare_graph", "feed_roles", "vocab_and_seq", "resolve_device",
           "use_deterministic_kernels", "load_network", "RunSetup", "set_up_run", "seed_everything", "run_banner"]



@contextmanager
def phase(say: Callable[[str], None], what: str) -> Iterator[list[str]]:
    """Say what a set-up phase did and how long it took ("setup: WHAT (0.12 s)"); the phase may append
    details to the yielded list.  The first minute of a run shows where its time goes."""
    t0 = time.perf_counter()
    details: list[str] = []
    yield details
    say(f"setup: {what}{': ' + '; '.join(details) if details else ''} ({time.perf_counter() - t0:.2f} s)")


# --------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------


def resolve_device(name: str | None) -> torch.device:
    """`--device` as a torch device (default: CUDA when there is one), refused when it cannot run here.

    Any device type torch knows (meta, xpu, mps, hpu, xla, ...) is accepted by `torch.device`, and failed
    only later, deep inside, with a traceback: here a type is refused unless this machine has such a
    device (`torch.<type>.is_available()`, and for an index, that many devices); `meta` holds no data
    at all, so nothing can be trained or sampled on it."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise TrainingError(f"--device {quote(name)} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise TrainingError(f"--device {quote(name)}: the meta device holds shapes but no data; nothing can be "
                            f"trained or sampled on it (use cpu or cuda)")
    backend = getattr(torch, device.type, None)
    try:
        count = int(backend.device_count()) if hasattr(backend, "device_count") else 0
        available = bool(backend.is_available()) if hasattr(backend, "is_available") else False
    except Exception:  # noqa: BLE001  (a backend torch lists but cannot even query here)
        count, available = 0, False
    if not available:
        what = "CUDA is" if device.type == "cuda" else f"no {device.type} device is"
        raise TrainingError(f"--device {quote(name)}: {what} not available on this machine (use cpu"
                            f"{', or cuda' if torch.cuda.is_available() else ''})")
    if device.index is not None and count and device.index >= count:
        raise TrainingError(f"--device {quote(name)}: this machine has {count} {device.type} device(s), "
                            f"numbered from 0")
    return device


def use_deterministic_kernels() -> None:
    """Deterministic kernels (and cuBLAS workspace), for bitwise-reproducible runs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def device_target(device: torch.device) -> str:
    """The `precision` pass target for a torch device: 'cpu' or 'cuda-smXY'."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return "cpu"


# --------------------------------------------------------------------------
# Graph preparation
# --------------------------------------------------------------------------


def load_network(network: str | Path | Graph) -> tuple[Graph, str]:
    """(graph, YAML text) of `--network`: a file, or a graph given by a library caller."""
    if isinstance(network, Graph):
        return network, dumps(network)
    path = Path(network)
    if not path.is_file():
        raise VGraphError(f"{path}: network file not found")
    return load(path), path.read_text(encoding="utf-8")


def prepare_graph(graph: Graph, *, passes: str | None = None, fuse: bool = True, target: str = "cpu") -> Graph:
    """A copy of `graph` after the pass pipeline: default, `passes` (a spec), or no fusion.

    `passes=""` runs nothing (the graph as loaded, e.g. one already optimised).
    """
    from vgraph.transform.pipeline import run_pipeline

    if passes is not None and not fuse:
        raise VGraphError("give either --passes or --no-fuse, not both (--no-fuse means the pipeline "
                          f"'{NO_FUSE_PIPELINE}')")
    spec = training_spec(passes, fuse)
    prepared = graph.copy()
    if spec is not None and not spec:  # an empty pipeline: the graph as loaded
        return prepared
    # remat{budget=auto} plans for this device's free memory (a GPU's; on the CPU, the core reads the host's)
    device_memory = available_memory("cuda")[0] if target.startswith("cuda") and torch.cuda.is_available() else None
    run_pipeline(prepared, spec, target=target, data={"device_memory": device_memory} if device_memory else None)
    return prepared


def feed_roles(module: VGraphModule, want: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(token-id feeds, next-token-target feeds) of the computation `want`.

    `vgraph train` can feed token ids to embedders and next-token targets to
    cross-entropy losses; any other network input is reported with its node.
    """
    graph = module.network
    tokens, targets = [], []
    for name in module.feeds_needed(want):
        node_id, _, slot_text = name.rpartition(":in")
        node, slot = graph.node(node_id), int(slot_text)
        if node.type == "embedder" and slot == 0:
            tokens.append(name)
        elif slot == 1 and (node.type == "tied_lm_head_ce" or
                            (node.type == "cost" and node.cfg["cost_function"] in ("ce", "ce_logits"))):
            targets.append(name)
        else:
            raise TrainingError([Diagnostic(
                f"input {slot} of this {node.type} is a network input that `vgraph train` cannot feed: it "
                f"feeds token ids to embedders and next-token targets to cross-entropy costs",
                node.loc, node.id)])
    if not tokens:
        raise TrainingError(f"network {graph.name!r} has no embedder whose token ids training could feed")
    return tokens, targets


def vocab_and_seq(graph: Graph) -> tuple[int, int]:
    """(vocabulary size, sequence length) of the network's (first) embedder: what the data must fit."""
    embedders = graph.nodes_of_type("embedder")
    if not embedders:
        raise TrainingError(f"network {graph.name!r} has no embedder: `vgraph train` trains language models")
    cfg = embedders[0].cfg
    return int(cfg["vocab_size"]), int(cfg["seq_len"])



# --------------------------------------------------------------------------
# The run: everything decided before the first step
# --------------------------------------------------------------------------


@dataclass
class RunSetup:
    """What `set_up_run` decided: the loop and its parts read these, never the raw config again."""

    device: torch.device
    source: Graph  # the network as given (before passes)
    yaml_text: str  # the run's definition: the file's text, or the trained graph after a non-preserving pass
    graph: Graph  # after the pass pipeline: what is compiled and trained
    seq_len: int
    precision: dict[str, Any]  # the `precision` pass's annotation
    dtype: torch.dtype  # the compute dtype (autocast), float32 master weights
    loss_scaling: bool  # fp16: dynamic loss scaling
    run_dir: Path
    latest: Path | None  # the checkpoint to resume from
    data: PreparedData
    run_info: dict[str, Any]  # run.json: also what a resume must not change


def set_up_run(cfg: TrainConfig, say: Callable[[str], None]) -> RunSetup:
    """Check `cfg`, set the process up (threads, determinism), prepare the graph, open the run directory,
    check memory and prepare the data, refusing each before anything large is allocated."""
    check_train_config(cfg)  # a library caller's values, held to the command line's checks
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        use_deterministic_kernels()

    with phase(say, "network loaded and passes run") as details:
        source, yaml_text = load_network(cfg.network)
        graph = prepare_graph(source, passes=cfg.passes, fuse=cfg.fuse, target=device_target(device))
        details.append(f"{len(graph)} VNodes")
    changes = semantic_changes(graph)
    if changes:  # the run trains another function than the file's: it stores that one (run_network.py)
        yaml_text = trained_network_yaml(graph)
        say(f"note: {', '.join(changes)} changed what the network computes; the run stores the network it "
            f"trains (network.yml and every checkpoint), which is not {cfg.network}")
    vocab, seq_len = vocab_and_seq(graph)
    precision = dict(graph.meta.get("precision") or {})
    dtype = compute_dtype(graph)
    if device.type == "cpu" and dtype != torch.float32:
        say(f"note: running {dtype} autocast on the CPU (slow; for tests of the precision path)")
    loss_scaling = bool(precision.get("loss_scaling")) and dtype == torch.float16

    run_dir = Path(cfg.out) if cfg.out is not None else Path("runs") / run_slug(source.name)
    latest = open_run_dir(run_dir, cfg.resume, inputs=(cfg.network, cfg.data, *loaded_files()))

    # Memory: refuse before anything large is allocated.
    with phase(say, "memory estimate") as details:
        estimate = check_memory(graph, cfg.batch, device, compute_dtype=dtype, limit=cfg.memory_limit)
        details.append(estimate.describe())

    with phase(say, "data") as details:
        data = prepare_data(cfg, vocab, seq_len, say)
        details.append(f"{data.description}, {data.dataset.train_tokens:,} train / {data.dataset.val_tokens:,} val "
                       f"tokens, read a window at a time")
    run_info = {"network": source.name, "seed": cfg.seed, "batch": cfg.batch, "seq_len": seq_len,
                **data.run_fields(), "vocab_size": vocab,
                "passes": cfg.passes, "fuse": cfg.fuse, "device": str(device), "precision": precision,
                "lr": cfg.lr, "steps": cfg.steps, "warmup": cfg.warmup, "schedule": cfg.schedule,
                # recorded when set: a run with the defaults writes what it wrote before they existed
                **({"weight_decay": cfg.weight_decay} if cfg.weight_decay else {}),
                **({"grad_accum": cfg.grad_accum} if cfg.grad_accum != 1 else {}),
                "semantic_changes": changes, "network_fingerprint": fingerprint(graph),
                "plugins": loaded_files(),  # named (never loaded) when a later command lacks them
                "plugin_distributions": plugin_distributions(source, graph),  # likewise, by package
                "memory_estimate": estimate_record(estimate, device)}  # vs measured: `vgraph report`
    return RunSetup(device, source, yaml_text, graph, seq_len, precision, dtype, loss_scaling, run_dir, latest,
                    data, run_info)


def open_run_dir(run_dir: Path, resume: bool, *, command: str = "vgraph train",
                 inputs: Sequence[str | Path | None] = ()) -> Path | None:
    """Create `run_dir` (or clean a killed run's temporaries from it) and take its lock; its latest
    checkpoint, which only `--resume` may continue.  `vgraph train` and `vgraph launch` (machine 0) both
    open runs here, under the core's rules (vgraph/run/files.py): the directory is not an input, does not
    lie inside one or inside another run's files, is a run or holds none of a run's names, and one process
    writes it at a time (the lock is held until the caller's `RunLock.held()` block ends)."""
    check_output_dir(run_dir, inputs=[i for i in inputs if isinstance(i, (str, Path))], what="run directory")
    refuse_foreign(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run_dir, command)
    if lock.note:
        print(lock.note, file=sys.stderr)
    clean_stale(run_dir)
    latest = None
    try:
        latest = ckpt.latest_checkpoint(run_dir)
    except ckpt.CheckpointError as exc:
        raise TrainingError(f"cannot resume {run_dir}: {exc}") from None
    if latest is not None and not resume:
        raise TrainingError(f"{run_dir} already holds a training run (checkpoint {latest.name}); pass "
                            f"--resume to continue it or choose another --out")
    return latest


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (weight initialisation draws from torch's)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def run_banner(setup: RunSetup, module: VGraphModule) -> str:
    """The line a run starts with: network, size, precision, device, data and run directory."""
    graph, dtype, data = setup.graph, setup.dtype, setup.data
    return (f"{graph.name}: {len(graph)} VNodes, {sum(p.numel() for p in module.parameters()):,} "
            f"parameters, {str(dtype).removeprefix('torch.')} compute on {setup.device}"
            f"{' with loss scaling' if setup.loss_scaling else ''}"
            f"{' (' + setup.precision['reason'] + ')' if setup.precision.get('reason') else ''}; data "
            f"{data.description} ({data.dataset.train_tokens:,} train / "
            f"{data.dataset.val_tokens:,} val tokens, {data.tokenizer_kind} tokenizer); "
            f"run dir {setup.run_dir}")
