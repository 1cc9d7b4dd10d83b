"""A launch worker's step strategy for the one training loop (training/loop.py): pipeline round, replicas, agreement.

Per step, on every rank in lockstep: this replica's share of the global batch
(the samples are a function of (seed, step); replicas read disjoint samples),
the rank's ops of the schedule round (stage_runner.py: 1F1B or GPipe,
boundary activations and gradients sent and received, the replicas' gradient
buckets all-reduced during the last backward: grad_sync.py), then **one
reduction** on the control group of [loss, squared gradient norm, non-finite
gradient flag, bytes sent, stop request, rank 0's clock vote], so every rank
takes the same decisions: the loss check (step.LossCheck, as `vgraph train`),
skip under loss scaling, clip, stop, and whether the step is a sync point.
Then the update in loop.apply_update's order, and the tied weights sent from
their owners to their replicas (tie_sync.py).
"""
from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import Any

import torch

from vgraph.run.step_plan import micro_batch_sizes

from .comm import ControlGroup
from .loss_scaler import SharedLossScaler
from .pnode_figures import PNodeFigures
from .powersgd import PowerSGD
from .rank_zero import local_metric_values
from .stage_runner import GlobalBatch, StageRunner
from ..job import Job
from ...training.batches import TokenShards
from ...training.loop import Due, StepDone, apply_update
from ...training.step import LossCheck

__all__ = ["PipelineStep"]


