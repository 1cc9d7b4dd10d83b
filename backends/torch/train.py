"""`vgraph train`: train a network YAML on text, resumably, with the production precision policy.

One run lives in one directory (``--out``)::

    network.yml        the network as given (before passes): the run's definition
    tokenizer.json     the tokenizer (HF tokenizers JSON)
    run.json           the run's settings (seed, batch, data, precision, ...)
    metrics.jsonl      one JSON object per step (loss, lr, tokens/s, val_loss, metrics: entries)
    metrics.csv        the same as a table
    loss_curve.png     training and validation loss
    step-00000500/     checkpoints (checkpoint.py): weights in the UNFUSED layout, optimizer
    latest             state per parameter, step, RNG and data-generator state, loss scaler,
                       and the network YAML and tokenizer again, so one checkpoint
                       directory is self-contained (`vgraph generate` needs nothing else)

Design points:

* **Graph**: the file is loaded, then the pass pipeline runs for the device
  (`prepare_graph`: the default production pipeline, `--passes SPEC`, or
  `--no-fuse`); the `precision` pass's annotation picks the compute dtype.
* **Per-VNode optimizers**: every trainable VNode is optimised as its config
  says (`optimizer`: adam (default) | sgd | none; `learning_rate` overrides
  `--lr`); a tied weight is its publisher's.  Adam and SGD are elementwise
  per parameter, so VNodes with equal settings share one torch optimizer
  (one param group per learning rate): the math is per VNode, the cost per
  step is that of a hand-written model's single optimizer.
* **Precision**: autocast to the annotated compute dtype (fp16 with dynamic
  loss scaling via GradScaler, bf16 without), float32 master weights and
  float32 losses.  Without annotations (or on a CPU) everything is float32.
* **Exact resume**: the data batches come from their own generator (its state
  is checkpointed) and dropout masks are keyed by (seed, step, VNode, sample)
  (dropout.py, which also makes `vgraph launch`'s micro-batched pipeline
  draw the same masks), so a run killed at any moment and resumed with
  `--resume` ends bitwise equal to an uninterrupted run (CPU,
  `--deterministic`).  Metrics past the checkpoint are dropped on resume.
* **Non-finite loss**: under fp16 loss scaling the scaler skips the step and
  lowers the scale; otherwise (or after too many skips in a row) training
  stops with a `TrainingError` naming the step, before that step's update.
* **Data**: `--data` (file, directory or glob) or the embedded corpus of
  standard-library docstrings; a byte-level BPE of the network's vocabulary
  size is trained and cached.  Networks with a vocabulary under 258 tokens
  (too small for byte-level BPE) get a character-level tokenizer of their
  most frequent characters instead (unknown characters map to `<|unk|>`).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from vgraph.diagnostics import Diagnostic, VGraphError
from vgraph.ir import Graph
from vgraph.yamlio import dumps, load, loads

from . import checkpoint as ckpt
from . import data as D
from .dropout import clear_dropout_key, set_dropout_key
from .lower import VGraphModule, compile_network, compute_dtype
from .memory import check_memory

__all__ = [
    "TrainConfig",
    "TrainResult",
    "TrainingError",
    "train",
    "prepare_graph",
    "device_target",
    "feed_roles",
    "NodeOptimizers",
    "build_tokenizer",
    "char_tokenizer",
    "load_trained",
    "lr_factor",
]

NO_FUSE_PIPELINE = "dead-nodes,precision"
CHECKPOINT_PREFIX = "step-"


class TrainingError(VGraphError):
    """Training cannot go on (non-finite loss, incompatible resume, unusable data)."""


@dataclass
class TrainConfig:
    """Everything `train` needs; the CLI options map onto these fields one to one."""

    network: str | Path | Graph
    data: str | None = None
    steps: int = 1000
    batch: int = 8
    lr: float = 6e-4
    warmup: int = 0
    schedule: str = "constant"  # constant | cosine (to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.1
    seed: int = 0
    out: str | Path | None = None
    resume: bool = False
    device: str | None = None
    passes: str | None = None  # None: the default pipeline; "": no passes at all
    fuse: bool = True
    val_every: int = 200
    val_batches: int = 8
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    deterministic: bool = False
    threads: int | None = None
    log_every: int | None = None  # default: every step on CPU, every 10 on an accelerator
    grad_clip: float | None = None
    corpus_bytes: int = D.DEFAULT_CORPUS_MAX_BYTES
    memory_limit: int | None = None
    compile: bool = False
    progress: bool = True
    initial_loss_scale: float = 2.0**16
    max_skipped_steps: int = 50
    cache_dir: str | Path | None = None


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    skipped_steps: int = 0  # steps the fp16 loss scaler skipped (counted from the scale's halvings)
    history: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------
# Graph preparation
# --------------------------------------------------------------------------


def device_target(device: torch.device) -> str:
    """The `precision` pass target for a torch device: 'cpu' or 'cuda-smXY'."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return "cpu"


