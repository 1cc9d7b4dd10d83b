"""One worker of `vgraph launch`: hosts one PNode's part of the network and trains it in lockstep.

    python -m vgraph.backends.torch.distributed.runtime.worker JOB.json

Started by `vgraph launch` (launch.py), by `torchrun`, or by `srun`, from the
job file launch writes (job.py; `vgraph launch ... --emit-job DIR` writes one
and trains nothing); where it stands in the world comes from its environment
(launchers.py).  Whatever started it, a worker set resumes from the run
directory's latest checkpoint when there is one, so a worker set that
torchrun restarts after a failure goes on where the last checkpoint left off.

What a worker does, per training step (every rank the same, in lockstep):

1. reads its replica's share of the step's global batch from the prepared
   corpus (the samples are a function of (seed, step): data.py; replicas read
   disjoint samples) and cuts it into micro-batches;
2. runs its ops of the pipeline schedule (step_plan.py, 1F1B or GPipe): the
   forward of a task for a micro-batch receives boundary activations and
   sends its own; its backward receives the gradients of what it sent and
   sends those of what it received; then the tied-weight gradients;
   with data-parallel replicas, rank r x P + s runs plan rank s of replica r on its share of the
   global batch, and the stage groups sum their gradients in buckets all-reduced while the last
   micro-batch's backward runs (grad_sync.py), all waited for before the step;
3. all-reduces [loss, squared gradient norm, non-finite flag, bytes sent] on
   the control group, so every rank takes the same decision (stop on a
   non-finite loss, skip under loss scaling, clip: train_step.LossCheck, as
   `vgraph train`);
4. steps its optimizers (per VNode, as `vgraph train`), then owners send
   tied weights to their replicas;
5. at sync points (validation, checkpoint, `--log-every` steps, and by default whenever rank 0 last
   flushed at least FLUSH_SECONDS ago: its vote travels in step 3's reduction, so every rank agrees),
   joins the collectives that gather the metrics rows since the last sync point, validation loss and
   checkpoint state on rank 0.  Every step still gets its row, with rank 0's own clock at its end as
   `elapsed_s`.  Gathering at every step, as before, cost two more collectives a step (gather_object:
   sizes, then bytes) than torch's DDP loop makes: on the tiny network a quarter of launch's step,
   which left it 2.4x DDP's (benchmarks/bench_vs_torch.py).

Micro-batching is exact: a cost is a mean over its tokens, so micro-batch m's
loss is weighted by its share of the batch's counted tokens (targets equal to
`ignore_index` do not count), and dropout masks are keyed by the global
sample index (dropout.py).  Losses therefore equal the single-process
trainer's up to float rounding.

Checkpoints are `vgraph train` checkpoints (checkpoint.py), in the unfused
global layout: rank 0 gathers every rank's parameters and optimizer state and
writes one checkpoint, atomically, then moves `latest`.  A run resumes from
it on any partition, or on one process with `vgraph train --resume`.

This module is the entry point (`main`) and the loop (`Worker`); the rank's
stages and schedule rounds live in stage_runner.py, what rank 0 gathers
(metrics entries, checkpoints) in rank_zero.py, the shared loss-scaling
decision in loss_scaler.py.

Exit status: 0 done; 2 a usage error; 3 a user-facing error (message in
launch/error-<rank>.txt and on stderr; the launcher does not restart);
anything else is a crash the launcher answers with a restart from the last
checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import atomic_write, read_json
from vgraph.cost.grad_compression import parse_grad_compress
from vgraph.data.shards import DataError, open_prepared
from vgraph.placement.export import assignment_of
from vgraph.plugins import load_plugins
from vgraph.run.compiled_graph import apply_assignment  # the launcher, the workers and `vgraph report` build it alike
from vgraph.run.files import (LOSS_CURVE_PNG, PLACEMENT_JSON, RELEASE_FILE, RUN_LOCK_ENV, RunInUse, RunLock,
                              error_name, held_name)
from vgraph.yamlio import loads

from ...training.batches import TokenShards
from .comm import ControlGroup, Transport
from .comm_choice import worker_device
from .powersgd import PowerSGD
from .grad_sync import GradientSync
from ..job import EXIT_USER_ERROR, LAUNCH_DIR, STOP_FILE, Job
from .launchers import WorkerPlace, worker_place
from .replica_groups import ReplicaLayoutError, check_replicas_agree, check_same_layout, stage_groups
from .loss_scaler import SharedLossScaler
from vgraph.run.step_plan import make_plan, micro_batch_sizes
from .pnode_figures import PNodeFigures, attach
from .progress import RankZeroProgress, progress_mode
from ..rendezvous import gloo_environment, process_group_store
from .rank_zero import GatheredCheckpoints, local_metric_values
from .stage_runner import GlobalBatch, StageRunner
from .tie_sync import tie_groups
from ...lowering.dropout import clear_dropout_key
from ...lowering.lower import compute_dtype
from ...training.metrics_log import MetricsLog
from ...training.tensorboard_log import TensorBoardLog
from ...training.optimizers import lr_factor
from ...training.config import TrainingError
from ...training import checkpoint as ckpt
from ...training.interrupt import StopRequest
from ...training.step import LossCheck
from ...training.setup import seed_everything, use_deterministic_kernels

__all__ = ["main", "Worker", "claim_run", "EXIT_USER_ERROR", "LAUNCH_DIR", "apply_assignment", "FLUSH_SECONDS"]

FLUSH_SECONDS = 1.0  # without --log-every: rank 0's rows and figures are gathered about this often (see 5. above)

@dataclass
class _Step:
    """One training step's outcome, as every rank agreed on it in the step's reduction."""

    row: dict[str, Any]  # the metrics row (rank 0 completes it)
    extras: dict[str, Any] = field(default_factory=dict)  # this rank's `metrics:` entries (flush steps)
    flush: bool = False  # a sync point: rows go to rank 0
    validate: bool = False
    save: bool = False
    stopping: bool = False  # the launcher asked to stop (a checkpoint is written now)


class Worker:
    """The state of one rank; `setup()` then `run()` trains to the configured step."""

    def __init__(self, job: Job, place: WorkerPlace) -> None:
        self.job, self.cfg = job, job.train
        self.place = place
        self.rank, self.world, self.local_rank = place.rank, place.world, place.local_rank
        self.attempt = job.attempt + place.restart
        self.run_dir = job.run_path
        self.log_enabled = bool(self.cfg.progress)
        self.log: MetricsLog | None = None
        self.progress: RankZeroProgress | None = None  # rank 0's bar, events or lines (progress.py)
        self._signalled: StopRequest | None = None  # a signal this worker got itself (torchrun, srun)
        self._stopped_early = False

    def say(self, msg: str) -> None:
        if not self.log_enabled:
            return
        if self.progress is not None:
            self.progress.write(msg)  # above rank 0's bar, when it draws one
        else:
            print(msg, flush=True)

    # -- set-up ------------------------------------------------------------------------------
    def setup(self) -> None:
        """Where this rank stands, its process groups, its stages and its data (in that order: every rank
        creates the process groups in the same order)."""
        self._layout()
        self._connect()
        self._build()
        self._data()

    def _layout(self) -> None:
        """Replica and plan rank of this world rank (world rank = replica x P + plan rank), device, threads."""
        job = self.job
        if self.world != len(job.ranks):
            started = "SLURM_NTASKS" if self.place.launcher == "slurm" else "WORLD_SIZE"
            raise TrainingError(f"{started} is {self.world} but the job places {len(job.ranks)} workers "
                                f"({len(job.batch_shares)} replica(s) x {len(job.plan_ranks)} PNodes): start "
                                f"{len(job.ranks)} processes")
        self.pnode = job.ranks[self.rank]
        P = len(job.plan_ranks)
        self.replica, self.local = divmod(self.rank, P)
        self.shares = list(job.batch_shares)
        self.device = worker_device(job.device, self.local_rank,
                                    torch.cuda.device_count() if job.device == "cuda" else 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        if self.cfg.deterministic:
            use_deterministic_kernels()
        # Like `vgraph train`: the global generators start from the run's seed, so what a checkpoint records
        # of them is the same in every run (a forked worker otherwise inherits whatever its forkserver drew).
        seed_everything(self.cfg.seed)

    def _connect(self) -> None:
        """The default process group (rendezvous.py: behind the run's secret) and the control group."""
        job = self.job
        timeout = timedelta(seconds=job.comm_timeout)
        if self.place.launcher != "vgraph":  # vgraph launch names the interface itself (launch.py)
            os.environ.update(gloo_environment(self.place.master_addr))
        store = process_group_store(self.place, timeout)
        dist.init_process_group(job.backend, rank=self.rank, world_size=self.world, timeout=timeout, store=store)
        self.ctrl = ControlGroup(self.rank, self.world, dist.new_group(backend="gloo") if job.control_group else None)

    def _build(self) -> None:
        """The placed graph (checked against the launcher's), the plan, this rank's stages and gradient sync."""
        job = self.job
        source = loads(job.network_yaml, file=job.network_file)
        graph = apply_assignment(source, job.pipeline_before, job.assignment, job.pipeline_after, job.target,
                                 job.plan_choices)
        final = assignment_of(graph)
        if final != job.final_assignment:
            raise TrainingError("this worker's placed graph differs from the launcher's (different vgraph "
                                "versions or pass plugins on the machines?)")
        self.graph = graph
        P = len(job.plan_ranks)
        plan = make_plan(graph, final, list(job.plan_ranks))
        self.dtype = compute_dtype(graph)
        precision = graph.meta.get("precision") or {}
        self.loss_scaling = bool(precision.get("loss_scaling")) and self.dtype == torch.float16
        self.amp = (lambda: torch.autocast(self.device.type, dtype=self.dtype)) if self.dtype != torch.float32 \
            else contextlib.nullcontext
        self.scaler = SharedLossScaler(self.loss_scaling, self.cfg.initial_loss_scale)
        self.loss_check = LossCheck(self.scaler, self.loss_scaling, self.cfg.max_skipped_steps, graph, self.run_dir)
        transport = Transport(self.device, stage_through_cpu=job.stage_through_cpu, offset=self.replica * P)
        self.stages = StageRunner(plan, self.local, P, self.device, transport, self.amp, self.scaler,
                                  seed=self.cfg.seed, lr=self.cfg.lr, pipeline=job.pipeline, replica=self.replica,
                                  tie_groups=tie_groups(plan, len(self.shares), self.replica),
                                  stage_through_cpu=job.stage_through_cpu, weight_decay=self.cfg.weight_decay)
        self.grad_sync = self._grad_sync(len(self.shares), P)
        self.figures = PNodeFigures(self.device, lambda: self.stages.transport.wait_s + (
            self.grad_sync.wait_s if self.grad_sync is not None else 0.0),
            tracked=lambda: (*self.stages.modules.values(), *(o for n in self.stages.optims.values()
                                                               for o in n.optimizers)))

    def _grad_sync(self, replicas: int, plan_ranks: int) -> GradientSync | None:
        """The stage group's gradient sum (grad_sync.py), after checking the replicas hold the same
        parameters (replica_groups.py); None without replicas."""
        self.group_device = self.device if self.job.backend == "nccl" else torch.device("cpu")
        self.powersgd: PowerSGD | None = None
        if replicas < 2:
            return None
        group = stage_groups(replicas, plan_ranks)[self.local]
        params, users, late = self.stages.sync_order()
        try:
            check_same_layout(group, params, device=self.group_device)
        except ReplicaLayoutError as exc:
            raise TrainingError(str(exc)) from None
        spec = parse_grad_compress(self.job.grad_compress)
        hook: dict[str, Any] = {}
        if spec.enabled:
            if any(p.dim() == 0 for p in params):
                raise TrainingError("--grad-compress powersgd views every gradient as a matrix of its first "
                                    "dimension's rows; this stage trains a scalar parameter: use --grad-compress none")
            self.powersgd = PowerSGD(group, spec, replicas, self.cfg.seed)
            hook = {"hook": self.powersgd.hook, "hook_state": self.powersgd.state, "wire": self.powersgd.wire_numels}
        sync = GradientSync(params, group, size=replicas, position=self.replica, users=users, late=late,
                            bucket_bytes=self.job.bucket_bytes, **hook)
        self.stages.grad_sync = sync
        return sync

    def _data(self) -> None:
        """The corpus the launcher prepared, this replica's share of the batch and its micro-batches."""
        job = self.job
        self.seq_len = int(job.run_info["seq_len"])
        self.dataset = self._open_data()
        self.batch = self.cfg.batch
        self.share, self.share_offset = self.shares[self.replica], sum(self.shares[:self.replica])
        self.sizes = micro_batch_sizes(self.share, min(job.micro_batches, self.share))
        self.checkpoints = GatheredCheckpoints(self.ctrl, self.stages, job, self.scaler, len(self.sizes), self.say,
                                               attempt=self.attempt, powersgd=self.powersgd)

    def _open_data(self) -> TokenShards:
        """The corpus the launcher prepared and verified, read a window at a time (sizes checked again here)."""
        job = self.job
        try:
            corpus = open_prepared(job.data_path, verify="size")
            if corpus.digest != job.data_digest:
                raise DataError(f"{job.data_path}: the corpus changed after the launcher checked it")
            return TokenShards(corpus, seq_len=self.seq_len, vocab=int(job.run_info["vocab_size"]), seed=self.cfg.seed)
        except DataError as exc:
            raise TrainingError(f"training data: {exc}") from None

    def _global_batch(self, step: int) -> GlobalBatch:
        """The global batch of `step`, which a replica's losses are weighted against.  Token windows hold ids
        inside the vocabulary, so a cross-entropy cost whose ignore_index lies outside it counts every target
        token (batch x seq_len) and nothing of the other replicas' samples is read; only an ignore_index that
        is a real token id makes the replica count it in the whole batch's targets."""
        vocab, full = int(self.job.run_info["vocab_size"]), self.batch * self.seq_len

        def counted_tokens(ignore: int) -> int:
            if not 0 <= ignore < vocab:
                return full
            return int((self.dataset.batch(step, self.batch)[1] != ignore).sum())

        return GlobalBatch(self.batch, counted_tokens)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Resume (when the run directory has a checkpoint), then train step by step to `train.steps`."""
        start = self.checkpoints.resume()
        self.stages.sync_tied_weights()
        if self.rank == 0:
            self.log = self._open_log(start)
            if self.log_enabled:
                self.progress = RankZeroProgress(progress_mode(os.environ, self.place.launcher), self.cfg.steps,
                                                 start, "launch", lambda line: print(line, flush=True))
        self._announce(start)
        self._pending: list[dict[str, Any]] = []  # rank 0: the rows since the last sync point
        self._extras: list[tuple[int, dict[str, Any]]] = []  # this rank's metrics entries since then, by step
        self._start_time = self._last_flush = time.perf_counter()
        dist.barrier(group=self.ctrl.group)  # rank 0's set-up (log files, TensorBoard's drawing) is not step 1's idle
        for step in range(start + 1, self.cfg.steps + 1):
            done = self._train_step(step)
            self._after_step(step, done)
            if done.stopping:
                self.say(f"stopped after step {step} as asked")
                self._stopped_early = step < self.cfg.steps
                break
        if self.log is not None:
            self.log.plot(self.run_dir / LOSS_CURVE_PNG, self.graph.name)
            self.log.close()
        if self.progress is not None:
            self.progress.close()
        clear_dropout_key()
        dist.barrier(group=self.ctrl.group)

    def _open_log(self, start: int) -> MetricsLog:
        """Rank 0's metrics.jsonl / .csv (and TensorBoard), cut back to the resumed step."""
        metric_names = [m.name for m in self.stages.plan.metrics if m.name not in ("step", "loss", "lr")]
        columns = ["step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale", "boundary_bytes",
                   *metric_names]
        log = MetricsLog(self.run_dir, columns, sink=self._tensorboard())
        log.restart(start)
        return log

    def _announce(self, start: int) -> None:
        if self.rank == 0:
            self.say(f"{self.graph.name}: {len(self.graph)} VNodes on {self.world} worker(s) ({len(self.shares)} "
                     f"replica(s), batch shares {self.shares}), {len(self.sizes)} micro-batch(es) of {self.sizes}; "
                     f"steps {start + 1}..{self.cfg.steps}; predicted traffic {self.job.predicted_bytes:,.0f} "
                     f"bytes/step")
        for task in self.stages.tasks:
            params = sum(p.numel() for p in self.stages.modules[task.id].parameters())
            self.say(f"task {task.id}: {len(task.graph)} VNodes, {params:,} parameters, "
                     f"{len(task.receives)} inputs, {len(task.sends)} outputs")

    def _train_step(self, step: int) -> _Step:
        """Forward, backward, the gradient sums, the step's reduction, the loss check and the update."""
        cfg = self.cfg
        self.figures.begin_step()
        lo, hi = self.share_offset, self.share_offset + self.share
        inputs, targets = self.dataset.batch(step, self.batch, lo, hi)  # this replica's samples only
        factor = lr_factor(step, cfg)
        for optim in self.stages.optims.values():
            optim.set_factor(factor)
        costs = self.stages.run_round(step, inputs, targets, self.sizes, train=True, offset=lo,
                                      whole=self._global_batch(step) if len(self.shares) > 1 else None)
        self.stages.finish_gradients()  # the replicas' buckets still in flight (grad_sync.py)
        done = _Step({"step": step, "lr": cfg.lr * factor})
        done.validate = cfg.val_every > 0 and (step % cfg.val_every == 0 or step == cfg.steps)
        done.save = step == cfg.steps or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0)
        hold = self.job.hold  # a test hook stops a rank after this step: what came before is on disk then
        by_time = cfg.log_every is None  # sync points by rank 0's clock (module docstring, 5.)
        done.flush = done.save or done.validate or (not by_time and step % cfg.log_every == 0) or bool(
            hold and hold["step"] == step)
        if done.flush or by_time:  # by time, every row keeps its metrics (gathered at the next sync point)
            done.extras = local_metric_values(self.stages, costs, self.scaler.scale)
        due = float(by_time and self.rank == 0 and time.perf_counter() - self._last_flush >= FLUSH_SECONDS)
        # One reduction: the loss, the summed gradients' squared norm (one replica counts them), a
        # non-finite gradient, the traffic since the previous reduction (the weight sync that preceded this
        # step, then its activations, gradients, tied-weight gradients and all-reduce: what placement_report
        # prices per step), and a stop request (the launcher got Ctrl-C/SIGTERM), so every rank decides alike.
        sent = self.stages.traffic
        with self.figures.waiting():
            loss, sumsq, bad_grads, step_bytes, stopping, due = self.ctrl.all_reduce(
                [float(sum(costs.values())) if costs else 0.0, self._local_sumsq(), self._local_bad_grads(),
                 sent, float(self._stop_asked()), due])
        self.stages.traffic = 0
        done.stopping = stopping > 0
        done.save = done.save or done.stopping
        done.flush = done.flush or done.stopping or due > 0
        self.loss_check.check(step, loss)
        self._optimizer_step(bad_grads > 0, sumsq)
        self.stages.sync_tied_weights()
        self.figures.end_step(step, sent)
        done.row.update(loss=loss, boundary_bytes=int(step_bytes), elapsed_s=time.perf_counter() - self._start_time)
        if self.loss_scaling:
            done.row["loss_scale"] = self.scaler.scale
        return done

    def _local_sumsq(self) -> float:
        if not self.cfg.grad_clip or self.replica != 0:  # the summed gradients: one replica counts them
            return 0.0
        return float(sum(float(p.grad.double().pow(2).sum()) for p in self.stages.trainable if p.grad is not None))

    def _local_bad_grads(self) -> float:
        if not self.loss_scaling:
            return 0.0
        return float(any(not bool(torch.isfinite(p.grad).all()) for p in self.stages.trainable
                         if p.grad is not None))

    def _after_step(self, step: int, done: _Step) -> None:
        """At sync points: rows, metrics and figures to rank 0, validation; at checkpoints: the checkpoint."""
        self._pending.append(done.row)
        if done.extras:
            self._extras.append((step, done.extras))
        if done.flush:
            extras, self._extras = self._extras, []
            gathered = self.ctrl.gather((extras, self.figures.take()))
            val_loss = self.validate() if done.validate else None
            if self.rank == 0:
                self._log_rows(step, gathered, val_loss)
            self._pending = []
            self._last_flush = time.perf_counter()
        if done.save:
            self._check_replicas()
            path = self.checkpoints.save(step)
            if path is not None:
                self.say(f"checkpoint {path}")
            if self.log is not None:
                # Drawn at checkpoints and at the end only: matplotlib's seconds on rank 0 would be every
                # other worker's idle time at each validation.
                self.log.plot(self.run_dir / LOSS_CURVE_PNG, self.graph.name)
            self._last_flush = time.perf_counter()
        hold = self.job.hold
        if hold and hold["rank"] == self.rank and hold["step"] == step:
            self._hold(step)

    def _log_rows(self, step: int, gathered: list, val_loss: float | None) -> None:
        """Rank 0: complete the rows since the last sync point and append them to the log."""
        now = time.perf_counter()
        pending = self._pending
        by_step = {r["step"]: r for r in pending}
        for r in pending:
            r["tokens_per_s"] = self.batch * self.seq_len * len(pending) / max(now - self._last_flush, 1e-9)
        for extras, _ in gathered:
            for at, part in extras:
                by_step[at].update(part)
        attach(pending, [figures for _, figures in gathered], self.job.ranks)
        if val_loss is not None:
            pending[-1]["val_loss"] = val_loss
        self.log.append(pending)
        if self.progress is not None:
            self.progress.report(step, pending[-1], val_loss)

    def _check_replicas(self) -> None:
        """Before a checkpoint: the replicas of this stage still hold the same weights and optimizer state."""
        if self.grad_sync is not None:
            try:
                check_replicas_agree(self.grad_sync.group, self.stages.named_state(), device=self.group_device)
            except ReplicaLayoutError as exc:
                raise TrainingError(str(exc)) from None

    def _tensorboard(self) -> TensorBoardLog | None:
        """Rank 0's TensorBoard sink (unless --no-tensorboard): the placed graph drawn by PNode, the settings."""
        if not self.cfg.tensorboard:
            return None
        placement = None
        try:
            placement = read_json(self.run_dir / PLACEMENT_JSON, what=PLACEMENT_JSON)
        except VGraphError:
            pass  # the drawing then takes each VNode's PNode from the graph itself
        settings = dict(self.job.run_info, pipeline=self.job.pipeline, micro_batches=self.job.micro_batches,
                        batch_shares=self.shares)
        return TensorBoardLog(self.run_dir, settings=settings, graph=self.graph,
                              placement=placement if isinstance(placement, dict) else None, say=self.say)

    def _optimizer_step(self, found_inf: bool, sumsq: float) -> None:
        scale = self.scaler.scale
        if found_inf:  # every rank skips together (the flag was all-reduced)
            self.scaler.update(True)
            if self.powersgd is not None:  # its error buffers took the non-finite gradients in
                self.powersgd.forget()
        else:
            with torch.no_grad():
                if self.scaler.enabled:
                    for p in self.stages.trainable:
                        if p.grad is not None:
                            p.grad.mul_(1.0 / scale)
                clip = self.cfg.grad_clip
                if clip:
                    total = math.sqrt(sumsq) / scale
                    coef = min(1.0, float(clip) / (total + 1e-6))
                    for p in self.stages.trainable:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            for optim in self.stages.optims.values():
                for opt in optim.optimizers:
                    opt.step()
            self.scaler.update(False)
        for optim in self.stages.optims.values():
            optim.zero_grad()
        for param in self.stages.replica_params.values():
            param.grad = None

    def validate(self) -> float:
        total, count = 0.0, 0
        for i, (inputs, targets) in enumerate(self.dataset.val_batches(self.batch)):
            if i >= self.cfg.val_batches:
                break
            if self.replica == 0:  # replicas hold the same weights: one evaluates
                costs = self.stages.run_round(0, inputs, targets, [inputs.shape[0]], train=False)
                total += float(sum(costs.values())) * inputs.shape[0] if costs else 0.0
            count += inputs.shape[0]
        (total,) = self.ctrl.all_reduce([total])
        return total / max(count, 1)

    @contextlib.contextmanager
    def stop_request(self):
        """Under torchrun or srun, SIGTERM and Ctrl-C reach the workers themselves (torchrun's agent forwards
        them and waits its --shutdown-timeout, 30 s by default, before SIGKILL): the first one is a stop
        request joined to the step's reduction, so every rank finishes the step and rank 0 saves its
        checkpoint, as under `vgraph launch`, whose launcher turns the signal into the stop file.  Under
        `vgraph launch` a worker's SIGTERM stays the supervisor's "stop now"."""
        if self.place.launcher == "vgraph":
            yield
            return
        self._signalled = StopRequest(self.say if self.rank == 0 else (lambda msg: None), echo_s=2.0)
        with self._signalled.installed():
            yield

    def _stop_asked(self) -> bool:
        """The launcher's stop file, or a signal this worker got itself (`stop_request`)."""
        return self._stop_file.exists() or (self._signalled is not None and self._signalled.requested)

    def stopped_status(self) -> int:
        """0 for a finished run; 128 + the signal for one a signal stopped (a shell's convention, and what
        `vgraph train` exits with), so torchrun with --max-restarts restarts a set that was signalled alone
        and it resumes from the checkpoint just written."""
        if self._signalled is None or not self._signalled.requested or not self._stopped_early:
            return 0
        if self.rank == 0:
            print(f"stopped by {signal.Signals(self._signalled.signum).name}: checkpoint "
                  f"{ckpt.latest_checkpoint(self.run_dir)}; start the same command again to continue",
                  file=sys.stderr, flush=True)
        return 128 + int(self._signalled.signum)

    @property
    def _stop_file(self) -> Path:
        """Written by the launcher on this machine at the first Ctrl-C/SIGTERM (launch.py)."""
        return self.run_dir / LAUNCH_DIR / STOP_FILE

    def _hold(self, step: int) -> None:
        """Test hook: stop after `step` (others block on this rank) until killed or released.  Once per run
        directory: a worker set restarted by torchrun from the same job file does not hold again."""
        marker = self.run_dir / LAUNCH_DIR / held_name(self.pnode)
        if marker.exists():
            return
        atomic_write(marker, json.dumps({"step": step, "pid": os.getpid()}) + "\n")
        deadline = time.monotonic() + 300
        while not (self.run_dir / LAUNCH_DIR / RELEASE_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def _peer_lost(exc: BaseException) -> bool:
    """A communication error caused by another worker going away (or timing out)."""
    backend_error = getattr(dist, "DistBackendError", None)
    text = str(exc)
    return (backend_error is not None and isinstance(exc, backend_error)) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "Timed out", "timed out"))