class PipelineStep:
    """One rank's step (loop.StepStrategy and the loop.GradientUpdate of its gradients)."""

    def __init__(self, job: Job, rank: int, stages: StageRunner, ctrl: ControlGroup, dataset: TokenShards, *,
                 scaler: SharedLossScaler, loss_check: LossCheck, figures: PNodeFigures,
                 powersgd: PowerSGD | None) -> None:
        self.job, self.cfg, self.rank, self.stages, self.ctrl = job, job.train, rank, stages, ctrl
        self.dataset, self.scaler, self.loss_check, self.pnode_figures = dataset, scaler, loss_check, figures
        self.powersgd = powersgd
        self.loss_scaling = loss_check.loss_scaling
        self.replica = stages.replica
        self.shares = list(job.batch_shares)
        self.share, self.share_offset = self.shares[self.replica], sum(self.shares[:self.replica])
        self.sizes = micro_batch_sizes(self.share, min(job.micro_batches, self.share))
        self.seq_len = int(job.run_info["seq_len"])
        self.tokens_per_step = self.cfg.batch * self.seq_len
        self._costs: dict[str, torch.Tensor] = {}
        self._found_inf, self._sumsq = False, 0.0
        self.completed: int | None = None  # the last step whose update this rank applied (a rescue shard's step)
        # Held while the update changes the state: a rescue shard written from another thread (the launcher's
        # request while this rank waits on a peer that went dark: worker.RescueWatch) takes it, so it never
        # reads a half-applied step; nothing inside it waits on a peer.
        self.state_lock = threading.Lock()

    def forward_backward(self, step: int, lr_factor: float) -> None:
        """This replica's samples through the rank's part of the schedule round; the replicas' gradient
        buckets still in flight waited for (grad_sync.py)."""
        self.pnode_figures.begin_step()
        lo, hi = self.share_offset, self.share_offset + self.share
        inputs, targets = self.dataset.batch(step, self.cfg.batch, lo, hi)  # this replica's samples only
        for optim in self.stages.optims.values():
            optim.set_factor(lr_factor)
        self._costs = self.stages.run_round(step, inputs, targets, self.sizes, train=True, offset=lo,
                                            whole=self._global_batch(step) if len(self.shares) > 1 else None)
        self.stages.finish_gradients()

    def update(self, step: int, due: Due, row: dict[str, Any]) -> StepDone:
        """The step's one reduction (the module docstring), the loss check, the update, the tied weights."""
        hold = self.job.hold  # a test hook stops a rank after this step: what came before is on disk then
        flush = due.flush or bool(hold and hold["step"] == step)
        # Sync points by time: every row keeps its metrics entries (gathered at the next sync point).
        extras = local_metric_values(self.stages, self._costs, self.scaler.scale) if flush or due.by_time else {}
        # The traffic since the previous reduction: the weight sync that preceded this step, then its
        # activations, gradients, tied-weight gradients and all-reduce (what placement_report prices per step).
        sent = self.stages.traffic
        with self.pnode_figures.waiting():
            loss, sumsq, bad_grads, step_bytes, stopping, clock = self.ctrl.all_reduce(
                [float(sum(self._costs.values())) if self._costs else 0.0, self._local_sumsq(),
                 self._local_bad_grads(), sent, float(due.stop), float(due.clock and self.rank == 0)])
        self.stages.traffic = 0
        agreed = replace(due, stop=stopping > 0, flush=flush or stopping > 0 or clock > 0)
        self.loss_check.check(step, loss)
        self._found_inf, self._sumsq = bad_grads > 0, sumsq
        with self.state_lock:
            apply_update(self, self.cfg.grad_clip)
            self.completed = step  # before the tied weights' sync: its replicas are not in a rescue shard
        self.stages.sync_tied_weights()
        self.pnode_figures.end_step(step, sent)
        row.update(loss=loss, boundary_bytes=int(step_bytes))
        if self.loss_scaling:
            row["loss_scale"] = self.scaler.scale
        return StepDone(agreed, extras)

    def _global_batch(self, step: int) -> GlobalBatch:
        """The global batch of `step`, which a replica's losses are weighted against.  Token windows hold ids
        inside the vocabulary, so a cross-entropy cost whose ignore_index lies outside it counts every target
        token (batch x seq_len) and nothing of the other replicas' samples is read; only an ignore_index that
        is a real token id makes the replica count it in the whole batch's targets."""
        vocab, full = int(self.job.run_info["vocab_size"]), self.cfg.batch * self.seq_len

        def counted_tokens(ignore: int) -> int:
            if not 0 <= ignore < vocab:
                return full
            return int((self.dataset.batch(step, self.cfg.batch)[1] != ignore).sum())

        return GlobalBatch(self.cfg.batch, counted_tokens)

    def _local_sumsq(self) -> float:
        if not self.cfg.grad_clip or self.replica != 0:  # the summed gradients: one replica counts them
            return 0.0
        return float(sum(float(p.grad.double().pow(2).sum()) for p in self.stages.trainable if p.grad is not None))

    def _local_bad_grads(self) -> float:
        if not self.loss_scaling:
            return 0.0
        return float(any(not bool(torch.isfinite(p.grad).all()) for p in self.stages.trainable
                         if p.grad is not None))

    # -- loop.GradientUpdate: the decisions were taken in the step's reduction, alike on every rank --------
    def unscale(self) -> bool:
        if self._found_inf:  # every rank skips together (the flag was all-reduced)
            return True
        if self.scaler.enabled:
            with torch.no_grad():
                for p in self.stages.trainable:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self.scaler.scale)
        return False

    def clip(self, max_norm: float) -> None:
        """By the global norm the reduction summed (before unscaling: divided by the scale here)."""
        coef = min(1.0, float(max_norm) / (math.sqrt(self._sumsq) / self.scaler.scale + 1e-6))
        with torch.no_grad():
            for p in self.stages.trainable:
                if p.grad is not None:
                    p.grad.mul_(coef)

    def step(self, skip: bool) -> None:
        if skip:
            if self.powersgd is not None:  # its error buffers took the non-finite gradients in
                self.powersgd.forget()
        else:
            for optim in self.stages.optims.values():
                for opt in optim.optimizers:
                    opt.step()
        self.scaler.update(skip)

    def zero_grad(self) -> None:
        for optim in self.stages.optims.values():
            optim.zero_grad()
        for param in self.stages.replica_params.values():
            param.grad = None

    def validate(self) -> float:
        total, count = 0.0, 0
        for i, (inputs, targets) in enumerate(self.dataset.val_batches(self.cfg.batch)):
            if i >= self.cfg.val_batches:
                break
            if self.replica == 0:  # replicas hold the same weights: one evaluates
                costs = self.stages.run_round(0, inputs, targets, [inputs.shape[0]], train=False)
                total += float(sum(costs.values())) * inputs.shape[0] if costs else 0.0
            count += inputs.shape[0]
        (total,) = self.ctrl.all_reduce([total])
        return total / max(count, 1)

    def figures(self) -> list[tuple[int, dict[str, Any]]]:
        """This rank's per-step figures since the last sync point (pnode_figures.py), for rank 0's gather."""
        return self.pnode_figures.take()

    def close(self) -> None:
        self.pnode_figures.tensor_peak.close()