def prepare_graph(graph: Graph, *, passes: str | None = None, fuse: bool = True, target: str = "cpu") -> Graph:
    """A copy of `graph` after the pass pipeline: default, `passes` (a spec), or no fusion.

    `passes=""` runs nothing (the graph as loaded, e.g. one already optimised).
    """
    from vgraph.pipeline import run_pipeline

    if passes is not None and not fuse:
        raise VGraphError("give either --passes or --no-fuse, not both (--no-fuse means the pipeline "
                          f"{NO_FUSE_PIPELINE!r})")
    spec = passes if passes is not None else (None if fuse else NO_FUSE_PIPELINE)
    prepared = graph.copy()
    if spec == "":
        return prepared
    run_pipeline(prepared, spec, target=target)
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


def _vocab_and_seq(graph: Graph) -> tuple[int, int]:
    embedders = graph.nodes_of_type("embedder")
    if not embedders:
        raise TrainingError(f"network {graph.name!r} has no embedder: `vgraph train` trains language models")
    cfg = embedders[0].cfg
    return int(cfg["vocab_size"]), int(cfg["seq_len"])


# --------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------


def _make_adam(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Adam, fused when this torch supports it for these tensors (one kernel per step)."""
    try:
        return torch.optim.Adam(groups, fused=True)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.Adam(groups, foreach=True)


class NodeOptimizers:
    """The per-VNode optimizers of a network, batched by identical settings.

    `lr_of(node)` is the learning rate the node is trained with (its own
    `learning_rate`, else the run's `--lr`; a tied node reports its
    publisher's, which owns the weight), times the schedule's current factor.
    """

    KINDS = ("adam", "sgd", "none")

    def __init__(self, module: VGraphModule, base_lr: float) -> None:
        graph = module.network
        self.module = module
        self.base_lr: dict[str, float] = {}
        self.key_of: dict[torch.nn.Parameter, str] = {}
        buckets: dict[tuple[str, float], list[torch.nn.Parameter]] = {}
        for node in graph.topo_order():
            params = module.node_parameters(node.id)
            lr = float(node.cfg.get("learning_rate") or base_lr)
            self.base_lr[node.id] = lr
            kind = node.cfg.get("optimizer") or "adam"
            for pname, param in params.items():
                self.key_of[param] = f"{node.id}.{pname}"
                if kind == "none":
                    param.requires_grad_(False)
                else:
                    buckets.setdefault((kind, lr), []).append(param)
        publishers = graph.publishers()
        for node in graph.nodes:  # a tied node trains with its publisher's optimizer
            tied = node.op.tied(node.cfg)
            if tied and not module.node_parameters(node.id):
                alias = next(iter(tied.values()))[0]
                if alias in publishers:
                    self.base_lr[node.id] = self.base_lr[publishers[alias].id]
        self.optimizers: list[torch.optim.Optimizer] = []
        for kind in ("adam", "sgd"):
            groups = [{"params": ps, "lr": lr, "base_lr": lr} for (k, lr), ps in buckets.items() if k == kind]
            if groups:
                self.optimizers.append(_make_adam(groups) if kind == "adam" else torch.optim.SGD(groups))
        self.factor = 1.0
        self.trainable = [p for ps in buckets.values() for p in ps]

    def set_factor(self, factor: float) -> None:
        if factor != self.factor:
            self.factor = factor
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["base_lr"] * factor

    def lr_of(self, node_id: str) -> float:
        return self.base_lr[node_id] * self.factor

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_by_key(self) -> dict[str, dict[str, Any]]:
        """Optimizer state per parameter key ("<vnode>.<param>"), in the module's layout."""
        out: dict[str, dict[str, Any]] = {}
        for opt in self.optimizers:
            for param, state in opt.state.items():
                out[self.key_of[param]] = dict(state)
        return out

    def load_state_by_key(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        for opt in self.optimizers:
            current = opt.state_dict()
            index = 0
            new_state: dict[int, Any] = {}
            for group in opt.param_groups:
                for param in group["params"]:
                    key = self.key_of[param]
                    if key in states:
                        new_state[index] = dict(states[key])
                    index += 1
            opt.load_state_dict({"state": new_state, "param_groups": current["param_groups"]})


def _state_to_unfused(states: Mapping[str, Mapping[str, Any]], graph: Graph) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state -> unfused keys: moments split like the weights, scalars copied."""
    from .lower import param_sources

    sources = param_sources(graph)
    out: dict[str, dict[str, Any]] = {}
    for key, state in states.items():
        pieces = sources[key]
        rows = [r for _, r in pieces]
        for unfused_key, _ in pieces:
            out[unfused_key] = {}
        for name, value in state.items():
            if len(pieces) > 1 and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape[0] == sum(rows):
                for (unfused_key, _), part in zip(pieces, torch.split(value, rows, dim=0)):
                    out[unfused_key][name] = part
            else:
                for unfused_key, _ in pieces:
                    out[unfused_key][name] = value
    return out


def _state_to_graph(states: Mapping[str, Mapping[str, Any]], graph: Graph) -> dict[str, dict[str, Any]]:
    """Unfused per-parameter optimizer state -> `graph`'s keys (moments concatenated)."""
    from .lower import param_sources

    out: dict[str, dict[str, Any]] = {}
    for key, pieces in param_sources(graph).items():
        parts = [states.get(unfused_key) for unfused_key, _ in pieces]
        if any(p is None for p in parts):
            continue  # never stepped: the optimizer initialises its state on the first step
        merged: dict[str, Any] = {}
        for name, first in parts[0].items():
            if len(parts) > 1 and isinstance(first, torch.Tensor) and first.dim() > 0:
                merged[name] = torch.cat([p[name] for p in parts], dim=0)
            else:
                merged[name] = first
        out[key] = merged
    return out


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def char_tokenizer(documents: list[str], vocab_size: int):
    """A character-level HF tokenizer of the `vocab_size - 3` most frequent characters.

    For networks whose vocabulary is too small for byte-level BPE (< 258):
    ids 0, 1, 2 are `<|endoftext|>`, `<|pad|>`, `<|unk|>`; every other
    character maps to `<|unk|>`.  Decoding concatenates characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [D.EOT_TOKEN, D.PAD_TOKEN, "<|unk|>"]
    if vocab_size < len(specials) + 1:
        raise TrainingError(f"vocab_size {vocab_size} is too small even for a character tokenizer")
    counts = Counter()
    for doc in documents:
        counts.update(doc)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch, _ in ranked:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return tokenizer


def build_tokenizer(documents: list[str], vocab_size: int, cache_dir: str | Path) -> tuple[Any, str]:
    """(tokenizer, kind): cached byte-level BPE when the vocabulary allows, else characters."""
    if vocab_size >= D.MIN_VOCAB_SIZE:
        return D.train_bpe_tokenizer(documents, vocab_size, cache_dir), "bpe"
    return char_tokenizer(documents, vocab_size), "char"


def _cache_dir(config: TrainConfig) -> Path:
    if config.cache_dir is not None:
        return Path(config.cache_dir)
    return Path(os.environ.get("VGRAPH_CACHE") or Path.home() / ".cache" / "vgraph")


@dataclass
class PreparedData:
    dataset: "D.TokenDataset"
    tokenizer: Any
    tokenizer_kind: str  # "bpe" | "char"
    description: str  # where the text came from, for the run info and the log


def prepare_data(config: TrainConfig, vocab: int, seq_len: int) -> PreparedData:
    """The tokenizer and token streams a run trains on: one place for `vgraph train` and `vgraph launch`,
    so both see exactly the same data."""
    documents, description = _documents(config)
    tokenizer, kind = build_tokenizer(documents, vocab, _cache_dir(config))
    if tokenizer.get_vocab_size() > vocab:
        raise TrainingError(f"tokenizer has {tokenizer.get_vocab_size()} tokens but the network's "
                            f"vocabulary is {vocab}")
    try:
        dataset = D.TokenDataset(documents, tokenizer, seq_len=seq_len)
    except D.DataError as exc:
        raise TrainingError(f"training data ({description}): {exc}") from None
    return PreparedData(dataset, tokenizer, kind, description)


def _documents(config: TrainConfig) -> tuple[list[str], str]:
    try:
        if config.data:
            return D.load_text_documents(config.data), str(config.data)
        return D.default_corpus_documents(config.corpus_bytes), f"default corpus ({config.corpus_bytes} bytes)"
    except D.DataError as exc:
        raise TrainingError(f"training data: {exc}") from None


# --------------------------------------------------------------------------
# Run directory: metrics and plots
# --------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (the record) and metrics.csv (the same rows as a table)."""

    def __init__(self, run_dir: Path, columns: list[str]) -> None:
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"
        self.columns = columns
        self.rows: list[dict[str, Any]] = []

    def restart(self, upto_step: int) -> None:
        """Keep rows up to `upto_step` (a resumed run redoes what came after) and rewrite both files."""
        rows = []
        if self.jsonl.is_file():
            for line in self.jsonl.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= upto_step:
                    rows.append(row)
        self.rows = rows
        _atomic_write(self.jsonl, "".join(json.dumps(r) + "\n" for r in rows))
        with open(self.csv.with_suffix(".csv.tmp"), "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(self.csv.with_suffix(".csv.tmp"), self.csv)

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.rows.extend(rows)
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        with open(self.csv, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore").writerows(rows)

    def plot(self, path: Path, title: str) -> None:
        # The object API with the Agg canvas: no pyplot, no GUI backend, nothing global.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        train = [(r["step"], r["loss"]) for r in self.rows if _finite(r.get("loss"))]
        val = [(r["step"], r["val_loss"]) for r in self.rows if _finite(r.get("val_loss"))]
        fig = Figure(figsize=(7, 4.2), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        if train:
            steps, losses = zip(*train)
            ax.plot(steps, losses, lw=0.8, alpha=0.45, label="train loss")
            if len(losses) >= 20:
                span = max(5, len(losses) // 50)
                smooth, ema = [], losses[0]
                for v in losses:
                    ema += (v - ema) / span
                    smooth.append(ema)
                ax.plot(steps, smooth, lw=1.6, label=f"train loss (EMA {span})")
        if val:
            ax.plot(*zip(*val), "o-", lw=1.4, ms=4, label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp)
        os.replace(tmp, path)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def lr_factor(step: int, config: TrainConfig) -> float:
    """Schedule multiplier for (1-based) `step`: linear warmup, then constant or cosine decay."""
    if config.warmup and step <= config.warmup:
        return step / config.warmup
    if config.schedule == "cosine":
        span = max(1, config.steps - config.warmup)
        progress = min(1.0, (step - config.warmup) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def _clean_stale(run_dir: Path) -> None:
    """Remove temporaries a killed checkpoint write left behind (never a complete checkpoint)."""
    for p in run_dir.glob(f".{CHECKPOINT_PREFIX}*"):
        if ".tmp-" in p.name or ".old-" in p.name:
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainingError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"--device {name}: CUDA is not available on this machine")
    return device


def _deterministic() -> None:
    """Deterministic kernels (and cuBLAS workspace), for bitwise-reproducible runs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def _load_network(network: str | Path | Graph) -> tuple[Graph, str]:
    if isinstance(network, Graph):
        return network, dumps(network)
    path = Path(network)
    if not path.is_file():
        raise VGraphError(f"{path}: network file not found")
    return load(path), path.read_text(encoding="utf-8")


class _Run:
    """The state of one training run; `train()` is the public entry point."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.say: Callable[[str], None] = (lambda msg: None)

    # The loop is kept in one function so that nothing per step goes through extra calls.
    def run(self) -> TrainResult:  # noqa: C901 - the training loop, top to bottom
        cfg = self.config
        if cfg.steps < 0 or cfg.batch < 1:
            raise TrainingError(f"--steps must be >= 0 and --batch >= 1 (got {cfg.steps}, {cfg.batch})")
        if cfg.schedule not in ("constant", "cosine"):
            raise TrainingError(f"--schedule must be constant or cosine, not {cfg.schedule!r}")
        device = _resolve_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.deterministic:
            _deterministic()

        source, yaml_text = _load_network(cfg.network)
        graph = prepare_graph(source, passes=cfg.passes, fuse=cfg.fuse, target=device_target(device))
        vocab, seq_len = _vocab_and_seq(graph)
        precision = dict(graph.meta.get("precision") or {})
        dtype = compute_dtype(graph)
        if device.type == "cpu" and dtype != torch.float32:
            self.say(f"note: running {dtype} autocast on the CPU (slow; for tests of the precision path)")
        loss_scaling = bool(precision.get("loss_scaling")) and dtype == torch.float16

        run_dir = Path(cfg.out) if cfg.out is not None else Path("runs") / _slug(source.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        _clean_stale(run_dir)
        latest = None
        try:
            latest = ckpt.latest_checkpoint(run_dir)
        except ckpt.CheckpointError as exc:
            raise TrainingError(f"cannot resume {run_dir}: {exc}") from None
        if latest is not None and not cfg.resume:
            raise TrainingError(f"{run_dir} already holds a training run (checkpoint {latest.name}); pass "
                                f"--resume to continue it or choose another --out")

        # Memory: refuse before anything large is allocated.
        estimate = check_memory(graph, cfg.batch, device, compute_dtype=dtype, limit=cfg.memory_limit)
        self.say(f"memory estimate: {estimate.describe()}")

        data = prepare_data(cfg, vocab, seq_len)
        dataset, tokenizer, tok_kind, data_desc = data.dataset, data.tokenizer, data.tokenizer_kind, data.description
        run_info = {"network": source.name, "seed": cfg.seed, "batch": cfg.batch, "seq_len": seq_len,
                    "data": data_desc, "tokenizer": tok_kind, "vocab_size": vocab,
                    "passes": cfg.passes, "fuse": cfg.fuse, "device": str(device), "precision": precision,
                    "lr": cfg.lr, "steps": cfg.steps, "warmup": cfg.warmup, "schedule": cfg.schedule}

        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        try:
            import numpy as np

            np.random.seed(cfg.seed % 2**32)
        except ImportError:  # pragma: no cover
            pass
        module = compile_network(graph, device=device, train=True, seed=cfg.seed)
        optimizers = NodeOptimizers(module, cfg.lr)
        scaler = torch.amp.GradScaler(device.type, init_scale=cfg.initial_loss_scale, enabled=loss_scaling)
        data_gen = torch.Generator().manual_seed(cfg.seed)
        tokenizer_json = tokenizer.to_str()

        start_step = 0
        if latest is not None:
            start_step = self._resume(latest, module, optimizers, scaler, data_gen, graph, run_info)
        else:
            _atomic_write(run_dir / "network.yml", yaml_text)
            _atomic_write(run_dir / "tokenizer.json", tokenizer_json)
        _atomic_write(run_dir / "run.json", json.dumps(run_info, indent=2, default=str) + "\n")

        costs = tuple(module.cost_names)
        if not costs:
            raise TrainingError(f"network {graph.name!r} has no costs: nothing to train")
        token_feeds, target_feeds = feed_roles(module, costs)
        metric_eps = list(graph.metrics)
        columns = ["step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale",
                   *[ep.name for ep in metric_eps if ep.name not in ("step", "loss", "lr")]]
        log = MetricsLog(run_dir, columns)
        log.restart(start_step)

        program = module.program_for(costs, training=True)
        forward = torch.compile(program.module) if cfg.compile else program.module
        feed_is_tokens = [name in token_feeds for name in program.feeds]
        batches = dataset.batches("train", cfg.batch, seq_len, data_gen)
        is_accel = device.type != "cpu"
        log_every = cfg.log_every or (10 if is_accel else 1)
        amp = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
               else contextlib.nullcontext())
        tokens_per_step = cfg.batch * seq_len

        def save(step: int) -> Path:
            return self._save(run_dir, step, module, optimizers, scaler, data_gen, graph, run_info,
                              yaml_text, tokenizer_json)

        result = TrainResult(run_dir, start_step, None, None, latest)
        if start_step >= cfg.steps:
            self.say(f"{run_dir}: already trained to step {start_step}")
            result.history = log.rows
            return result

        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc=_slug(source.name), unit="step",
                   disable=not cfg.progress, dynamic_ncols=True, file=sys.stderr)
        self.say = (lambda msg: bar.write(msg, file=sys.stderr)) if cfg.progress else self.say
        self.say(f"{graph.name}: {len(graph)} VNodes, {sum(p.numel() for p in module.parameters()):,} "
                 f"parameters, {str(dtype).removeprefix('torch.')} compute on {device}"
                 f"{' with loss scaling' if loss_scaling else ''}"
                 f"{' (' + precision['reason'] + ')' if precision.get('reason') else ''}; data {data_desc} "
                 f"({dataset.train_tokens.numel():,} train / {dataset.val_tokens.numel():,} val tokens, "
                 f"{tok_kind} tokenizer); run dir {run_dir}")
        pending: list[tuple[int, torch.Tensor, float]] = []
        consecutive_bad = 0
        skipped_total = 0
        last_scale = scaler.get_scale() if loss_scaling else 1.0
        last_flush = time.perf_counter()
        start_time = last_flush
        last_val: float | None = None
        step = start_step
        try:
            for step in range(start_step + 1, cfg.steps + 1):
                inputs, targets = next(batches)
                if is_accel:
                    inputs = inputs.to(device, non_blocking=True)
                    targets = targets.to(device, non_blocking=True)
                optimizers.set_factor(lr_factor(step, cfg))
                set_dropout_key(cfg.seed, step)  # masks keyed by (seed, step, VNode, sample): dropout.py
                with amp:
                    out = forward(*[inputs if is_tokens else targets for is_tokens in feed_is_tokens])
                loss = out[costs[0]]
                for name in costs[1:]:
                    loss = loss + out[name]
                scaler.scale(loss).backward()
                pending.append((step, loss.detach(), optimizers.factor))

                validate = cfg.val_every > 0 and (step % cfg.val_every == 0 or step == cfg.steps)
                save_now = step == cfg.steps or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0)
                flush = save_now or validate or step % log_every == 0
                extras: dict[str, Any] = {}
                if flush:
                    # Sync point: a non-finite loss stops here, before its update is applied.
                    values = torch.stack([l for _, l, _ in pending]).float().cpu().tolist()
                    for (s, _, _), value in zip(pending, values):
                        if math.isfinite(value):
                            consecutive_bad = 0
                            continue
                        consecutive_bad += 1
                        if not loss_scaling or consecutive_bad > cfg.max_skipped_steps:
                            raise TrainingError(self._diverged(s, value, graph, run_dir, loss_scaling,
                                                               consecutive_bad))
                    extras = self._metric_values(metric_eps, module, optimizers, scaler, out)
                if cfg.grad_clip:
                    for opt in optimizers.optimizers:
                        scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(optimizers.trainable, cfg.grad_clip)
                for opt in optimizers.optimizers:
                    scaler.step(opt)
                scaler.update()
                optimizers.zero_grad()

                if not flush:
                    continue
                now = time.perf_counter()
                if validate:
                    last_val = self._validate(module, dataset, cfg, seq_len, device, amp, costs,
                                              token_feeds, target_feeds)
                rows = []
                for (s, _, factor), value in zip(pending, values):
                    rows.append({"step": s, "loss": value, "lr": cfg.lr * factor,
                                 "tokens_per_s": tokens_per_step * len(pending) / max(now - last_flush, 1e-9),
                                 "elapsed_s": now - start_time})
                rows[-1].update(extras)
                if loss_scaling:
                    scale = scaler.get_scale()
                    if scale < last_scale:  # each skipped step halves the scale
                        skipped_total += round(math.log2(last_scale / scale))
                    last_scale = scale
                    rows[-1]["loss_scale"] = scale
                if validate:
                    rows[-1]["val_loss"] = last_val
                log.append(rows)
                result.loss = values[-1]
                bar.update(len(pending))
                bar.set_postfix(loss=f"{values[-1]:.4f}", tok_s=f"{rows[-1]['tokens_per_s']:,.0f}",
                                lr=f"{rows[-1]['lr']:.2e}", refresh=False)
                pending.clear()
                last_flush = time.perf_counter()
                if validate:
                    log.plot(run_dir / "loss_curve.png", source.name)
                if save_now:
                    result.checkpoint = save(step)
                    last_flush = time.perf_counter()
        finally:
            clear_dropout_key()
            bar.close()
        log.plot(run_dir / "loss_curve.png", source.name)
        result.step = step
        result.val_loss = last_val
        result.skipped_steps = skipped_total
        result.history = log.rows
        return result

    # -- pieces of the loop that do not run every step ------------------------------
    def _metric_values(self, metric_eps, module: VGraphModule, optimizers: NodeOptimizers,
                       scaler: torch.amp.GradScaler, out: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        graph = module.network
        cost_at = {(ep.node, ep.slot): ep.name for ep in graph.costs}
        for ep in metric_eps:
            if ep.type in (None, "learning_rate"):
                values[ep.name] = optimizers.lr_of(ep.node) if ep.node in optimizers.base_lr else None
            elif ep.type == "loss" and (ep.node, ep.slot) in cost_at:
                values[ep.name] = float(out[cost_at[(ep.node, ep.slot)]].detach())
            elif ep.type == "grad_norm":
                node = graph.node(ep.node)
                params = list(module.node_parameters(ep.node).values())
                if not params and node.op.tied(node.cfg):
                    alias = next(iter(node.op.tied(node.cfg).values()))[0]
                    params = [module.node_parameters(graph.publishers()[alias].id)["weight"]]
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                    values[ep.name] = float(norm) / (scaler.get_scale() if scaler.is_enabled() else 1.0)
        return values

    @torch.no_grad()
    def _validate(self, module, dataset, cfg, seq_len, device, amp, costs, token_feeds, target_feeds) -> float:
        module.eval()
        total = 0.0
        count = 0
        try:
            for i, (inputs, targets) in enumerate(dataset.val_batches(cfg.batch, seq_len)):
                if i >= cfg.val_batches:
                    break
                feeds = {name: inputs.to(device) for name in token_feeds}
                feeds.update({name: targets.to(device) for name in target_feeds})
                with amp:
                    out = module(feeds, want=costs)
                total += float(sum(out[c] for c in costs)) * inputs.shape[0]
                count += inputs.shape[0]
        finally:
            module.train()
        return total / max(count, 1)

    def _diverged(self, step: int, value: float, graph: Graph, run_dir: Path, loss_scaling: bool,
                  streak: int) -> str:
        try:
            last = ckpt.latest_checkpoint(run_dir)
        except ckpt.CheckpointError:
            last = None
        where = (f"the last checkpoint, {last}, predates it: resume from it (--resume) with a lower --lr"
                 if last else "no checkpoint was written yet: restart with a lower --lr")
        why = (f"the loss scaler skipped {streak} steps in a row without recovering" if loss_scaling
               else "training stopped before applying that step's update")
        return (f"network {graph.name!r}: the loss at step {step} is {value} (not finite); {why}. {where}, "
                f"or clip gradients with --grad-clip 1.0.")

    def _save(self, run_dir: Path, step: int, module: VGraphModule, optimizers: NodeOptimizers,
              scaler: torch.amp.GradScaler, data_gen: torch.Generator, graph: Graph,
              run_info: dict, yaml_text: str, tokenizer_json: str) -> Path:
        model_state = module.unfused_state_dict()
        opt_state = _state_to_unfused(optimizers.state_by_key(), graph)
        extra = {
            "layout": "unfused",
            "data_generator": data_gen.get_state(),
            "grad_scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "run": json.loads(json.dumps(run_info, default=str)),
            "network_yaml": yaml_text,
            "tokenizer_json": tokenizer_json,
        }
        path = ckpt.save_checkpoint(run_dir / f"{CHECKPOINT_PREFIX}{step:08d}", step=step,
                                    model_state=model_state, optimizer_states=opt_state,
                                    rng_state=ckpt.capture_rng_state(), extra=extra)
        keep = max(1, self.config.keep_checkpoints)
        for old in _checkpoints(run_dir)[:-keep]:
            if old.name != path.name:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def _resume(self, latest: Path, module: VGraphModule, optimizers: NodeOptimizers,
                scaler: torch.amp.GradScaler, data_gen: torch.Generator, graph: Graph, run_info: dict) -> int:
        try:
            state = ckpt.load_checkpoint(latest, map_location="cpu")
        except ckpt.CheckpointError as exc:
            raise TrainingError(f"cannot resume: {exc}") from None
        before = state.extra.get("run", {})
        for key in ("seed", "batch", "seq_len", "data", "vocab_size", "tokenizer"):
            if key in before and before[key] != run_info[key]:
                raise TrainingError(f"cannot resume {latest.parent}: it was trained with {key}={before[key]!r}, "
                                    f"this run has {key}={run_info[key]!r}; resuming must not change it")
        for key in ("lr", "warmup", "schedule"):
            if key in before and before[key] != run_info[key]:
                self.say(f"note: resuming with {key}={run_info[key]!r} (the run had {before[key]!r})")
        device = next(module.parameters()).device
        module.load_unfused_state_dict({k: v.to(device) for k, v in state.model_state.items()})
        optimizers.load_state_by_key(_state_to_graph(state.optimizer_states, graph))
        if state.extra.get("grad_scaler") and scaler.is_enabled():
            scaler.load_state_dict(state.extra["grad_scaler"])
        data_gen.set_state(state.extra["data_generator"])
        ckpt.restore_rng_state(state.rng_state)
        self.say(f"resumed from {latest} at step {state.step}")
        return state.step


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-") or "network"


def train(config: TrainConfig) -> TrainResult:
    """Train as `config` says (see the module docstring); returns where the run ended.

    Process-wide torch settings the run changes (deterministic algorithms,
    thread count) are restored afterwards, so a library caller keeps its own.
    """
    run = _Run(config)
    if config.progress:
        run.say = lambda msg: print(msg, file=sys.stderr)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    try:
        return run.run()
    finally:
        if config.deterministic:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        if config.threads:
            torch.set_num_threads(threads)


# --------------------------------------------------------------------------
# Loading a trained checkpoint (for generation)
# --------------------------------------------------------------------------


def load_trained(path: str | Path, *, device: str | None = None, fuse: bool = True):
    """(module in eval mode, tokenizer, graph) from a checkpoint or a run directory (its latest).

    A checkpoint carries its network YAML and tokenizer, so nothing else is
    needed; the graph is prepared for `device` like training prepares it.
    """
    from tokenizers import Tokenizer

    target = Path(path)
    if not target.exists():
        raise VGraphError(f"{target}: no such checkpoint or run directory")
    try:
        if (target / ckpt.LATEST_POINTER).is_file():
            target = ckpt.latest_checkpoint(target) or target
        state = ckpt.load_checkpoint(target, map_location="cpu")
    except ckpt.CheckpointError as exc:
        raise VGraphError(f"{path}: {exc}") from None
    yaml_text = state.extra.get("network_yaml")
    tokenizer_json = state.extra.get("tokenizer_json")
    if not yaml_text or not tokenizer_json:
        raise VGraphError(f"{target}: this checkpoint does not carry its network and tokenizer "
                          f"(not written by `vgraph train`)")
    torch_device = _resolve_device(device)
    run = state.extra.get("run") or {}
    source = loads(yaml_text, file=f"{target}/network.yml")
    graph = prepare_graph(source, passes=run.get("passes"), fuse=fuse and run.get("fuse", True),
                          target=device_target(torch_device))
    module = compile_network(graph, device=torch_device, train=False, unfused_state=state.model_state)
    return module, Tokenizer.from_str(tokenizer_json), graph
