"""`vgraph train`: train a network YAML on text, resumably, with the production precision policy.

One run lives in one directory (``--out``)::

    network.yml        the network as given (before passes): the run's definition
    tokenizer.json     the tokenizer (HF tokenizers JSON)
    run.json           the run's settings (seed, batch, data, precision, ...)
    metrics.jsonl      one JSON object per step (loss, lr, tokens/s, val_loss, metrics: entries)
    metrics.csv        the same as a table
    loss_curve.png     training and validation loss
    events.out.tfevents.*  the same curves for TensorBoard (tensorboard_log.py; --no-tensorboard: none)
    step-00000500/     checkpoints (run_checkpoints.py): weights in the UNFUSED layout, optimizer
    latest             state per parameter, step, RNG and data-generator state, loss scaler,
                       and the network YAML and tokenizer again, so one checkpoint
                       directory is self-contained (`vgraph generate` needs nothing else)

This module is the entry point (`train`, `load_trained`): it sets a run up and
hands it to the one training loop (loop.py, which `vgraph launch`'s workers run
too); each part lives in a module of its own:

* set-up (setup.py, corpus.py): the config checked, the device, the graph
  through the pass pipeline, the run directory, memory, the tokenizer and
  token streams;
* the loop (loop.py): the cadence of sync points, validation, checkpoints and
  stop requests, the metrics rows;
* the step (step.py, optimizers.py): `LocalStep`, forward and backward under
  autocast with loss scaling, the non-finite-loss check, the per-VNode
  optimizers and the learning-rate schedule;
* evaluation (validation.py): the held-out loss;
* checkpointing (run_checkpoints.py): save, prune, resume, clean a killed write;
* logging (run_output.py, metrics_log.py): metrics.jsonl / .csv, the loss
  curve, the progress bar.

**Exact resume**: a step's samples are a function of (seed, step) (data.py:
nothing to checkpoint) and dropout masks are keyed by (seed, step, VNode, sample)
(dropout.py, which also makes `vgraph launch`'s micro-batched pipeline draw
the same masks), so a run killed at any moment and resumed with `--resume`
ends bitwise equal to an uninterrupted run (CPU, `--deterministic`).
Metrics past the checkpoint are dropped on resume.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from vgraph.base.diagnostics import VGraphError
from vgraph.plugins import naming_missing_plugins
from vgraph.run import files
from vgraph.run.files import RunLock, RunReader
from vgraph.yamlio import loads

from . import checkpoint as ckpt
from .interrupt import StopRequest
from ..lowering.lower import compile_network
from .loop import row_columns, run_loop
from .metrics_log import MetricsLog, progress_bar
from .optimizers import NodeOptimizers, lr_factor
from .peak_memory import TensorPeak
from .run_checkpoints import TrainingState, resume_run, save_run_checkpoint
from .run_files import atomic_write_text
from .run_output import LocalOutput
from .tensorboard_log import TensorBoardLog
from .run_network import check_finite, definition_graph, passes_for_definition, require_match
from .config import TrainConfig, TrainingError, TrainResult
from .step import LocalStep, LossCheck, TrainStep, metric_values
from .setup import (device_target, feed_roles, phase, prepare_graph, resolve_device, run_banner, seed_everything,
                    set_up_run)
from .validation import validation_loss

__all__ = [
    "TrainConfig",
    "TrainResult",
    "TrainingError",
    "train",
    "prepare_graph",
    "device_target",
    "feed_roles",
    "NodeOptimizers",
    "load_trained",
    "lr_factor",
]


def train(config: TrainConfig) -> TrainResult:
    """Train as `config` says (see the module docstring); returns where the run ended.

    Process-wide torch settings the run changes (deterministic algorithms,
    thread count) are restored afterwards, so a library caller keeps its own.
    """
    say: Callable[[str], None] = ((lambda msg: print(msg, file=sys.stderr)) if config.progress
                                  else (lambda msg: None))
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    try:
        with RunLock.held():  # the run directory's lock, taken when it is opened, is held until here
            return _train(config, say)
    finally:
        if config.deterministic:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        if config.threads:
            torch.set_num_threads(threads)


def _train(cfg: TrainConfig, say: Callable[[str], None]) -> TrainResult:
    """Set the run up, then train from its start step (0, or its checkpoint's) to `cfg.steps`."""
    run = _set_up(cfg, say)
    result = TrainResult(run.dir, run.start_step, None, None, run.setup.latest)
    if run.start_step >= cfg.steps:
        say(f"{run.dir}: already trained to step {run.start_step}")
        result.history = run.log.rows
        run.close()
        return result
    return _loop(run, result, say)


@dataclass
class _Run:
    """What the loop needs, made once before its first step: the set-up (training_setup.py), the compiled
    network with its optimizers and loss scaler, the step strategy, the logs."""

    cfg: TrainConfig
    setup: Any
    module: Any
    state: TrainingState
    steps: LocalStep
    log: MetricsLog
    tokenizer_json: str
    start_step: int

    @property
    def dir(self) -> Path:
        return self.setup.run_dir

    def close(self) -> None:
        self.steps.close()
        self.log.close()


def _set_up(cfg: TrainConfig, say: Callable[[str], None]) -> _Run:
    """Config, device, graph, run directory and data (set_up_run); the weights and optimizers; resume from the
    checkpoint when there is one; the run's files; the logs and the step."""
    setup = set_up_run(cfg, say)
    device, graph, run_dir = setup.device, setup.graph, setup.run_dir
    with phase(say, "compiled to torch and optimizers made") as details:
        seed_everything(cfg.seed)
        module = compile_network(graph, device=device, train=True, seed=cfg.seed)
        state = TrainingState(
            module, NodeOptimizers(module, cfg.lr, cfg.weight_decay),
            torch.amp.GradScaler(device.type, init_scale=cfg.initial_loss_scale, enabled=setup.loss_scaling))
        details.append(f"{sum(p.numel() for p in module.parameters()):,} parameters on {device}")
    tokenizer_json = setup.data.tokenizer.to_str()
    start_step = 0
    if setup.latest is not None:
        start_step = resume_run(setup.latest, state, setup.run_info, say, yaml_text=setup.yaml_text,
                                network=str(cfg.network), accept_network_change=cfg.accept_network_change)
    else:
        atomic_write_text(run_dir / files.TOKENIZER_JSON, tokenizer_json)
    atomic_write_text(run_dir / files.NETWORK_YML, setup.yaml_text)  # the network trained from here on
    atomic_write_text(run_dir / files.RUN_JSON, json.dumps(setup.run_info, indent=2, default=str) + "\n")

    costs = tuple(module.cost_names)
    if not costs:
        raise TrainingError(f"network {graph.name!r} has no costs: nothing to train")
    token_feeds, target_feeds = feed_roles(module, costs)
    metric_eps = list(graph.metrics)
    tensorboard = (TensorBoardLog(run_dir, settings=setup.run_info, graph=graph, say=say) if cfg.tensorboard
                   else None)  # event files beside metrics.jsonl, the same rows (tensorboard_log.py)
    log = MetricsLog(run_dir, row_columns(ep.name for ep in metric_eps), sink=tensorboard)
    log.restart(start_step)
    amp = (torch.autocast(device.type, dtype=setup.dtype) if setup.dtype != torch.float32
           else contextlib.nullcontext())
    trainer = TrainStep(module, state.optimizers, state.scaler, costs, token_feeds, amp, compile=cfg.compile,
                        grad_clip=cfg.grad_clip)

    def validate() -> float:  # found through this module's globals at the call (tests wrap it here)
        return validation_loss(module, setup.data.dataset, batch=cfg.batch, max_batches=cfg.val_batches,
                               device=device, amp=amp, costs=costs, token_feeds=token_feeds, target_feeds=target_feeds)

    steps = LocalStep(cfg, trainer, LossCheck(state.scaler, setup.loss_scaling, cfg.max_skipped_steps, graph, run_dir),
                      TensorPeak(device, lambda: (module, *state.optimizers.optimizers)),  # vs the estimate
                      dataset=setup.data.dataset,  # step s reads the samples (seed, s) names: nothing to checkpoint
                      device=device, seq_len=setup.seq_len, loss_scaling=setup.loss_scaling,
                      measure=lambda out: metric_values(metric_eps, module, state.optimizers, state.scaler, out),
                      validate=validate)
    return _Run(cfg, setup, module, state, steps, log, tokenizer_json, start_step)


def _loop(run: _Run, result: TrainResult, say: Callable[[str], None]) -> TrainResult:
    """The one training loop (loop.py) with this process's step (step.LocalStep) and output
    (run_output.LocalOutput); a stop request (Ctrl-C / SIGTERM: interrupt.py) ends it with a checkpoint and
    a message saying how to continue."""
    cfg, setup = run.cfg, run.setup
    bar = progress_bar(cfg.steps, run.start_step, "train", cfg.progress)
    say = (lambda msg: bar.write(msg, file=sys.stderr)) if cfg.progress else say
    say(run_banner(setup, run.module))

    def save(step: int) -> Path:  # found through this module's globals at the call (tests wrap it here)
        return save_run_checkpoint(run.dir, step, run.state, setup.run_info, setup.yaml_text, run.tokenizer_json,
                                   cfg.keep_checkpoints)

    out = LocalOutput(run.log, bar, save, (run.dir / files.LOSS_CURVE_PNG, setup.source.name))
    stop = StopRequest(say)  # finish the step, checkpoint, say how to resume
    with stop.installed():
        end = run_loop(run.steps, out, stop, cfg, run.start_step)
    result.step, result.loss, result.val_loss = end.step, end.loss, end.val_loss
    result.checkpoint = end.checkpoint or result.checkpoint
    result.skipped_steps = run.steps.loss_check.skipped_steps
    result.history = run.log.rows
    if end.stopped:
        how = (cfg.continue_command(run.dir) if cfg.continue_command is not None else
               f"vgraph train {cfg.network} --out {run.dir} --resume (and the same options)")
        raise stop.interrupted(f"{run.dir}: stopped at step {end.step} of {cfg.steps}; checkpoint "
                               f"{result.checkpoint}. Continue with: {how}")
    return result


# --------------------------------------------------------------------------
# Loading a trained checkpoint (for generation)
# --------------------------------------------------------------------------


def load_trained(path: str | Path, *, device: str | None = None, fuse: bool = True):
    """(module in eval mode, tokenizer, graph) from a checkpoint or a run directory (its latest).

    A checkpoint carries its network YAML and tokenizer, so nothing else is
    needed; the graph is prepared for `device` like training prepares it.
    The tokenizer is None for a checkpoint without one (`vgraph import hf` of
    a model directory without tokenizer.json): such a model reads token ids.
    """
    try:
        target = ckpt.resolve_checkpoint(path)
    except ckpt.CheckpointError as exc:
        raise VGraphError(str(exc)) from None
    try:
        state = ckpt.load_checkpoint(target, map_location="cpu")
    except ckpt.CheckpointError as exc:
        raise VGraphError(f"{path}: {exc}") from None
    yaml_text = state.extra.get("network_yaml")
    tokenizer_json = state.extra.get("tokenizer_json")
    if not yaml_text:
        raise VGraphError(f"{target}: this checkpoint does not carry its network (not written by `vgraph train`)")
    torch_device = resolve_device(device)
    run = state.extra.get("run") or {}
    check_finite(state.model_state, target)
    source = definition_graph(yaml_text, f"{target}/network.yml", run)
    stored = Path(path) / "network.yml"
    stored_text = RunReader(Path(path)).text("network.yml", "network file") if Path(path).is_dir() else None
    if stored_text is not None and stored_text != yaml_text:  # a run directory was given
        require_match(source, loads(stored_text, file=str(stored)),
                      checkpoint=str(target), given_label=str(stored), changes=run.get("semantic_changes") or ())
    graph = naming_missing_plugins(run, lambda: prepare_graph(
        source, passes=passes_for_definition(run), fuse=fuse and run.get("fuse", True),
        target=device_target(torch_device)))
    tokenizer = ckpt.checked_tokenizer(tokenizer_json, ckpt.network_vocab(source), str(target))
    module = compile_network(graph, device=torch_device, train=False, unfused_state=state.model_state)
    return module, tokenizer, graph
