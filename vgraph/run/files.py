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

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import read_input

__all__ = ["RUN_JSON", "NETWORK_YML", "TOKENIZER_JSON", "METRICS_JSONL", "METRICS_CSV", "PLACEMENT_JSON",
           "LOSS_CURVE_PNG", "LATEST", "CHECKPOINT_PREFIX", "MODEL_FILE", "STATE_JSON", "LAUNCH_DIR", "STOP_FILE",
           "TOKENS_FILE", "JOB_FILE", "checkpoint_name", "job_name", "RunReader", "MAX_METRICS_BYTES"]

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
MAX_POINTER_BYTES = 4096


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint taken after `step` (sorted by name = sorted by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def job_name(attempt: int) -> str:
    """The job file of a launch's attempt `attempt` (0 first, one more per restart)."""
    return f"job-{attempt}.json"


@dataclass
class RunReader:
    """Reads one run directory's files, each bounded in size; what cannot be read becomes a note.

    `read` lists every file read, so that a command writing next to them can refuse to write over one.
    """

    path: Path
    notes: list[str] = field(default_factory=list)
    read: list[Path] = field(default_factory=list)

    def json(self, name: str | Path, optional: bool = False) -> Any:
        """The JSON value of the run's file `name` (relative to the run), or None with a note."""
        path = self.path / name
        if not path.is_file():
            if not optional:
                self.notes.append(f"{Path(name).as_posix()} is missing")
            return None
        try:
            text = read_input(path, what="JSON file")
            self.read.append(path)
            return json.loads(text)
        except VGraphError as exc:
            self.notes.append(str(exc.diagnostics[0]))
        except ValueError as exc:
            self.notes.append(f"{path.name} is not valid JSON ({exc}); a run may be rewriting it")
        return None

    def text(self, name: str, what: str, limit: int | None = None) -> str | None:
        """The run's text file `name`, or None (missing: silently; unreadable: with a note)."""
        path = self.path / name
        if not path.is_file():
            return None
        try:
            text = str(read_input(path, what=what, **({"limit": limit} if limit else {})))
        except VGraphError as exc:
            self.notes.append(str(exc.diagnostics[0]))
            return None
        self.read.append(path)
        return text

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's rows in step order; lines that are not rows (a torn last line of a running or
        killed run, damage) are skipped and counted.  A step written twice keeps its last row (a resume)."""
        path = self.path / METRICS_JSONL
        if not path.is_file():
            self.notes.append(f"{METRICS_JSONL} is missing: no step was logged yet")
            return []
        try:
            raw = read_input(path, what="metrics file", limit=MAX_METRICS_BYTES, binary=True)
        except VGraphError as exc:
            self.notes.append(str(exc.diagnostics[0]))
            return []
        self.read.append(path)
        by_step: dict[int, dict[str, Any]] = {}
        bad = 0
        for line in bytes(raw).decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                bad += 1
                continue
            by_step[step] = row
        if bad:
            self.notes.append(f"{METRICS_JSONL}: {bad} line(s) that are not metrics rows were skipped (a torn "
                              f"last line is normal while a run is being written)")
        return [by_step[s] for s in sorted(by_step)]

    def latest_job(self) -> dict[str, Any] | None:
        """The newest launch/job-N.json as a dict (launch runs), else None."""
        launch = self.path / LAUNCH_DIR
        if not launch.is_dir():
            return None
        jobs = sorted((int(m.group(1)), p) for p in launch.iterdir()
                      if (m := JOB_FILE.fullmatch(p.name)) and p.is_file())
        if not jobs:
            return None
        job = self.json(jobs[-1][1].relative_to(self.path), optional=True)
        return job if isinstance(job, dict) else None

    def latest_checkpoint_name(self) -> str | None:
        """What the `latest` pointer names (not checked further: loading a checkpoint is the backend's)."""
        text = self.text(LATEST, "checkpoint pointer", limit=MAX_POINTER_BYTES)
        return text.strip()[:200] if text is not None else None
