"""A launch's inputs, resolved once: `LaunchConfig` (the settings, one field per CLI option) checked and
turned into `Run`, the plain values the attempts, the joins, the boundaries, the failures and the job emission
use (the fleet, the network and a given placement.json read, the device resolved, the defaults decided, the
pipelines cut around the partition, the run directory opened with its data files written).

Why a value of its own: the modules after this one take the values they need from `Run`, so none of them goes
back to the settings, reads a file again or decides a default of its own; what a launch will do is visible in
one place, before anything is started.  Unlike the settings, `Run` also carries what the attempts learn on
the way (its "state" fields: where each PNode runs, the admission, a succession's new coordinator, a move
being measured), each set by the one module that owns it.
"""
from __future__ import annotations

import math
import os
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.safeio import OutputDir, atomic_write, check_output_dir, read_json
from vgraph.cost.fleet import Fleet, resolve_fleet
from vgraph.cost.grad_compression import parse_grad_compress
from vgraph.ir.graph import Graph
from vgraph.placement.drift import DEFAULT_DRIFT_STEPS
from vgraph.placement.replan import DEFAULT_REPLAN_OVERHEAD_S
from vgraph.run.files import NETWORK_YML, RELEASE_FILE, TOKENIZER_JSON, error_name, held_name
from vgraph.run.step_plan import PIPELINES
from vgraph.transform.pipeline import Pipeline

from ...training.config import TrainConfig, TrainingError
from ...training.interrupt import StopRequest
from ...training.options import check_train_config
from ...training.run_files import run_slug
from ..job import JOB_FILE, LAUNCH_DIR, STOP_FILE
from ..rendezvous import TOKEN_ENV, check_master_addr, check_token, probe_port
from ..runtime.comm_choice import COMM_MODES, DEFAULT_BUCKET_BYTES
from ..runtime.progress import LaunchBar
from . import elastic
from .membership import MachineLost, Machines
from .mirror import Mirror, superseded
from .placing import split_pipeline

__all__ = ["LaunchConfig", "Run", "ON_FAILURE", "resolve_inputs", "is_elastic", "succeeds", "job_folder",
           "read_placement_layout", "read_placement", "SETTINGS_VERSION", "launch_settings", "read_launch_settings",
           "joined_config"]

ON_FAILURE = ("restart", "repartition", "shrink", "stop")


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
    hold: Any = None  # test hook: the worker of PNode [0] stops after step [1] (1st attempt); a list of (PNode,
    # step, attempt): each in its attempt (attempts.held)
    comm: str = "auto"  # auto | gloo | nccl-on-gloo (test hook: the nccl path's code over gloo), comm_choice.py
    log: Callable[[str], None] | None = None  # where status and worker lines go (default stderr)
    emit_job: str | Path | None = None  # write the run directory and DIR/job.json, train nothing (torchrun, srun)
    drift_steps: int = DEFAULT_DRIFT_STEPS  # steps off the plan by > 25% before a drift is reported (0: never; drift.py)
    replan_overhead_s: float = DEFAULT_REPLAN_OVERHEAD_S  # what a boundary costs besides the move (replan.py)
    leaving: Any = None  # machine k != 0 of a run that takes joins: the elastic.Leaving to leave by (SIGTERM's)
    joined: bool = False  # a machine that joined (`joined_config`): node_rank is its machine number, its channel open


def _check(cfg: LaunchConfig) -> tuple[str, tuple[Any, Any]]:
    """Refuse settings that cannot run, before anything is written or started; the values the attempts use
    in place of the settings that need reading: the gradient compression's canonical text, and the given
    placement as (assignment, replica layout), or (None, None) when the partition pass decides."""
    if cfg.fleet is None:
        raise VGraphError("vgraph launch needs a fleet: --fleet FLEET.yml (see networks/fleets/)")
    if cfg.comm not in COMM_MODES:
        raise VGraphError(f"comm must be one of {', '.join(COMM_MODES)}, not {cfg.comm!r}")
    if cfg.on_failure not in ON_FAILURE:
        raise VGraphError(f"--on-failure must be one of {', '.join(ON_FAILURE)}, not {cfg.on_failure!r}")
    if cfg.nnodes < 1 or not (0 <= cfg.node_rank < cfg.nnodes or (cfg.joined and cfg.node_rank >= cfg.nnodes)):
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
    if is_elastic(cfg) and cfg.on_failure == "repartition":
        raise VGraphError("--on-failure repartition needs all workers on one machine; a run that takes joins "
                          "(--nnodes MIN:MAX) restarts, shrinks or stops")
    if is_elastic(cfg) and cfg.emit_job is not None:
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


