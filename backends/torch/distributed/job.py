"""The job file: everything a worker of `vgraph launch` needs, typed, versioned and checked when read.

    job = Job.read("runs/net/launch/job.json")     # a JobError naming the file and field if it is not one
    job.run_path, job.data_path, job.train.steps, job.ranks[rank]

Why a dataclass and a file: the launcher computes the placement, the data and
the settings once; the workers (started by `vgraph launch`, by `torchrun`, or
by `srun`, possibly on other machines and from another checkout) must build
exactly the same run from it.  A file that another version wrote, or that was
edited by hand, must fail on read with a message that names the field, never
half-way through training.

Paths: `run_dir` is relative to the job file's folder (so a run directory
moves with its job), and `written_in` records that folder's real path when
the job was written: a job copied alone elsewhere (its relative `run_dir` now
naming some other directory) finds its run from where it was written, and a
directory whose run.json is not the job's `run_info` is never taken for the
run (`locate_run`), so a worker never writes metrics into a directory that is
not its run.  `tokenizer` is relative to the run directory and may
not leave it; `data_dir`, the prepared corpus, stays where it was prepared
(an absolute path, or one relative to the run directory), checked against
`data_digest` by every worker.  `train` is the run's `TrainConfig` (the
worker trains as `vgraph train` would be asked to); the few launch-only
settings sit beside it.  Writing goes through safeio (atomic), reading is
bounded and refuses NaN, infinities, wrong types and out-of-range numbers.
"""
from __future__ import annotations

import json
import math
import os
import signal
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Union

from vgraph.base.diagnostics import VGraphError, printable, quote
from vgraph.base.jsonio import loads
from vgraph.base.safeio import atomic_write, read_json
from vgraph.cost.grad_compression import parse_grad_compress
from vgraph.run.compiled_graph import PLAN_CHOICES
from vgraph.run.files import LAUNCH_DIR, RUN_JSON, STOP_FILE, RunReader  # re-exported: the run format's names

from ..training.config import TrainConfig
from ..training.options import config_problems, train_section
from vgraph.run.step_plan import PIPELINES

__all__ = ["Job", "JobError", "JOB_VERSION", "JOB_FILE", "LAUNCH_DIR", "STOP_FILE", "EXIT_USER_ERROR", "RESCUE_SIGNAL"]

JOB_VERSION = 1
JOB_FILE = "job.json"  # what --emit-job DIR writes (launch's own attempts: LAUNCH_DIR/job-<attempt>.json)
EXIT_USER_ERROR = 3  # a worker's exit status for a user-facing error: the launcher does not restart
# `vgraph launch` asks its workers for their rescue shards with this signal when a machine went dark (its
# link lost, no connection closed, so the workers wait in a collective): the workers it starts block it in
# every thread, and one thread of theirs waits for it (worker.watch_rescue_requests).
RESCUE_SIGNAL = signal.SIGUSR1
MAX_INT = 2**62
_BACKENDS = ("gloo", "nccl")
_DEVICES = ("cpu", "cuda")


_NOT_WRITTEN = frozenset({"path", "located"})  # fields of the object, not of the file


class JobError(VGraphError):
    """A job file that is not one this worker can run (another version's, damaged, edited)."""


