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
   non-finite loss, skip under loss scaling, clip: step.LossCheck, as
   `vgraph train`);
4. steps its optimizers (per VNode, as `vgraph train`), then owners send
   tied weights to their replicas;
5. at sync points (validation, checkpoint, `--log-every` steps, and by default whenever rank 0 last
   flushed at least loop.FLUSH_SECONDS ago: its vote travels in step 3's reduction, so every rank agrees),
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

This module is the entry point (`main`) and the rank's set-up (`Worker`),
which runs the one training loop `vgraph train` runs too (training/loop.py:
sync points, validation, checkpoints, stop requests, the rows) with this
rank's step strategy (pipeline_step.py: steps 1 to 4 above, and the vote of
step 5) and output (rank_zero.RankOutput: the gathering of step 5); the
launcher's stop file and test hold are here (`LaunchStop`, `hold`).  The
rank's stages and schedule rounds live in stage_runner.py, the shared
loss-scaling decision in loss_scaler.py.

Exit status: 0 done; 2 a usage error; 3 a user-facing error (message in
launch/error-<rank>.txt and on stderr; the launcher does not restart);
anything else is a crash the launcher answers with a restart from the last
checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import atomic_write
from vgraph.cost.grad_compression import parse_grad_compress
from vgraph.data.shards import DataError, open_prepared
from vgraph.placement.export import assignment_of
from vgraph.plugins import load_plugins
from vgraph.run.compiled_graph import apply_assignment  # the launcher, the workers and `vgraph report` build it alike
from vgraph.run.files import LOSS_CURVE_PNG, RELEASE_FILE, RUN_LOCK_ENV, RunInUse, RunLock, error_name, held_name
from vgraph.run.step_plan import make_plan
from vgraph.yamlio import loads

from .comm import ControlGroup, Transport
from .comm_choice import worker_device
from .fleet_watch import FleetWatch, machine_count
from .grad_sync import GradientSync
from .launchers import WorkerPlace, worker_place
from .loss_scaler import SharedLossScaler
from .pipeline_step import PipelineStep
from .pnode_figures import PNodeFigures, run_drift
from .powersgd import PowerSGD
from .progress import RankZeroProgress, progress_mode
from .rank_zero import GatheredCheckpoints, RankOutput, open_log
from .replica_groups import ReplicaLayoutError, check_replicas_agree, check_same_layout, stage_groups
from .stage_runner import StageRunner
from .tie_sync import tie_groups
from ..job import EXIT_USER_ERROR, LAUNCH_DIR, RESCUE_SIGNAL, STOP_FILE, Job
from ..rendezvous import gloo_environment, process_group_store
from ...lowering.lower import compute_dtype
from ...training import checkpoint as ckpt
from ...training.batches import TokenShards
from ...training.config import TrainingError
from ...training.interrupt import StopRequest
from ...training.loop import run_loop
from ...training.rescue import RESCUE_DIR, run_identity, write_shard
from ...training.setup import seed_everything, use_deterministic_kernels
from ...training.step import LossCheck

__all__ = ["main", "Worker", "claim_run", "EXIT_USER_ERROR", "LAUNCH_DIR", "apply_assignment"]

class LaunchStop:
    """A worker's stop request (loop.StopSource): the launcher's stop file, or a signal the worker got itself
    (`Worker.stop_request`).  Acted on once every rank agreed on it, in the step's reduction."""

    late_requests = False

    def __init__(self, stop_file: Path, signalled: StopRequest | None) -> None:
        self.stop_file, self.signalled = stop_file, signalled

    @property
    def requested(self) -> bool:
        return self.stop_file.exists() or (self.signalled is not None and self.signalled.requested)


