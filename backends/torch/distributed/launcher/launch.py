"""`vgraph launch`: train a network partitioned over a fleet, one torch.distributed worker per PNode.

    vgraph launch NETWORK.yml --fleet FLEET.yml [train options] [--micro-batches M] [--pipeline 1f1b|gpipe]
                  [--replicas N|auto] [--on-failure restart|repartition|shrink|stop] [--max-restarts N]
                  [--nnodes N --node-rank R --master-addr HOST --master-port PORT] [--bucket-size SIZE]
                  [--emit-job DIR]

The launcher (this module) does what needs doing once: it runs the pass
pipeline with the `partition` pass in it (before the fusions, so fusion
respects the placement), opens the corpus once for everybody (a prepared
directory, or text and the embedded corpus prepared into the cache:
training_data.py) and verifies it, writes the run directory's files as
`vgraph train` does (network.yml, tokenizer.json, run.json, placement.json),
and a job file (run_dir/launch/job-<attempt>.json).  Then it starts one
worker process per PNode that holds VNodes (worker.py) with the
torchrun environment on 127.0.0.1 and a free port (gloo on CPUs, nccl when
every local worker has a GPU of its own, else gloo through host memory).
Workers are forked from a multiprocessing forkserver that imported torch
once, so starting (and restarting) them takes milliseconds, not seconds per
process.  The launcher relays their output prefixed with `[<pnode>]` and
supervises them:

* all exit 0: done;
* one exits 3 (a user-facing error: diverged loss, incompatible resume, an
  input it cannot feed): the others are stopped and the error is raised;
* one dies otherwise (killed, crashed, lost its peer): the others, typically
  blocked in a receive from it, see their peer lost, write their rescue shard
  (the state of the last step they completed: training/rescue.py) and exit,
  or are terminated after 5 s (SIGTERM, then SIGKILL); machine 0 makes a
  checkpoint of the shards when they hold every VNode at one step (`_rescue`;
  the other machines send theirs over the launchers' channel:
  shard_transfer.py), and the run restarts from the latest checkpoint, with the same
  placement (`--on-failure restart`) or re-partitioned onto the PNodes that
  survived (`--on-failure repartition`: the dead worker's PNode is dropped
  from the fleet).  Checkpoints are in the unfused global layout and the
  data generator state travels in them, so no step is lost or applied twice:
  metrics past the checkpoint are dropped and recomputed.  At most
  `--max-restarts` times.

Replicas (`--replicas N|auto`; the CLI's default is auto, `LaunchConfig`'s 1): the partition pass plans R
copies of an S-stage pipeline (passes/partition_replicas.py) and R x S workers run it: world rank
r x S + s runs stage s of replica r (s in the order of use along the network), point to point inside
its replica, and the S stage groups sum their gradients with bucketed all-reduces on torch's collectives,
overlapped with the last micro-batch's backward (grad_sync.py; `--bucket-size`, default 25 MiB).  Every rank draws the global batch; replica r trains on its `batch_shares[r]` samples
of it, with losses weighted by shares of the global batch and dropout keyed by the global sample index,
so the run is the same training as one process.  Workers count every byte they send, the all-reduce
included, against placement.json's `bytes_per_step`.  `--on-failure shrink` drops the replicas that
lost a worker: the survivors keep their PNodes, share the global batch again by speed
(`vgraph.placement.replica_report.rebalanced_shares`) and resume from the last checkpoint; across machines, a
machine whose launcher falls silent (membership.py) loses all its PNodes.

Several machines (the torchrun way): run the same command on every machine
with `--nnodes N --node-rank R --master-addr <rank-0 machine> --master-port P`.
The placement is computed identically everywhere; machine R hosts ranks
R*k .. R*k+k-1 (k = ceil(ranks / N)), rank r being the r-th PNode in order of
use along the network.  Rank 0 (machine 0) writes metrics and checkpoints and
hands each rank its share of a checkpoint on resume, so only machine 0 needs
the run directory.  A failure restarts every machine's workers from the last
checkpoint (each launcher restarts its own; the rendezvous port moves to
P + attempt; a machine that vanished is re-planned around, its VNodes' state
rescued from a surviving replica when one holds them); `repartition` is
single-machine only.  The launchers keep in
touch through machine 0 on port P - 1 (membership.py): a machine lost with its
link is noticed within --link-timeout, and machine 0 decides for all what the
next attempt is.  With `shrink` or `restart`, machine 0 itself may be lost: the
lowest surviving machine becomes the coordinator from the history it mirrored
and the survivors' rescue shards (`_succeed`, succession.py).  A PNode stays on the machine that ran it first (after a
shrink, the survivors keep theirs).  The worker is a plain
torchrun-style program, so
`torchrun --nnodes N --nproc-per-node k ... -m vgraph.backends.torch.distributed.runtime.worker JOB.json`
from the job file `--emit-job DIR` writes (it prepares the run directory and
trains nothing) also works, and so does `srun` (docs/distributed.md).

Machines that join while the run goes on (`--nnodes MIN:MAX` on the machines the run starts with,
`vgraph launch --join HOST:PORT --pnode PNODE.yml` on a newcomer): machine 0 admits them on the launchers'
channel, decides whether re-planning onto the grown fleet pays (`_on_join`, vgraph/placement/replan.py) and
then asks for a boundary: the workers stop after the current step with a checkpoint and the next attempt
is placed on the grown fleet (`_boundary`); the other machines run the jobs machine 0 publishes from then on
(elastic.py).

The launch reads top to bottom: `_prepare` (settings, run directory, data,
once), then per attempt `_place_attempt` (placement, run.json,
placement.json, the job file: job.py) and `_supervise` (this machine's
workers, supervisor.py), and `_after_failure` (restart, re-partition or
shrink, or give up; across machines, machine 0 decides: membership.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.safeio import OutputDir, atomic_write, check_output_dir, read_input, read_json
from vgraph.cost.grad_compression import parse_grad_compress
from vgraph.cost.fleet import Fleet, resolve_fleet
from vgraph.placement.drift import DEFAULT_DRIFT_STEPS, fleet_file_text
from vgraph.ir.graph import Graph
from vgraph.placement.export import assignment_of, placement_report
from vgraph.placement.replan import DEFAULT_REPLAN_OVERHEAD_S
from vgraph.placement.replica_report import rebalanced_shares
from vgraph.plugins import loaded_files
from vgraph.run.compiled_graph import (PLAN_CHOICES, apply_assignment, network_changes, plugin_distributions,
                                       weight_keeping_changes)
from vgraph.run.files import (MEASURED_FLEET, METRICS_JSONL, NETWORK_YML, PLACEMENT_JSON, RELEASE_FILE, RUN_JSON,
                              TOKENIZER_JSON, WORKERS_JSON, RunLock, error_name, held_name)
from vgraph.transform.pipeline import DEFAULT_PIPELINE, Pipeline, available_passes, run_pipeline

from ...training import checkpoint as ckpt
from ..runtime.comm_choice import COMM_MODES, choose_comm
from ..runtime.grad_sync import DEFAULT_BUCKET_BYTES
from ..job import EXIT_USER_ERROR, JOB_FILE, LAUNCH_DIR, STOP_FILE, Job
from .membership import REQUEST_TIMEOUT_S, MachineLost, Machines, decide
from . import elastic, succession
from vgraph.run.step_plan import PIPELINES
from ..runtime.progress import LaunchBar
from ..rendezvous import TOKEN_ENV, check_master_addr, check_token, free_port, probe_port
from .supervisor import Supervisor
from .shard_transfer import ShardReceiver, send_shards
from .elastic import record_event
from ...training.rescue import RESCUE_DIR, assemble, clear_rescue, read_shards, run_identity, save_rescued
from vgraph.run.step_plan import make_plan
from ...training.interrupt import StopRequest
from ...training.metrics_log import read_rows
from ...training.config import TrainConfig, TrainingError
from ...training.corpus import prepare_data
from ...training.run_files import run_slug
from ...training.options import add_train_options, check_train_config, print_result, train_settings
from ...training.setup import (NO_FUSE_PIPELINE, device_target, load_network, open_run_dir, resolve_device,
                              vocab_and_seq)

__all__ = ["LaunchConfig", "LaunchResult", "launch", "split_pipeline", "place", "read_placement",
           "register_launch", "main"]

ON_FAILURE = ("restart", "repartition", "shrink", "stop")
MOVE_POLL_S = 0.1  # how often the launcher looks for the first step after a boundary (metrics.jsonl's tail)


@dataclass
class LaunchConfig(TrainConfig):
    """`TrainConfig` plus where and how to run it (the CLI options map one to one)."""

    fleet: str | Path | Fleet | None = None
    micro_batches: int | None = None  # default: min(batch, 2 x PNodes of the fleet)
    pipeline: str = "1f1b"  # micro-batch schedule: 1f1b (bounded activations) | gpipe
    on_failure: str = "restart"
    replicas: int | str = 1  # data-parallel replicas of the pipeline: a number, or "auto" (the CLI's default)
    max_restarts: int = 3
    comm_timeout: float = 300.0  # seconds a worker waits on a peer before giving up
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # gradient buckets of the replicas' all-reduce (grad_sync.py)
    link_timeout: float = 10.0  # several machines: seconds of silence after which a machine is lost (membership.py)
    grad_compress: str = "none"  # the replicas' all-reduce: none | powersgd[:rank=R,start=N] (grad_compress.py)
    nnodes: int = 1
    max_nnodes: int | None = None  # --nnodes MIN:MAX: machines may join up to MAX (elastic.py); None: nnodes
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # default: a free port (one machine), 29500 (several)
    placement: dict[str, str] | str | Path | None = None  # VNode -> PNode, or a placement.json: no partition pass
    hold: tuple[str, int] | None = None  # test hook: the worker of PNode [0] stops after step [1] (1st attempt)
    comm: str = "auto"  # auto | gloo | nccl-on-gloo (test hook: the nccl path's code over gloo), comm_choice.py
    log: Callable[[str], None] | None = None  # where status and worker lines go (default stderr)
    emit_job: str | Path | None = None  # write the run directory and DIR/job.json, train nothing (torchrun, srun)
    drift_steps: int = DEFAULT_DRIFT_STEPS  # steps off the plan by > 25% before a drift is reported (0: never; drift.py)
    replan_overhead_s: float = DEFAULT_REPLAN_OVERHEAD_S  # what a boundary costs besides the move (replan.py)
    leaving: Any = None  # machine k != 0 of a run that takes joins: the elastic.Leaving to leave by (SIGTERM's)


@dataclass
class LaunchResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    restarts: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # per attempt: ranks, exit codes, outcome
    placement: dict[str, Any] = field(default_factory=dict)  # placement_report of the last attempt
    steps_redone: int = 0  # machine 0: steps trained again after failures (0 when every rescue found its step)


# -- the graph --------------------------------------------------------------------------------------

def split_pipeline(passes: str | None, fuse: bool, options: dict[str, str]) -> tuple[Pipeline, Pipeline, Pipeline]:
    """(passes before the partition, the partition pass, passes after it) for a `vgraph train` pipeline.

    The partition goes right after dead-nodes/precision (it prices effective
    precisions) and before any fusion (fusion then respects the placement);
    a pipeline that names `partition` itself keeps its place and options,
    with the run's batch and micro-batches.
    """
    if passes is not None and not fuse:
        raise VGraphError(f"give either --passes or --no-fuse, not both (--no-fuse means the pipeline "
                          f"'{NO_FUSE_PIPELINE}')")
    options = {**options, "replicas": options.get("replicas", "1")}  # one pipeline unless the run asks for more
    pipeline = Pipeline.parse(passes) if passes is not None else (DEFAULT_PIPELINE if fuse else NO_FUSE_PIPELINE)
    if "partition" not in pipeline:  # after the last of dead-nodes/precision, else first
        pipeline = pipeline.insert("partition", after=("dead-nodes", "precision"), before=pipeline.names)
    before, partition, after = pipeline.with_options("partition", **options).split("partition")
    return before, Pipeline((partition,)), after


@dataclass
class Placement:
    graph: Graph  # placed and optimised, as every worker builds it
    assignment: dict[str, str]  # VNode -> PNode right after the partition pass (pre-fusion ids)
    final: dict[str, str]  # VNode -> PNode of `graph`
    ranks: list[str]  # rank -> PNode, in order of use along the network (replica 0: the plan's ranks)
    report: dict[str, Any]  # placement_report (placement.json)
    rows: list[list[str]] = field(default_factory=list)  # per replica, its PNodes in stage order
    shares: list[int] = field(default_factory=list)  # per replica, its samples of the global batch
    choices: dict[str, Any] = field(default_factory=dict)  # the partition's choices the passes after it read

    @property
    def world(self) -> list[str]:
        """World rank -> PNode: replica r's workers are ranks r*P .. r*P+P-1, in the plan's rank order."""
        stage = {p: s for s, p in enumerate(self.rows[0])}
        return [row[stage[p]] for row in self.rows for p in self.ranks]


def place(source: Graph, fleet: Fleet, *, before: str | Pipeline, partition: str | Pipeline, after: str | Pipeline,
          target: str, batch: int,
          micro_batches: int, assignment: dict[str, str] | None = None,
          replicas: tuple[list[list[str]], list[int]] | None = None, grad_compress: str = "none",
          pipeline: str = "1f1b") -> Placement:
    """Partition `source` onto `fleet` (or take `assignment`) and build the placed graph the workers build.

    A given `assignment` names the VNodes as the partition pass would see them
    (after the passes before it, i.e. before any fusion); `replicas` (rows of
    PNodes per replica, batch shares) goes with it when the run has replicas.
    """
    graph = source.copy()
    if before:
        run_pipeline(graph, before, target=target)
    if assignment is None:
        if "partition" not in available_passes():
            raise VGraphError("the 'partition' pass is not installed: reinstall vgraph (pip install -e .) so "
                              "its entry point is registered")
        run_pipeline(graph, partition, target=target, data={"fleet": fleet})
        assignment = {n.id: n.meta["pnode"] for n in graph.nodes}
        planned = graph.meta.get("placement") or {}
        if planned.get("replicas", 1) > 1:
            replicas = (planned["replica_pnodes"], planned["batch_shares"])
        choices = {k: planned[k] for k in PLAN_CHOICES if k in planned}
    else:
        missing = [n.id for n in graph.nodes if n.id not in assignment]
        unknown = sorted(set(assignment.values()) - set(fleet.ids))
        problems = []
        if missing:
            problems.append(f"does not place VNode(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unknown:
            problems.append(f"names PNode(s) {', '.join(unknown)} that fleet {fleet.name!r} does not have")
        if problems:
            raise VGraphError(f"the given placement {'; '.join(problems)}")
        assignment = {n.id: assignment[n.id] for n in graph.nodes}
        choices = {}
    placed = apply_assignment(source, before, assignment, after, target, choices)
    final = assignment_of(placed)
    ranks = list(dict.fromkeys(final[n.id] for n in placed.topo_order()))
    placed.meta["placement"] = {"batch": batch, "micro_batches": micro_batches, "grad_compress": grad_compress,
                                "pipeline": pipeline, **choices}  # the schedule the step is priced as
    if replicas is not None:
        placed.meta["placement"].update(replica_pnodes=replicas[0], batch_shares=replicas[1])
    report = placement_report(placed, fleet, batch=batch, micro_batches=micro_batches)
    return Placement(placed, assignment, final, ranks, report, report["replica_pnodes"], report["batch_shares"],
                     choices)


_NOT_A_PLACEMENT = "expected {'assignment': {vnode: pnode}}"


def read_placement_layout(path: str | Path) -> tuple[dict[str, str], tuple[list[list[str]], list[int]] | None]:
    """The assignment of a placement.json and, when it plans replicas, (replica_pnodes, batch_shares)."""
    data = read_json(path, what="placement.json")  # a regular file of bounded size, JSON of bounded depth
    assignment = data["assignment"] if isinstance(data, dict) and "assignment" in data else data
    if not isinstance(assignment, dict) or not all(isinstance(v, str) for v in assignment.values()):
        raise VGraphError(f"{path}: not a placement: {quote(_NOT_A_PLACEMENT, 200)}")
    rows, shares = (data.get("replica_pnodes"), data.get("batch_shares")) if isinstance(data, dict) else (None, None)
    if not rows or len(rows) < 2:
        return assignment, None
    if (not isinstance(shares, list) or len(shares) != len(rows) or not all(isinstance(x, int) for x in shares)
            or not all(isinstance(r, list) and all(isinstance(p, str) for p in r) for r in rows)):
        raise VGraphError(f"{path}: not a placement: 'replica_pnodes' needs one integer 'batch_shares' entry "
                          f"per replica")
    return assignment, ([list(r) for r in rows], [int(x) for x in shares])


def _shrink(placement: Placement, fleet: Fleet, lost: list[str], described: str, batch: int, micro: int
            ) -> tuple[dict[str, str], tuple[list[list[str]], list[int]]]:
    """The plan without the replicas that lost a worker: the survivors keep their PNodes, replica 0's
    assignment moves to the first survivor, and the global batch is shared out again by speed."""
    rows = [row for row in placement.rows if not set(row) & set(lost)]
    if not rows:
        raise TrainingError(f"worker {described} failed and no complete replica is left (--on-failure shrink "
                            f"drops the replicas that lost a worker)")
    stage = {p: s for s, p in enumerate(placement.rows[0])}
    assignment = {v: rows[0][stage[p]] for v, p in placement.assignment.items()}
    final = {v: rows[0][stage[p]] for v, p in placement.final.items()}
    shares = rebalanced_shares(placement.graph, fleet, final, rows, batch, micro)
    return assignment, (rows, shares)


def read_placement(path: str | Path) -> dict[str, str]:
    """The `assignment` of a placement.json (as `vgraph partition` and `vgraph launch` write)."""
    return read_placement_layout(path)[0]


# -- the launch -------------------------------------------------------------------------------------

def _validate(cfg: LaunchConfig) -> tuple[str, tuple[Any, Any]]:
    """Refuse settings that cannot run, before anything is written or started; the values the attempts use
    in place of the settings that need reading: the gradient compression's canonical text, and the given
    placement as (assignment, replica layout), or (None, None) when the partition pass decides."""
    if cfg.fleet is None:
        raise VGraphError("vgraph launch needs a fleet: --fleet FLEET.yml (see networks/fleets/)")
    if cfg.comm not in COMM_MODES:
        raise VGraphError(f"comm must be one of {', '.join(COMM_MODES)}, not {cfg.comm!r}")
    if cfg.on_failure not in ON_FAILURE:
        raise VGraphError(f"--on-failure must be one of {', '.join(ON_FAILURE)}, not {cfg.on_failure!r}")
    if cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        raise VGraphError(f"--node-rank must be in 0..{cfg.nnodes - 1} (--nnodes {cfg.nnodes}), got {cfg.node_rank}")
    if cfg.nnodes > 1 and cfg.on_failure == "repartition":
        raise VGraphError("--on-failure repartition needs all workers on one machine; use restart or shrink with "
                          "--nnodes")
    if not (isinstance(cfg.link_timeout, (int, float)) and math.isfinite(cfg.link_timeout) and cfg.link_timeout > 0):
        raise VGraphError(f"--link-timeout must be a positive number of seconds, got {cfg.link_timeout!r}")
    if not (cfg.replicas == "auto" or (isinstance(cfg.replicas, int) and not isinstance(cfg.replicas, bool)
                                       and cfg.replicas >= 1)):
        raise VGraphError(f"--replicas must be a positive integer or auto, got {cfg.replicas!r}")
    if cfg.compile:
        raise VGraphError("vgraph launch does not support --compile yet")
    if cfg.pipeline not in PIPELINES:
        raise VGraphError(f"--pipeline must be one of {', '.join(PIPELINES)}, not {cfg.pipeline!r}")
    if cfg.max_restarts < 0:
        raise VGraphError(f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    if isinstance(cfg.bucket_bytes, bool) or not isinstance(cfg.bucket_bytes, int) or not 1 <= cfg.bucket_bytes <= 2**62:
        raise VGraphError(f"--bucket-size must be a whole number of bytes from 1 to 2**62, got {cfg.bucket_bytes!r}")
    if cfg.max_nnodes is not None and not (isinstance(cfg.max_nnodes, int) and cfg.nnodes <= cfg.max_nnodes):
        raise VGraphError(f"--nnodes MIN:MAX needs MAX >= MIN, got {cfg.nnodes}:{cfg.max_nnodes}")
    if _elastic(cfg) and cfg.on_failure == "repartition":
        raise VGraphError("--on-failure repartition needs all workers on one machine; a run that takes joins "
                          "(--nnodes MIN:MAX) restarts, shrinks or stops")
    if _elastic(cfg) and cfg.emit_job is not None:
        raise VGraphError("--emit-job writes a job for torchrun or srun, whose machines are fixed: give --nnodes N")
    if (isinstance(cfg.drift_steps, bool) or not isinstance(cfg.drift_steps, int)
            or not 0 <= cfg.drift_steps <= 1_000_000):
        raise VGraphError(f"--drift-steps must be a whole number from 0 to 1000000, got {cfg.drift_steps!r}")
    if (isinstance(cfg.replan_overhead_s, bool) or not isinstance(cfg.replan_overhead_s, (int, float))
            or not (math.isfinite(cfg.replan_overhead_s) and 0 <= cfg.replan_overhead_s <= 86400)):
        raise VGraphError(f"the re-plan overhead must be a number of seconds from 0 to 86400, got "
                          f"{cfg.replan_overhead_s!r}")
    if cfg.emit_job is not None and cfg.node_rank != 0:
        raise VGraphError("--emit-job writes the job once, on machine 0: drop --node-rank (torchrun and srun "
                          "start every machine's workers from that one job file)")
    given = read_placement_layout(cfg.placement) if isinstance(cfg.placement, (str, Path)) else (cfg.placement, None)
    check_train_config(cfg)  # a library caller's values, held to the command line's checks
    try:
        grad_compress = parse_grad_compress(cfg.grad_compress).text()
    except ValueError as exc:
        raise VGraphError(f"--grad-compress: {exc}") from None
    check_master_addr(cfg.master_addr)  # never every interface (rendezvous.py)
    return grad_compress, given


def _elastic(cfg: LaunchConfig) -> bool:
    """A run that admits joins: --nnodes MIN:MAX with MAX > MIN (elastic.py)."""
    return cfg.max_nnodes is not None and cfg.max_nnodes > cfg.nnodes


def launch(config: LaunchConfig) -> LaunchResult:
    """Partition, start the workers, supervise them through failures; see the module docstring.

    The first Ctrl-C or SIGTERM asks the workers to stop after the current step with a checkpoint
    (a file they poll in their per-step reduction) and raises `Interrupted` saying how to resume;
    a second one stops everything at once.  With `emit_job`, only writes the run directory and the job.
    """
    stop = StopRequest(lambda line: print(line, file=sys.stderr, flush=True))
    leave = config.leaving
    if leave is None and _elastic(config) and config.node_rank != 0 and config.emit_job is None:
        leave = elastic.Leaving(lambda line: print(line, file=sys.stderr, flush=True))
    # Machine k != 0 of a run that takes joins: SIGTERM is a graceful leave (elastic.Leaving), not a stop.
    restore = leave.install() if leave is not None and config.leaving is None else stop.install()
    machines = Machines()  # several machines: opened by _prepare (membership.py)
    try:
        with RunLock.held():  # machine 0's lock of the run directory (taken in _prepare), held until here
            jobs = _job_folder(config) if config.emit_job is not None else None  # refused before any work
            run = _prepare(config, stop, machines)
            if leave is not None:
                run.leave = leave
                leave.attach(machines)
            if _elastic(config) and run.lead:
                run.admission = _admission(run)
            if run.lead and machines.active:
                _serve_channel(run)
            if jobs is not None:
                return _emit_job(run, jobs)
            try:
                result = _attempts(run, stop)
                return _collect(run, result)
            except BaseException as exc:
                if run.admission is not None:  # the joined machines hear why, instead of waiting on silence
                    run.admission.finish(error=str(exc) or type(exc).__name__)
                    run.admission.wait_told(min(config.link_timeout, 5.0))
                raise
    finally:
        if leave is not None:
            leave.close()
        machines.close()
        restore()


@dataclass
class _Run:
    """What a launch prepares once, before any attempt: the checked settings, turned into the plain values
    the attempts use (the config's files read, its device resolved), the network, the run directory with
    its data files, and the pass pipeline around the partition."""

    cfg: LaunchConfig
    machines: Machines  # several machines: the launchers' channel (membership.py)
    emit: Callable[[str], None]  # every line (worker output included)
    say: Callable[[str], None]  # status lines (silent under --quiet)
    token: str
    fleet: Fleet
    given: tuple[Any, Any]  # --placement read: (assignment, replica layout), or (None, None): the partition pass
    device: Any  # torch.device of --device
    source: Graph
    yaml_text: str
    network_file: str
    micro: int
    run_dir: Path
    lead: bool  # machine 0: writes the run directory
    before: Pipeline
    partition: Pipeline
    after: Pipeline
    target: str
    grad_compress: str  # the replicas' all-reduce, canonical text
    run_info: dict[str, Any]
    data_dir: str  # the prepared corpus (absolute)
    data_digest: str
    tokenizer: str  # relative to run_dir
    home: dict[str, int] | None = None  # PNode -> machine, fixed by the first attempt: a PNode stays where it ran
    admission: "elastic.Admission | None" = None  # machine 0 of a run that takes joins (elastic.py)
    leave: "elastic.Leaving | None" = None  # machine k != 0 of a run that takes joins: its graceful leave
    bar: LaunchBar | None = None  # rank 0's progress, drawn here (progress.py)
    moving: tuple[int, float] | None = None  # a boundary's step and its stop request's time, until the move is measured
    mirror: "succession.Mirror | None" = None  # a machine next in line: the coordinator's history (succession.py)
    rescued: Callable[[], list[Path]] = lambda: []  # other consistent states a successor may resume from

    @property
    def launch_dir(self) -> Path:
        return self.run_dir / LAUNCH_DIR


def _prepare(cfg: LaunchConfig, stop: StopRequest, machines: Machines) -> _Run:
    """Check the settings, open the run directory (machine 0), tokenise the data once, write the run's files.

    Long because it is the launch's one walk through its settings, in the order the run needs them: each
    setting read, checked and turned into the value the attempts use, so none of them goes back to it."""
    grad_compress, given = _validate(cfg)
    emitting = cfg.emit_job is not None
    lock = threading.Lock()

    def out(line: str) -> None:
        with lock:
            if cfg.log is not None:
                cfg.log(line)
            else:
                print(line, file=sys.stderr, flush=True)

    # On stderr, rank 0's progress is a bar drawn here (progress.py); given a log callback, status lines.
    bar = LaunchBar(out) if cfg.progress and cfg.log is None and not emitting else None
    emit = bar.write if bar is not None else out
    token = os.environ.get(TOKEN_ENV) or ""
    if not emitting:  # torchrun has its own rendezvous; srun workers check the token themselves
        token = check_token(token or None, cfg.max_nnodes or cfg.nnodes)  # before anything is written or started
        if cfg.master_port and cfg.node_rank == 0:
            probe_port(cfg.master_addr, cfg.master_port)
        if cfg.nnodes > 1 or _elastic(cfg):  # the launchers' channel: heartbeats, decisions, joins
            if cfg.node_rank == 0:  # whatever its options now: a run another machine took over stays there
                _refuse_superseded(cfg, token)
            try:
                machines.open(cfg.master_addr, (cfg.master_port or 29500) - 1, token, cfg.node_rank, cfg.nnodes,
                              cfg.link_timeout, cfg.comm_timeout)
            except MachineLost as exc:
                raise TrainingError(str(exc)) from None
    fleet = resolve_fleet(cfg.fleet)
    micro = cfg.micro_batches or min(cfg.batch, 2 * len(fleet))
    if not 1 <= micro <= cfg.batch:
        raise TrainingError(f"--micro-batches must be between 1 and --batch {cfg.batch}, got {micro}")
    source, yaml_text = load_network(cfg.network)
    network_file = str(cfg.network) if not isinstance(cfg.network, Graph) else f"<{source.name}>"
    run_dir = Path(cfg.out) if cfg.out is not None else Path("runs") / run_slug(source.name)
    vocab, seq_len = vocab_and_seq(source)
    device = resolve_device(cfg.device)
    target = device_target(device)
    lead = cfg.node_rank == 0
    if lead:
        open_run_dir(run_dir, cfg.resume, command="vgraph launch")  # an existing run only with --resume; locked
    launch_dir = run_dir / LAUNCH_DIR
    launch_dir.mkdir(parents=True, exist_ok=True)
    (launch_dir / STOP_FILE).unlink(missing_ok=True)
    stop.on_request = lambda: atomic_write(launch_dir / STOP_FILE, "stop\n")
    if lead:
        for stale in [*launch_dir.glob(held_name("*")), *launch_dir.glob(error_name("*")), launch_dir / RELEASE_FILE]:
            stale.unlink(missing_ok=True)
    options = {"batch": str(cfg.batch), "micro_batches": str(micro), "replicas": str(cfg.replicas),
               **({"grad_compress": grad_compress} if grad_compress != "none" else {})}
    before, partition, after = split_pipeline(cfg.passes, cfg.fuse, options)
    run = _Run(cfg, machines, emit, emit if cfg.progress else (lambda line: None), token, fleet, given, device,
               source, yaml_text, network_file, micro, run_dir, lead, before, partition, after, target, grad_compress,
               {}, "", "", f"{LAUNCH_DIR}/tokenizer.json", bar=bar)
    _write_data(run, vocab, seq_len)
    if _succeeds(cfg) and not emitting:
        _mirror(run)
    return run


def _succeeds(cfg: LaunchConfig) -> bool:
    """A run whose coordinator role can move when machine 0 is lost (succession.py): several machines, a fixed
    set of them, and `shrink` (a lost machine costs its replicas, so another replica can carry on) or `restart`
    (the next attempt is re-planned on the machines left, as for any machine that vanished)."""
    return cfg.nnodes > 1 and cfg.on_failure in ("shrink", "restart") and not _elastic(cfg)


def _refuse_superseded(cfg: LaunchConfig, token: str) -> None:
    """Machine 0 started again on a run another machine took over: refused, never a second run beside it."""
    from .membership import channel_key

    run_dir = Path(cfg.out) if cfg.out is not None else Path("runs") / run_slug(load_network(cfg.network)[0].name)
    why = succession.superseded(run_dir, channel_key(token))
    if why is not None:
        raise VGraphError(f"{run_dir}: {why}")


def _fence(run: _Run) -> None:
    """The coordinator, about to go on without machines it lost: stop if one of them coordinates the run now (a
    machine 0 started again within the rejoin timeout heard the others before they took the run over)."""
    from .membership import channel_key

    why = succession.superseded(run.run_dir, channel_key(run.token), run.cfg.node_rank) if _succeeds(run.cfg) else None
    if why is not None:
        raise TrainingError(why)


def _mirror(run: _Run) -> None:
    """The coordinator serves the run's history and records where the machines are; the machines next in
    line (succession.MIRRORS of them) pull it into RUN/launch/mirror/."""
    machines = run.machines
    if run.lead:
        machines.serve_mirror(succession.MirrorSource(run.run_dir).answer)
        port = machines.port
        machines.on_addresses(lambda addrs: succession.record_machines(run.run_dir, port, addrs))
    elif run.cfg.node_rank <= succession.MIRRORS:
        run.mirror = succession.Mirror(machines.request, run.launch_dir / succession.MIRROR_DIR, run.say,
                                       active=lambda: machines.coordinator != machines.node_rank,
                                       over=lambda: not machines.active).start()


def _write_data(run: _Run, vocab: int, seq_len: int) -> None:
    """The corpus every worker reads (prepared and verified once: corpus.py), its tokenizer, and
    network.yml + tokenizer.json as `vgraph train` writes them; run_info, run.json's content."""
    cfg = run.cfg
    data = prepare_data(cfg, vocab, seq_len, run.say)  # the corpus `vgraph train` would read
    run.data_dir, run.data_digest = str(data.dataset.corpus.root.absolute()), data.digest
    tokenizer = data.tokenizer.to_str()
    atomic_write(run.run_dir / run.tokenizer, tokenizer)
    run.run_info = {
        "network": run.source.name, "seed": cfg.seed, "batch": cfg.batch, "seq_len": seq_len,
        "data": data.description, "data_digest": data.digest, "tokenizer": data.tokenizer_kind, "vocab_size": vocab,
        "passes": cfg.passes, "fuse": cfg.fuse, "device": str(run.device), "lr": cfg.lr, "steps": cfg.steps,
        "warmup": cfg.warmup, "schedule": cfg.schedule, "grad_compress": run.grad_compress,
    }
    if run.lead and (not (run.run_dir / NETWORK_YML).exists() or not cfg.resume):
        atomic_write(run.run_dir / NETWORK_YML, run.yaml_text)
        atomic_write(run.run_dir / TOKENIZER_JSON, tokenizer)


@dataclass
class _Attempt:
    """One attempt's placement, job and local workers."""

    number: int
    placement: Placement
    job: Job
    job_path: Path
    local: list[int]  # world ranks this machine starts
    threads: int
    comm: Any  # comm_choice.CommChoice

    @property
    def ranks(self) -> list[str]:
        return self.job.ranks


def _place_attempt(run: _Run, fleet: Fleet, number: int, given: Any, layout: Any, hold: tuple[str, int] | None
                   ) -> _Attempt | None:
    """Place the network for attempt `number`, write run.json, placement.json and the attempt's job file.
    None when no worker of this machine is left in the run (across machines, after a shrink)."""
    cfg = run.cfg
    placement = place(run.source, fleet, before=run.before, partition=run.partition, after=run.after,
                      target=run.target, batch=cfg.batch, micro_batches=run.micro, assignment=given, replicas=layout,
                      grad_compress=run.grad_compress, pipeline=cfg.pipeline)
    changes = network_changes(placement.graph)  # passes that keep every weight aside: checkpoints stay true
    if changes:  # checkpoints carry the network as given: training another function would make them lie
        raise TrainingError(f"{', '.join(changes)} changes what the network computes, and vgraph launch "
                            f"stores the network as given: write the changed network first (vgraph optimize "
                            f"{run.network_file} --passes '{cfg.passes}' -o NEW.yml) and launch NEW.yml")
    compression = weight_keeping_changes(placement.graph)
    distributions = plugin_distributions(run.source, placement.graph)
    ranks = placement.world
    local = _local_ranks(run, ranks, number)
    if not local:  # shrunk away: this machine's PNodes are all in dropped replicas
        run.emit(f"launch: no worker of this machine (node rank {cfg.node_rank}) is left in the run; it goes on "
                 f"without it")
        return None
    gpus = sorted({p.accelerator for p in fleet if (p.accelerator or "").startswith("cuda") and p.id in ranks})
    if number == 0 and run.device.type == "cpu" and gpus:  # the plan's figures are the GPUs', not this CPU's
        run.say(f"launch: note: fleet {fleet.name!r} describes {', '.join(gpus)} PNodes and this run is on the CPU: "
                f"the placement and its predicted step are for those GPUs (a CPU fleet: --fleet cpu2, or one "
                f"measured with vgraph probe)")
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, len(local)))
    info = dict(run.run_info, precision=dict(placement.graph.meta.get("precision") or {}), compression=compression,
                plugin_distributions=distributions,
                launch={"fleet": fleet.name, "pnodes": ranks, "micro_batches": run.micro, "attempt": number})
    job, comm = _job(run, placement, info, number, local, threads, hold, fleet=fleet)
    if run.lead:
        atomic_write(run.run_dir / RUN_JSON, json.dumps(info, indent=2, default=str) + "\n")
        atomic_write(run.run_dir / PLACEMENT_JSON, json.dumps(placement.report, indent=2) + "\n")
    job_path = job.write(run.launch_dir / f"job-{number}.json")
    return _Attempt(number, placement, job, job_path, local, threads, comm)


