"""What rank 0 gathers from every rank of a partitioned run: metrics entries and checkpoint shares.

`RankOutput` is where a launch worker's rows and checkpoints go in the one
training loop (training/loop.RunOutput): every rank sends its metrics entries,
per-step figures and checkpoint share, rank 0 writes the run's files.

Checkpoints are `vgraph train` checkpoints (checkpoint.py), in the unfused
global layout: rank 0 gathers every rank's parameters and optimizer state and
writes one checkpoint, atomically, then moves `latest`.  A run resumes from
it on any partition (rank 0 reads it and scatters each rank its share), or
on one process with `vgraph train --resume`.

Compression state travels in the checkpoint's `extra["compression"]`: the
error-feedback residuals of the `compress` VNodes (`boundary`: per VNode,
rows of the global batch, merged from the ranks that send those gradients;
the same entry `vgraph train` writes) and every rank's PowerSGD state
(`powersgd`, by world rank: each replica's error buffers are its own).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import read_input, read_json
from vgraph.ir.graph import Graph
from vgraph.run import layout
from vgraph.run.files import PLACEMENT_JSON

from .comm import ControlGroup
from .fleet_watch import FleetWatch
from .powersgd import PowerSGD
from ..job import Job
from .loss_scaler import SharedLossScaler
from .pnode_figures import attach
from .progress import RankZeroProgress
from .stage_runner import StageRunner
from ...training import checkpoint as ckpt
from ...lowering.wire_formats import merge_residuals
from ...training.run_checkpoints import (CHECKPOINT_PREFIX, changed_identity, clean_stale, optimizer_state_to_graph,
                                         optimizer_state_to_unfused, prune_checkpoints)
from ...training.config import TrainingError
from ...training.loop import merge_entries, row_columns
from ...training.metrics_log import MetricsLog
from ...training.tensorboard_log import TensorBoardLog

__all__ = ["GatheredCheckpoints", "RankOutput", "local_metric_values", "open_log"]


def local_metric_values(stages: StageRunner, costs: dict[str, torch.Tensor], scale: float) -> dict[str, Any]:
    """The network's `metrics:` entries measured on this rank (see plan.MetricSource)."""
    values: dict[str, Any] = {}
    if stages.replica:  # replicas hold the same parameters: replica 0 reports for all
        return values
    mine = {t.id for t in stages.tasks}
    for src in stages.plan.metrics:
        if src.task not in mine:
            continue
        task = stages.plan.tasks[src.task]
        optim, module = stages.optims[task.id], stages.modules[task.id]
        if src.type in (None, "learning_rate"):
            values[src.name] = optim.lr_of(src.node) if src.node in optim.base_lr else None
        elif src.type == "loss":
            names = [ep.name for ep in task.graph.costs if ep.node == src.node and ep.slot == src.slot]
            if names and names[0] in costs:
                values[src.name] = float(costs[names[0]])
        elif src.type == "grad_norm":
            grads = [p.grad for p in module.node_parameters(src.node).values() if p.grad is not None]
            if grads:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                values[src.name] = float(norm) / scale
    return values


