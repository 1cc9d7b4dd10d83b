"""Rank 0's view of the fleet over time: the machines on every metrics row, the re-plans in TensorBoard and
the progress line.

Why here, and without a message: the attempt's placement is in rank 0's job (`Job.machines`: PNode ->
machine), so the machines that train a step are known without a collective; the re-plans are the
launcher's (RUN/launch/fleet-events.jsonl, one writer: elastic.py), and rank 0, on machine 0 beside that
file, reads it through the one reader (vgraph/run/fleet_events.py) at a sync point only when the file
changed (a stat; the file is a few rows).  A re-plan's measured seconds are written by the launcher after
this attempt's first step, so they reach TensorBoard a sync point or so later.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from vgraph.run.fleet_events import FLEET_EVENTS_PATH, FleetHistory, read_fleet
from vgraph.run.files import RunReader

from ..job import Job

__all__ = ["FleetWatch", "machine_count"]


def machine_count(job: Job) -> int | None:
    """The machines that run this attempt's ranks (None: a job of an older vgraph does not say)."""
    if not job.machines:
        return None
    return len({job.machines.get(p, 0) for p in job.ranks})


class FleetWatch:
    """Rank 0: `rows` stamps the machines on the rows of a sync point and re-reads the events when they
    changed; `note` is the latest re-plan, briefly, for the progress line."""

    def __init__(self, run_dir: Path, machines: int | None, steps: int, tensorboard: Any = None) -> None:
        self.run_dir, self.machines, self.steps, self.tensorboard = Path(run_dir), machines, steps, tensorboard
        self.history = FleetHistory()
        self._seen: tuple[int, int] | None = None
        self.refresh()

    def rows(self, rows: Sequence[dict[str, Any]]) -> None:
        if self.machines is not None:
            for row in rows:
                row["machines"] = self.machines
        self.refresh()

    def refresh(self) -> None:
        """Read the fleet events again when the file's size or time changed (nothing when it is missing)."""
        try:
            st = os.stat(self.run_dir / FLEET_EVENTS_PATH)
        except OSError:
            return
        if (st.st_size, st.st_mtime_ns) == self._seen:
            return
        self._seen = (st.st_size, st.st_mtime_ns)
        self.history = read_fleet(RunReader(self.run_dir), self.steps)
        if self.tensorboard is not None:
            self.tensorboard.replans(self.history.replans)

    @property
    def note(self) -> str:
        latest = self.history.latest
        return latest.brief() if latest is not None else ""