class _RankZeroJoined(Exception):
    """A plan that puts rank 0 on a joined machine: machine 0 holds the run (its metrics, checkpoints and
    rank 0) until the coordinator can move (issue 36), so such a plan is not run; the joined PNodes wait."""


def _local_ranks(run: _Run, ranks: list[str], number: int) -> list[int]:
    """The world ranks this machine starts: a PNode stays on the machine that ran it first (machines
    k = ceil(ranks / N) consecutive ranks each at the first attempt); across machines, attempt `number`
    begins on the launchers' channel (membership.py)."""
    cfg = run.cfg
    if run.home is None:
        per_node = math.ceil(len(ranks) / cfg.nnodes)
        run.home = {p: r // per_node for r, p in enumerate(ranks)}
    home = run.home
    if run.admission is not None and ranks[0] in run.admission.home():
        raise _RankZeroJoined(ranks[0])
    if run.machines.active and home.get(ranks[0], 0) != run.machines.coordinator:
        who = run.machines.coordinator
        raise TrainingError(f"the replica of machine {who} was dropped: machine {who}, the coordinator, holds the run "
                            f"and its rank 0, so the run stops here; continue it with --resume")
    run.machines.begin(number, {home.get(p, 0) for p in ranks})
    return [r for r, p in enumerate(ranks) if home.get(p, 0) == cfg.node_rank]


def _job(run: _Run, placement: Placement, info: dict[str, Any], number: int, local: list[int], threads: int,
         hold: tuple[str, int] | None, run_dir: str = "..", fleet: Fleet | None = None) -> tuple[Job, Any]:
    """The job file's content (job.py), with the transport this machine's `local` workers use (comm_choice.py);
    `run_dir` relative to the folder the job is written to; `fleet`: the attempt's, for rank 0's measured
    figures (vgraph/placement/drift.py)."""
    cfg = run.cfg
    comm = choose_comm(run.device.type, len(local), torch.cuda.device_count() if run.device.type == "cuda" else 0,
                       torch.distributed.is_nccl_available(), cfg.comm)
    train = TrainConfig(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})
    train.network, train.threads = run.network_file, threads
    ranks = placement.world
    return Job(
        run_dir=run_dir, network_yaml=run.yaml_text, network_file=run.network_file,
        pipeline_before=str(run.before), pipeline_after=str(run.after), target=run.target,
        assignment=placement.assignment, final_assignment=placement.final, ranks=ranks,
        plan_ranks=placement.ranks, batch_shares=placement.shares,
        predicted_bytes=float(placement.report["bytes_per_step"]),
        predicted_cut_bytes=float(placement.report["cut_bytes_per_step"]),
        device=comm.device, backend=comm.backend, stage_through_cpu=comm.stage_through_cpu,
        control_group=comm.control_group, data_dir=run.data_dir, data_digest=run.data_digest,
        tokenizer=run.tokenizer,
        run_info=json.loads(json.dumps(info, default=str)), attempt=number, train=train,
        micro_batches=run.micro, pipeline=cfg.pipeline, comm_timeout=float(cfg.comm_timeout),
        bucket_bytes=cfg.bucket_bytes, plugins=loaded_files(),  # every worker loads the launcher's plugin files
        grad_compress=run.grad_compress, plan_choices=placement.choices,
        hold={"rank": ranks.index(hold[0]), "step": int(hold[1])} if hold and hold[0] in ranks else None,
        fleet_yaml=fleet_file_text(fleet) if fleet is not None else "",
        fleet_file=os.path.realpath(fleet.source) if fleet is not None and fleet.source else "",
        drift_steps=cfg.drift_steps,
        machines={p: (run.home or {}).get(p, 0) for p in ranks}), comm


