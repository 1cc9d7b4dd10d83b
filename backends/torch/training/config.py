"""What a training run is asked to do (`TrainConfig`), what it reports (`TrainResult`), how it fails.

Its own module because every part of the loop (training_setup, train_step,
run_checkpoints, ...) and `vgraph launch` (whose `LaunchConfig` extends
`TrainConfig`) share these three names, while train.py, the entry point,
imports those parts: here they depend on nothing of the loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vgraph.base.diagnostics import VGraphError
from vgraph.data.stdlib_corpus import DEFAULT_CORPUS_MAX_BYTES
from vgraph.ir.graph import Graph

__all__ = ["TrainConfig", "TrainResult", "TrainingError"]


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
    accept_network_change: bool = False  # resume on a network other than the checkpoint's (recorded)
    device: str | None = None
    passes: str | None = None  # None: the default pipeline; "": no passes at all
    fuse: bool = True
    val_every: int = 200
    val_batches: int = 8
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    deterministic: bool = False
    threads: int | None = None
    log_every: int | None = None  # None: the loop's one default (training/loop.py: by the clock, any device)
    grad_clip: float | None = None
    weight_decay: float = 0.0  # decoupled (AdamW) decay of Adam nodes' matrices; 0: plain Adam, as before
    grad_accum: int = 1  # micro-batches of `batch` per optimizer step: the step trains grad_accum x batch samples
    corpus_bytes: int = DEFAULT_CORPUS_MAX_BYTES
    memory_limit: int | None = None
    compile: bool = False
    progress: bool = True
    initial_loss_scale: float = 2.0**16
    max_skipped_steps: int = 50
    cache_dir: str | Path | None = None  # the corpus cache (vgraph/data/cache.py); default $VGRAPH_CACHE_DIR, XDG
    tensorboard: bool = True  # event files in the run directory (tensorboard_log.py)
    # The command that continues this run from its run directory (the CLI's own, as typed: vgraph.cli.common.
    # command_line); None: a library caller, told the network and --out only.
    continue_command: Callable[[Path], str] | None = None


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    skipped_steps: int = 0  # steps the fp16 loss scaler skipped (counted from the scale's halvings)
    history: list[dict[str, Any]] = field(default_factory=list)
