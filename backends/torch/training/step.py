"""One training step: forward and backward under autocast with the loss scaled, the loss checked, the update.

The loop (train.py) calls `TrainStep.forward_backward`, then, on the steps it
synchronises with the device, `LossCheck.losses` on the losses gathered since
the last sync, then `TrainStep.update`: a non-finite loss therefore stops
training before its step's update is applied.

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
from pathlib import Path
from typing import Callable, Any, Mapping

import torch

from vgraph.ir.graph import Graph

from . import checkpoint as ckpt
from .run_network import finite_checkpoint
from ..lowering.lower import VGraphModule
from .optimizers import NodeOptimizers
from .config import TrainingError

__all__ = ["TrainStep", "LossCheck", "PendingLoss"]

PendingLoss = tuple[int, torch.Tensor, float]  # (step, its loss still on the device, its lr factor)


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
        """Clip (if asked), step every optimizer through the scaler (which skips non-finite steps), zero grads."""
        if self.grad_clip:
            for opt in self.optimizers.optimizers:
                self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self.optimizers.trainable, self.grad_clip)
        for opt in self.optimizers.optimizers:
            self.scaler.step(opt)
        self.scaler.update()
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

    def losses(self, pending: list[PendingLoss]) -> list[float]:
        """The pending losses as floats (a sync point); raises `TrainingError` on one training cannot survive."""
        values = torch.stack([l for _, l, _ in pending]).float().cpu().tolist()
        for (s, _, _), value in zip(pending, values):
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