def _attempts(run: _Run, stop: StopRequest) -> LaunchResult:
    """Attempt after attempt until the workers finish, fail for good, or a stop is asked for."""
    cfg = run.cfg
    result = LaunchResult(run.run_dir, 0, None, None, None)
    fleet, hold, number, replanned = run.fleet, cfg.hold, 0, False
    shrunk: tuple[dict[str, str], tuple[list[list[str]], list[int]]] | None = None
    while True:
        if stop.requested:
            raise stop.interrupted(f"{run.run_dir}: stopped before attempt {number} started; continue with: "
                                   f"{_continue_with(cfg, run.run_dir)}")
        given = _given_placement(run, number, shrunk, replanned)
        try:
            attempt = _place_attempt(run, fleet, number, *given, hold)
        except _RankZeroJoined as exc:
            waiting = sorted(set(run.admission.home()) & set(fleet.ids))
            run.admission.event({"event": "placement", "attempt": number, "waiting": waiting,
                                 "reason": f"the plan puts rank 0 on joined PNode {exc}: machine 0 keeps it"})
            fleet = fleet.without(waiting)
            attempt = _place_attempt(run, fleet, number, *given, hold)
        if attempt is None:
            return result
        if run.admission is not None:
            run.admission.publish(number, attempt.job_path, dict(run.home or {}), attempt.placement, fleet)
        record = _supervise(run, attempt)
        result.attempts.append(record)
        result.placement = attempt.placement.report
        if record["ok"] and run.admission is not None and not stop.requested and _boundary(run):
            with run.admission.lock:  # a drift re-plan's measured fleet, once
                measured, run.admission.next_fleet = run.admission.next_fleet, None
            fleet = run.admission.grown_fleet(measured or fleet)
            shrunk, number, hold, replanned = None, number + 1, None, True  # the planner places it from now on
            continue
        if _elastic(cfg) and not run.lead and not stop.requested:  # only machine 0 knows the grown fleet
            if not record["ok"]:
                _after_failure(run, attempt, record, result, fleet)  # its report; machine 0's error raised here
            followed = elastic.Joined(cfg.node_rank, "", run.run_dir)
            elastic.follow_attempts(run.machines, run.token, cfg.master_addr, _base_port(cfg), run.run_dir,
                                    Path(run.data_dir), run.tokenizer, number + 1,
                                    cfg.comm_timeout + cfg.link_timeout, run.emit, followed, run.leave)
            result.attempts += [{"attempt": a, "followed": True} for a in followed.attempts]
            if followed.released:
                result.attempts.append({"released": True})
            return result
        if stop.requested:
            where = ckpt.latest_checkpoint(run.run_dir) if run.lead else None
            raise stop.interrupted(f"{run.run_dir}: stopped as asked{'' if record['ok'] else ' (a worker failed on the way)'}; "
                                   f"checkpoint {where or 'on machine 0'}. Continue with: "
                                   f"{_continue_with(cfg, run.run_dir)}")
        if record["ok"]:
            if run.admission is not None:
                run.admission.finish()
                run.admission.wait_told(cfg.link_timeout)
            return result
        if run.admission is not None:  # a restart is a boundary too: the admitted machines take part
            fleet = run.admission.grown_fleet(fleet)
            run.home = {**(run.home or {}), **run.admission.home()}
        fleet, shrunk = _after_failure(run, attempt, record, result, fleet)
        result.restarts += 1
        number += 1
        hold = None