class Worker:
    """The state of one rank; `setup()` then `run()` trains to the configured step."""

    def __init__(self, job: Job, place: WorkerPlace) -> None:
        self.job, self.cfg = job, job.train
        self.place = place
        self.rank, self.world, self.local_rank = place.rank, place.world, place.local_rank
        self.attempt = job.attempt + place.restart
        self.run_dir = job.run_path
        self.log_enabled = bool(self.cfg.progress)
        self.progress: RankZeroProgress | None = None  # rank 0's bar, events or lines (progress.py)
        self._signalled: StopRequest | None = None  # a signal this worker got itself (torchrun, srun)
        self._stopped_early = False
        self._rescue_lock = threading.Lock()  # one shard: the launcher's request and a lost peer may both ask
        self._rescued: tuple[Path | None, int | None] | None = None  # (shard, its step) once written

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
        self.replica, self.local = divmod(self.rank, len(job.plan_ranks))
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
        dtype = compute_dtype(graph)
        precision = graph.meta.get("precision") or {}
        self.loss_scaling = bool(precision.get("loss_scaling")) and dtype == torch.float16
        amp = (lambda: torch.autocast(self.device.type, dtype=dtype)) if dtype != torch.float32 \
            else contextlib.nullcontext
        self.scaler = SharedLossScaler(self.loss_scaling, self.cfg.initial_loss_scale)
        transport = Transport(self.device, stage_through_cpu=job.stage_through_cpu, offset=self.replica * P)
        self.stages = StageRunner(plan, self.local, P, self.device, transport, amp, self.scaler,
                                  seed=self.cfg.seed, lr=self.cfg.lr, pipeline=job.pipeline, replica=self.replica,
                                  tie_groups=tie_groups(plan, len(job.batch_shares), self.replica),
                                  stage_through_cpu=job.stage_through_cpu, weight_decay=self.cfg.weight_decay)
        self.group_device = self.device if job.backend == "nccl" else torch.device("cpu")
        self.grad_sync, self.powersgd = replica_sync(self.stages, job, self.group_device)

    def _data(self) -> None:
        """The corpus the launcher prepared, the step (this replica's share of the batch, its micro-batches)."""
        job = self.job
        figures = PNodeFigures(self.device, lambda: self.stages.transport.wait_s + (
            self.grad_sync.wait_s if self.grad_sync is not None else 0.0),
            tracked=lambda: (*self.stages.modules.values(), *(o for n in self.stages.optims.values()
                                                               for o in n.optimizers)))
        self.steps = PipelineStep(job, self.rank, self.stages, self.ctrl, open_data(job), scaler=self.scaler,
                                  loss_check=LossCheck(self.scaler, self.loss_scaling, self.cfg.max_skipped_steps,
                                                       self.graph, self.run_dir),
                                  figures=figures, powersgd=self.powersgd)
        self.checkpoints = GatheredCheckpoints(self.ctrl, self.stages, job, self.scaler, len(self.steps.sizes),
                                               self.say, attempt=self.attempt, powersgd=self.powersgd)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Resume (when the run directory has a checkpoint), then the one training loop (training/loop.py) to
        `train.steps`: this rank's PipelineStep, rows and checkpoints gathered on rank 0 (RankOutput)."""
        start = self.checkpoints.resume()
        self.steps.completed = start
        self.stages.sync_tied_weights()
        log = None
        if self.rank == 0:
            log = open_log(self.job, self.graph, start, [m.name for m in self.stages.plan.metrics], self.say)
            if self.log_enabled:
                self.progress = RankZeroProgress(progress_mode(os.environ, self.place.launcher), self.cfg.steps,
                                                 start, "launch", lambda line: print(line, flush=True))
        self._announce(start)
        drift = run_drift(self.job, self.run_dir, self.say) if log is not None else None  # rank 0 (drift.py)
        fleet = (FleetWatch(self.run_dir, machine_count(self.job), self.cfg.steps, log.sink)
                 if log is not None else None)
        out = RankOutput(self.ctrl, self.checkpoints, log=log, progress=self.progress, pnodes=list(self.job.ranks),
                         curve=(self.run_dir / LOSS_CURVE_PNG, self.graph.name), before_save=self._check_replicas,
                         after_step=lambda step: hold(self.job, self.rank, self.pnode, step), say=self.say,
                         drift=drift.rows if drift is not None else None, fleet=fleet)
        dist.barrier(group=self.ctrl.group)  # rank 0's set-up (log files, TensorBoard's drawing) is not step 1's idle
        end = run_loop(self.steps, out, LaunchStop(self.run_dir / LAUNCH_DIR / STOP_FILE, self._signalled),
                       self.cfg, start)
        if end.stopped:
            self.say(f"stopped after step {end.step} as asked")
            self._stopped_early = end.step < self.cfg.steps
        dist.barrier(group=self.ctrl.group)

    def _announce(self, start: int) -> None:
        if self.rank == 0:
            self.say(f"{self.graph.name}: {len(self.graph)} VNodes on {self.world} worker(s) "
                     f"({len(self.job.batch_shares)} replica(s), batch shares {list(self.job.batch_shares)}), "
                     f"{len(self.steps.sizes)} micro-batch(es) of {self.steps.sizes}; steps {start + 1}.."
                     f"{self.cfg.steps}; predicted traffic {self.job.predicted_bytes:,.0f} bytes/step")
        for task in self.stages.tasks:
            params = sum(p.numel() for p in self.stages.modules[task.id].parameters())
            self.say(f"task {task.id}: {len(task.graph)} VNodes, {params:,} parameters, "
                     f"{len(task.receives)} inputs, {len(task.sends)} outputs")

    def rescued(self) -> tuple[Path | None, int | None]:
        """(this rank's rescue shard, its step) when a peer is lost (training/rescue.py), written once whoever
        asks first: the main thread after a collective failed, or the rescue watch while the main thread waits
        on a peer that went dark (`watch_rescue_requests`).  (None, None) when it has none yet (lost during
        set-up) or was not started by `vgraph launch` (torchrun and srun resume from the last checkpoint)."""
        with self._rescue_lock:
            if self._rescued is None:
                self._rescued = _rescue_shard(self)
            return self._rescued

    def _check_replicas(self) -> None:
        """Before a checkpoint: the replicas of this stage still hold the same weights and optimizer state."""
        if self.grad_sync is not None:
            try:
                check_replicas_agree(self.grad_sync.group, self.stages.named_state(), device=self.group_device)
            except ReplicaLayoutError as exc:
                raise TrainingError(str(exc)) from None

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


