"""Each PNode's own figures of a `vgraph launch` step: wall time, idle (bubble) time, bytes sent, peak memory.

Why: a partitioned run is only as fast as its slowest PNode, and the
placement predicted each PNode's time and traffic (placement.json); these
measurements are what to compare the prediction with, per PNode and per
step (`vgraph report`, TensorBoard's pnode/<id>/... curves).

Every rank measures itself (`PNodeFigures`); at each sync point rank 0
gathers the entries of the steps since the previous one (in the same gather
as the network's metrics) and `attach` puts them into the metrics rows as
`"pnodes": {pnode: {"step_s", "idle_s", "bytes_sent", "tensor_peak_bytes", "peak_rss_bytes"}}`.

* step_s: the step's wall time on this rank, from drawing the batch to the
  tied-weight sync after the update;
* idle_s: the seconds of it spent blocked on peers: receives waiting for a
  neighbour's activations or gradients and sends waiting to complete (the
  pipeline's bubble), the wait for the replicas' gradient all-reduce after
  the backward (grad_sync.py), and the step's loss reduction
  (waiting for the slowest rank).  A peer's work between steps shows here
  too: while rank 0 writes logs, validates or checkpoints after step n, the
  others wait for it during step n + 1;
* bytes_sent: what this rank sent for the step (the step's share of
  `boundary_bytes`, which is the sum over ranks), to compare with
  placement.json's `bytes_sent_per_step` for its PNode (the same basis:
  bytes sent, not bytes in and out);
* tensor_peak_bytes, peak_rss_bytes: the rank's tensor peak (what
  placement.json's `memory_bytes` predicts) and its process's peak resident
  set, measured as `vgraph train` measures them (../peak_memory.py).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import atomic_write, read_json, same_file
from vgraph.cost.fleet import Fleet, loads_fleet
from vgraph.placement.drift import (DriftWatch, busy_seconds, fleet_file_text, measured_fleet,
                                    predicted_busy)
from vgraph.run.files import MEASURED_FLEET, PLACEMENT_JSON

from ..job import Job

from ...training.peak_memory import TensorPeak, memory_figures

__all__ = ["PNodeFigures", "attach", "RunDrift", "run_drift"]


class PNodeFigures:
    """This rank's per-step figures since rank 0 last gathered them."""

    def __init__(self, device: torch.device, peer_wait_s: Callable[[], float],
                 tracked: Callable[[], Iterable[Any]] = tuple) -> None:
        self.device = device
        self.peer_wait_s = peer_wait_s  # running total of the transports' blocked seconds
        self.tensor_peak = TensorPeak(device, tracked)  # tracked: this rank's modules and optimizers
        self.entries: list[tuple[int, dict[str, Any]]] = []
        self._start = 0.0
        self._waited = 0.0
        self._collective = 0.0

    def begin_step(self) -> None:
        self.tensor_peak.begin_step()
        self._start = time.perf_counter()
        self._waited = self.peer_wait_s()
        self._collective = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A collective every rank joins: the time in it is time spent waiting for the others."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._collective += time.perf_counter() - start

    def end_step(self, step: int, bytes_sent: float) -> None:
        self.tensor_peak.end_step()
        idle = self.peer_wait_s() - self._waited + self._collective
        self.entries.append((step, {"step_s": time.perf_counter() - self._start, "idle_s": idle,
                                    "bytes_sent": int(bytes_sent)}))

    def take(self) -> list[tuple[int, dict[str, Any]]]:
        """The entries since the last call (the last one with the memory peaks so far), for rank 0's gather."""
        taken, self.entries = self.entries, []
        if taken:
            taken[-1][1].update(memory_figures(self.tensor_peak))
        return taken


def attach(rows: Sequence[dict[str, Any]], gathered: Sequence[Sequence[tuple[int, dict[str, Any]]]],
           pnodes: Sequence[str]) -> None:
    """Put every rank's entries (rank r is PNode `pnodes[r]`) into the metrics rows of their steps."""
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for rank, entries in enumerate(gathered):
        for step, figures in entries or ():
            by_step.setdefault(int(step), {})[pnodes[rank]] = figures
    for row in rows:
        if row.get("step") in by_step:
            row["pnodes"] = by_step[row["step"]]