def _user_error(job: Job | None, rank: int | None, exc: VGraphError) -> int:
    """Print a user-facing error; every rank that raised writes it for the launcher (identical texts when
    the decision was collective), which then does not restart."""
    text = "\n".join(str(d) for d in exc.diagnostics)
    print(f"error: {text}", file=sys.stderr, flush=True)
    if job is not None and rank is not None:
        with contextlib.suppress(VGraphError):  # into the launch folder a launcher made, never a new one
            atomic_write(job.run_path / LAUNCH_DIR / error_name(rank), text + "\n", make_parents=False)
    return EXIT_USER_ERROR


def claim_run(job: Job, place: WorkerPlace, env: Mapping[str, str]) -> RunLock | None:
    """The run directory this worker set writes, found and locked before anything else is done.

    Rank 0 writes the run (metrics, checkpoints, the curve): it takes the job's run directory only when it
    is the run the job was written for (`Job.locate_run`, a JobError otherwise), and only with the run's
    lock (files.RunLock, as `vgraph train` and `vgraph launch` take it), so a second worker set started on
    the same job (another master port, another torchrun) is refused naming the run and the first set's
    rank 0, instead of appending its own rows to the same metrics.  Under `vgraph launch` the launcher
    holds the lock for its workers and hands rank 0 its key (RUN_LOCK_ENV).  The other ranks write no
    run file; they take the checked run directory when theirs is one (on other machines it may not be)."""
    if place.rank != 0:
        with contextlib.suppress(VGraphError):
            job.locate_run()
        return None
    run = job.locate_run()
    key = env.get(RUN_LOCK_ENV, "")
    if key and RunLock.shares(run, key):
        return None  # the launcher that started us holds it
    lock = RunLock.acquire(run, f"vgraph worker (rank 0 of {place.world}, {place.launcher})")
    if lock.note:
        print(lock.note, file=sys.stderr, flush=True)
    return lock


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.distributed.runtime.worker JOB.json` (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m vgraph.backends.torch.distributed.runtime.worker JOB.json", file=sys.stderr)
        return 2
    job: Job | None = None
    place: WorkerPlace | None = None
    try:
        place = worker_place(os.environ)
        job = Job.read(args[0])
        with RunLock.held():
            claim_run(job, place, os.environ)
            load_plugins(job.plugins)  # what the launcher loaded: installed op types, --plugin files
            worker = Worker(job, place)
            with worker.stop_request():
                worker.setup()
                worker.run()
            return worker.stopped_status()
    except RunInUse as exc:  # the run is another worker set's: nothing of ours is written into it
        return _user_error(None, None, exc)
    except VGraphError as exc:
        return _user_error(job, place.rank if place is not None else None, exc)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if _peer_lost(exc):  # the launcher knows which worker died first; no traceback needed here
            print(f"stopped: lost a peer ({str(exc).splitlines()[0][:200]})", file=sys.stderr, flush=True)
            return 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