def replica_sync(stages: StageRunner, job: Job, group_device: torch.device
                 ) -> tuple[GradientSync | None, PowerSGD | None]:
    """The stage group's gradient sum (grad_sync.py) and its PowerSGD compression, after checking the
    replicas hold the same parameters (replica_groups.py); (None, None) without replicas."""
    replicas, plan_ranks = len(job.batch_shares), len(job.plan_ranks)
    if replicas < 2:
        return None, None
    group = stage_groups(replicas, plan_ranks)[stages.rank]  # StageRunner.rank: the plan rank
    params, users, late = stages.sync_order()
    try:
        check_same_layout(group, params, device=group_device)
    except ReplicaLayoutError as exc:
        raise TrainingError(str(exc)) from None
    spec = parse_grad_compress(job.grad_compress)
    hook: dict[str, Any] = {}
    powersgd = None
    if spec.enabled:
        if any(p.dim() == 0 for p in params):
            raise TrainingError("--grad-compress powersgd views every gradient as a matrix of its first "
                                "dimension's rows; this stage trains a scalar parameter: use --grad-compress none")
        powersgd = PowerSGD(group, spec, replicas, job.train.seed)
        hook = {"hook": powersgd.hook, "hook_state": powersgd.state, "wire": powersgd.wire_numels}
    sync = GradientSync(params, group, size=replicas, position=stages.replica, users=users, late=late,
                        bucket_bytes=job.bucket_bytes, **hook)
    stages.grad_sync = sync
    return sync, powersgd


def open_data(job: Job) -> TokenShards:
    """The corpus the launcher prepared and verified, read a window at a time (sizes checked again here)."""
    try:
        corpus = open_prepared(job.data_path, verify="size")
        if corpus.digest != job.data_digest:
            raise DataError(f"{job.data_path}: the corpus changed after the launcher checked it")
        return TokenShards(corpus, seq_len=int(job.run_info["seq_len"]), vocab=int(job.run_info["vocab_size"]),
                           seed=job.train.seed)
    except DataError as exc:
        raise TrainingError(f"training data: {exc}") from None


