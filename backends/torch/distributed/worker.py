"""One worker of `vgraph launch`: hosts one PNode's part of the network and trains it in lockstep.

Started by the launcher (launch.py) as
`python -m vgraph.backends.torch.distributed.worker JOB.json` with the torchrun
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), so the
same command also runs under `torchrun` on several machines.

What a worker does, per training step (every rank the same, in lockstep):

1. reads its replica's share of the step's global batch from the prepared
   corpus (the samples are a function of (seed, step): data.py; replicas read
   disjoint samples) and cuts it into micro-batches;
2. runs its ops of the pipeline schedule (plan.py, 1F1B or GPipe): the
   forward of a task for a micro-batch receives boundary activations and
   sends its own; its backward receives the gradients of what it sent and
   sends those of what it received; then the tied-weight gradients;
   with data-parallel replicas, rank r x P + s runs plan rank s of replica r on its share of the
   global batch, and the stage groups sum their gradients in buckets all-reduced while the last
   micro-batch's backward runs (grad_sync.py), all waited for before the step;
3. all-reduces [loss, squared gradient norm, non-finite flag, bytes sent] on
   the control group, so every rank takes the same decision (stop on a
   non-finite loss, skip under loss scaling, clip);
4. steps its optimizers (per VNode, as `vgraph train`), then owners send
   tied weights to their replicas;
5. on logging / validation / checkpoint steps, joins the collectives that
   gather metrics, validation loss and checkpoint state on rank 0.

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

Exit status: 0 done; 3 a user-facing error (message in launch/error-<rank>.txt
and on stderr; the launcher does not restart); anything else is a crash the
launcher answers with a restart from the last checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from vgraph.base.diagnostics import VGraphError
from vgraph.placement.export import assignment_of
from vgraph.plugins import load_plugins
from vgraph.run.compiled_graph import apply_assignment  # the launcher, the workers and `vgraph report` build it alike
from vgraph.yamlio import loads

from vgraph.data.shards import DataError, open_prepared

from ..data import TokenShards
from .comm import ControlGroup, Transport
from .comm_choice import worker_device
from .grad_sync import DEFAULT_BUCKET_BYTES, GradientSync
from .replica_groups import ReplicaLayoutError, check_replicas_agree, check_same_layout, stage_groups
from .loss_scaler import SharedLossScaler
from .plan import make_plan, micro_batch_sizes
from .pnode_figures import PNodeFigures, attach
from .rendezvous import rendezvous_store
from .rank_zero import GatheredCheckpoints, local_metric_values
from .stage_runner import StageRunner
from .tie_sync import tie_groups
from ..dropout import clear_dropout_key
from ..lower import compute_dtype
from ..metrics_log import MetricsLog
from ..tensorboard_log import TensorBoardLog
from ..node_optimizers import lr_factor
from ..train_config import TrainingError
from ..training_setup import use_deterministic_kernels

__all__ = ["main", "Worker", "EXIT_USER_ERROR", "LAUNCH_DIR", "apply_assignment"]

EXIT_USER_ERROR = 3
LAUNCH_DIR = "launch"  # inside the run directory: job files, token streams, worker markers
STOP_FILE = "stop"  # in LAUNCH_DIR: the launcher asks every worker to stop after this step, with a checkpoint


class Worker:
    """The state of one rank; `run()` trains to the configured step."""

    def __init__(self, job: dict[str, Any], rank: int, world: int, local_rank: int) -> None:
        self.job = job
        self.cfg = job["config"]
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.run_dir = Path(job["run_dir"])
        self.pnode = job["ranks"][rank]
        self.log_enabled = bool(self.cfg.get("progress", True))

    # -- set-up ------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.log_enabled:
            print(msg, flush=True)

    def setup(self) -> None:
        cfg, job = self.cfg, self.job
        if self.world != len(job["ranks"]):
            raise TrainingError(f"WORLD_SIZE is {self.world} but the placement has {len(job['ranks'])} PNodes")
        # Data-parallel replicas: world rank = replica x P + plan rank, P = the PNodes of one replica.
        plan_ranks = list(job.get("plan_ranks") or job["ranks"])
        P = len(plan_ranks)
        self.replica, self.local = divmod(self.rank, P)
        shares = [int(x) for x in (job.get("batch_shares") or [cfg["batch"]])]
        if P * len(shares) != self.world:
            raise TrainingError(f"WORLD_SIZE {self.world} is not {len(shares)} replicas x {P} PNodes")
        self.device = worker_device(job["device"], self.local_rank,
                                    torch.cuda.device_count() if job["device"] == "cuda" else 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(int(cfg["threads"]))
        if cfg.get("deterministic"):
            use_deterministic_kernels()
        timeout = timedelta(seconds=float(cfg["comm_timeout"]))
        # Under `vgraph launch`: a store bound to MASTER_ADDR only, keys behind the run's token
        # (rendezvous.py); under torchrun: torchrun's own rendezvous.
        store = None if os.environ.get("TORCHELASTIC_RUN_ID") else rendezvous_store(self.rank, self.world, timeout)
        dist.init_process_group(job["backend"], rank=self.rank, world_size=self.world, timeout=timeout, store=store)
        self.ctrl = ControlGroup(self.rank, self.world,
                                 dist.new_group(backend="gloo") if job.get("control_group", job["backend"] != "gloo")
                                 else None)
        transport = Transport(self.device, stage_through_cpu=bool(job.get("stage_through_cpu")),
                              offset=self.replica * P)

        source = loads(job["network_yaml"], file=job["network_file"])
        graph = apply_assignment(source, job["pipeline_before"], job["assignment"], job["pipeline_after"],
                                 job["target"])
        final = assignment_of(graph)
        if final != job["final_assignment"]:
            raise TrainingError("this worker's placed graph differs from the launcher's (different vgraph "
                                "versions or pass plugins on the machines?)")
        self.graph = graph
        plan = make_plan(graph, final, plan_ranks)
        self.dtype = compute_dtype(graph)
        precision = graph.meta.get("precision") or {}
        self.loss_scaling = bool(precision.get("loss_scaling")) and self.dtype == torch.float16
        self.amp = (lambda: torch.autocast(self.device.type, dtype=self.dtype)) if self.dtype != torch.float32 \
            else contextlib.nullcontext
        self.scaler = SharedLossScaler(self.loss_scaling, float(cfg["initial_loss_scale"]))
        self.stages = StageRunner(plan, self.local, P, self.device, transport, self.amp, self.scaler, cfg,
                                  replica=self.replica, tie_groups=tie_groups(plan, len(shares), self.replica),
                                  stage_through_cpu=bool(job.get("stage_through_cpu")))
        self.grad_sync = self._grad_sync(len(shares), P, job["backend"])
        self.figures = PNodeFigures(self.device, lambda: self.stages.transport.wait_s + (
            self.grad_sync.wait_s if self.grad_sync is not None else 0.0),
            tracked=lambda: (*self.stages.modules.values(), *(o for n in self.stages.optims.values()
                                                               for o in n.optimizers)))

        self.seq_len = int(job["run_info"]["seq_len"])
        self.dataset = self._open_data()
        self.batch = int(cfg["batch"])
        self.shares = shares
        self.share, self.share_offset = shares[self.replica], sum(shares[:self.replica])
        self.sizes = micro_batch_sizes(self.share, min(int(cfg["micro_batches"]), self.share))
        self.checkpoints = GatheredCheckpoints(self.ctrl, self.stages, job, self.scaler,
                                               len(self.sizes), self.say)

    def _grad_sync(self, replicas: int, plan_ranks: int, backend: str) -> GradientSync | None:
        """The stage group's gradient sum (grad_sync.py), after checking the replicas hold the same
        parameters (replica_groups.py); None without replicas."""
        if replicas < 2:
            return None
        group = stage_groups(replicas, plan_ranks)[self.local]
        params, users, late = self.stages.sync_order()
        self.group_device = self.device if backend == "nccl" else torch.device("cpu")
        try:
            check_same_layout(group, params, device=self.group_device)
        except ReplicaLayoutError as exc:
            raise TrainingError(str(exc)) from None
        sync = GradientSync(params, group, size=replicas, position=self.replica, users=users, late=late,
                            bucket_bytes=int(self.cfg.get("bucket_bytes") or DEFAULT_BUCKET_BYTES))
        self.stages.grad_sync = sync
        return sync

    def _check_replicas(self) -> None:
        """Before a checkpoint: the replicas of this stage still hold the same weights and optimizer state."""
        if self.grad_sync is not None:
            try:
                check_replicas_agree(self.grad_sync.group, self.stages.named_state(), device=self.group_device)
            except ReplicaLayoutError as exc:
                raise TrainingError(str(exc)) from None

    def _whole_targets(self, step: int) -> torch.Tensor:
        """What `run_round` weighs a replica's loss against: the global batch's targets, of which only the
        count of tokens a cross-entropy cost does not ignore matters.  Token windows hold ids inside the
        vocabulary only, so unless a cost ignores such an id that count is batch x seq_len, and zeros (never
        an ignored id then) count the same without reading the other replicas' samples."""
        vocab = int(self.job["run_info"]["vocab_size"])
        ignored = {int(n.cfg.get("ignore_index", -100)) for n in self.graph.nodes
                   if n.type in ("cost", "tied_lm_head_ce")}
        if any(0 <= i < vocab for i in ignored):
            return self.dataset.batch(step, self.batch)[1]
        return torch.zeros((self.batch, self.seq_len), dtype=torch.int64)

    def _open_data(self) -> TokenShards:
        """The corpus the launcher prepared and verified, through memory maps (sizes checked again here)."""
        try:
            corpus = open_prepared(self.job["data_dir"], verify="size")
            if corpus.digest != self.job["data_digest"]:
                raise DataError(f"{self.job['data_dir']}: the corpus changed after the launcher checked it")
            return TokenShards(corpus, seq_len=self.seq_len, vocab=int(self.job["run_info"]["vocab_size"]),
                               seed=int(self.cfg["seed"]))
        except DataError as exc:
            raise TrainingError(f"training data: {exc}") from None

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        start = self.checkpoints.resume()
        steps = int(cfg["steps"])
        self.stages.sync_tied_weights()
        log: MetricsLog | None = None
        if self.rank == 0:
            metric_names = [m.name for m in self.stages.plan.metrics if m.name not in ("step", "loss", "lr")]
            columns = ["step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale",
                       "boundary_bytes", *metric_names]
            log = MetricsLog(self.run_dir, columns, sink=self._tensorboard())
            log.restart(start)
            self.say(f"{self.graph.name}: {len(self.graph)} VNodes on {self.world} worker(s) ("
                     f"{len(self.shares)} replica(s), batch shares {self.shares}), {len(self.sizes)} micro-batch(es) "
                     f"of {self.sizes}; steps {start + 1}..{steps}; predicted traffic "
                     f"{self.job.get('predicted_bytes', self.job['predicted_cut_bytes']):,.0f} bytes/step")
        for task in self.stages.tasks:
            params = sum(p.numel() for p in self.stages.modules[task.id].parameters())
            self.say(f"task {task.id}: {len(task.graph)} VNodes, {params:,} parameters, "
                     f"{len(task.receives)} inputs, {len(task.sends)} outputs")
        log_every = int(cfg.get("log_every") or 1)
        val_every = int(cfg["val_every"])
        ckpt_every = int(cfg["checkpoint_every"])
        tokens_per_step = self.batch * self.seq_len
        pending: list[dict[str, Any]] = []
        consecutive_bad = 0
        start_time = last_flush = last_print = time.perf_counter()
        hold = self.job.get("hold")
        dist.barrier(group=self.ctrl.group)  # rank 0's set-up (log files, TensorBoard's drawing) is not step 1's idle
        for step in range(start + 1, steps + 1):
            self.figures.begin_step()
            lo, hi = self.share_offset, self.share_offset + self.share
            inputs, targets = self.dataset.batch(step, self.batch, lo, hi)  # this replica's samples only
            factor = lr_factor(step, _Schedule(cfg))
            for optim in self.stages.optims.values():
                optim.set_factor(factor)
            replicated = len(self.shares) > 1
            costs = self.stages.run_round(step, inputs, targets, self.sizes, train=True, offset=lo,
                                          whole=self._whole_targets(step) if replicated else None)
            self.stages.finish_gradients()  # the replicas' buckets still in flight (grad_sync.py)
            loss_local = float(sum(costs.values())) if costs else 0.0
            validate = val_every > 0 and (step % val_every == 0 or step == steps)
            save_now = step == steps or (ckpt_every > 0 and step % ckpt_every == 0)
            flush = save_now or validate or step % log_every == 0
            extras = local_metric_values(self.stages, costs, self.scaler.scale) if flush else {}
            sumsq = 0.0
            if cfg.get("grad_clip") and self.replica == 0:  # the summed gradients: one replica counts them
                sumsq = float(sum(float(p.grad.double().pow(2).sum()) for p in self.stages.trainable
                                  if p.grad is not None))
            bad_grads = 0.0
            if self.loss_scaling:
                bad_grads = float(any(not bool(torch.isfinite(p.grad).all()) for p in self.stages.trainable
                                      if p.grad is not None))
            # Traffic since the previous reduction: the weight sync that preceded this step, then its
            # activations, gradients and tied-weight gradients (what placement_report prices per step).
            # A stop request (the launcher got Ctrl-C/SIGTERM) travels in the same reduction, so every
            # rank stops after the same step, with a checkpoint.
            sent = self.stages.traffic
            with self.figures.waiting():
                loss, sumsq, bad_grads, step_bytes, stopping = self.ctrl.all_reduce(
                    [loss_local, sumsq, bad_grads, sent, float(self._stop_file.exists())])
            if stopping > 0:
                save_now = flush = True
            self.stages.traffic = 0
            if math.isfinite(loss):
                consecutive_bad = 0
            else:
                consecutive_bad += 1
                if not self.loss_scaling or consecutive_bad > int(cfg["max_skipped_steps"]):
                    raise TrainingError(self._diverged(step, loss, consecutive_bad))
            self._optimizer_step(bad_grads > 0, sumsq)
            self.stages.sync_tied_weights()
            self.figures.end_step(step, sent)

            row = {"step": step, "loss": loss, "lr": float(cfg["lr"]) * factor, "boundary_bytes": int(step_bytes)}
            if self.loss_scaling:
                row["loss_scale"] = self.scaler.scale
            pending.append(row)
            if flush:
                gathered = self.ctrl.gather((extras, self.figures.take()))
                val_loss = self.validate() if validate else None
                now = time.perf_counter()
                if self.rank == 0:
                    for r in pending:
                        r["tokens_per_s"] = tokens_per_step * len(pending) / max(now - last_flush, 1e-9)
                        r["elapsed_s"] = now - start_time
                    for part, _ in gathered:
                        pending[-1].update({k: v for k, v in part.items()})
                    attach(pending, [figures for _, figures in gathered], self.job["ranks"])
                    if val_loss is not None:
                        pending[-1]["val_loss"] = val_loss
                    log.append(pending)
                    if now - last_print >= 2.0 or step == steps or validate:
                        last_print = now
                        r = pending[-1]
                        self.say(f"step {step}/{steps} loss {r['loss']:.4f} tok/s {r['tokens_per_s']:,.0f} "
                                 f"lr {r['lr']:.2e}" + (f" val {val_loss:.4f}" if val_loss is not None else ""))
                pending = []
                last_flush = time.perf_counter()
            if save_now:
                self._check_replicas()
                path = self.checkpoints.save(step)
                if path is not None:
                    self.say(f"checkpoint {path}")
                if self.rank == 0 and log is not None:
                    # Drawn at checkpoints and at the end only: matplotlib's seconds on rank 0 would be
                    # every other worker's idle time at each validation.
                    log.plot(self.run_dir / "loss_curve.png", self.graph.name)
                last_flush = time.perf_counter()
            if hold and int(hold["rank"]) == self.rank and int(hold["step"]) == step:
                self._hold(step)
            if stopping > 0:
                self.say(f"stopped after step {step} as asked")
                break
        if self.rank == 0 and log is not None:
            log.plot(self.run_dir / "loss_curve.png", self.graph.name)
            log.close()
        clear_dropout_key()
        dist.barrier(group=self.ctrl.group)

    def _tensorboard(self) -> TensorBoardLog | None:
        """Rank 0's TensorBoard sink (unless --no-tensorboard): the placed graph drawn by PNode, the settings."""
        if not self.cfg.get("tensorboard", True):
            return None
        placement = None
        try:
            placement = json.loads((self.run_dir / "placement.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass  # the drawing then takes each VNode's PNode from the graph itself
        settings = dict(self.job["run_info"], pipeline=self.cfg.get("pipeline"),
                        micro_batches=self.cfg.get("micro_batches"), batch_shares=self.shares)
        return TensorBoardLog(self.run_dir, settings=settings, graph=self.graph,
                              placement=placement if isinstance(placement, dict) else None, say=self.say)

    def _optimizer_step(self, found_inf: bool, sumsq: float) -> None:
        scale = self.scaler.scale
        if found_inf:  # every rank skips together (the flag was all-reduced)
            self.scaler.update(True)
        else:
            with torch.no_grad():
                if self.scaler.enabled:
                    for p in self.stages.trainable:
                        if p.grad is not None:
                            p.grad.mul_(1.0 / scale)
                clip = self.cfg.get("grad_clip")
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
            if i >= int(self.cfg["val_batches"]):
                break
            if self.replica == 0:  # replicas hold the same weights: one evaluates
                costs = self.stages.run_round(0, inputs, targets, [inputs.shape[0]], train=False)
                total += float(sum(costs.values())) * inputs.shape[0] if costs else 0.0
            count += inputs.shape[0]
        (total,) = self.ctrl.all_reduce([total])
        return total / max(count, 1)

    def _diverged(self, step: int, value: float, streak: int) -> str:
        why = (f"the loss scaler skipped {streak} steps in a row without recovering" if self.loss_scaling
               else "training stopped before applying that step's update")
        return (f"network {self.graph.name!r}: the loss at step {step} is {value} (not finite); {why}. Resume "
                f"from the last checkpoint (--resume) with a lower --lr, or clip gradients with --grad-clip 1.0.")

    @property
    def _stop_file(self) -> Path:
        """Written by the launcher on this machine at the first Ctrl-C/SIGTERM (launch.py)."""
        return Path(self.job["run_dir"]) / LAUNCH_DIR / STOP_FILE

    def _hold(self, step: int) -> None:
        """Test hook: stop after `step` (others block on this rank) until killed or released."""
        launch_dir = self.run_dir / LAUNCH_DIR
        (launch_dir / f"held-{self.pnode}").write_text(f"{step}\n")
        deadline = time.monotonic() + 300
        while not (launch_dir / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


class _Schedule:
    """The fields `node_optimizers.lr_factor` reads, from the job's config dict."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.warmup = int(cfg.get("warmup") or 0)
        self.schedule = cfg.get("schedule") or "constant"
        self.steps = int(cfg["steps"])
        self.min_lr_ratio = float(cfg.get("min_lr_ratio", 0.1))


def _peer_lost(exc: BaseException) -> bool:
    """A communication error caused by another worker going away (or timing out)."""
    backend_error = getattr(dist, "DistBackendError", None)
    text = str(exc)
    return (backend_error is not None and isinstance(exc, backend_error)) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "Timed out", "timed out"))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.distributed.worker JOB.json` (torchrun environment)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m vgraph.backends.torch.distributed.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    worker = Worker(job, rank, world, local_rank)
    try:
        load_plugins(job.get("plugins", ()))  # what the launcher loaded: installed op types, --plugin files
        worker.setup()
        worker.run()
        return 0
    except VGraphError as exc:
        text = "\n".join(str(d) for d in exc.diagnostics)
        print(f"error: {text}", file=sys.stderr, flush=True)
        # Every rank that raised writes its message; a collective decision gives identical texts.
        (Path(job["run_dir"]) / LAUNCH_DIR / f"error-{rank}.txt").write_text(text + "\n", encoding="utf-8")
        return EXIT_USER_ERROR
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