def _admission(run: _Run) -> elastic.Admission:
    """Machine 0 of a run that takes joins: what it offers a joined machine (the prepared corpus's files,
    by the names its manifest gives) and how it decides on a join, served on the launchers' channel."""
    from vgraph.data.shards import MANIFEST, SPLITS, TOKENIZER_FILE, open_prepared

    cfg = run.cfg
    admission = elastic.Admission(run.run_dir, run.fleet, run.source, cfg.max_nnodes or cfg.nnodes, cfg.nnodes,
                                  step=lambda: _last_step(run), on_join=lambda adm, joined: _on_join(run, joined),
                                  on_leave=lambda adm, machine, pnodes, step: _on_leave(run, machine, pnodes, step),
                                  homes=lambda: {**(run.home or {}), **admission.home()})
    corpus = Path(run.data_dir)
    splits = open_prepared(corpus, verify="size").manifest["splits"]  # checked: names inside the directory
    for name in (MANIFEST, TOKENIZER_FILE):
        admission.serve(name, corpus / name)
    for shard in (shard for split in SPLITS for shard in splits[split]["shards"]):
        for key in ("bin", "idx"):  # the manifest's SHA-256 of each: a large corpus is not read again here
            admission.serve(shard[key], corpus / shard[key], shard[f"{key}_sha256"])
    return admission


