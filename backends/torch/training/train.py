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

This module is the entry point (`train`, `load_trained`) and the loop itself,
which reads top to bottom; each part it calls lives in a module of its own:

* set-up (training_setup.py, training_data.py): the config checked, the
  device, the graph through the pass pipeline, the run directory, memory,
  the tokenizer and token streams;
* the step (train_step.py, node_optimizers.py): forward and backward under
  autocast with loss scaling, the non-finite-loss check, the per-VNode
  optimizers and the learning-rate schedule;
* evaluation (validation.py): the held-out loss;
* checkpointing (run_checkpoints.py): save, prune, resume, clean a killed write;
* logging (metrics_log.py): metrics.jsonl / .csv, the loss curve, the progress bar.

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
import time
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
from ..lowering.dropout import clear_dropout_key, set_dropout_key
from .interrupt import StopRequest
from ..lowering.lower import compile_network
from .metrics_log import MetricsLog, metric_columns, metric_values, progress_bar, run_banner, step_rows
from .optimizers import NodeOptimizers, lr_factor
from .peak_memory import TensorPeak, memory_figures
from .run_checkpoints import TrainingState, resume_run, save_run_checkpoint
from .run_files import atomic_write_text
from .tensorboard_log import TensorBoardLog
from .run_network import check_finite, definition_graph, passes_for_definition, require_match
from .config import TrainConfig, TrainingError, TrainResult
from .step import LossCheck, PendingLoss, TrainStep
from .setup import (device_target, feed_roles, phase, prepare_graph, resolve_device, seed_everything,
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
    network with its optimizers and loss scaler, the step, the loss check, the logs."""

    cfg: TrainConfig
    setup: Any
    module: Any
    state: TrainingState
    trainer: TrainStep
    loss_check: LossCheck
    tensor_peak: TensorPeak
    log: MetricsLog
    amp: Any
    costs: tuple[str, ...]
    token_feeds: Any
    target_feeds: Any
    metric_eps: list
    tokenizer_json: str
    start_step: int

    @property
    def dir(self) -> Path:
        return self.setup.run_dir

    def close(self) -> None:
        self.tensor_peak.close()
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
    log = MetricsLog(run_dir, metric_columns(metric_eps), sink=tensorboard)
    log.restart(start_step)
    amp = (torch.autocast(device.type, dtype=setup.dtype) if setup.dtype != torch.float32
           else contextlib.nullcontext())
    trainer = TrainStep(module, state.optimizers, state.scaler, costs, token_feeds, amp, compile=cfg.compile,
                        grad_clip=cfg.grad_clip)
    loss_check = LossCheck(state.scaler, setup.loss_scaling, cfg.max_skipped_steps, graph, run_dir)
    tensor_peak = TensorPeak(device, lambda: (module, *state.optimizers.optimizers))  # vs the estimate
    return _Run(cfg, setup, module, state, trainer, loss_check, tensor_peak, log, amp, costs, token_feeds,
                target_feeds, metric_eps, tokenizer_json, start_step)


def _loop(run: _Run, result: TrainResult, say: Callable[[str], None]) -> TrainResult:
    """The steps.  Losses are read back at sync points only (every --log-every steps, validations and
    checkpoints: `_log`), where a non-finite loss stops the run before its update is applied.

    Long because the loop is the one place a reader follows a step from its batch to its checkpoint, and
    the stop handling (a stop request seen at any point saves the last finished step) needs all of it in view.
    """
    cfg, setup, module = run.cfg, run.setup, run.module
    optimizers = run.state.optimizers
    device = setup.device
    dataset = setup.data.dataset  # step s reads the samples (seed, s) names: nothing to checkpoint (data.py)
    is_accel = device.type != "cpu"
    log_every = cfg.log_every or (10 if is_accel else 1)
    bar = progress_bar(cfg.steps, run.start_step, "train", cfg.progress)
    say = (lambda msg: bar.write(msg, file=sys.stderr)) if cfg.progress else say
    say(run_banner(setup, module))
    sync = _SyncPoint(run, bar)
    step = run.start_step
    stop = StopRequest(say)  # Ctrl-C / SIGTERM: finish the step, checkpoint, say how to resume (interrupt.py)
    restore_signals = stop.install()
    try:
        for step in range(run.start_step + 1, cfg.steps + 1):
            # -- the step: forward + backward; at a sync point the losses are checked before the update
            inputs, targets = dataset.batch(step, cfg.batch * cfg.grad_accum)  # --grad-accum K: K x --batch
            if is_accel:
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
            optimizers.set_factor(lr_factor(step, cfg))
            set_dropout_key(cfg.seed, step)  # masks keyed by (seed, step, VNode, sample): dropout.py
            run.tensor_peak.begin_step()
            out, loss = run.trainer.forward_backward(inputs, targets, accumulate=cfg.grad_accum,
                                                     dropout_key=lambda offset: set_dropout_key(cfg.seed, step, offset))
            sync.pending.append((step, loss, optimizers.factor))

            validate = cfg.val_every > 0 and (step % cfg.val_every == 0 or step == cfg.steps)
            save_now = (step == cfg.steps or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0)
                        or stop.requested)
            flush = save_now or validate or step % log_every == 0
            if flush:
                # Sync point: a non-finite loss stops here, before its update is applied.
                values = run.loss_check.losses(sync.pending)
                extras = metric_values(run.metric_eps, module, optimizers, run.state.scaler, out)
            run.trainer.update()
            run.tensor_peak.end_step()
            if not flush:
                continue
            result.loss = sync.log(values, extras, validate)

            # -- checkpointing; the loss curve is drawn here and at the end, not at every validation
            # (matplotlib takes seconds; a killed run keeps the curve of its last checkpoint).  A stop request
            # that arrived after `save_now` was decided (during the update, validation or logging) saves too:
            # the step is finished and logged, and stopping without its checkpoint would lose every step
            # since the last one.
            if save_now or stop.requested:
                result.checkpoint = save_run_checkpoint(run.dir, step, run.state, setup.run_info, setup.yaml_text,
                                                        run.tokenizer_json, cfg.keep_checkpoints)
                run.log.plot(run.dir / files.LOSS_CURVE_PNG, setup.source.name)
                sync.last_flush = time.perf_counter()
            if stop.requested:
                break
        run.log.plot(run.dir / files.LOSS_CURVE_PNG, setup.source.name)  # still under the stop handler
    finally:
        run.tensor_peak.close()
        restore_signals()
        clear_dropout_key()
        bar.close()
        run.log.close()
    result.step = step
    result.val_loss = sync.last_val
    result.skipped_steps = run.loss_check.skipped_steps
    result.history = run.log.rows
    if stop.requested:
        how = (cfg.continue_command(run.dir) if cfg.continue_command is not None else
               f"vgraph train {cfg.network} --out {run.dir} --resume (and the same options)")
        raise stop.interrupted(f"{run.dir}: stopped at step {step} of {cfg.steps}; checkpoint {result.checkpoint}. "
                               f"Continue with: {how}")
    return result


class _SyncPoint:
    """Evaluation and logging at a sync point: validation when due, the rows of the steps since the last sync
    point (throughput over them, memory figures, the loss scale), the progress bar."""

    def __init__(self, run: _Run, bar: Any) -> None:
        self.run, self.bar = run, bar
        self.pending: list[PendingLoss] = []  # steps since the last sync point
        self.last_flush = self.start_time = time.perf_counter()
        self.last_val: float | None = None

    def log(self, values: list[float], extras: dict[str, Any], validate: bool) -> float:
        """Log the pending steps (their checked loss `values`), return the last loss."""
        run, cfg = self.run, self.run.cfg
        now = time.perf_counter()
        if validate:
            self.last_val = validation_loss(run.module, run.setup.data.dataset, batch=cfg.batch,
                                            max_batches=cfg.val_batches, device=run.setup.device, amp=run.amp,
                                            costs=run.costs, token_feeds=run.token_feeds,
                                            target_feeds=run.target_feeds)
        tokens = cfg.batch * cfg.grad_accum * run.setup.seq_len * len(self.pending)
        rows = step_rows(self.pending, values, cfg.lr, tokens / max(now - self.last_flush, 1e-9),
                         now - self.start_time)
        rows[-1].update(extras)
        rows[-1].update(memory_figures(run.tensor_peak))  # vs run.json's memory_estimate
        if run.setup.loss_scaling:
            rows[-1]["loss_scale"] = run.loss_check.scale_after_update()
        if validate:
            rows[-1]["val_loss"] = self.last_val
        run.log.append(rows)
        self.bar.update(len(self.pending))
        shown = {"val": f"{self.last_val:.4f}"} if self.last_val is not None else {}  # kept until the next one
        self.bar.set_postfix(loss=f"{values[-1]:.4f}", tok_s=f"{rows[-1]['tokens_per_s']:,.0f}",
                             lr=f"{rows[-1]['lr']:.2e}", **shown, refresh=False)
        self.pending.clear()
        self.last_flush = time.perf_counter()
        return values[-1]


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
