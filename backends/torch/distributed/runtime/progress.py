"""The progress of a partitioned run: a rank-0 bar like `vgraph train`'s (step, loss, tokens/s, ETA).

Why a module of its own: the figures exist on the worker of rank 0, but under
`vgraph launch` its output reaches the terminal only as lines the launcher
relays (prefixed `[pnode]`), where a bar redrawn in place would arrive as one
long line at the end.  So the three ways a worker runs show progress
differently, with one format between them:

* under `vgraph launch` with a bar (`VGRAPH_PROGRESS=events`): rank 0 prints
  one event line per sync point, `EVENT_PREFIX` + JSON; the launcher's relay
  takes it out of the output (`LaunchBar.take`) and draws the bar, writing
  every other worker line above it;
* under torchrun or srun (no variable): rank 0 draws the bar itself on
  stderr, as `vgraph train` does;
* `VGRAPH_PROGRESS=lines` (a launch whose lines go to a callback, e.g. a
  library caller's log): a status line every 2 seconds, as before.

Both bars are `metrics_log.progress_bar`: tqdm on a terminal, a line every 10
steps when stderr is captured (a log file, CI), nothing under --quiet.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Mapping

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.jsonio import loads

from ...training.metrics_log import progress_bar

__all__ = ["PROGRESS_ENV", "EVENT_PREFIX", "RankZeroProgress", "LaunchBar", "progress_mode"]

PROGRESS_ENV = "VGRAPH_PROGRESS"
EVENT_PREFIX = "@@vgraph-progress@@ "  # printable (a line that is no event is shown as it is) and no worker line starts so
MODES = ("events", "bar", "lines")
MAX_NOTE = 120  # the latest re-plan on the progress line: one short clause


def progress_mode(env: Mapping[str, str], launcher: str) -> str:
    """How rank 0 shows progress (see the module docstring)."""
    mode = env.get(PROGRESS_ENV)
    if mode in MODES:
        return mode
    return "lines" if launcher == "vgraph" else "bar"


def _postfix(event: Mapping[str, Any]) -> dict[str, str]:
    out = {"loss": f"{event['loss']:.4f}", "tok_s": f"{event['tok_s']:,.0f}", "lr": f"{event['lr']:.2e}"}
    if event.get("val") is not None:
        out["val"] = f"{event['val']:.4f}"
    out.update(_fleet(event))
    return out


def _fleet(event: Mapping[str, Any]) -> dict[str, str]:
    """The machines of the step and the latest re-plan (fleet_watch.py), when the run says them."""
    out = {}
    machines = event.get("machines")
    if isinstance(machines, int) and not isinstance(machines, bool) and 0 < machines < 2**31:
        out["machines"] = str(machines)
    note = event.get("fleet")
    if isinstance(note, str) and note:
        out["fleet"] = printable(note, MAX_NOTE)
    return out


class RankZeroProgress:
    """Rank 0's side: `report` at every sync point, `close` at the end."""

    def __init__(self, mode: str, total: int, start: int, name: str, say: Callable[[str], None]) -> None:
        self.mode, self.total, self.start, self.name, self.say = mode, total, start, name, say
        self.bar = progress_bar(total, start, name, True) if mode == "bar" else None
        self._last_print = time.perf_counter()
        if mode == "events":  # the launcher starts its bar (and its clock) now, before the first step
            print(EVENT_PREFIX + json.dumps({"step": start, "steps": total, "start": start, "name": name}), flush=True)

    def report(self, step: int, row: Mapping[str, Any], val_loss: float | None, fleet: str = "") -> None:
        """`fleet`: the latest re-plan, briefly (fleet_watch.FleetWatch.note); the row's `machines` is shown."""
        event = {"step": step, "steps": self.total, "start": self.start, "name": self.name,
                 "loss": row["loss"], "tok_s": row["tokens_per_s"], "lr": row["lr"], "val": val_loss,
                 "machines": row.get("machines"), "fleet": fleet}
        if self.mode == "events":
            safe = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in event.items()}
            print(EVENT_PREFIX + json.dumps(safe), flush=True)
        elif self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(refresh=False, **_postfix(event))
        else:
            now = time.perf_counter()
            if now - self._last_print >= 2.0 or step == self.total or val_loss is not None:
                self._last_print = now
                self.say(f"step {step}/{self.total} loss {row['loss']:.4f} tok/s {row['tokens_per_s']:,.0f} "
                         f"lr {row['lr']:.2e}" + (f" val {val_loss:.4f}" if val_loss is not None else "")
                         + "".join(f" {k} {v}" if k == "machines" else f" ({v})" for k, v in _fleet(event).items()))

    def write(self, line: str) -> None:
        """A status line that must not break the bar."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            self.say(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LaunchBar:
    """The launcher's side: rank 0's events drawn as a bar, every other line written above it.

    `write` prints (through `out`) when no bar is up; `take(line)` is True for an event, which it draws.
    Thread-safe: the relay threads of all local workers call it.  `close()` ends the bar (an attempt
    ended); the next attempt's first event draws a new one from its resumed step."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.bar: Any = None
        self.lock = threading.Lock()

    def write(self, line: str) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.write(line)
            else:
                self.out(line)

    def take(self, line: str) -> bool:
        if not line.startswith(EVENT_PREFIX):
            return False
        try:
            event = loads(line[len(EVENT_PREFIX):], "a worker's output")
            step, total, start = int(event["step"]), int(event["steps"]), int(event["start"])
            name = str(event.get("name") or "launch")
            figures = None
            if "loss" in event:  # a step's figures (the first event only starts the bar)
                figures = {k: float(event[k]) if event[k] is not None else math.nan for k in ("loss", "tok_s", "lr")}
                figures["val"] = event.get("val")
                figures.update({k: event.get(k) for k in ("machines", "fleet")})
        except (VGraphError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
            return False  # not an event after all: an ordinary line
        with self.lock:
            if self.bar is None:
                self.bar = progress_bar(total, start, name, True)
            if figures is not None:
                self.bar.update(step - self.bar.n)
                self.bar.set_postfix(refresh=False, **_postfix(figures))
        return True

    def close(self) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
