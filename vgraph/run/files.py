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
    RUN/loss_curve.png      the curve, redrawn at each validation and at the end
    RUN/latest              the newest complete checkpoint's folder name
    RUN/step-NNNNNNNN/      a checkpoint: model.safetensors, optimizer.*, state.*
    RUN/launch/job-N.json   launch runs: what attempt N's workers were told
    RUN/launch/tokens.safetensors, RUN/launch/stop
    RUN/events.out.tfevents.*   TensorBoard
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.numbers import is_number, number_or_none
from vgraph.base.safeio import decode_text, read_open_file

__all__ = ["RUN_JSON", "NETWORK_YML", "TOKENIZER_JSON", "METRICS_JSONL", "METRICS_CSV", "PLACEMENT_JSON",
           "LOSS_CURVE_PNG", "LATEST", "CHECKPOINT_PREFIX", "MODEL_FILE", "STATE_JSON", "LAUNCH_DIR", "STOP_FILE",
           "TOKENS_FILE", "JOB_FILE", "checkpoint_name", "job_name", "RunReader", "MAX_METRICS_BYTES",
           "clean_json", "metrics_row"]

RUN_JSON = "run.json"
NETWORK_YML = "network.yml"
TOKENIZER_JSON = "tokenizer.json"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
PLACEMENT_JSON = "placement.json"
LOSS_CURVE_PNG = "loss_curve.png"
LATEST = "latest"  # a pointer file: the newest complete checkpoint's folder name
CHECKPOINT_PREFIX = "step-"
MODEL_FILE = "model.safetensors"
STATE_JSON = "state.json"
LAUNCH_DIR = "launch"  # launch runs: job files, token streams, the stop request
STOP_FILE = "stop"  # in LAUNCH_DIR: the launcher asks every worker to stop after this step, with a checkpoint
TOKENS_FILE = "tokens.safetensors"  # in LAUNCH_DIR: the token streams every worker reads
JOB_FILE = re.compile(r"job-(\d+)\.json")  # in LAUNCH_DIR
MAX_METRICS_BYTES = 512 * 2**20
MAX_RUN_FILE_BYTES = 64 * 2**20  # run.json, placement.json, a job file (a 100k-VNode assignment is ~10 MB)
MAX_POINTER_BYTES = 4096
MAX_JSON_DEPTH = 64  # vgraph writes at most 4 levels; deeper is damage or hostility (RecursionError)
MAX_STEP = 2**62  # the largest --steps (vgraph/base/options.py)


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint taken after `step` (sorted by name = sorted by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


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
        try:
            value, left_out = clean_json(json.loads(decode_text(raw, shown)))
        except VGraphError as exc:
            self.notes.append(str(exc.diagnostics[0]))
            return None
        except (ValueError, RecursionError) as exc:
            why = (f"nested deeper than {MAX_JSON_DEPTH} levels" if isinstance(exc, (RecursionError, TooDeep))
                   else printable(str(exc), 200))
            self.notes.append(f"{shown} is not valid JSON ({why}); a run may be rewriting it")
            return None
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
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row, left_out = metrics_row(json.loads(line))
            except (ValueError, RecursionError):
                row, left_out = None, 0
            if row is None:
                bad += 1
                continue
            dropped += left_out
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
            pnodes = {}
            for pnode, figures in item.items():
                if not isinstance(figures, dict):
                    dropped += 1
                    continue
                kept = {k: v for k, v in figures.items() if is_number(v)}
                dropped += len(figures) - len(kept)
                pnodes[pnode] = kept
            row["pnodes"] = pnodes
        elif is_number(item):
            row[key] = item
        else:
            dropped += 1
    return row, dropped
