"""One training step: forward and backward under autocast with the loss scaled, the loss checked, the update.

`LocalStep` is `vgraph train`'s step strategy for the one training loop
(loop.py): `TrainStep.forward_backward`, then, on the steps the loop makes
sync points, `LossCheck.losses` on the losses gathered since the last one,
then `TrainStep.update` (loop.apply_update's order): a non-finite loss
therefore stops training before its step's update is applied.

* **Precision**: autocast to the annotated compute dtype (fp16 with dynamic
  loss scaling via GradScaler, bf16 without), float32 master weights and
  float32 losses.  Without annotations (or on a CPU) everything is float32.
* **Non-finite loss**: under fp16 loss scaling the scaler skips the step and
  lowers the scale; otherwise (or after too many skips in a row) training
  stops with a `TrainingError` naming the step.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable, Any, Iterable, Mapping

import torch

from vgraph.ir.graph import Graph

from . import checkpoint as ckpt
from .run_network import finite_checkpoint
from ..lowering.dropout import set_dropout_key
from ..lowering.lower import VGraphModule
from .loop import Due, StepDone, apply_update
from .optimizers import NodeOptimizers
from .peak_memory import TensorPeak, memory_figures
from .config import TrainConfig, TrainingError

__all__ = ["TrainStep", "LossCheck", "LocalStep", "metric_values", "read_back"]


class TrainStep:
    """Forward + backward of one batch and the optimizer update, for the training program of `costs`."""

    def __init__(self, module: VGraphModule, optimizers: NodeOptimizers, scaler: torch.amp.GradScaler,
                 costs: tuple[str, ...], token_feeds: list[str], amp: contextlib.AbstractContextManager, *,
                 compile: bool, grad_clip: float | None) -> None:
        program = module.program_for(costs, training=True)
        self.forward = torch.compile(program.module) if compile else program.module
        self.feed_is_tokens = [name in token_feeds for name in program.feeds]
        self.optimizers = optimizers
        self.scaler = scaler
        self.costs = costs
        self.amp = amp
        self.grad_clip = grad_clip

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, accumulate: int = 1,
                         dropout_key: Callable[[int], None] | None = None
                         ) -> tuple[Mapping[str, torch.Tensor], torch.Tensor]:
        """(the program's outputs, the summed loss, detached); the gradients are accumulated (scaled).

        With `accumulate` K > 1 the batch is K micro-batches run one after the other (gradient accumulation:
        the memory of one micro-batch, the step of the whole batch).  A cost is a mean over its positions and
        every sample is a full window, so each micro-batch's loss weighs 1/K and the gradients sum to the
        whole batch's; `dropout_key(offset)` keys the masks by the sample's index in the whole batch, so the
        step draws the masks the whole batch would.  Outputs are the last micro-batch's."""
        if accumulate == 1:
            return self._forward_backward(inputs, targets, 1.0)
        total = 0.0
        size = inputs.shape[0] // accumulate
        for m in range(accumulate):
            if dropout_key is not None:
                dropout_key(m * size)
            part = slice(m * size, (m + 1) * size)
            out, loss = self._forward_backward(inputs[part], targets[part], 1.0 / accumulate)
            total = total + loss
        return out, total

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float
                          ) -> tuple[Mapping[str, torch.Tensor], torch.Tensor]:
        with self.amp:
            out = self.forward(*[inputs if is_tokens else targets for is_tokens in self.feed_is_tokens])
        loss = out[self.costs[0]]
        for name in self.costs[1:]:
            loss = loss + out[name]
        if weight != 1.0:
            loss = loss * weight
        self.scaler.scale(loss).backward()
        return out, loss.detach()

    def update(self) -> None:
        """The update in loop.apply_update's order, through the GradScaler (loop.GradientUpdate)."""
        apply_update(self, self.grad_clip)

    def unscale(self) -> bool:
        """Before a clip, unscale through the scaler (otherwise its `step` unscales, or hands the scale to an
        optimizer that takes it).  False: the scaler finds a non-finite gradient itself and its `step` skips
        the update, without the device sync that reading its flag here would cost."""
        if self.grad_clip:
            for opt in self.optimizers.optimizers:
                self.scaler.unscale_(opt)
        return False

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.optimizers.trainable, max_norm)

    def step(self, skip: bool) -> None:
        for opt in self.optimizers.optimizers:
            self.scaler.step(opt)
        self.scaler.update()

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()