def _serve_channel(run: _Run) -> None:
    """Machine 0: what its channel answers besides heartbeats and decisions: the other machines' rescue shards
    (shard_transfer.py) and, in a run that takes joins, the joiners' requests (elastic.py)."""
    receiver = ShardReceiver(run.launch_dir / RESCUE_DIR)

    def answer(request: dict) -> dict:
        if str(request.get("op", "")).startswith("rescue-"):
            return receiver.answer(request)
        if run.admission is not None:
            return run.admission.answer(request)
        return {"error": "this run takes no joins (--nnodes MIN:MAX)"}

    run.machines.serve_extra(answer)


def _last_step(run: _Run) -> int:
    """The run's last logged step (rank 0 writes metrics.jsonl about once a second)."""
    rows = _tail_rows(run)
    return max(0, rows[-1]["step"]) if rows else 0


def _tail_rows(run: _Run) -> list[dict[str, Any]]:
    """The complete rows in the last 64 KiB of metrics.jsonl, in order: a join or a drift watch must not
    wait for a read of a long run's whole log."""
    from vgraph.base.jsonio import loads

    path = run.run_dir / METRICS_JSONL
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read()
    except OSError:
        return []
    rows = []
    for line in tail.split(b"\n")[1:] if len(tail) == 65536 else tail.split(b"\n"):
        try:
            row = loads(line, str(path)) if line.strip() else None
        except VGraphError:
            continue  # a line being written
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
    return rows


def _on_join(run: _Run, joined: Any) -> None:
    """A machine was admitted (its own thread): re-plan onto the grown fleet when it pays (`_replan`)."""
    _replan(run, "join", joined.step, run.admission.grown_fleet,
            {"pnode": joined.pnode.id, "machine": joined.machine}, label=f"join {joined.pnode.id}")


def _on_leave(run: _Run, machine: int, pnodes: list[str], step: int) -> None:
    """Machine `machine` said it leaves (its own thread): the running plan cannot go on without its PNodes,
    so the boundary is taken whatever the price; the decision's figures say what the next plan predicts."""
    _replan(run, "leave", step, run.admission.grown_fleet, {"pnodes": pnodes, "machine": machine},
            label=f"leave {', '.join(pnodes)} (machine {machine})", gone=pnodes)


def _replan(run: _Run, trigger: str, step: int, target_of: Callable[[Fleet], Fleet], fields_: dict[str, Any], *,
            label: str, gone: Sequence[str] = (), measured: Fleet | None = None, why: str = "") -> None:
    """The one re-plan decision of a join, a leave and a drift (vgraph/placement/replan.py): the planner's plan
    on `target_of(the running attempt's fleet)` priced against the running plan over the steps left; when it
    pays (a leave: always, the running plan loses `gone`), ask the workers for a boundary: they stop after the
    current step with a checkpoint and the next attempt runs on that fleet (`_boundary`).  A drift prices the
    running plan on the `measured` fleet too, so both steps come from the same figures.  Every decision is a
    `replan` row of fleet-events.jsonl and one line."""
    cfg, admission = run.cfg, run.admission
    row: dict[str, Any] = {"event": "replan", "kind": trigger, "step": step, **fields_}
    try:
        placement, fleet = _running(admission, wait_s=cfg.comm_timeout if gone else 0.0)
        target = target_of(fleet)
        decision, machines, handed = _decision(run, placement, target, step, gone, measured is not None)
    except Exception as exc:  # in its own thread: whatever went wrong is said and recorded, the run goes on
        said = str(exc) if isinstance(exc, VGraphError) else f"{type(exc).__name__}: {exc}"
        admission.event({**row, "chosen": "new" if gone else "keep", "reason": said})
        run.emit(f"launch: {label} at step {step}: {'boundary all the same' if gone else 'no re-plan now'}: {said}")
        if gone:
            _ask_boundary(run)
        return
    if gone and machines < cfg.nnodes:  # documented: the run goes on below MIN (docs/distributed.md)
        row["below_min"] = machines
        run.emit(f"launch: warning: after {label} the run has {machines} machine(s), fewer than --nnodes MIN "
                 f"{cfg.nnodes}; it goes on with them")
    row.update(decision.to_json())
    if gone:  # what only the leaving machine held: its VNodes' state, through the boundary's checkpoint
        row["checkpoint_bytes"] = handed
    if why:
        why = f"{why}; the planner's plan predicts {decision.new_step:.3g} s a step"
        row["reason"] = f"{why}; {decision.reason}"
    admission.event(row)
    run.say(f"launch: {label} at step {step}: {why + '; ' if why else ''}{decision.describe()}")
    if decision.chosen == "new":
        if measured is not None:
            with admission.lock:
                admission.next_fleet = measured
        _ask_boundary(run)


def _running(admission: elastic.Admission, wait_s: float) -> tuple[Any, Fleet]:
    """The running attempt's (placement, fleet); a leave before the first attempt is placed waits for it."""
    deadline = time.monotonic() + wait_s
    while True:
        with admission.lock:
            current = admission.current
        if current is not None:
            return current
        if time.monotonic() >= deadline:
            raise VGraphError("no attempt is running yet: the change takes effect at the first boundary")
        time.sleep(0.1)


def _decision(run: _Run, placement: Placement, target: Fleet, step: int, gone: Sequence[str], reprice: bool
              ) -> tuple[Any, int, float]:
    """(replan.Replan, machines left on `target`, state bytes of the VNodes only `gone` held): the planner's
    plan on `target` against `placement` (`reprice`: the running plan's step priced on `target` as well, a
    drift's measured figures)."""
    from vgraph.placement.replan import PlanView, decide, state_bytes

    cfg, admission = run.cfg, run.admission
    new = _plan_on(run, target)
    if new.world[0] in admission.home():
        raise VGraphError(f"the planner's plan puts rank 0 on {new.world[0]}, and machine 0 keeps rank 0 (it "
                          f"holds the run) until the coordinator can move")
    old = placement
    if reprice:
        layout = (placement.rows, placement.shares) if len(placement.rows) > 1 else None
        old = _plan_on(run, target, placement.assignment, layout)
    views = [PlanView.of(p.assignment, p.rows, p.report.get("step_seconds", p.report["bottleneck_seconds"]))
             for p in (old, new)]
    sizes = state_bytes(_before_partition(run))
    gone = sorted(set(gone) | admission.departing())  # another leave at the same step: no sender either
    decision = decide(*views, sizes, target, max(0, cfg.steps - step), gone=gone, overhead_s=cfg.replan_overhead_s)
    homes = {**(run.home or {}), **admission.home()}
    handed = sum(sizes.get(v, 0.0) for v in decision.move.from_checkpoint)
    return decision, len({homes.get(p, 0) for p in target.ids}), handed


def _plan_on(run: _Run, fleet: Fleet, assignment: dict[str, str] | None = None, layout: Any = None) -> Placement:
    cfg = run.cfg
    return place(run.source, fleet, before=run.before, partition=run.partition, after=run.after, target=run.target,
                 batch=cfg.batch, micro_batches=run.micro, assignment=assignment, replicas=layout,
                 grad_compress=run.grad_compress, pipeline=cfg.pipeline)


def _ask_boundary(run: _Run) -> None:
    """Ask this run's workers to stop after the current step with a checkpoint (once, while none is under way)."""
    admission = run.admission
    with admission.lock:
        if admission.done:
            return
        admission.replanning = True
    elastic.ask_stop(run.run_dir)


def _watch_drift(run: _Run, start: int, ended: threading.Event) -> None:
    """Machine 0, while an attempt runs (its own thread): a drift rank 0 reported in this attempt's rows (a
    metrics row with `drift`, at a step after `start`) is a re-plan decision on the measured fleet
    (fleet.measured.yml) through `_replan`.  Fresh evidence only: the rows of this attempt, whose rank 0 watches
    its own plan's prediction from its own warm-up (so a re-plan's next one needs K steps measured under the
    new plan), and once a drift re-plan is chosen this watch ends."""
    from dataclasses import replace

    from vgraph.cost.fleet import load_fleet

    seen = start
    while not ended.wait(0.5):
        row = _last_drift(run, seen)
        if row is None:
            continue
        seen = row["step"]
        try:  # the file rank 0 wrote with the row; not the fleet's own file: a boundary's fleet is this one
            measured = replace(load_fleet(run.run_dir / MEASURED_FLEET), source=None)
        except VGraphError as exc:
            run.emit(f"launch: drift at step {seen}: no re-plan: {exc}")
            continue
        pnodes = row["drift"].get("pnodes")
        why = "drift: " + ", ".join(
            f"{pid} measured {p['measured_s']:.3g} s vs predicted {p['predicted_s']:.3g} s busy for "
            f"{run.cfg.drift_steps} steps" for pid, p in sorted((pnodes if isinstance(pnodes, dict) else {}).items())
            if isinstance(p, dict) and all(isinstance(p.get(k), (int, float)) for k in ("measured_s", "predicted_s")))
        _replan(run, "drift", seen, lambda fleet: run.admission.grown_fleet(measured), {"drift": row["drift"]},
                label="drift", measured=measured, why=why)
        with run.admission.lock:
            if run.admission.next_fleet is not None:
                return


