"""The run directory's format, owned here: every file `vgraph train` and `vgraph launch` write into a run,
by name, and the bounded readers every reader of a run goes through.

A run directory is shared by a writer (a training process, the launcher and its workers) and its readers
(`vgraph report`, resume, `generate`, the ONNX commands).  Its names were string literals in six files;
here each has one name, and a reader of a run reads only through `RunReader`, which is bounded in size and
turns a damaged or missing file into a note instead of an exception, so a report of a run still being written
or killed halfway shows what is there.

Layout (the checkpoint folder's own files are the torch backend's `checkpoint.py`'s format; their names are
here so that nothing else writes over them):

    RUN/run.json            settings, versions, plugins (written once, at the start)
    RUN/network.yml         the network as trained from here on
    RUN/tokenizer.json      the tokenizer
    RUN/metrics.jsonl       one JSON row per logged step (+ metrics.csv, the same rows)
    RUN/placement.json      launch runs: the plan
    RUN/fleet.measured.yml  launch runs: the fleet rescaled to what the run measured, after a drift
    RUN/loss_curve.png      the curve, redrawn at each validation and at the end
    RUN/latest              the newest complete checkpoint's folder name
    RUN/step-NNNNNNNN/      a checkpoint: model.safetensors, optimizer.*, state.*
    RUN/launch/job-N.json   launch runs: what attempt N's workers were told
    RUN/launch/workers.json, error-<rank>.txt, stop, held-<pnode>, release   the launcher and its workers
    RUN/launch/fleet-events.jsonl  elastic runs: joins, re-plans, boundaries, measured moves (fleet_events.py)
    RUN/.vgraph-lock        the writer's advisory lock (pid, host)
    RUN/events.out.tfevents.*   TensorBoard
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.numbers import is_number, number_or_none
from vgraph.base.jsonio import MAX_DEPTH, jsonl_lines, loads
from vgraph.base.safeio import decode_text, read_open_file, register_owner

__all__ = ["RUN_JSON", "NETWORK_YML", "TOKENIZER_JSON", "METRICS_JSONL", "METRICS_CSV", "PLACEMENT_JSON", "MEASURED_FLEET",
           "LOSS_CURVE_PNG", "LATEST", "CHECKPOINT_PREFIX", "MODEL_FILE", "STATE_JSON", "LAUNCH_DIR", "STOP_FILE",
           "WORKERS_JSON", "FLEET_EVENTS_JSONL", "RELEASE_FILE", "JOB_FILE", "LOCK_FILE", "RUN_LOCK_ENV", "RunLock", "RunInUse", "refuse_foreign",
           "owned_by_run", "looks_like_run", "is_checkpoint", "run_owner", "checkpoint_name", "job_name", "error_name",
           "held_name", "RunReader", "MAX_METRICS_BYTES", "clean_json", "metrics_row"]

RUN_JSON = "run.json"
NETWORK_YML = "network.yml"
TOKENIZER_JSON = "tokenizer.json"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
PLACEMENT_JSON = "placement.json"
MEASURED_FLEET = "fleet.measured.yml"  # launch runs: the fleet rescaled to the run's figures (placement/drift.py)
LOSS_CURVE_PNG = "loss_curve.png"
LATEST = "latest"  # a pointer file: the newest complete checkpoint's folder name
CHECKPOINT_PREFIX = "step-"
MODEL_FILE = "model.safetensors"
STATE_JSON = "state.json"
LAUNCH_DIR = "launch"  # launch runs: job files, worker errors, the stop request
STOP_FILE = "stop"  # in LAUNCH_DIR: the launcher asks every worker to stop after this step, with a checkpoint
WORKERS_JSON = "workers.json"  # in LAUNCH_DIR: which process runs which rank, for an outside supervisor
FLEET_EVENTS_JSONL = "fleet-events.jsonl"  # in LAUNCH_DIR: joins, re-plan decisions, boundaries, moves (fleet_events.py)
RELEASE_FILE = "release"  # in LAUNCH_DIR: lets workers held at a step (--hold, for tests) go on
JOB_FILE = re.compile(r"job-(\d+)\.json")  # in LAUNCH_DIR
MAX_METRICS_BYTES = 512 * 2**20
MAX_RUN_FILE_BYTES = 64 * 2**20  # run.json, placement.json, a job file (a 100k-VNode assignment is ~10 MB)
MAX_POINTER_BYTES = 4096
MAX_JSON_DEPTH = MAX_DEPTH  # the one JSON reader's bound (vgraph/base/jsonio.py)
MAX_STEP = 2**62  # the largest --steps (vgraph/base/options.py)


RUN_LOCK_ENV = "VGRAPH_RUN_LOCK_KEY"  # the key of the run lock `vgraph launch` holds, given to its workers
LOCK_FILE = ".vgraph-lock"  # the advisory lock of the process writing the run (`RunLock`); its presence marks a run
EVENTS_PREFIX = "events.out.tfevents."
_OWNED_NAMES = {RUN_JSON: "settings", NETWORK_YML: "network", TOKENIZER_JSON: "tokenizer", METRICS_JSONL: "metrics",
                METRICS_CSV: "metrics", PLACEMENT_JSON: "placement",
                MEASURED_FLEET: "measured fleet", LOSS_CURVE_PNG: "loss curve",
                LATEST: "checkpoint pointer", LOCK_FILE: "lock", LAUNCH_DIR: "job files, worker errors and stop request"}


def owned_by_run(name: str) -> str | None:
    """What a run keeps under the top-level entry `name` of its directory, or None when it is not the run's
    (a report written beside it, a user's notes)."""
    if name in _OWNED_NAMES:
        return _OWNED_NAMES[name]
    if name.startswith((CHECKPOINT_PREFIX, "." + CHECKPOINT_PREFIX)):
        return "checkpoint"
    if name.startswith(EVENTS_PREFIX):
        return "TensorBoard events"
    return None


def looks_like_run(directory: Path) -> bool:
    """Whether `directory` holds a run's marks (its lock, run.json, metrics.jsonl or `latest`)."""
    return any((directory / name).is_file() for name in (LOCK_FILE, RUN_JSON, METRICS_JSONL, LATEST))


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` is a checkpoint folder (in a run or copied out of one)."""
    return (directory / STATE_JSON).is_file() and (directory / MODEL_FILE).is_file()


def run_owner(path: Path) -> str | None:
    """Why `path` (resolved) lies inside something a run owns, or None: the rule `safeio.check_output` applies
    to every command's outputs (registered below), so `report -o RUN/step-3/model.safetensors`,
    `export-onnx --checkpoint CKPT -o CKPT/model.safetensors` or `-o RUN/launch/job-0.json` are refused."""
    for parent in path.parents:
        if is_checkpoint(parent):
            return f"lies inside the checkpoint {printable(str(parent), 200)}"
        if looks_like_run(parent):
            top = path.relative_to(parent).parts[0]
            what = owned_by_run(top)
            return (f"is part of the run {printable(str(parent), 200)} ({printable(top, 80)}: its {what})"
                    if what else None)
    return None


register_owner(run_owner)


class RunInUse(VGraphError):
    """Another process holds the run's lock."""


class RunLock:
    """One writer per run directory: an advisory lock (flock) on RUN/.vgraph-lock, which names its holder.

    Why: two `vgraph train --resume` on one run both exited 0 and left metrics.jsonl with 1,600 duplicated,
    out-of-order steps.  The lock is the kernel's (`fcntl.flock`), so a process killed by any signal
    releases it; the file keeps the holder's pid, host, command and start time, for the message a second
    writer gets.  Taking a lock whose file still names a holder means that holder died without releasing
    it (a stale lock: the kernel dropped its flock): on this host that is certain and the lock is taken
    over with a note; a holder on another host (a run directory on a shared file system, whose flock may
    not reach across machines) cannot be checked from here, so the run is refused, with the command that
    clears the lock once that process is known to be gone.

    Locks are counted per process (`acquire` of a run this process already holds returns the same lock),
    so one process may open its own run twice (a launcher and its in-process helpers); `held()` scopes
    every lock taken in a block.  A holder may share its lock with the processes it starts (`vgraph
    launch`'s workers): each lock has a random `key`, whose digest the file records; a process given the
    key (`RUN_LOCK_ENV`) proves with `shares` that the live holder is the one that started it, and anyone
    else (a second worker set on the same job) is refused as a second writer.
    """

    _held: dict[str, "RunLock"] = {}

    def __init__(self, run_dir: Path, fd: int, note: str | None, key: str = "") -> None:
        self.run_dir = run_dir
        self.fd: int | None = fd
        self.count = 1
        self.note = note  # what the lock said about an earlier holder (a stale lock taken over)
        self.key = key  # handed to the processes this holder starts (RUN_LOCK_ENV), never written

    @classmethod
    def of(cls, run_dir: Path) -> "RunLock | None":
        """The lock this process holds on `run_dir`, if any."""
        held = cls._held.get(os.path.realpath(run_dir))
        return held if held is not None and held.fd is not None else None

    @classmethod
    def shares(cls, run_dir: Path, key: str) -> bool:
        """Whether `run_dir` is locked now by a holder whose key is `key` (the process that started us)."""
        import fcntl
        import hashlib

        try:
            fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            holder = _holder(os.read(fd, 4096))
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                held = True  # somebody holds it: is it the process whose key we were given?
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                held = False
        finally:
            os.close(fd)
        digest = hashlib.sha256(key.encode()).hexdigest()
        return held and bool(key) and holder.get("key") == digest

    @classmethod
    def acquire(cls, run_dir: Path, command: str) -> "RunLock":
        import fcntl
        import socket

        held = cls._held.get(os.path.realpath(run_dir))
        if held is not None and held.fd is not None:
            held.count += 1
            return held
        path = Path(run_dir) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o666)
        except OSError as exc:
            raise VGraphError(f"{printable(str(path))}: cannot open the run's lock: {exc.strerror}") from None
        try:
            previous = _holder(os.read(fd, 4096))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunInUse(f"{printable(str(run_dir))} is in use by {_describe(previous)}: one process writes "
                               f"a run at a time; wait for it to end or stop it (Ctrl-C saves a checkpoint)"
                               ) from None
            host = socket.gethostname()
            note = None
            if previous:
                if previous.get("host") != host:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    raise RunInUse(f"{printable(str(run_dir))} was locked by {_describe(previous)}, on another "
                                   f"machine, which this one cannot check; if that process is gone, remove "
                                   f"{printable(str(path))} and run again")
                note = (f"note: {printable(str(run_dir))} was left locked by {_describe(previous)}, which is no "
                        f"longer running (killed?); the lock is taken over")
            key = secrets.token_hex(16)
            me = {"pid": os.getpid(), "host": host, "command": command,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "key": hashlib.sha256(key.encode()).hexdigest()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(Path(run_dir), fd, note, key)
        cls._held[os.path.realpath(run_dir)] = lock
        return lock

    def release(self) -> None:
        """Give the lock back (the last of this process's holds): the file is emptied, then unlocked."""
        if self.fd is None:
            return
        self.count -= 1
        if self.count > 0:
            return
        import fcntl

        fd, self.fd = self.fd, None
        self._held.pop(os.path.realpath(self.run_dir), None)
        try:
            os.ftruncate(fd, 0)  # no holder named: the next writer sees a released lock, not a stale one
        except OSError:
            pass
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @classmethod
    @contextmanager
    def held(cls) -> Iterator[None]:
        """Release, at the end of the block, every run lock this process took inside it (however the
        block ends): `vgraph train` and `vgraph launch` open their run deep inside and hold it until they
        return."""
        before = set(cls._held)
        try:
            yield
        finally:
            for key in [k for k in cls._held if k not in before]:
                lock = cls._held.get(key)
                while lock is not None and lock.fd is not None:
                    lock.release()


def _holder(raw: bytes) -> dict[str, Any]:
    """The holder a lock file names ({} for an empty or damaged one)."""
    try:
        doc = loads(raw, LOCK_FILE)
    except VGraphError:
        return {}
    return doc if isinstance(doc, dict) and "pid" in doc else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process"
    return (f"{printable(str(holder.get('command', 'a vgraph command')), 40)} (pid "
            f"{printable(str(holder.get('pid')), 20)} on host {printable(str(holder.get('host')), 80)}, since "
            f"{printable(str(holder.get('since')), 40)})")


def refuse_foreign(run_dir: Path) -> None:
    """A VGraphError when `run_dir` exists, is not a run, and holds entries a run would write (run.json,
    metrics.jsonl, step-*, ...): a run replaces only files it can prove it wrote, and an existing directory
    proves it is a run by its lock file (every run writes it first), or, for runs of a vgraph before the
    lock, by a run.json of theirs.  Anything else in the directory is never touched."""
    if not run_dir.is_dir() or (run_dir / LOCK_FILE).is_file() or _legacy_run(run_dir):
        return
    try:
        clashes = sorted(n for n in os.listdir(run_dir) if owned_by_run(n))
    except OSError as exc:
        raise VGraphError(f"{printable(str(run_dir))}: cannot list the run directory: {exc.strerror}") from None
    if clashes:
        shown = ", ".join(printable(n, 60) for n in clashes[:4]) + (f" and {len(clashes) - 4} more"
                                                                  if len(clashes) > 4 else "")
        raise VGraphError(f"{printable(str(run_dir))}: is not a vgraph run but holds {shown}, which a run would "
                          f"replace; a run replaces only files it wrote: choose a new or empty directory")


def _legacy_run(run_dir: Path) -> bool:
    """run.json of a run written before the lock file: an object with the settings vgraph records."""
    reader = RunReader(run_dir)
    run = reader.json(RUN_JSON, optional=True)
    return isinstance(run, dict) and {"network", "seed", "batch", "steps"} <= set(run)


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint taken after `step` (sorted by name = sorted by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def error_name(rank: int) -> str:
    """In LAUNCH_DIR: a worker's user-facing error (the launcher prints it once, not a traceback per rank)."""
    return f"error-{rank}.txt"


def held_name(pnode: str) -> str:
    """In LAUNCH_DIR: the marker a worker held at a step (--hold) leaves until RELEASE_FILE appears."""
    return f"held-{pnode}"


def job_name(attempt: int) -> str:
    """The job file of a launch's attempt `attempt` (0 first, one more per restart)."""
    return f"job-{attempt}.json"


class Unreadable(Exception):
    """Why one of the run's files is not read (becomes a note)."""


@dataclass
class RunReader:
    """Reads one run directory's files; what cannot be read becomes a note, never an exception.

    The rules, for every reader of a run (a run directory may come from anyone, and `vgraph report`'s page
    is made to be shared):

    * only regular files inside the run: each is opened relative to the run directory, component by
      component, with O_NOFOLLOW, so a symlink (`latest`, `run.json`, a `launch` folder pointing
      elsewhere) is refused, never followed out of the run; a FIFO or device is refused too;
    * never a path a run file names: the reader returns values, and opens only the fixed names above;
    * bounded: each file in size, JSON in nesting depth (`MAX_JSON_DEPTH`), and the work linear in
      the bytes read;
    * numbers through the one checked reader (vgraph/base/numbers.py): a metrics value that is not a
      finite, normal number of float range (a subnormal loss, an integer past 1e308, a list where a
      loss belongs) is left out and counted in a note.

    `read` lists every file read, so that a command writing next to them can refuse to write over one.
    """

    path: Path
    notes: list[str] = field(default_factory=list)
    read: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    # -- the one way a run's file is opened -------------------------------------------------------
    def raw(self, name: str | Path, what: str, *, limit: int = MAX_RUN_FILE_BYTES,
            optional: bool = False) -> bytes | None:
        """The bytes of the run's file `name` (relative), or None: missing (noted unless `optional`),
        or refused (noted: a symlink, not a regular file, too large, unreadable)."""
        rel = Path(name)
        try:
            fd = self._open(rel)
        except FileNotFoundError:
            if not optional:
                self.notes.append(f"{rel.as_posix()} is missing")
            return None
        except Unreadable as why:
            self.notes.append(f"{printable(rel.as_posix(), 200)}: {why}")
            return None
        try:
            data = read_open_file(fd, printable(rel.as_posix(), 200), what=what, limit=limit)
        except VGraphError as exc:
            self.notes.append(str(exc.diagnostics[0]))
            return None
        self.read.append(self.path / rel)
        return data

    def _open(self, rel: Path) -> int:
        """A read-only descriptor of `rel` inside the run, reached through no symlink (O_NOFOLLOW on
        every component, each opened relative to its parent's descriptor: nothing can swap a component
        for a link between a check and the open)."""
        parts = rel.parts
        if not parts or rel.is_absolute() or any(p in ("..", ".") for p in parts):
            raise Unreadable("not a name inside the run")
        nofollow = getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise Unreadable(f"the run directory cannot be read: {exc.strerror}") from None
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = os.O_RDONLY | nofollow | (getattr(os, "O_NONBLOCK", 0) if last
                                                  else getattr(os, "O_DIRECTORY", 0))
                try:
                    child = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    raise
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", -1)):
                        if os.path.islink(os.path.join(self.path, *parts[:i + 1])):
                            raise Unreadable("is a symbolic link; a run's files are read from the run itself, "
                                             "never through a link") from None
                    raise Unreadable(f"cannot be read: {exc.strerror}") from None
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def names(self, folder: str) -> list[str]:
        """The names of the regular files (and symlinks, which a read then refuses with a note) directly in
        the run's `folder`, itself reached through no symlink."""
        try:
            fd = self._open(Path(folder)) if folder else os.open(self.path, os.O_RDONLY)
        except (FileNotFoundError, Unreadable):
            return []
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                return []
            with os.scandir(fd) as entries:
                return sorted(e.name for e in entries if e.is_file(follow_symlinks=False) or e.is_symlink())
        except OSError:
            return []
        finally:
            os.close(fd)

    # -- what the files hold ----------------------------------------------------------------------
    def json(self, name: str | Path, optional: bool = False) -> Any:
        """The JSON value of the run's file `name` (relative to the run), or None with a note; numbers in
        it that are not finite normal floats (or ints of float range) are None (and noted)."""
        raw = self.raw(name, "JSON file", optional=optional)
        if raw is None:
            return None
        shown = printable(Path(name).as_posix(), 200)
        refused: list[str] = []
        try:
            value, left_out = clean_json(loads(raw, shown, max_depth=MAX_JSON_DEPTH, limit=len(raw),
                                               on_bad_number=lambda literal: refused.append(literal)))
        except (VGraphError, TooDeep) as exc:
            why = str(exc.diagnostics[0]) if isinstance(exc, VGraphError) else f"{shown}: {exc}"
            self.notes.append(f"{why} (not valid JSON; a run may be rewriting it)")
            return None
        left_out += len(refused)
        if left_out:
            self.notes.append(f"{shown}: {left_out} number(s) that are not finite, normal numbers of float "
                              f"range were left out")
        return value

    def text(self, name: str, what: str, limit: int | None = None) -> str | None:
        """The run's text file `name`, or None (missing: silently; unreadable: with a note)."""
        raw = self.raw(name, what, limit=limit or MAX_RUN_FILE_BYTES, optional=True)
        if raw is None:
            return None
        try:
            return decode_text(raw, printable(name, 200))
        except VGraphError as exc:
            self.notes.append(str(exc.diagnostics[0]))
            return None

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's rows in step order; lines that are not rows (a torn last line of a running or
        killed run, damage) are skipped and counted.  A step written twice keeps its last row (a resume).
        Each row holds only numbers (checked) and `pnodes` (PNode -> figure -> number)."""
        raw = self.raw(METRICS_JSONL, "metrics file", limit=MAX_METRICS_BYTES, optional=True)
        if raw is None:
            if not any(n.startswith(METRICS_JSONL) for n in self.notes):
                self.notes.append(f"{METRICS_JSONL} is missing: no step was logged yet")
            return []
        by_step: dict[int, dict[str, Any]] = {}
        bad = dropped = 0
        for number, line in jsonl_lines(raw.decode("utf-8", errors="replace")):
            refused: list[str] = []
            try:
                row, left_out = metrics_row(loads(line, METRICS_JSONL, line=number, max_depth=MAX_JSON_DEPTH,
                                                  allow_nonfinite=True, on_bad_number=refused.append))
            except VGraphError:
                row, left_out = None, 0
            if row is None:
                bad += 1
                continue
            dropped += left_out + len(refused)
            by_step[row["step"]] = row
        if bad:
            self.notes.append(f"{METRICS_JSONL}: {bad} line(s) that are not metrics rows were skipped (a torn "
                              f"last line is normal while a run is being written)")
        if dropped:
            self.notes.append(f"{METRICS_JSONL}: {dropped} value(s) that are not finite, normal numbers were left "
                              f"out")
        return [by_step[s] for s in sorted(by_step)]

    def run_info(self) -> dict[str, Any]:
        """run.json's settings ({} with a note when it is missing, damaged or not an object); a field of
        the wrong type (`passes` a list, `steps` true) is left out with a note."""
        noted = len(self.notes)
        run = self.json(RUN_JSON)
        if not isinstance(run, dict):
            if len(self.notes) == noted:  # read, but `null`, a list, a string
                self.notes.append(f"{RUN_JSON} does not hold a JSON object; settings not shown")
            return {}
        return self._typed(run, RUN_FIELDS, RUN_JSON)

    def placement(self) -> dict[str, Any] | None:
        """placement.json (launch runs) with its fields checked, or None."""
        doc = self.json(PLACEMENT_JSON, optional=True)
        return self._typed(doc, PLACEMENT_FIELDS, PLACEMENT_JSON) if isinstance(doc, dict) else None

    def latest_job(self) -> dict[str, Any] | None:
        """The newest launch/job-N.json as a dict with its fields checked (launch runs), else None."""
        jobs = sorted((int(m.group(1)), name) for name in self.names(LAUNCH_DIR)
                      if (m := JOB_FILE.fullmatch(name)) and len(m.group(1)) <= 9)
        if not jobs:
            return None
        name = f"{LAUNCH_DIR}/{jobs[-1][1]}"
        job = self.json(name, optional=True)
        return self._typed(job, JOB_FIELDS, name) if isinstance(job, dict) else None

    def _typed(self, doc: dict[str, Any], fields: dict[str, Any], name: str) -> dict[str, Any]:
        """`doc` without the fields whose value is not of their type in `fields` (noted)."""
        out = dict(doc)
        for key, check in fields.items():
            if key in out and not check(out[key]):
                self.notes.append(f"{name}: {key!r} is not {check.__doc__}; left out")
                del out[key]
        return out

    def latest_checkpoint_name(self) -> str | None:
        """What the `latest` pointer names (not checked further: loading a checkpoint is the backend's)."""
        text = self.text(LATEST, "checkpoint pointer", limit=MAX_POINTER_BYTES)
        return text.strip()[:200] if text is not None else None


def _text(value: Any) -> bool:
    """text"""
    return isinstance(value, str)


def _text_or_none(value: Any) -> bool:
    """text or null"""
    return value is None or isinstance(value, str)


def _flag(value: Any) -> bool:
    """true or false"""
    return isinstance(value, bool)


def _count(value: Any) -> bool:
    """a whole number from 0"""
    return number_or_none(value, integer=True, low=0) is not None


def _object(value: Any) -> bool:
    """an object"""
    return isinstance(value, dict)


def _texts(value: Any) -> bool:
    """a list of text"""
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _objects(value: Any) -> bool:
    """an object of objects"""
    return isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())


def _names(value: Any) -> bool:
    """an object of names (VNode -> PNode)"""
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


# What the readers of a run rely on, by file: a field of another type is left out (and noted).
RUN_FIELDS = {"network": _text, "passes": _text_or_none, "fuse": _flag, "precision": _object, "steps": _count,
              "memory_estimate": _object, "semantic_changes": _texts, "plugins": _texts, "launch": _object,
              "device": _text}
PLACEMENT_FIELDS = {"network": _text, "pnodes": _objects, "assignment": _names}
JOB_FIELDS = {"pipeline_before": _text, "pipeline_after": _text, "target": _text, "assignment": _names,
              "ranks": _texts, "plan_choices": _object}


class TooDeep(ValueError):
    """JSON nested deeper than MAX_JSON_DEPTH."""


def clean_json(value: Any, depth: int = 0) -> tuple[Any, int]:
    """(`value` with every number that the checked reader refuses replaced by None, how many were), or
    TooDeep.  A run's JSON is data for a page and for code that does arithmetic on it: an integer past
    1e308 (OverflowError in float()), NaN or a subnormal never reaches either."""
    if depth > MAX_JSON_DEPTH:
        raise TooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        out, bad = {}, 0
        for k, v in value.items():
            out[k], n = clean_json(v, depth + 1)
            bad += n
        return out, bad
    if isinstance(value, list):
        items, bad = [], 0
        for v in value:
            item, n = clean_json(v, depth + 1)
            items.append(item)
            bad += n
        return items, bad
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not is_number(value):
        return None, 1
    return value, 0


def _per_pnode_numbers(item: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], int]:
    """({pnode: {name: number}}, how many values were left out) of a row's per-PNode mapping."""
    pnodes, dropped = {}, 0
    for pnode, figures in item.items():
        if not isinstance(figures, dict):
            dropped += 1
            continue
        kept = {k: v for k, v in figures.items() if is_number(v)}
        dropped += len(figures) - len(kept)
        pnodes[pnode] = kept
    return pnodes, dropped


def metrics_row(value: Any) -> tuple[dict[str, Any] | None, int]:
    """(One metrics.jsonl row with only checked numbers, how many values were left out), or (None, 0)
    when it is not a row (not an object, or no step that is an integer from 0 to MAX_STEP)."""
    if not isinstance(value, dict):
        return None, 0
    step = number_or_none(value.get("step"), integer=True, low=0, high=MAX_STEP)
    if step is None:
        return None, 0
    row: dict[str, Any] = {"step": step}
    dropped = 0
    for key, item in value.items():
        if key == "step":
            continue
        if key == "pnodes" and isinstance(item, dict):
            row["pnodes"], left_out = _per_pnode_numbers(item)
            dropped += left_out
        elif key == "drift" and isinstance(item, dict) and isinstance(item.get("pnodes"), dict):
            # a drift episode's start (vgraph/placement/drift.py): {step, pnodes: {pnode: {measured_s, ...}}}
            pnodes, left_out = _per_pnode_numbers(item["pnodes"])
            row["drift"] = {"pnodes": pnodes, **({"step": item["step"]} if is_number(item.get("step")) else {})}
            dropped += left_out + sum(1 for k in item if k not in ("step", "pnodes"))
        elif is_number(item):
            row[key] = item
        else:
            dropped += 1
    return row, dropped