class LossCheck:
    """Stops training on a non-finite loss (unless the loss scaler may skip it) and counts skipped steps.

    Shared by `vgraph train` (a GradScaler) and the workers of `vgraph launch` (their SharedLossScaler,
    which answers `get_scale` alike), so both stop, skip and explain in the same words."""

    def __init__(self, scaler: torch.amp.GradScaler | Any, loss_scaling: bool, max_skipped_steps: int,
                 graph: Graph, run_dir: Path) -> None:
        self.scaler = scaler
        self.loss_scaling = loss_scaling
        self.max_skipped_steps = max_skipped_steps
        self.graph = graph
        self.run_dir = run_dir
        self.consecutive_bad = 0
        self.skipped_steps = 0  # counted from the scale's halvings
        self.last_scale = scaler.get_scale() if loss_scaling else 1.0

    def losses(self, pending: list[tuple[int, torch.Tensor]]) -> list[float]:
        """The pending (step, loss on the device) as floats (a sync point); raises `TrainingError` on one
        training cannot survive."""
        values = torch.stack([l for _, l in pending]).float().cpu().tolist()
        for (s, _), value in zip(pending, values):
            self.check(s, value)
        return values

    def check(self, step: int, value: float) -> None:
        """One step's loss: a `TrainingError` if training cannot survive it (see the class docstring)."""
        if math.isfinite(value):
            self.consecutive_bad = 0
            return
        self.consecutive_bad += 1
        if not self.loss_scaling or self.consecutive_bad > self.max_skipped_steps:
            raise TrainingError(self._diverged(step, value))

    def scale_after_update(self) -> float:
        """The loss scale after the latest update; counts the steps skipped since the previous call."""
        scale = self.scaler.get_scale()
        if scale < self.last_scale:  # each skipped step halves the scale
            self.skipped_steps += round(math.log2(self.last_scale / scale))
        self.last_scale = scale
        return scale

    def _diverged(self, step: int, value: float) -> str:
        try:
            last = ckpt.latest_checkpoint(self.run_dir)
        except ckpt.CheckpointError:
            last = None
        if last is not None and not finite_checkpoint(
                last, lambda path: ckpt.load_checkpoint(path, map_location="cpu").model_state):
            where = (f"the last checkpoint, {last}, holds non-finite weights and cannot be resumed: restart "
                     f"with a lower --lr")
        else:
            where = (f"the last checkpoint, {last}, predates it: resume from it (--resume) with a lower --lr"
                     if last else "no checkpoint was written yet: restart with a lower --lr")
        why = (f"the loss scaler skipped {self.consecutive_bad} steps in a row without recovering"
               if self.loss_scaling else "training stopped before applying that step's update")
        return (f"network {self.graph.name!r}: the loss at step {step} is {value} (not finite); {why}. {where}, "
                f"or clip gradients with --grad-clip 1.0.")


