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

**Exact resume**: the data batches come from their own generator (its state
is checkpointed) and dropout masks are keyed by (seed, step, VNode, sample)
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
from pathlib import Path
from typing import Any, Callable

import torch

from vgraph.base.diagnostics import VGraphError
from vgraph.plugins import naming_missing_plugins
from vgraph.run import files
from vgraph.run.files import RunLock, RunReader
from vgraph.yamlio import loads

from . import checkpoint as ckpt
from .dropout import clear_dropout_key, set_dropout_key
from .interrupt import StopRequest
from .lower import compile_network
from .metrics_log import MetricsLog, metric_columns, metric_values, progress_bar, run_banner, step_rows
from .node_optimizers import NodeOptimizers, lr_factor
from .peak_memory import TensorPeak, memory_figures
from .run_checkpoints import TrainingState, resume_run, save_run_checkpoint
from .run_files import atomic_write_text
from .tensorboard_log import TensorBoardLog
from .run_network import check_finite, definition_graph, passes_for_definition, require_match
from .train_config import TrainConfig, TrainingError, TrainResult
from .train_step import LossCheck, PendingLoss, TrainStep
from .training_setup import (device_target, feed_roles, phase, prepare_graph, resolve_device, seed_everything,
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


def _train(cfg: TrainConfig, say: Callable[[str], None]) -> TrainResult:  # noqa: C901 - the loop, top to bottom
    # -- set-up: config, device, graph, run directory, data; then the weights and the optimizers
    setup = set_up_run(cfg, say)
    device, graph, run_dir, seq_len = setup.device, setup.graph, setup.run_dir, setup.seq_len
    with phase(say, "compiled to torch and optimizers made") as details:
        seed_everything(cfg.seed)
        module = compile_network(graph, device=device, train=True, seed=cfg.seed)
        state = TrainingState(
            module, NodeOptimizers(module, cfg.lr),
            torch.amp.GradScaler(device.type, init_scale=cfg.initial_loss_scale, enabled=setup.loss_scaling))
        details.append(f"{sum(p.numel() for p in module.parameters()):,} parameters on {device}")
    optimizers, scaler = state.optimizers, state.scaler
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
    trainer = TrainStep(module, optimizers, scaler, costs, token_feeds, amp, compile=cfg.compile,
                        grad_clip=cfg.grad_clip)
    loss_check = LossCheck(scaler, setup.loss_scaling, cfg.max_skipped_steps, graph, run_dir)
    tensor_peak = TensorPeak(device, lambda: (module, *optimizers.optimizers))  # vs the estimate (peak_memory.py)
    dataset = setup.data.dataset  # step s reads the samples (seed, s) names: nothing to checkpoint (data.py)
    is_accel = device.type != "cpu"
    log_every = cfg.log_every or (10 if is_accel else 1)
    tokens_per_step = cfg.batch * seq_len

    result = TrainResult(run_dir, start_step, None, None, setup.latest)
    if start_step >= cfg.steps:
        say(f"{run_dir}: already trained to step {start_step}")
        result.history = log.rows
        return result

    bar = progress_bar(cfg.steps, start_step, setup.source.name, cfg.progress)
    say = (lambda msg: bar.write(msg, file=sys.stderr)) if cfg.progress else say
    say(run_banner(setup, module))
    pending: list[PendingLoss] = []  # steps since the last sync point
    last_flush = time.perf_counter()
    start_time = last_flush
    last_val: float | None = None
    step = start_step
    stop = StopRequest(say)  # Ctrl-C / SIGTERM: finish the step, checkpoint, say how to resume (interrupt.py)
    restore_signals = stop.install()
    try:
        for step in range(start_step + 1, cfg.steps + 1):
            # -- the step: forward + backward; at a sync point the losses are checked before the update
            inputs, targets = dataset.batch(step, cfg.batch)
            if is_accel:
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
            optimizers.set_factor(lr_factor(step, cfg))
            set_dropout_key(cfg.seed, step)  # masks keyed by (seed, step, VNode, sample): dropout.py
            tensor_peak.begin_step()
            out, loss = trainer.forward_backward(inputs, targets)
            pending.append((step, loss, optimizers.factor))

            validate = cfg.val_every > 0 and (step % cfg.val_every == 0 or step == cfg.steps)
            save_now = (step == cfg.steps or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0)
                        or stop.requested)
            flush = save_now or validate or step % log_every == 0
            extras: dict[str, Any] = {}
            if flush:
                # Sync point: a non-finite loss stops here, before its update is applied.
                values = loss_check.losses(pending)
                extras = metric_values(metric_eps, module, optimizers, scaler, out)
            trainer.update()
            tensor_peak.end_step()
            if not flush:
                continue

            # -- evaluation and logging, at sync points only
            now = time.perf_counter()
            if validate:
                last_val = validation_loss(module, dataset, batch=cfg.batch, max_batches=cfg.val_batches,
                                           device=device, amp=amp, costs=costs,
                                           token_feeds=token_feeds, target_feeds=target_feeds)
            rows = step_rows(pending, values, cfg.lr, tokens_per_step * len(pending) / max(now - last_flush, 1e-9),
                             now - start_time)
            rows[-1].update(extras)
            rows[-1].update(memory_figures(tensor_peak))  # vs run.json's memory_estimate
            if setup.loss_scaling:
                rows[-1]["loss_scale"] = loss_check.scale_after_update()
            if validate:
                rows[-1]["val_loss"] = last_val
            log.append(rows)
            result.loss = values[-1]
            bar.update(len(pending))
            bar.set_postfix(loss=f"{values[-1]:.4f}", tok_s=f"{rows[-1]['tokens_per_s']:,.0f}",
                            lr=f"{rows[-1]['lr']:.2e}", refresh=False)
            pending.clear()
            last_flush = time.perf_counter()

            # -- checkpointing; the loss curve is drawn here and at the end, not at every validation
            # (matplotlib takes seconds; a killed run keeps the curve of its last checkpoint).  A stop request
            # that arrived after `save_now` was decided (during the update, validation or logging) saves too:
            # the step is finished and logged, and stopping without its checkpoint would lose every step
            # since the last one.
            if save_now or stop.requested:
                result.checkpoint = save_run_checkpoint(run_dir, step, state, setup.run_info, setup.yaml_text,
                                                        tokenizer_json, cfg.keep_checkpoints)
                log.plot(run_dir / files.LOSS_CURVE_PNG, setup.source.name)
                last_flush = time.perf_counter()
            if stop.requested:
                break
        log.plot(run_dir / files.LOSS_CURVE_PNG, setup.source.name)  # still under the stop handler: no traceback
    finally:
        tensor_peak.close()
        restore_signals()
        clear_dropout_key()
        bar.close()
        log.close()
    result.step = step
    result.val_loss = last_val
    result.skipped_steps = loss_check.skipped_steps
    result.history = log.rows
    if stop.requested:
        raise stop.interrupted(f"{run_dir}: stopped at step {step} of {cfg.steps}; checkpoint {result.checkpoint}. "
                               f"Continue with: vgraph train {cfg.network} --out {run_dir} --resume "
                               f"(and the same options)")
    return result


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
    module = compile_network(graph, device=torch_device, train=False, unfused_state=state.model_state)
    return module, Tokenizer.from_str(tokenizer_json), graph