class GatheredCheckpoints:
    """Saving and resuming a partitioned run's checkpoints: rank 0 reads and writes, every rank takes part."""

    def __init__(self, ctrl: ControlGroup, stages: StageRunner, job: Job, scaler: SharedLossScaler,
                 micro_batches: int, say: Callable[[str], None], attempt: int = 0,
                 powersgd: PowerSGD | None = None) -> None:
        self.ctrl, self.stages, self.job = ctrl, stages, job
        self.run_dir = job.run_path
        self.attempt = attempt
        self.scaler = scaler
        self.micro_batches = micro_batches
        self.say = say
        self.powersgd = powersgd

    def local_state(self, every_replica: bool = False) -> dict[str, Any]:
        """This rank's parameters and optimizer state, unfused layout, replicas of tied weights left out (CPU
        copies).  `every_replica`: a rescue shard (rescue.py) needs a replica's state too, when its replica 0
        is the one lost."""
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, Any]] = {}
        compression = self._local_compression()
        if self.stages.replica and not every_replica:  # replicas are identical: replica 0's share is the checkpoint
            return {"model": model, "optim": optim, "compression": compression}
        for task in self.stages.tasks:
            module = self.stages.modules[task.id]
            replicas = {f"{n.id}." for n in task.graph.nodes if n.type == "weight_replica"}
            for key, value in module.unfused_state_dict().items():
                if not any(key.startswith(r) for r in replicas):
                    model[key] = value.detach().cpu().clone()
            states = optimizer_state_to_unfused(self.stages.optims[task.id].state_by_key(), module.network)
            for key, state in states.items():
                if not any(key.startswith(r) for r in replicas):
                    optim[key] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in state.items()}
        return {"model": model, "optim": optim, "compression": compression}

    def _local_compression(self) -> dict[str, Any]:
        """This rank's error-feedback residuals and PowerSGD state (CPU copies)."""
        boundary = {node: state for node, fb in self.stages.feedback.items() if (state := fb.state()) is not None}
        sync = self.stages.grad_sync
        powersgd = (self.powersgd.state_dict(sync.layout) if self.powersgd is not None and sync is not None
                    else None)
        return {"boundary": boundary, "powersgd": powersgd}

    def save(self, step: int) -> Path | None:
        """Gather every rank's share; rank 0 writes checkpoint `step` and prunes old ones (its path; None elsewhere)."""
        parts = self.ctrl.gather(self.local_state())
        if self.ctrl.rank != 0:
            return None
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, Any]] = {}
        for part in parts:
            model.update(part["model"])
            optim.update(part["optim"])
        compression = {"boundary": merge_residuals([part["compression"]["boundary"] for part in parts]),
                       "powersgd": {rank: part["compression"]["powersgd"] for rank, part in enumerate(parts)
                                    if part["compression"]["powersgd"] is not None}}
        job = self.job
        extra = {
            "layout": "unfused",
            "grad_scaler": self.scaler.state_dict(),
            "run": json.loads(json.dumps(job.run_info, default=str)),
            "network_yaml": job.network_yaml,
            "tokenizer_json": read_input(job.path_of(job.tokenizer), what="tokenizer"),
            "launch": {"ranks": job.ranks, "assignment": job.final_assignment,
                       "micro_batches": self.micro_batches, "attempt": self.attempt},
            "compression": compression,
        }
        path = ckpt.save_checkpoint(self.run_dir / f"{CHECKPOINT_PREFIX}{step:08d}", step=step, model_state=model,
                                    optimizer_states=optim, rng_state=ckpt.capture_rng_state(), extra=extra)
        prune_checkpoints(self.run_dir, job.train.keep_checkpoints, path)
        return path

    def resume(self) -> int:
        """Load the latest checkpoint (rank 0 reads it and hands every rank its share); the start step."""
        payloads: list[Any] | None = None
        if self.ctrl.rank == 0:
            payloads = self._resume_payloads()
        mine = self.ctrl.scatter(payloads)
        if mine is None:
            return 0
        if "error" in mine:
            raise TrainingError(mine["error"])
        with torch.no_grad():
            for task in self.stages.tasks:
                module = self.stages.modules[task.id]
                own = module.state_dict(keep_vars=True)
                for key, pieces in layout.param_sources(module.network).items():
                    if module.network.node(key.split(".", 1)[0]).type == "weight_replica":
                        continue
                    parts = [mine["model"][k] for k, _ in pieces]
                    own[key].copy_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
                self.stages.optims[task.id].load_state_by_key(optimizer_state_to_graph(mine["optim"], module.network))
        self.scaler.load_state_dict(mine["grad_scaler"])
        self._load_compression(mine.get("compression") or {})
        return int(mine["step"])

    def _load_compression(self, saved: dict[str, Any]) -> None:
        for node, feedback in self.stages.feedback.items():
            feedback.load((saved.get("boundary") or {}).get(node), self.stages.device)
        sync = self.stages.grad_sync
        if self.powersgd is not None and sync is not None:
            why = self.powersgd.load_state_dict(saved.get("powersgd"), sync.layout, sync.buckets[0].flat.device)
            if why is not None:
                self.say(f"note: PowerSGD starts afresh: {why}")

    def _resume_payloads(self) -> list[Any]:
        try:
            clean_stale(self.run_dir)  # a killed save's temporaries (a worker set restarted by torchrun)
            latest = ckpt.latest_checkpoint(self.run_dir)
            if latest is None:
                return [None] * self.ctrl.world
            state = ckpt.load_checkpoint(latest, map_location="cpu")
        except ckpt.CheckpointError as exc:
            return [{"error": f"cannot resume: {exc}"}] * self.ctrl.world
        before = state.extra.get("run", {})
        info = self.job.run_info
        if state.extra.get("tokenizer_json"):
            try:
                ckpt.checked_tokenizer(state.extra["tokenizer_json"], int(info["vocab_size"]), str(latest))
            except VGraphError as exc:
                return [{"error": f"cannot resume: {exc.diagnostics[0]}"}] * self.ctrl.world
        refused = changed_identity(self.run_dir, before, info)
        if refused is not None:
            return [{"error": refused}] * self.ctrl.world
        out = []
        for r in range(self.ctrl.world):
            keys = self.stages.plan.param_keys(r % self.stages.plan.world_size)  # world rank -> plan rank
            missing = sorted(keys - set(state.model_state))
            if missing:
                return [{"error": f"checkpoint {latest} has no {', '.join(missing[:4])}: it is not a checkpoint "
                                  f"of this network"}] * self.ctrl.world
            saved = state.extra.get("compression") or {}
            out.append({"step": state.step, "model": {k: state.model_state[k] for k in keys},
                        "optim": {k: v for k, v in state.optimizer_states.items() if k in keys},
                        "grad_scaler": state.extra.get("grad_scaler"),
                        "compression": {"boundary": saved.get("boundary") or {},
                                        "powersgd": (saved.get("powersgd") or {}).get(r)}})
        self.say(f"resumed from {latest} at step {state.step}")
        return out