def _last_drift(run: _Run, after: int) -> dict[str, Any] | None:
    """The last metrics row with a drift report at a step after `after`, or None (read from the log's tail)."""
    for row in reversed(_tail_rows(run)):
        if isinstance(row.get("drift"), dict) and row["step"] > after:
            return row
    return None


def _before_partition(run: _Run) -> Graph:
    """The network as the partition pass sees it (after the passes before it): the VNodes plans assign."""
    graph = run.source.copy()
    if run.before:
        run_pipeline(graph, run.before, target=run.target)
    return graph


def _boundary(run: _Run) -> bool:
    """Machine 0, every worker done: was it a re-plan boundary (`_replan`: a join, a leave, a drift) with steps
    left?  Then the admitted machines get their PNodes' homes, the leaving ones are released (the boundary's
    checkpoint holds what they held), and the next attempt is placed on the fleet without them."""
    admission = run.admission
    with admission.lock:
        asked, admission.replanning = admission.replanning, False
        queued, admission.queued = admission.queued, []
    requested = elastic.stop_requested_at(run.run_dir)
    (run.launch_dir / STOP_FILE).unlink(missing_ok=True)
    step = _last_step(run)
    if not asked or step >= run.cfg.steps:
        admission.release(step)  # the run is over: a leaving machine goes (its `job` answer says released)
        return False
    run.home = {**(run.home or {}), **admission.home()}
    requested = requested if requested is not None else time.time()
    run.moving = (step, requested)
    released = admission.release(step)  # their workers ended with this boundary's checkpoint
    pnodes = sorted(set(run.home) - admission.departing())
    admission.event({"event": "boundary", "step": step, "pnodes": pnodes, "released": released,
                     "requested": round(requested, 3),
                     "queued": [admission.joined[m].pnode.id for m in queued]})
    run.say(f"launch: re-plan boundary after step {step}: the next attempt runs on {', '.join(pnodes)}"
            f"{f'; machine(s) {released} released' if released else ''}")
    return True


def _base_port(cfg: LaunchConfig) -> int | None:
    """The rendezvous port of attempt 0 (attempt n: + n): --master-port, 29500 across machines, else None (a
    free port each attempt)."""
    return cfg.master_port or (29500 if cfg.nnodes > 1 or _elastic(cfg) else None)


def _continue_with(cfg: LaunchConfig, run_dir: Path) -> str:
    """The command that continues the run: the CLI's own as typed (cli.resume_command), else the gist."""
    if cfg.continue_command is not None:
        return cfg.continue_command(run_dir)
    return f"vgraph launch {cfg.network} --fleet {cfg.fleet} --out {run_dir} --resume (and the same options)"


def _supervise(run: _Run, attempt: _Attempt) -> dict[str, Any]:
    """Start this machine's workers of `attempt`, relay their output, wait for the outcome (its record).

    The rendezvous port: --master-port (29500 across machines) moved up by the attempt's number, else a free
    one."""
    cfg, placement = run.cfg, attempt.placement
    base_port = _base_port(cfg)
    port = (base_port + attempt.number) if base_port else free_port(cfg.master_addr)
    if run.lead:
        probe_port(cfg.master_addr, port)  # a busy port is a diagnostic, not a burnt restart
    run.say(f"launch: {run.source.name} on {len(attempt.ranks)} worker(s) {', '.join(attempt.ranks)} of fleet "
            f"{run.fleet.name!r} ({len(placement.rows)} replica(s), batch shares {placement.shares}; "
            f"{attempt.comm.describe()}, {_micro_per_replica(run.micro, placement.shares)} {cfg.pipeline}, predicted "
            f"traffic {placement.report['bytes_per_step']:,.0f} bytes/step, all-reduce included); attempt "
            f"{attempt.number}")
    lock = RunLock.of(run.run_dir)  # machine 0's; its rank 0 writes the run under it
    supervisor = Supervisor(run.emit, run.token, take=run.bar.take if run.bar is not None else None,
                            lock_key=lock.key if lock is not None else "")
    ended = threading.Event()
    if run.admission is not None and cfg.drift_steps:  # a drift is a re-plan decision (`_watch_drift`)
        threading.Thread(target=_watch_drift, args=(run, _last_step(run), ended), daemon=True).start()
    try:
        supervisor.start(attempt.job_path, attempt.local, attempt.ranks, len(attempt.ranks), cfg.master_addr, port,
                         attempt.threads)
        atomic_write(run.launch_dir / WORKERS_JSON,
                          json.dumps({"attempt": attempt.number, "pids": supervisor.pids()}))
        ok, codes, lost = supervisor.wait(trouble=_watch_move(run, attempt.number))
        _move_measured(run, attempt.number)  # an attempt too short for the watch to see its first step
    except BaseException:
        supervisor.stop()
        raise
    finally:
        ended.set()
        if run.bar is not None:
            run.bar.close()  # the attempt's bar ends; a restart draws its own from the resumed step
    ranks = attempt.ranks
    return {"attempt": attempt.number, "ranks": ranks, "exit_codes": {ranks[r]: c for r, c in codes.items()},
            "lost": [ranks[r] for r in lost], "ok": ok, "codes": codes, "lost_ranks": lost}


def _watch_move(run: _Run, attempt: int) -> Callable[[], str | None]:
    """The supervisor's `trouble` poll, which also measures a boundary's move (`_move_measured`) every
    MOVE_POLL_S while one is pending: the seconds a re-plan took, from its stop request to this attempt's
    first logged step (rank 0 logs a resumed attempt's first step at once: training/loop.py)."""
    trouble, due = run.machines.trouble, [0.0]

    def poll() -> str | None:
        if run.moving is not None and time.monotonic() >= due[0]:
            due[0] = time.monotonic() + MOVE_POLL_S
            _move_measured(run, attempt)
        return trouble()
    return poll


def _move_measured(run: _Run, attempt: int) -> None:
    """When the attempt after a boundary has logged a step: its `moved` row (fleet-events.jsonl) and a line."""
    if run.moving is None or run.admission is None:
        return
    step, requested = run.moving
    first = _last_step(run)
    if first <= step:
        return
    run.moving = None
    seconds = max(0.0, time.time() - requested)
    run.admission.event({"event": "moved", "step": step, "first_step": first, "attempt": attempt,
                         "seconds": round(seconds, 3)})
    run.say(f"launch: the re-plan at step {step} took {seconds:.1f} s, from the stop request to attempt {attempt}'s "
            f"first step")


def _after_failure(run: _Run, attempt: _Attempt, record: dict[str, Any], result: LaunchResult, fleet: Fleet
                   ) -> tuple[Fleet, Any]:
    """A failed attempt: raise when it must not restart; else the fleet (and shrunk plan) of the next one."""
    cfg = run.cfg
    codes, lost = record.pop("codes"), record.pop("lost_ranks")
    errors = _user_errors(run.launch_dir)
    if not errors and any(c == EXIT_USER_ERROR for c in codes.values()):
        errors = "a worker stopped with an error (see its output above)"
    ranks = attempt.ranks
    lost_pnodes = [ranks[r] for r in lost]
    described = ", ".join(f"{ranks[r]} (rank {r}, exit {codes[r]})" for r in lost)
    if run.machines.active:  # every machine reports; machine 0 decides for all (membership.py)
        if not run.lead:  # this machine's survivors' shards first: machine 0 decides once it has every report
            send_shards(run.machines.request, run.launch_dir / RESCUE_DIR, attempt.number, run.emit)
            run.rescued = lambda: succession.rescued_state(run.run_dir, **_rescue_inputs(run, attempt),
                                                           keep=cfg.keep_checkpoints, say=run.emit)  # a successor's
        report = {"lost": lost_pnodes, "described": described, "error": errors}
        try:
            plan = run.machines.settle(report,
                                       lambda reports, missing: decide(reports, missing, run.home, cfg.on_failure),
                                       wait_for_all=cfg.on_failure == "restart")
        except MachineLost as exc:
            plan = _succeed(run, report, exc, attempt.number)  # the coordinator is lost: a survivor takes its role, or the run stops
        if run.lead and plan["lost"]:
            _fence(run)  # before going on without machines: none of them took this run over meanwhile
        lost_pnodes, described, errors = plan["lost"], plan["described"] or "on another machine", plan["error"]
        gone = list(plan.get("gone") or [])
    else:
        gone = []
    if errors:
        raise TrainingError(errors)
    if run.lead:  # before any refusal to restart: a later --resume starts from the rescued step too
        _rescue(run, attempt, result, lost_pnodes)
    if cfg.on_failure == "stop" or result.restarts >= cfg.max_restarts:
        raise TrainingError(f"worker {described} failed; not restarting "
                            f"({'--on-failure stop' if cfg.on_failure == 'stop' else f'{result.restarts} restarts'})."
                            f" Continue the run with --resume.")
    shrunk = None
    if cfg.on_failure == "repartition":
        if not any(p.id not in lost_pnodes for p in fleet):
            raise TrainingError(f"worker {described} failed and no PNode is left to re-partition onto")
        fleet = fleet.without(lost_pnodes)
    if cfg.on_failure == "shrink":
        shrunk = _shrink(attempt.placement, fleet, lost_pnodes, described, cfg.batch, run.micro)
    if cfg.on_failure == "restart" and gone:  # machines that vanished: re-planned around (the partition pass)
        fleet = fleet.without(gone)
        run.given = (None, None)  # a given placement names the lost PNodes
        run.partition = run.partition.with_options("partition", replicas="auto")  # as many as the rest holds
    where = ckpt.latest_checkpoint(run.run_dir) if run.lead else None
    run.emit(f"launch: worker {described} failed; restarting from {where or 'the last checkpoint'}"
             f"{' on ' + ', '.join(fleet.ids) if cfg.on_failure == 'repartition' or gone else ''}"
             f"{f' with {len(shrunk[1][0])} replica(s), batch shares {shrunk[1][1]}' if shrunk else ''}")
    return fleet, shrunk