def is_elastic(cfg: LaunchConfig) -> bool:
    """A run that admits joins: --nnodes MIN:MAX with MAX > MIN (elastic.py)."""
    return cfg.max_nnodes is not None and cfg.max_nnodes > cfg.nnodes


def succeeds(cfg: LaunchConfig) -> bool:
    """A run whose coordinator role can move when machine 0 is lost (succession.py): several machines (--nnodes
    N > 1, or an elastic run whatever its MIN: a machine that joined takes the role from the settings its
    admission carried, `launch_settings`, and the latest job), and `shrink` (a lost machine costs its
    replicas, so another replica can carry on) or `restart` (the next attempt is re-planned on the machines
    left, as for any machine that vanished)."""
    return (cfg.nnodes > 1 or is_elastic(cfg)) and cfg.on_failure in ("shrink", "restart")


SETTINGS_VERSION = 1  # the admission's launch settings (`launch_settings`): a joiner refuses another version's


def launch_settings(run: "Run") -> dict[str, Any]:
    """What a joined machine needs, besides the latest job, to act as the coordinator should machine 0 be lost:
    the launch-only settings a started machine has from its command line.  The training options, the network,
    the fleet, the micro-batches, the schedule, the timeouts the workers use and the gradient settings are in
    every job (job.py), declared once; only what no job carries travels here, in the admission's answer."""
    return {"version": SETTINGS_VERSION, "on_failure": run.on_failure, "max_restarts": run.max_restarts,
            "nnodes": run.nnodes, "max_nnodes": run.max_nnodes, "link_timeout": run.link_timeout,
            "comm": run.comm, "replan_overhead_s": run.replan_overhead_s}