def metric_values(metric_eps: Iterable[Any], module: VGraphModule, optimizers: NodeOptimizers,
                  scaler: torch.amp.GradScaler, out: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The network's `metrics:` entries now (between backward and update: gradients are this step's).

    A figure still on the device stays there until `read_back` (the next sync point), so measuring every
    step costs no device sync of its own."""
    values: dict[str, Any] = {}
    graph = module.network
    cost_at = {(ep.node, ep.slot): ep.name for ep in graph.costs}
    for ep in metric_eps:
        if ep.type in (None, "learning_rate"):
            values[ep.name] = optimizers.lr_of(ep.node) if ep.node in optimizers.base_lr else None
        elif ep.type == "loss" and (ep.node, ep.slot) in cost_at:
            loss = out[cost_at[(ep.node, ep.slot)]].detach()
            values[ep.name] = lambda loss=loss: float(loss)
        elif ep.type == "grad_norm":
            node = graph.node(ep.node)
            params = list(module.node_parameters(ep.node).values())
            if not params and node.op.tied(node.cfg):
                alias = next(iter(node.op.tied(node.cfg).values()))[0]
                params = [module.node_parameters(graph.publishers()[alias].id)["weight"]]
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                scale = scaler.get_scale() if scaler.is_enabled() else 1.0
                values[ep.name] = lambda norm=norm, scale=scale: float(norm) / scale
    return values


def read_back(values: dict[str, Any]) -> None:
    """`metric_values`' figures as numbers (in place), at a sync point."""
    for name, value in values.items():
        if callable(value):
            values[name] = value()


class LocalStep:
    """`vgraph train`'s step strategy (loop.StepStrategy): one process trains the whole batch (`--grad-accum`
    micro-batches one after the other) under autocast with the GradScaler; every sync point is its own."""

    def __init__(self, cfg: TrainConfig, trainer: TrainStep, loss_check: LossCheck, tensor_peak: TensorPeak, *,
                 dataset: Any, device: torch.device, seq_len: int, loss_scaling: bool,
                 measure: Callable[[Mapping[str, torch.Tensor]], dict[str, Any]],
                 validate: Callable[[], float]) -> None:
        self.cfg, self.trainer, self.loss_check, self.tensor_peak = cfg, trainer, loss_check, tensor_peak
        self.dataset, self.device, self.loss_scaling = dataset, device, loss_scaling
        self.measure, self.validate = measure, validate
        self.tokens_per_step = cfg.batch * cfg.grad_accum * seq_len
        self._pending: list[tuple[dict[str, Any], torch.Tensor]] = []  # rows and losses since the last sync
        self._unread: list[dict[str, Any]] = []  # metrics entries measured since then
        self._out: Mapping[str, torch.Tensor] = {}
        self._loss: torch.Tensor | None = None

    def forward_backward(self, step: int, lr_factor: float) -> None:
        cfg = self.cfg
        inputs, targets = self.dataset.batch(step, cfg.batch * cfg.grad_accum)  # (seed, step) names them: data.py
        if self.device.type != "cpu":
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
        self.trainer.optimizers.set_factor(lr_factor)
        set_dropout_key(cfg.seed, step)  # masks keyed by (seed, step, VNode, sample): dropout.py
        self.tensor_peak.begin_step()
        self._out, self._loss = self.trainer.forward_backward(
            inputs, targets, accumulate=cfg.grad_accum, dropout_key=lambda offset: set_dropout_key(cfg.seed, step, offset))

    def update(self, step: int, due: Due, row: dict[str, Any]) -> StepDone:
        """At a sync point (the cadence's, or the clock's: this process alone decides) the losses since the last
        one are checked before this step's update is applied."""
        agreed = replace(due, flush=due.flush or due.clock or due.stop)
        self._pending.append((row, self._loss))
        extras = self.measure(self._out) if agreed.flush or due.by_time else {}
        self._unread.append(extras)
        if agreed.flush:
            values = self.loss_check.losses([(r["step"], loss) for r, loss in self._pending])
            for (r, _), value in zip(self._pending, values):
                r["loss"] = value
            for entries in self._unread:
                read_back(entries)
            self._pending, self._unread = [], []
        self.trainer.update()
        self.tensor_peak.end_step()
        if self.loss_scaling:
            row["loss_scale"] = self.loss_check.scale_after_update()
        return StepDone(agreed, extras)

    def figures(self) -> dict[str, int]:
        return memory_figures(self.tensor_peak)  # vs run.json's memory_estimate

    def close(self) -> None:
        self.tensor_peak.close()