def _rescue(run: _Run, attempt: _Attempt, result: LaunchResult, lost: list[str]) -> None:
    """Machine 0 after a failed attempt: a checkpoint from the survivors' rescue shards when they hold every
    VNode at one step later than the last checkpoint (training/rescue.py), else the last checkpoint; either
    way the steps redone are said (the launcher's line, a fleet-events.jsonl row, the final summary)."""
    cfg, folder, inputs = run.cfg, run.launch_dir / RESCUE_DIR, _rescue_inputs(run, attempt)
    shards, refused = read_shards(folder, run=inputs["run"], attempt=attempt.number)
    latest = ckpt.latest_checkpoint(run.run_dir)
    floor = ckpt.checkpoint_step(latest) if latest is not None else 0
    logged = _last_step(run)
    found = assemble(shards, keys=inputs["keys"], floor=floor, ceiling=cfg.steps, logged=logged, reached=logged,
                     refused=refused, per_rank_state=inputs["per_rank_state"])
    for why in found.refused:
        run.emit(f"launch: rescue shard refused: {why}")
    if found.step is not None:
        try:
            where = save_rescued(run.run_dir, found, inputs["extra"], cfg.keep_checkpoints)
        except OSError as exc:  # a full disk: the run still has its last checkpoint
            found.why = f"its checkpoint could not be written: {exc.strerror or exc}"
            found.step = None
    if found.step is not None:
        resume, source = found.step, "replicas"
        said = f"the survivors hold every VNode at step {found.step} (ranks {found.ranks}): checkpoint {where}"
    else:
        resume, source = floor, "checkpoint"
        said = f"no rescue ({found.why}); resuming from {latest or 'the start'}"
    redone = max(0, found.reached - resume)
    result.steps_redone += redone
    run.emit(f"launch: {said}; {redone} step(s) redone")
    record_event(run.run_dir, {"event": "rescue", "step": logged, "attempt": attempt.number, "lost": lost,
                               "from": source,
                               "resume_step": resume, "reached": found.reached, "steps_redone": redone,
                               "why": found.why if found.step is None else "", "refused": found.refused})
    clear_rescue(folder)


def _rescue_inputs(run: _Run, attempt: _Attempt) -> dict[str, Any]:
    """What a rescue of `attempt` is assembled against (training/rescue.py): the run's identity, the network's
    parameter keys, whether state is each rank's own, and what its checkpoint carries besides the shards'."""
    job, graph = attempt.job, attempt.placement.graph
    plan = make_plan(graph, attempt.placement.final, list(attempt.placement.ranks))
    compressing = job.grad_compress != "none" or graph.nodes_of_type("compress")
    return {"run": run_identity(job.network_yaml, job.run_info), "attempt": attempt.number, "ceiling": run.cfg.steps,
            "keys": set().union(*(plan.param_keys(r) for r in range(plan.world_size))),
            "per_rank_state": "the run compresses with error feedback, whose buffers are each rank's own"
                              if compressing else "",
            "extra": {"layout": "unfused", "run": json.loads(json.dumps(job.run_info, default=str)),
                      "network_yaml": job.network_yaml,
                      "tokenizer_json": read_input(run.run_dir / run.tokenizer, what="tokenizer"),
                      "launch": {"ranks": job.ranks, "assignment": job.final_assignment, "micro_batches": run.micro,
                                 "attempt": attempt.number}}}


def _succeed(run: _Run, report: dict[str, Any], lost: MachineLost, attempt: int) -> dict[str, Any]:
    """This machine lost the coordinator (succession.py): the lowest surviving machine takes its role, the
    others follow it; the decision for the next attempt, with the lost coordinator's PNodes lost (shrink
    drops its replicas, restart re-plans on the rest).  The followers send their rescue shards of `attempt`
    to it (the successor resumes from the newest consistent state: `_Run.rescued`).  A coordinator followed
    and lost in turn is elected around the same way.  The run stops (TrainingError) when the coordinator role
    cannot move: another --on-failure, or nobody left."""
    cfg, machines = run.cfg, run.machines
    if not _succeeds(cfg) or run.lead:
        raise TrainingError(str(lost)) from None
    home = run.home or {}
    survivors = set(home.values()) | {cfg.node_rank}
    window = 2 * (cfg.link_timeout + REQUEST_TIMEOUT_S)  # a lower-ranked survivor noticed the loss by then
    gone: set[str] = set()
    dead: set[int] = set()
    while True:
        old = machines.coordinator
        survivors.discard(old)
        gone.update(p for p, m in home.items() if m == old)
        # Only the lost machines' PNodes count (as membership.decide rules for a missing machine): the workers
        # here failed because of them.
        report = {**report, "lost": sorted(gone), "described": f"{', '.join(sorted(gone))} (machine(s) "
                                                              f"{', '.join(map(str, sorted(dead | {old})))} lost)"}
        dead.add(old)
        run.emit(f"launch: machine {old} (the coordinator) is lost: {lost}; electing a successor among machine(s) "
                 f"{', '.join(map(str, sorted(survivors)))}")
        try:
            plan = succession.succeed(
                machines, old, survivors, report, lambda reports, missing: decide(reports, missing, home, cfg.on_failure),
                window, send=lambda: send_shards(machines.request, run.launch_dir / RESCUE_DIR, attempt, run.emit),
                serve=lambda: _serve_channel(run))
            break
        except MachineLost as again:
            lost = again
    run.cfg = dataclasses.replace(cfg, master_addr=machines.addr)  # the workers' rendezvous: the coordinator's
    if machines.coordinator == cfg.node_rank:
        _become_coordinator(run, old, plan)
    else:
        run.emit(f"launch: machine {machines.coordinator} ({machines.addr}) is the coordinator now; this machine "
                 f"follows it")
    return plan


def _become_coordinator(run: _Run, old: int, plan: dict[str, Any]) -> None:
    """This machine took the coordinator role: its run directory becomes the run's (locked, the newest state
    installed, network.yml and tokenizer.json written) and it serves the history to the next in line."""
    if run.mirror is not None:
        run.mirror.stop()
    # This launcher's own --out (a follower's: its launch/ folder and mirror); open_run_dir would refuse it
    # as not yet a run, and it becomes one here, under the lock.
    lock = RunLock.acquire(run.run_dir, "vgraph launch (the coordinator, after succession)")
    if lock.note:
        run.emit(lock.note)
    installed = succession.install(run.run_dir, run.rescued(), run.emit)
    run.lead = True
    atomic_write(run.run_dir / NETWORK_YML, run.yaml_text)
    atomic_write(run.run_dir / TOKENIZER_JSON, read_input(run.run_dir / run.tokenizer, what="tokenizer"))
    _mirror(run)
    row = {"event": "succession", "step": installed.step, "coordinator": run.cfg.node_rank, "lost": old,
           "address": run.machines.addr,
           "resume_step": installed.step, "steps_redone": installed.redone, "state": installed.source,
           "pnodes_lost": plan.get("lost", [])}
    record_event(run.run_dir, row)
    run.emit(f"launch: machine {run.cfg.node_rank} is the coordinator now (machine {old} lost): the run goes on in "
             f"{run.run_dir} from step {installed.step} ({installed.source}; {installed.redone} step(s) redone)")


def _collect(run: _Run, result: LaunchResult) -> LaunchResult:
    """Machine 0: the run's rows (metrics.jsonl) and last checkpoint into the result."""
    if run.lead:
        rows = read_rows(run.run_dir / METRICS_JSONL)
        result.history = rows
        if rows:
            result.step = rows[-1]["step"]
            result.loss = rows[-1]["loss"]
        result.val_loss = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
        result.checkpoint = ckpt.latest_checkpoint(run.run_dir)
    return result


def _job_folder(cfg: LaunchConfig) -> OutputDir:
    """--emit-job DIR as an output directory: like every output never an input, never inside what a run
    owns (its checkpoints, its launch folder), and DIR/job.json replaced only when an earlier --emit-job
    wrote it there and nobody changed it since (safeio.OutputDir's manifest): a job.json of the user's is
    refused, never lost."""
    read = [p for p in (cfg.network, cfg.fleet, cfg.data, cfg.placement) if isinstance(p, (str, Path))]
    check_output_dir(cfg.emit_job, inputs=read, what="--emit-job directory")
    folder = OutputDir(cfg.emit_job, command="launch --emit-job", inputs=read)
    folder.plan([JOB_FILE])
    return folder


def _emit_job(run: _Run, folder: OutputDir) -> LaunchResult:
    """--emit-job DIR: place, write DIR/job.json (its run directory relative to DIR, the files in it relative
    to the run directory, and DIR's real path, from which a copy of the job finds its run: job.py) and say
    how to start it under torchrun or srun; trains nothing.

    The torchrun command carries `--max-restarts` (launch's own, default 3): torchrun's default, 0, ends the
    job at the first dead worker, while each restart resumes from the run's latest checkpoint (worker.py), so
    a few restarts cost at most a few checkpoint intervals and a fault that recurs still ends the job after a
    handful of tries instead of looping."""
    cfg = run.cfg
    attempt = _place_attempt(run, run.fleet, 0, *run.given, cfg.hold)
    folder.path.mkdir(parents=True, exist_ok=True)
    attempt.job.run_dir = os.path.relpath(run.run_dir.absolute(), folder.path.absolute())
    path = attempt.job.write(folder.check(JOB_FILE))
    folder.wrote(JOB_FILE)
    world, per_node = len(attempt.ranks), len(attempt.local)
    module = "vgraph.backends.torch.distributed.runtime.worker"
    run.emit(f"launch: wrote {path} ({world} worker(s) {', '.join(attempt.ranks)}; {attempt.comm.describe()}); "
             f"start it with\n"
             f"  torchrun --nnodes {cfg.nnodes} --nproc-per-node {per_node} --max-restarts {cfg.max_restarts} "
             f"--rdzv-backend c10d --rdzv-endpoint {cfg.master_addr}:{cfg.master_port or 29500} -m {module} {path}\n"
             f"    (--max-restarts {cfg.max_restarts}: without it one dead worker ends the job; with it torchrun "
             f"starts the worker set again, which resumes from the latest checkpoint; SIGTERM or Ctrl-C: the "
             f"workers finish the step and save a checkpoint first)\n"
             f"  srun --ntasks {world} --ntasks-per-node {per_node} python -m {module} {path}   "
             f"(with {TOKEN_ENV} exported)")
    return LaunchResult(run.run_dir, 0, None, None, None, placement=attempt.placement.report)