def read_launch_settings(record: Any) -> dict[str, Any]:
    """The admission's launch settings checked as any input (a coordinator of another version, or a damaged
    answer): a JoinRefused naming the field, never a traceback later, when this machine would take the role."""
    from vgraph.base.numbers import NumberError, checked_number

    def refuse(why: str) -> elastic.JoinRefused:
        return elastic.JoinRefused(f"the coordinator's launch settings (its admission's answer): {why}; this "
                                   f"machine could not take the coordinator's role, so it does not join")

    if not isinstance(record, dict):
        raise refuse(f"expected a record of settings, got {quote(record, 60)}")
    if record.get("version") != SETTINGS_VERSION:
        raise refuse(f"version {quote(record.get('version'), 20)}, this vgraph reads {SETTINGS_VERSION}")
    unknown = sorted(set(record) - {"version", "on_failure", "max_restarts", "nnodes", "max_nnodes", "link_timeout",
                                    "comm", "replan_overhead_s"})
    if unknown:
        raise refuse(f"unknown field {quote(unknown[0], 40)}")
    if record.get("on_failure") not in ON_FAILURE:
        raise refuse(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {quote(record.get('on_failure'), 40)}")
    if record.get("comm") not in COMM_MODES:
        raise refuse(f"comm must be one of {', '.join(COMM_MODES)}, got {quote(record.get('comm'), 40)}")
    try:
        nnodes = checked_number(record.get("nnodes"), "nnodes", integer=True, low=1, high=1_000_000)
        return {**record, "nnodes": nnodes,
                "max_nnodes": checked_number(record.get("max_nnodes"), "max_nnodes", integer=True, low=nnodes,
                                             high=1_000_000),
                "max_restarts": checked_number(record.get("max_restarts"), "max_restarts", integer=True, low=0,
                                               high=2**31),
                "link_timeout": checked_number(record.get("link_timeout"), "link_timeout", low=1e-3, high=86400),
                "replan_overhead_s": checked_number(record.get("replan_overhead_s"), "replan_overhead_s", low=0,
                                                    high=86400)}
    except NumberError as exc:
        raise refuse(str(exc)) from None


def joined_config(settings: dict[str, Any], job: Any, *, machine: int, corpus: Path, run_dir: Path,
                  master_addr: str, master_port: int, log: Callable[[str], None]) -> LaunchConfig:
    """The settings of a machine that joined, about to take the coordinator's role: those its admission carried
    (`read_launch_settings`'s), the latest job's training options as machine 0 resolved them (job.py: the
    same `TrainConfig`), and this machine's own copies: the job's network and fleet written as files into its
    launch folder (so the command that continues the run names files this machine has), the corpus it
    received (`corpus`, a prepared corpus), its run directory.  The placement is the partition pass's
    (replicas auto, as after any succession)."""
    network, fleet = run_dir / LAUNCH_DIR / "network.yml", run_dir / LAUNCH_DIR / "fleet.yml"
    atomic_write(network, job.network_yaml)
    atomic_write(fleet, job.fleet_yaml)
    train = {f.name: getattr(job.train, f.name) for f in fields(TrainConfig)}
    train.update(network=str(network), data=str(corpus), out=run_dir, resume=False, continue_command=None)
    return LaunchConfig(
        **train, fleet=str(fleet), micro_batches=job.micro_batches,
        pipeline=job.pipeline, on_failure=settings["on_failure"], replicas="auto",
        max_restarts=settings["max_restarts"], comm_timeout=job.comm_timeout, bucket_bytes=job.bucket_bytes,
        link_timeout=settings["link_timeout"], grad_compress=job.grad_compress, nnodes=settings["nnodes"],
        max_nnodes=settings["max_nnodes"], node_rank=machine, master_addr=master_addr, master_port=master_port,
        comm=settings["comm"], drift_steps=job.drift_steps, replan_overhead_s=settings["replan_overhead_s"],
        log=log, joined=True)


@dataclass
class Run:
    """What a launch resolves once, before any attempt (every setting the attempts read, as the value they use:
    files read, defaults decided, the device resolved; the network, the pipelines around the partition, the
    run directory with its data files), and the state the attempts carry from one to the next."""

    machines: Machines  # several machines: the launchers' channel (membership.py)
    # where lines go
    emit: Callable[[str], None]  # every line (worker output included)
    say: Callable[[str], None]  # status lines (silent under --quiet)
    bar: LaunchBar | None  # rank 0's progress, drawn here (progress.py)
    # the machines
    token: str
    lead: bool  # machine 0 (a succession: the new coordinator): writes the run directory
    master_addr: str  # the coordinator's (the workers' rendezvous); a succession moves it
    node_rank: int
    nnodes: int
    max_nnodes: int  # --nnodes MIN:MAX's MAX (MIN when the run takes no joins)
    elastic: bool  # the run takes joins (elastic.py)
    succeeds: bool  # the coordinator role can move when machine 0 is lost (succession.py)
    base_port: int | None  # the rendezvous port of attempt 0 (attempt n: + n); None: a free port each attempt
    link_timeout: float
    comm_timeout: float
    # what is placed, and how
    fleet: Fleet
    device: Any  # torch.device of --device
    source: Graph
    yaml_text: str
    network_file: str
    passes: str | None  # --passes as given (named in a diagnostic)
    given: tuple[Any, Any]  # --placement read: (assignment, replica layout), or (None, None): the partition pass
    before: Pipeline
    partition: Pipeline  # with the run's options (a machine that vanished: replicas auto from then on)
    after: Pipeline
    target: str
    batch: int
    micro: int
    steps: int
    pipeline: str
    grad_compress: str  # the replicas' all-reduce, canonical text
    # when a worker fails, or the fleet changes
    on_failure: str
    max_restarts: int
    hold: Any  # test hook: LaunchConfig.hold (attempts.held)
    continue_with: str  # the command that continues the run
    keep_checkpoints: int
    drift_steps: int
    replan_overhead_s: float
    # the run directory and what the job file carries
    run_dir: Path
    train: TrainConfig  # the job's training settings (its network: network_file)
    threads: int | None
    comm: str
    bucket_bytes: int
    tokenizer: str = f"{LAUNCH_DIR}/tokenizer.json"  # relative to run_dir
    tokenizer_json: str = ""  # its text: what a rescue's checkpoint and a successor's run directory carry
    run_info: dict[str, Any] = field(default_factory=dict)  # run.json's content, before the attempt's placement
    data_dir: str = ""  # the prepared corpus (absolute)
    data_digest: str = ""
    # state: what the attempts learn and change on the way
    home: dict[str, int] | None = None  # PNode -> machine, fixed by the first attempt: a PNode stays where it ran
    admission: Any = None  # machine 0 of a run that takes joins: boundaries.Admission (that module imports this)
    leave: "elastic.Leaving | None" = None  # machine k != 0 of a run that takes joins: its graceful leave
    moving: tuple[int, float, float] | None = None  # a boundary's step, its stop request's time and the seconds
    # its workers trained after the request (boundaries.boundary), until the move is measured
    moved_s: float | None = None  # the last boundary's measured seconds: the next decisions' overhead (boundaries.py)
    mirror: "Mirror | None" = None  # a machine next in line: the coordinator's history (mirror.py)
    settings: dict[str, Any] = field(default_factory=dict)  # `launch_settings`: what an admission sends a joiner

    @property
    def launch_dir(self) -> Path:
        return self.run_dir / LAUNCH_DIR


def resolve_inputs(cfg: LaunchConfig, stop: StopRequest, machines: Machines) -> Run:
    """Check the settings, open the run directory (machine 0), tokenise the data once, write the run's files.

    Long because it is the launch's one walk through its settings, in the order the run needs them: each
    setting read, checked and turned into the value the attempts use, so none of them goes back to it."""
    # torch's (setup.py): the device resolved here is the workers'; a launcher that only joins imports neither.
    from ...training.setup import device_target, load_network, open_run_dir, resolve_device, vocab_and_seq

    emitting = cfg.emit_job is not None
    emit, bar = _outputs(cfg.log, cfg.progress and not emitting)
    grad_compress, given = _check(cfg)
    token = os.environ.get(TOKEN_ENV) or ""
    channel = not emitting and (cfg.nnodes > 1 or is_elastic(cfg))  # the launchers' channel: heartbeats, decisions, joins
    if not emitting:  # torchrun has its own rendezvous; srun workers check the token themselves
        token = check_token(token or None, cfg.max_nnodes or cfg.nnodes)  # before anything is written or started
        if cfg.master_port and cfg.node_rank == 0:
            probe_port(cfg.master_addr, cfg.master_port)
    # The network once: its name names the run directory, its vocabulary and sequence the data.
    source, yaml_text = load_network(cfg.network)
    device = resolve_device(cfg.device)
    target = device_target(device)
    run_dir = Path(cfg.out) if cfg.out is not None else Path("runs") / run_slug(source.name)
    lead = cfg.node_rank == 0
    if channel and not machines.active:  # a machine that joined has its channel open already
        if lead:  # whatever its options now: a run another machine took over stays there
            _refuse_superseded(run_dir, token)
        try:
            machines.open(cfg.master_addr, (cfg.master_port or 29500) - 1, token, cfg.node_rank, cfg.nnodes,
                          cfg.link_timeout, cfg.comm_timeout)
        except MachineLost as exc:
            raise TrainingError(str(exc)) from None
    fleet = resolve_fleet(cfg.fleet)
    micro = cfg.micro_batches or min(cfg.batch, 2 * len(fleet))
    if not 1 <= micro <= cfg.batch:
        raise TrainingError(f"--micro-batches must be between 1 and --batch {cfg.batch}, got {micro}")
    if lead:
        open_run_dir(run_dir, cfg.resume, command="vgraph launch")  # an existing run only with --resume; locked
    vocab, seq_len = vocab_and_seq(source)
    network_file = str(cfg.network) if not isinstance(cfg.network, Graph) else f"<{source.name}>"
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
    train = TrainConfig(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})
    train.network = network_file
    run = Run(
        machines=machines, emit=emit, say=emit if cfg.progress else (lambda line: None), bar=bar, token=token,
        lead=lead, master_addr=cfg.master_addr, node_rank=cfg.node_rank, nnodes=cfg.nnodes,
        max_nnodes=cfg.max_nnodes or cfg.nnodes, elastic=is_elastic(cfg), succeeds=succeeds(cfg),
        base_port=_base_port(cfg), link_timeout=cfg.link_timeout, comm_timeout=cfg.comm_timeout, fleet=fleet,
        device=device, source=source, yaml_text=yaml_text, network_file=network_file, passes=cfg.passes,
        given=given, before=before, partition=partition, after=after, target=target, batch=cfg.batch, micro=micro,
        steps=cfg.steps, pipeline=cfg.pipeline, grad_compress=grad_compress, on_failure=cfg.on_failure,
        max_restarts=cfg.max_restarts, hold=cfg.hold, continue_with=_continue_with(cfg, run_dir),
        keep_checkpoints=cfg.keep_checkpoints, drift_steps=cfg.drift_steps, replan_overhead_s=cfg.replan_overhead_s,
        run_dir=run_dir, train=train, threads=cfg.threads, comm=cfg.comm, bucket_bytes=cfg.bucket_bytes)
    run.settings = launch_settings(run)  # built once: the admission sends it to every joiner
    _write_data(run, cfg, vocab, seq_len)
    return run