class RankOutput:
    """Launch's loop.RunOutput: every rank sends, rank 0 (the one holding `log`) writes rows and checkpoints."""

    def __init__(self, ctrl: ControlGroup, checkpoints: GatheredCheckpoints, *, log: MetricsLog | None,
                 progress: RankZeroProgress | None, pnodes: list[str], curve: tuple[Path, str],
                 before_save: Callable[[], None], after_step: Callable[[int], None],
                 say: Callable[[str], None], drift: Callable[[list[dict[str, Any]]], None] | None = None,
                 fleet: FleetWatch | None = None) -> None:
        self.ctrl, self.checkpoints, self.log, self.progress = ctrl, checkpoints, log, progress
        self.fleet = fleet  # rank 0: the machines on every row, the re-plans (fleet_watch.py)
        self.drift = drift  # rank 0: the rows' figures against the plan (pnode_figures.RunDrift)
        self.pnodes, self.curve, self.say = pnodes, curve, say
        self.before_save, self.after_step = before_save, after_step

    def gather(self, extras: list[tuple[int, dict[str, Any]]], figures: Any) -> Any:
        """Rows since the last sync point: every rank's metrics entries and figures, on rank 0 (None elsewhere).
        Gathered at sync points only: at every step, two more collectives (sizes, then bytes) than torch's DDP
        loop makes were a quarter of launch's step on the tiny network (benchmarks/bench_vs_torch.py)."""
        return self.ctrl.gather((extras, figures))

    def write(self, step: int, rows: list[dict[str, Any]], gathered: Any, val_loss: float | None) -> None:
        if self.log is None:
            return
        for extras, _ in gathered:
            merge_entries(rows, extras)
        attach(rows, [figures for _, figures in gathered], self.pnodes)
        if self.drift is not None:
            self.drift(rows)
        if self.fleet is not None:
            self.fleet.rows(rows)
        self.log.append(rows)
        if self.progress is not None:
            self.progress.report(step, rows[-1], val_loss, self.fleet.note if self.fleet is not None else "")

    def save(self, step: int) -> Path | None:
        self.before_save()  # the replicas still agree (replica_groups.py)
        path = self.checkpoints.save(step)
        if path is not None:
            self.say(f"checkpoint {path}")
        # Drawn at checkpoints and at the end only: matplotlib's seconds on rank 0 would be every other
        # worker's idle time at each validation.
        self.finish()
        return path

    def step_done(self, step: int) -> None:
        self.after_step(step)

    def finish(self) -> None:
        if self.log is not None:
            self.log.plot(*self.curve)

    def unwritten(self, rows: list[dict[str, Any]]) -> None:
        """Rank 0, the loop failed (a peer lost): the finished steps since the last sync point are written
        with what rank 0 has of them (the loss every rank agreed on, lr, time, bytes; the other ranks' entries
        were not gathered), since a rescue (rescue.py) may resume after them; a resume from an earlier step
        cuts them off again (MetricsLog.restart)."""
        if self.log is not None and rows:
            self.log.append(rows)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.progress is not None:
            self.progress.close()


def open_log(job: Job, graph: Graph, start: int, metric_names: list[str], say: Callable[[str], None]) -> MetricsLog:
    """Rank 0's metrics.jsonl / .csv (and TensorBoard, unless --no-tensorboard: the placed graph drawn by
    PNode, the settings), cut back to the resumed step."""
    run_dir, tensorboard = job.run_path, None
    if job.train.tensorboard:
        placement = None
        try:
            placement = read_json(run_dir / PLACEMENT_JSON, what=PLACEMENT_JSON)
        except VGraphError:
            pass  # the drawing then takes each VNode's PNode from the graph itself
        settings = dict(job.run_info, pipeline=job.pipeline, micro_batches=job.micro_batches,
                        batch_shares=list(job.batch_shares))
        tensorboard = TensorBoardLog(run_dir, settings=settings, graph=graph,
                                     placement=placement if isinstance(placement, dict) else None, say=say)
    log = MetricsLog(run_dir, row_columns(metric_names, extra=("boundary_bytes", "machines")), sink=tensorboard)
    log.restart(start)
    return log