def _given_placement(run: _Run, number: int, shrunk: Any, replanned: bool = False) -> tuple[Any, Any]:
    """(assignment, replica layout) attempt `number` must use, or (None, None): the partition pass decides
    (always after a re-plan boundary: the fleet is no longer the one a given placement was for)."""
    if shrunk is not None:
        return shrunk
    if replanned:
        return None, None
    return run.given if number == 0 or run.cfg.on_failure == "restart" else (None, None)


def _user_errors(launch_dir: Path) -> str:
    """The workers' user-facing errors (error-<rank>.txt), each text once."""
    texts = [read_input(p, what="worker error file").strip() for p in sorted(launch_dir.glob(error_name("*")))]
    return "\n".join(dict.fromkeys(t for t in texts if t))


# -- the command ------------------------------------------------------------------------------------

def register_launch(subparsers: argparse._SubParsersAction) -> None:
    """Add `launch` to a `vgraph` subparser set (entry point of group `vgraph.commands`).

    Long because it is one `add_argument` per option, in the order `--help` shows them;
    split up, the command's options would no longer read as one list."""
    from vgraph.cli.common import remember_parser
    from vgraph.cli.main import add_plugin_option

    from vgraph.base import options
    from vgraph.base.options import non_negative_int as _non_negative_int, positive_int as _positive_int

    default = {f.name: f.default for f in fields(LaunchConfig)}  # LaunchConfig's, but --replicas: auto

    p = subparsers.add_parser(
        "launch", help="train a network partitioned over a fleet, one torch.distributed worker per PNode",
        description="Partition the network onto the fleet's PNodes and train it with one worker process per "
                    "PNode (torch.distributed; pipelined micro-batches, boundary tensors by send/recv). A "
                    "worker that dies is detected and the run restarts from the last checkpoint. The run "
                    "directory is the one `vgraph train` writes.")
    p.add_argument("network", metavar="FILE", type=options.network_file, nargs="?",
                   help="network YAML, or a shipped network's name (vgraph networks); not with --join")
    p.add_argument("--fleet", metavar="FLEET", type=options.fleet_file,
                   help="fleet spec YAML (PNodes), or a shipped fleet's name (required, except with --join)")
    p.add_argument("--micro-batches", type=_positive_int, metavar="M",
                   help="micro-batches per step, pipelined over the PNodes (default min(batch, 2 x PNodes))")
    p.add_argument("--pipeline", choices=PIPELINES, default=default["pipeline"],
                   help="micro-batch schedule: 1f1b (default; at most min(M, PNodes) micro-batches of activations "
                        "per worker) or gpipe (all forwards, then all backwards)")
    p.add_argument("--placement", metavar="JSON", type=options.path, help="use this placement.json's assignment (VNode -> PNode, "
                   "VNodes as before fusion) instead of running the partition pass")
    p.add_argument("--replicas", type=options.replicas, default="auto", metavar="N|auto",
                   help="data-parallel replicas of the pipeline (default auto: the plan of least predicted step "
                        "time, see `vgraph partition`); each replica's stage groups all-reduce gradients")
    p.add_argument("--on-failure", choices=ON_FAILURE, default=default["on_failure"],
                   help="when a worker dies: restart all on the same placement (default) from the survivors' "
                        "state when a replica of every VNode survived, else from the last checkpoint (the steps "
                        "redone are said; machines that vanished are re-planned around), re-partition onto the "
                        "surviving PNodes, shrink (drop the replicas that lost a worker; the others share the "
                        "global batch), or stop")
    p.add_argument("--max-restarts", type=_non_negative_int, default=default["max_restarts"], metavar="N",
                   help=f"default {default['max_restarts']}")
    p.add_argument("--comm-timeout", type=options.positive_float, default=default["comm_timeout"], metavar="S",
                   help="seconds a worker waits on a peer before failing (default 300)")
    p.add_argument("--bucket-size", type=options.byte_size, default=default["bucket_bytes"], metavar="SIZE",
                   help="gradient bucket of the replicas' all-reduce, e.g. 25M (default 25 MiB, as DDP): a bucket "
                        "is all-reduced as soon as its gradients are final in the last backward")
    p.add_argument("--grad-compress", default=default["grad_compress"], metavar="none|powersgd[:rank=R,start=N]",
                   help="the replicas' gradient all-reduce: none (default) or PowerSGD with error feedback "
                        "(torch's powerSGD_hook; rank R, default 4, after N plain steps, default 2); the planner "
                        "prices it")
    p.add_argument("--link-timeout", type=options.positive_float, default=default["link_timeout"], metavar="S",
                   help="several machines: a machine silent for S seconds is lost (its link or itself); the "
                        "others stop their workers (default 10; see membership.py)")
    p.add_argument("--nnodes", type=options.nnodes, default=(1, 1), metavar="N|MIN:MAX",
                   help="machines taking part (default 1); MIN:MAX: start with MIN, admit joins up to MAX "
                        "(launch --join)")
    p.add_argument("--node-rank", type=_non_negative_int, default=default["node_rank"], help="this machine's index (default 0)")
    p.add_argument("--master-addr", default=default["master_addr"], metavar="HOST",
                   help="address of machine 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=options.port, metavar="PORT",
                   help="rendezvous port on machine 0 (default: free port; 29500 with --nnodes > 1)")
    add_train_options(p, "launch", network=False)  # the training options, as `vgraph train` has them
    p.add_argument("--emit-job", metavar="DIR", type=options.path,
                   help="prepare the run directory and write DIR/job.json, train nothing: start the workers with "
                        "torchrun or srun (docs/distributed.md; the command is printed)")
    # Figures from the run itself (vgraph/placement/drift.py): launch only.
    p.add_argument("--drift-steps", type=_non_negative_int, default=DEFAULT_DRIFT_STEPS, metavar="K",
                   help="report a drift when a PNode's busy time stays more than 25%% off the plan's prediction for "
                        "K steps, and write the run's measured fleet (fleet.measured.yml); 0: never "
                        f"(default {DEFAULT_DRIFT_STEPS})")
    add_plugin_option(p)  # the files travel to the workers in the job file
    # Joining a running run (elastic.py): the only options a volunteer machine gives, with its secret in
    # VGRAPH_LAUNCH_TOKEN; everything else comes from machine 0.
    p.add_argument("--join", metavar="HOST:PORT", type=options.host_port,
                   help="join the run whose machine 0 has --master-addr HOST --master-port PORT and --nnodes "
                        "MIN:MAX (the run's secret in VGRAPH_LAUNCH_TOKEN); needs --pnode. SIGTERM leaves the "
                        "run gracefully (exit 0 once machine 0 releases this machine)")
    p.add_argument("--pnode", metavar="PNODE.yml", type=options.path,
                   help="with --join: this machine's figures (the file `vgraph probe -o` writes)")
    p.add_argument("--join-timeout", type=options.positive_float, default=60.0, metavar="S",
                   help="with --join: seconds to wait for machine 0's admission (default 60)")
    p.set_defaults(func=run_launch)
    remember_parser(p)


def run_launch(args: argparse.Namespace) -> int:
    from vgraph.placement.replica_report import step_prediction_gap

    if args.join is not None or args.pnode is not None:
        return _run_join(args)
    if args.network is None or args.fleet is None:
        raise VGraphError("vgraph launch needs a network FILE and --fleet FLEET (or, to join a running run, "
                          "--join HOST:PORT --pnode PNODE.yml)")
    train = train_settings(args, "launch")
    # A pipeline's micro-batches are gradient accumulation: K x --batch samples a step, in at least K of them.
    accum = train.pop("grad_accum")
    train["batch"] *= accum
    config = LaunchConfig(
        **train, fleet=args.fleet,
        micro_batches=(args.micro_batches if accum == 1 else max(args.micro_batches or 1, accum)),
        pipeline=args.pipeline, placement=args.placement, on_failure=args.on_failure, max_restarts=args.max_restarts,
        replicas=int(args.replicas) if args.replicas != "auto" else "auto",
        comm_timeout=args.comm_timeout, bucket_bytes=args.bucket_size, link_timeout=args.link_timeout,
        grad_compress=args.grad_compress, nnodes=args.nnodes[0], max_nnodes=args.nnodes[1], node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, drift_steps=args.drift_steps,
        emit_job=args.emit_job, log=None if not args.emit_job else (lambda line: print(line, flush=True)))

    result = launch(config)
    if not args.emit_job:
        print_result(result, f"{result.restarts} restart(s)" if result.restarts else None,
                     f"{result.steps_redone} step(s) redone" if result.restarts else None)
        gap = step_prediction_gap(result.placement or {}, result.history)
        if gap and not args.quiet:
            print(f"note: prediction off: {gap}", file=sys.stderr)
    return 0


def _run_join(args: argparse.Namespace) -> int:
    """`vgraph launch --join HOST:PORT --pnode PNODE.yml`: this machine takes part in a running run
    (elastic.py).  Everything but --out, --link-timeout, --comm-timeout and --quiet comes from machine 0."""
    if args.join is None or args.pnode is None:
        raise VGraphError("--join HOST:PORT and --pnode PNODE.yml go together: a machine joins with its own figures")
    if args.network is not None or args.fleet is not None:
        raise VGraphError("a joining machine gives no network or fleet: machine 0 sends the run's (drop "
                          f"{'FILE' if args.network is not None else '--fleet'})")
    host, port = args.join
    check_master_addr(host)
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    emit = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    leave = elastic.Leaving(emit)  # SIGTERM, or a first Ctrl-C: leave gracefully (docs/distributed.md)
    restore = leave.install()
    try:
        joined = elastic.follow(host, port, args.pnode, args.out, join_timeout=args.join_timeout,
                                link_timeout=args.link_timeout, comm_timeout=args.comm_timeout, emit=emit,
                                leave=leave)  # JoinRefused: exit 2
    finally:
        restore()
    say(f"launch --join: done: machine {joined.machine} (PNode {joined.pnode}) ran in attempt(s) "
        f"{', '.join(map(str, joined.attempts)) or 'none'}{'; released: it left the run' if joined.released else ''}")
    return 0


def _micro_per_replica(micro: int, shares: list[int]) -> str:
    """What each replica pipelines: --micro-batches caps it, a replica's batch share bounds it (as the worker)."""
    counts = sorted({min(micro, share) for share in shares} or {micro})
    text = " or ".join(str(c) for c in counts)  # unequal shares can leave a small replica fewer
    return f"{text} micro-batch{'es' if counts != [1] else ''}" + (" per replica" if len(shares) > 1 else "")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.distributed.launcher.launch launch ...` (before the entry point is installed)."""
    from vgraph.cli.main import run_commands

    return run_commands([register_launch], argv, prog="python -m vgraph.backends.torch.distributed.launcher.launch")


if __name__ == "__main__":
    sys.exit(main())