class RunDrift:
    """Rank 0: the gathered figures fed to a `DriftWatch` (vgraph/placement/drift.py), busy = step - idle per
    PNode.  When a drift episode starts, its row gets `"drift": {step, pnodes: {pnode: {measured_s,
    predicted_s, ratio}}}`, the fleet rescaled to the window's measured busy times is written to the run
    directory (fleet.measured.yml, atomically, never over the fleet file given), and one line says it.
    The re-plan from it is the launcher's to decide (launcher/boundaries.py's `watch_drift` reads the row and the file)."""

    def __init__(self, watch: DriftWatch, fleet: Fleet, out: Path, fleet_file: str, relaunch: str,
                 say: Callable[[str], None]) -> None:
        self.watch, self.fleet, self.out, self.fleet_file = watch, fleet, out, fleet_file
        self.relaunch, self.say = relaunch, say

    def rows(self, rows: Sequence[dict[str, Any]]) -> None:
        rewrite = None
        for row in rows:
            figures = row.get("pnodes")
            if not isinstance(figures, dict) or not isinstance(row.get("step"), int):
                continue
            busy = {}
            for pid, entry in figures.items():
                seconds, why = busy_seconds(entry)
                if seconds is None:
                    self.watch.skip(row["step"], pid, str(why))
                else:
                    busy[pid] = seconds
            drift = self.watch.feed(row["step"], busy)
            if drift is not None:
                row["drift"] = drift.to_json()
                self.say(f"drift at step {drift.step}: {drift.describe()} busy against the plan; "
                         f"{self._write(drift.step)}")
            elif self.watch.drifting:  # the episode goes on: its figure steadies, rewritten (said once)
                rewrite = row["step"]
        if rewrite is not None:  # once per gather, not per row
            self._write(rewrite)

    def _write(self, step: int) -> str:
        """Write the measured fleet; what to do next (or why it was not written)."""
        result = measured_fleet(self.fleet, self.watch.predicted, self.watch.measured())
        skipped = "".join(f"; {pid} kept as given: {why}" for pid, why in sorted(result.skipped.items()))
        comment = (f"fleet {self.fleet.name!r} rescaled to the busy times measured up to step {step} "
                   f"(vgraph/placement/drift.py)")
        path = self.out
        # Not check_output: the run owns this name (no other command writes there), and this is the run.
        if self.fleet_file and same_file(path, Path(self.fleet_file)):
            return f"the measured fleet was not written: {path} is the fleet file this run read{skipped}"
        try:
            atomic_write(path, fleet_file_text(result.fleet, comment))
        except VGraphError as exc:
            return f"the measured fleet was not written: {exc}{skipped}"
        return (f"measured figures written to {path}{skipped}; to plan on them: {self.relaunch} --fleet {path} "
                f"(a run that takes joins, --nnodes MIN:MAX, re-plans on them itself when that pays)")


def run_drift(job: Job, run_dir: Path, say: Callable[[str], None]) -> RunDrift | None:
    """Rank 0's drift report for this job, or None: disabled (--drift-steps 0), a job without its fleet (an older
    launcher's), or a plan without per-PNode predictions (said once: the run goes on without it)."""
    if not job.drift_steps or not job.fleet_yaml:
        return None
    try:
        fleet = loads_fleet(job.fleet_yaml, "<the job's fleet>")
        predicted = predicted_busy(read_json(run_dir / PLACEMENT_JSON, what=PLACEMENT_JSON))
    except VGraphError as exc:
        say(f"note: no drift report in this run: {exc}")
        return None
    watch = DriftWatch(predicted, steps=job.drift_steps)
    relaunch = f"vgraph launch {job.network_file} (the same options and a new --out)"
    return RunDrift(watch, fleet, run_dir / MEASURED_FLEET, job.fleet_file, relaunch, say)