def hold(job: Job, rank: int, pnode: str, step: int) -> None:
    """Test hook (job.hold): stop `rank` after `step` (others block on it) until killed or released, once its
    rows and checkpoint are out.  Once per run directory: a worker set restarted by torchrun from the same job
    file does not hold again."""
    spec = job.hold
    if not spec or spec["rank"] != rank or spec["step"] != step:
        return
    marker = job.run_path / LAUNCH_DIR / held_name(pnode)
    if marker.exists():
        return
    atomic_write(marker, json.dumps({"step": step, "pid": os.getpid()}) + "\n")
    deadline = time.monotonic() + 300
    while not (job.run_path / LAUNCH_DIR / RELEASE_FILE).exists() and time.monotonic() < deadline:
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


def _rescue_shard(worker: Worker) -> tuple[Path | None, int | None]:
    """Write `worker`'s VNodes' state at the last step it completed, into its run directory for the launcher
    to assemble; read under the step's state lock, so never between an update's first and last tensor."""
    steps = getattr(worker, "steps", None)
    if worker.place.launcher != "vgraph" or steps is None:
        return None, None
    with steps.state_lock:
        step = steps.completed
        if step is None:
            return None, None
        state = worker.checkpoints.local_state(every_replica=True)
        path = write_shard(worker.run_dir / LAUNCH_DIR / RESCUE_DIR,
                           run=run_identity(worker.job.network_yaml, worker.job.run_info), attempt=worker.job.attempt,
                           rank=worker.rank, pnode=worker.pnode, step=step, model=state["model"], optim=state["optim"],
                           extra={"grad_scaler": worker.scaler.state_dict(),
                                  "compression": {"boundary": state["compression"]["boundary"]}})
    return path, step


def _write_rescue(worker: Worker | None) -> None:
    """The lost peer's survivors each leave their shard (Worker.rescue); a shard that cannot be written is
    said and skipped: the launcher then falls back to the last checkpoint."""
    if worker is None:
        return
    try:
        path, step = worker.rescued()
    except Exception as exc:  # noqa: BLE001 - a full disk, a torn state: the checkpoint path still holds
        print(f"rescue shard not written: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr, flush=True)
        return
    if path is not None:
        print(f"rescue: left step {step} of rank {worker.rank} in {path}", file=sys.stderr, flush=True)


def watch_rescue_requests(worker: Worker) -> bool:
    """When `vgraph launch` started this worker (RESCUE_SIGNAL blocked in every thread, supervisor.py): a
    thread that waits for the signal, writes this rank's rescue shard and ends the process.

    Why a thread: the launcher asks when a machine went dark without closing its connections (a lost link,
    a frozen host), and then this worker's main thread waits inside a gloo collective until --comm-timeout,
    with the GIL released; a signal handler would only run after that wait, by which time the launcher has
    stopped the worker and the state of the last completed step is lost.  Exiting with os._exit is the one
    way out of the wait; the launcher treats the exit as this attempt's end, as it would a lost peer's."""
    if RESCUE_SIGNAL not in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return False  # torchrun, srun, a hand-started worker: they resume from the last checkpoint

    def wait() -> None:
        signal.sigwait({RESCUE_SIGNAL})
        print("rescue: the launcher asked for this rank's shard (a machine went dark)", file=sys.stderr, flush=True)
        _write_rescue(worker)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=wait, name="vgraph-rescue-watch", daemon=True).start()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.distributed.runtime.worker JOB.json` (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m vgraph.backends.torch.distributed.runtime.worker JOB.json", file=sys.stderr)
        return 2
    job: Job | None = None
    place: WorkerPlace | None = None
    worker: Worker | None = None
    try:
        place = worker_place(os.environ)
        job = Job.read(args[0])
        with RunLock.held():
            claim_run(job, place, os.environ)
            load_plugins(job.plugins)  # what the launcher loaded: installed op types, --plugin files
            worker = Worker(job, place)
            watch_rescue_requests(worker)
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
            _write_rescue(worker)
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