def _outputs(log: Callable[[str], None] | None, progress: bool
             ) -> tuple[Callable[[str], None], LaunchBar | None]:
    """Where every line goes (`log`, else stderr, one line at a time) and, on stderr with --progress, rank
    0's progress bar drawn here (progress.py), through which the lines then go; given a log callback,
    status lines."""
    lock = threading.Lock()

    def out(line: str) -> None:
        with lock:
            if log is not None:
                log(line)
            else:
                print(line, file=sys.stderr, flush=True)

    bar = LaunchBar(out) if progress and log is None else None
    return (bar.write if bar is not None else out), bar


def _base_port(cfg: LaunchConfig) -> int | None:
    """The rendezvous port of attempt 0 (attempt n: + n): --master-port, 29500 across machines, else None (a
    free port each attempt)."""
    return cfg.master_port or (29500 if cfg.nnodes > 1 or is_elastic(cfg) else None)


def _continue_with(cfg: LaunchConfig, run_dir: Path) -> str:
    """The command that continues the run: the CLI's own as typed (cli.resume_command), else the gist."""
    if cfg.continue_command is not None:
        return cfg.continue_command(run_dir)
    return f"vgraph launch {cfg.network} --fleet {cfg.fleet} --out {run_dir} --resume (and the same options)"