@dataclass
class Job:
    """What launch hands every worker (see the module docstring); field order is the file's."""

    run_dir: str  # relative to the job file's folder (or absolute)
    network_yaml: str  # the network as given
    network_file: str  # its name, for diagnostics
    pipeline_before: str  # passes before the partition pass
    pipeline_after: str  # passes after it (fusions)
    target: str  # device_target of the passes
    assignment: dict[str, str]  # VNode -> PNode right after the partition pass
    final_assignment: dict[str, str]  # VNode -> PNode of the placed graph (the workers check theirs)
    ranks: list[str]  # world rank -> PNode (replica r: ranks r*P .. r*P+P-1)
    plan_ranks: list[str]  # one replica's ranks: plan rank -> PNode
    batch_shares: list[int]  # per replica, its samples of the global batch
    predicted_bytes: float  # placement.json's bytes_per_step (all-reduce included)
    predicted_cut_bytes: float  # placement.json's cut_bytes_per_step
    device: str  # cpu | cuda (comm_choice.py)
    backend: str  # gloo | nccl
    stage_through_cpu: bool
    control_group: bool
    data_dir: str  # the prepared corpus (vgraph/data): absolute, or relative to the run directory
    data_digest: str  # its manifest's SHA-256, as the launcher verified it
    tokenizer: str  # tokenizer JSON, relative to the run directory
    run_info: dict[str, Any]  # run.json's content
    attempt: int  # the launcher's attempt (a restart under torchrun adds its restart count)
    train: TrainConfig
    micro_batches: int
    pipeline: str  # 1f1b | gpipe
    comm_timeout: float  # seconds a worker waits on a peer
    bucket_bytes: int  # gradient buckets of the replicas' all-reduce
    plugins: list[str] = field(default_factory=list)  # plugin files the launcher loaded
    hold: dict[str, int] | None = None  # test hook: {"rank", "step"}: that rank stops after that step, once
    grad_compress: str = "none"  # the replicas' all-reduce (vgraph/cost/grad_compression.py: none | powersgd:...)
    plan_choices: dict[str, Any] = field(default_factory=dict)  # the partition's choices later passes read
    written_in: str = ""  # the real path of the folder the job was written to ("": a job of an older vgraph)
    fleet_yaml: str = ""  # the attempt's fleet as a fleet file (placement/drift.py: rank 0 rescales it to the run's figures)
    fleet_file: str = ""  # the real path of the fleet file given ("": built in code), never written over
    drift_steps: int = 0  # consecutive steps off the plan by more than 25% before rank 0 reports a drift (0: never)
    machines: dict[str, int] = field(default_factory=dict)  # PNode -> the machine running it ({}: a job of an older vgraph)
    version: int = JOB_VERSION
    path: Path | None = field(default=None, compare=False)  # the file it was read from (not written)
    located: Path | None = field(default=None, compare=False)  # the run directory `locate_run` found (not written)

    # -- paths ----------------------------------------------------------------------------------
    @property
    def run_path(self) -> Path:
        """The run directory: the one `locate_run` found, else the job's `run_dir` against the job file's
        folder."""
        if self.located is not None:
            return self.located
        base = self.path.parent if self.path is not None else Path.cwd()
        return Path(os.path.normpath(base / self.run_dir))

    def locate_run(self) -> Path:
        """The run directory this job was written for, checked: `run_dir` against the job file's folder
        (a run moved with its job), else against the folder the job was written in (a job copied alone);
        the first whose run.json holds the job's `run_info`.  A JobError naming both places otherwise:
        a worker must never write a run's files into a directory that is not that run."""
        where = str(self.path) if self.path is not None else "job"
        tried = []
        bases = [self.path.parent if self.path is not None else Path.cwd()]
        if self.written_in:
            bases.append(Path(self.written_in))
        for base in bases:
            candidate = Path(os.path.normpath(base / self.run_dir))
            if candidate in tried:
                continue
            tried.append(candidate)
            if self._is_the_run(candidate):
                self.located = candidate
                return candidate
        raise JobError(f"{where}: its run directory is not the run it was written for: "
                       f"{' nor '.join(quote(str(t), 200) for t in tried)} holds no {RUN_JSON} of this job "
                       f"(a job file copied away from its run, or a run directory replaced since): start the "
                       f"workers on the job file --emit-job wrote, next to its run")

    def _is_the_run(self, candidate: Path) -> bool:
        if not candidate.is_dir():
            return False
        reader = RunReader(candidate)
        doc = reader.json(RUN_JSON, optional=True)
        return isinstance(doc, dict) and doc == self.run_info

    def path_of(self, relative: str) -> Path:
        """A run-directory file named in the job."""
        return self.run_path / relative

    @property
    def data_path(self) -> Path:
        """The prepared corpus (it lives where it was prepared, often a cache, not in the run directory)."""
        return self.run_path / self.data_dir

    # -- writing and reading ----------------------------------------------------------------------
    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_WRITTEN}
        data["train"] = train_section(self.train)
        return json.dumps(data, indent=1, allow_nan=False) + "\n"

    def write(self, path: str | os.PathLike) -> Path:
        """Atomically, as JSON (safeio)."""
        target = Path(path)
        self.written_in = os.path.realpath(target.parent)
        atomic_write(target, self.to_json())
        self.path = target
        return target

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Job":
        """The job in `path`, checked field by field (a JobError naming the file and field otherwise)."""
        return cls._checked(read_json(path, what="job file", error=JobError), path)

    @classmethod
    def loads(cls, raw: bytes, path: str | os.PathLike) -> "Job":
        """The job whose file `raw` is, received for `path` (a machine that follows the coordinator's jobs:
        launcher/elastic.py), checked as `read` checks a file, before anything of it is written."""
        return cls._checked(loads(raw, printable(str(path)), error=JobError), path)

    @classmethod
    def _checked(cls, data: Any, path: str | os.PathLike) -> "Job":
        where = str(path)
        if not isinstance(data, dict):
            raise JobError(f"{where}: not a job file (expected a JSON object)")
        version = data.get("version")
        if version != JOB_VERSION:
            raise JobError(f"{where}: job format {quote(json.dumps(version), 20)[1:-1]}, but this vgraph reads format "
                           f"{JOB_VERSION}: write it again with this vgraph (vgraph launch ... --emit-job DIR)")
        job = cls(**_decode_fields(cls, data, where, skip=_NOT_WRITTEN))
        job.path = Path(path)
        job._check(where)
        return job

    def _check(self, where: str) -> None:
        """Relations between fields, and the ranges a field's type does not say."""
        problems = []
        P, R = len(self.plan_ranks), len(self.batch_shares)
        if P < 1 or R < 1 or P * R != len(self.ranks):
            problems.append(f"ranks: {len(self.ranks)} ranks are not {R} replica(s) x {P} plan rank(s)")
        if not set(self.plan_ranks) <= set(self.ranks):
            problems.append("plan_ranks: names PNodes that are not in ranks")
        if any(s < 1 for s in self.batch_shares) or sum(self.batch_shares) != self.train.batch:
            problems.append(f"batch_shares: {self.batch_shares} must be positive and add up to train.batch "
                            f"{self.train.batch}")
        problems += [f"train.{name}: {why}" for name, why in config_problems(self.train)]  # the CLI's own checks
        for name, value, allowed in (("device", self.device, _DEVICES), ("backend", self.backend, _BACKENDS),
                                     ("pipeline", self.pipeline, PIPELINES)):
            if value not in allowed:
                problems.append(f"{name}: {quote(value, 40)} is not one of {', '.join(allowed)}")
        for name, value in (("micro_batches", self.micro_batches), ("bucket_bytes", self.bucket_bytes)):
            if value < 1:
                problems.append(f"{name}: must be at least 1, got {value}")
        for name, value in (("comm_timeout", self.comm_timeout),
                            ("train.initial_loss_scale", self.train.initial_loss_scale)):
            if not value > 0:
                problems.append(f"{name}: must be greater than 0, got {value}")
        if not 0 <= self.train.min_lr_ratio <= 1:
            problems.append(f"train.min_lr_ratio: must be in 0..1, got {self.train.min_lr_ratio}")
        if self.written_in and (not os.path.isabs(self.written_in) or not self.written_in.isprintable()):
            problems.append(f"written_in: {quote(self.written_in, 60)} is not an absolute path")
        reason = _inside_problem(self.tokenizer)
        if reason:
            problems.append(f"tokenizer: {reason}")
        if not self.data_dir or any(not c.isprintable() for c in self.data_dir):
            problems.append(f"data_dir: {quote(self.data_dir, 60)} is empty or holds control characters")
        if len(self.data_digest) != 64 or any(c not in "0123456789abcdef" for c in self.data_digest):
            problems.append(f"data_digest: {quote(self.data_digest, 70)} is not a SHA-256 in hex")
        try:
            parse_grad_compress(self.grad_compress)
        except ValueError as exc:
            problems.append(f"grad_compress: {exc}")
        if set(self.plan_choices) - set(PLAN_CHOICES):
            problems.append(f"plan_choices: only {', '.join(PLAN_CHOICES)}")
        if self.hold is not None and set(self.hold) != {"rank", "step"}:
            problems.append("hold: expected {\"rank\": R, \"step\": S}")
        if self.machines and set(self.machines) != set(self.ranks):
            problems.append("machines: expected every PNode of ranks, each with its machine's number")
        seq_len = self.run_info.get("seq_len")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_INT:
            problems.append(f"run_info.seq_len: expected a positive integer, got {quote(json.dumps(seq_len), 40)}")
        if problems:
            raise JobError("\n".join(f"{where}: {p}" for p in problems))