def _refuse_superseded(run_dir: Path, token: str) -> None:
    """Machine 0 started again on a run another machine took over: refused, never a second run beside it."""
    from .membership import channel_key

    why = superseded(run_dir, channel_key(token))
    if why is not None:
        raise VGraphError(f"{run_dir}: {why}")


def _write_data(run: Run, cfg: LaunchConfig, vocab: int, seq_len: int) -> None:
    """The corpus every worker reads (prepared and verified once: corpus.py), its tokenizer, and
    network.yml + tokenizer.json as `vgraph train` writes them; run_info, run.json's content."""
    from ...training.corpus import prepare_data  # its token shards are torch's (batches.py)

    data = prepare_data(cfg, vocab, seq_len, run.say)  # the corpus `vgraph train` would read
    run.data_dir, run.data_digest = str(data.dataset.corpus.root.absolute()), data.digest
    run.tokenizer_json = data.tokenizer.to_str()
    atomic_write(run.run_dir / run.tokenizer, run.tokenizer_json)
    run.run_info = {
        "network": run.source.name, "seed": cfg.seed, "batch": cfg.batch, "seq_len": seq_len,
        **data.run_fields(), "vocab_size": vocab,
        "passes": cfg.passes, "fuse": cfg.fuse, "device": str(run.device), "lr": cfg.lr, "steps": cfg.steps,
        "warmup": cfg.warmup, "schedule": cfg.schedule, "grad_compress": run.grad_compress,
    }
    if run.lead and (not (run.run_dir / NETWORK_YML).exists() or not cfg.resume):
        atomic_write(run.run_dir / NETWORK_YML, run.yaml_text)
        atomic_write(run.run_dir / TOKENIZER_JSON, run.tokenizer_json)


def job_folder(cfg: LaunchConfig) -> OutputDir:
    """--emit-job DIR as an output directory: like every output never an input, never inside what a run
    owns (its checkpoints, its launch folder), and DIR/job.json replaced only when an earlier --emit-job
    wrote it there and nobody changed it since (safeio.OutputDir's manifest): a job.json of the user's is
    refused, never lost."""
    read = [p for p in (cfg.network, cfg.fleet, cfg.data, cfg.placement) if isinstance(p, (str, Path))]
    check_output_dir(cfg.emit_job, inputs=read, what="--emit-job directory")
    folder = OutputDir(cfg.emit_job, command="launch --emit-job", inputs=read)
    folder.plan([JOB_FILE])
    return folder


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


def read_placement(path: str | Path) -> dict[str, str]:
    """The `assignment` of a placement.json (as `vgraph partition` and `vgraph launch` write)."""
    return read_placement_layout(path)[0]