def _inside_problem(name: str) -> str | None:
    """Why `name` is not a plain path inside the run directory (None when it is)."""
    if not name or any(not c.isprintable() for c in name):
        return f"{quote(name, 60)} is empty or holds control characters"
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        return f"{quote(name, 60)} must be relative to the run directory and stay inside it"
    return None


# -- typed decoding --------------------------------------------------------------------------------

def _decode_fields(cls: type, data: dict[str, Any], where: str, skip: set[str] = frozenset()) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)} - skip
    unknown = sorted(set(data) - names)
    if unknown:
        raise JobError(f"{where}: unknown field(s) {', '.join(quote(u, 40) for u in unknown[:5])} (a job of "
                       f"another vgraph version?)")
    required = {f.name for f in fields(cls)
                if f.name not in skip and f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise JobError(f"{where}: missing field(s) {', '.join(missing)}")
    return {name: _decode(data[name], hints[name], f"{where}: {name}") for name in data}


def _decode(value: Any, hint: Any, where: str) -> Any:
    """`value` (from JSON) checked against the type `hint`; dataclasses decoded field by field."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode(value, option, where)
            except JobError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        raise JobError(f"{where}: unexpected {type(value).__name__}")
    if hint is Any:
        return value
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        if not isinstance(value, dict):
            raise JobError(f"{where}: expected an object, got {type(value).__name__}")
        return hint(**_decode_fields(hint, value, where))
    if origin is list:
        if not isinstance(value, list):
            raise JobError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        return [_decode(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise JobError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = typing.get_args(hint)
        return {k: _decode(v, item, f"{where}.{k}") for k, v in value.items()}
    return _scalar(value, hint, where)


def _scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -MAX_INT <= value <= MAX_INT:
                raise JobError(f"{where}: {value} is out of range")
            if value < 0:
                raise JobError(f"{where}: must be >= 0, got {value}")
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or abs(value) > 1e300:
                raise JobError(f"{where}: {value} is not a finite number")
            return float(value)
    elif hint is str or hint is Path:
        if isinstance(value, str):
            return value
    else:  # Graph and other in-memory types: a job holds their file name instead
        raise JobError(f"{where}: expected a {getattr(hint, '__name__', hint)}, which a job cannot hold")
    expected = {bool: "true or false", int: "an integer", float: "a number"}.get(hint, "a string")
    raise JobError(f"{where}: expected {expected}, got {quote(json.dumps(value), 40)}")
