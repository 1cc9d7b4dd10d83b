"""The fleet over time: RUN/launch/fleet-events.jsonl and the metrics rows' machines, read as one history.

Why a reader of its own: a `vgraph launch` run whose fleet changes (machines join, leave, vanish; the plan
drifts) records each change as rows of one file, written by one writer (the launcher's
`boundaries.Admission.event`, which stamps `time`), and four places show them: the progress line, TensorBoard
(rank 0), `vgraph report` and the tests.  They all read it here, through `RunReader` (bounded, no symlink
followed, numbers checked), so a damaged or hostile file is read the same way everywhere and never raises.

The rows (the common fields; a writer may add more, the reader ignores what it does not know):

* every row: `event` (its kind, text), `step` (the run's last logged step when it happened), `time`
  (seconds since the epoch, machine 0's clock);
* a **decision** is any row with `chosen` ("new": the plan changes; "keep"): the re-plan decision
  (vgraph/placement/replan.py `Decision.to_json`): `old_step_s` and `new_step_s` (the predicted step
  before and after), `bytes_moved`, `move_s` and `overhead_s` (the predicted seconds of the move and of
  the boundary), `reason`; `kind` says what asked for it (`join`, `leave`, `lost`, `drift`; the row's
  `event` when absent) and `pnode` the machine's PNode it is about;
* `boundary`: the workers stopped after `step`; `pnodes`, the fleet of the next attempt; `requested`, the
  time the stop was asked for;
* `moved`: the next attempt's first step is logged: `step` the boundary's step, `seconds` from the stop
  request to that first step (measured by the launcher, written when known).

A decision, the boundary after it and its `moved` row are one `Replan`.  Rows are taken in step order
(within a step decisions, then a boundary, then its move; else the file's order: a file appended to by
hand or by two writers may be out of order); a row
that is no object, has no `event` text or no integer `step`, or whose step lies beyond the run's last step
is left out and counted in a note.  Numbers go through the checked reader (vgraph/base/numbers.py): a NaN,
an infinity, a negative byte count or a value of the wrong type becomes None.  Text is kept printable
(control characters escaped) and short.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.jsonio import jsonl_lines, loads
from vgraph.base.numbers import number_or_none

from .files import FLEET_EVENTS_JSONL, LAUNCH_DIR, MAX_JSON_DEPTH, MAX_STEP, RunReader

__all__ = ["Replan", "FleetHistory", "MachineSpan", "read_fleet", "fleet_history", "machine_spans",
           "FLEET_EVENTS_PATH", "MAX_EVENT_BYTES"]

FLEET_EVENTS_PATH = f"{LAUNCH_DIR}/{FLEET_EVENTS_JSONL}"
MAX_EVENT_BYTES = 16 * 2**20  # a join or decision is a few hundred bytes: 16 MiB is tens of thousands of them
MAX_TEXT = 300  # a reason is a sentence or two
_PHASE = {"boundary": 1, "moved": 2}


@dataclass
class Replan:
    """One re-plan decision with what followed it (None: not recorded, or not a number)."""

    step: int  # the run's last logged step when it was decided
    kind: str  # what asked for it: join, leave, lost, drift, ... (printable)
    chosen: str  # "new" (the plan changed) or "keep"
    pnode: str = ""  # the PNode it is about (printable; "" when none is named)
    reason: str = ""
    old_step_s: float | None = None  # predicted seconds per step of the running plan
    new_step_s: float | None = None  # ... of the plan chosen for the new fleet
    bytes_moved: float | None = None
    predicted_s: float | None = None  # the move's and the boundary's predicted seconds together
    boundary: int | None = None  # the step after which the workers stopped (chosen "new")
    pnodes: list[str] = field(default_factory=list)  # the next attempt's PNodes
    seconds: float | None = None  # measured: from the stop request to the next attempt's first step
    lost_s: float | None = None  # of those, the part not training (the steps after the request left out)
    time: float | None = None

    def brief(self) -> str:
        """One short line for the progress display: `re-plan @3 join j1: 2.4->1.2 s/step, 50.8 KiB, moved in 4.2 s`
        (`re-plan asked @2` before its boundary, `kept plan @7` for a decision that kept it)."""
        at = self.boundary if self.boundary is not None else self.step
        who = f" {self.pnode}" if self.pnode else ""
        parts = [f"{_seconds(self.old_step_s)}->{_seconds(self.new_step_s)} s/step"]
        if self.bytes_moved is not None:
            parts.append(_bytes(self.bytes_moved))
        if self.seconds is not None:
            lost = (f" ({self.lost_s:.1f} s not training)"
                    if self.lost_s is not None and round(self.lost_s, 1) != round(self.seconds, 1) else "")
            parts.append(f"moved in {self.seconds:.1f} s{lost}")
        verb = "kept plan" if self.chosen != "new" else "re-plan" if self.boundary is not None else "re-plan asked"
        return f"{verb} @{at} {self.kind}{who}: {', '.join(parts)}"


@dataclass
class FleetHistory:
    """What fleet-events.jsonl says, checked: the decisions (in step order) and how many rows of each kind."""

    replans: list[Replan] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # event kind (and join outcome) -> rows
    rows: int = 0  # rows read (kept)

    @property
    def latest(self) -> Replan | None:
        """The latest decision that changed the plan, else the latest decision."""
        changed = [r for r in self.replans if r.chosen == "new"]
        return (changed or self.replans or [None])[-1]


@dataclass
class MachineSpan:
    """Consecutive logged steps trained by the same machines."""

    first: int
    last: int
    machines: int
    pnodes: tuple[str, ...]  # printable, sorted


def read_fleet(reader: RunReader, last_step: int | None = None) -> FleetHistory:
    """The run's fleet events (an empty history when the file is missing: a run without joins has none);
    `last_step`, the run's last step (its --steps): a row beyond it is left out with a note."""
    raw = reader.raw(FLEET_EVENTS_PATH, "fleet events file", limit=MAX_EVENT_BYTES, optional=True)
    if raw is None:
        return FleetHistory()
    rows, bad = [], 0
    for number, line in jsonl_lines(raw.decode("utf-8", errors="replace")):
        try:
            value = loads(line, FLEET_EVENTS_PATH, line=number, max_depth=MAX_JSON_DEPTH,
                          on_bad_number=lambda literal: None)
        except VGraphError:
            value = None
        row = _event_row(value, MAX_STEP if last_step is None else last_step)
        if row is None:
            bad += 1
        else:
            rows.append(row)
    if bad:
        beyond = f" or at a step beyond the run's {last_step}" if last_step is not None else ""
        reader.notes.append(f"{FLEET_EVENTS_PATH}: {bad} line(s) that are not fleet events (no event kind or "
                            f"integer step{beyond}, not JSON, torn) were skipped")
    return fleet_history(rows)


def _event_row(value: Any, last_step: int) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("event"), str):
        return None
    step = number_or_none(value.get("step"), integer=True, low=0, high=min(last_step, MAX_STEP))
    if step is None:
        return None
    return {**value, "step": step}


def fleet_history(rows: Iterable[Mapping[str, Any]]) -> FleetHistory:
    """Rows (each with `event` text and an integer `step`) as decisions joined to their boundary and move."""
    history = FleetHistory()
    pending: list[Replan] = []  # changed the plan, no boundary yet
    moving: list[Replan] = []  # past their boundary, the move not measured yet
    # Step order, and within a step decision, boundary, move (the order they happen in); else the file's.
    for row in sorted(rows, key=lambda r: (r["step"], _PHASE.get(r["event"], 0))):
        history.rows += 1
        kind = _text(row["event"], 40)
        label = f"{kind} {_text(row.get('outcome'), 20)}".strip() if kind == "join" else kind
        history.counts[label] = history.counts.get(label, 0) + 1
        if row.get("chosen") in ("new", "keep"):
            replan = _decision(row)
            history.replans.append(replan)
            if replan.chosen == "new":
                pending.append(replan)
        elif kind == "boundary":
            names = row.get("pnodes")
            pnodes = sorted({_text(p, 80) for p in names if isinstance(p, str)}) if isinstance(names, list) else []
            for replan in pending:
                replan.boundary, replan.pnodes = row["step"], pnodes
            moving, pending = pending, []
        elif kind == "moved":
            seconds, lost = number_or_none(row.get("seconds"), low=0), number_or_none(row.get("lost_s"), low=0)
            for replan in moving:
                if replan.boundary == row["step"]:
                    replan.seconds, replan.lost_s = seconds, lost
            moving = [r for r in moving if r.boundary != row["step"]]
    return history


def _decision(row: Mapping[str, Any]) -> Replan:
    move, overhead = _number(row.get("move_s")), _number(row.get("overhead_s"))
    predicted = move + overhead if move is not None and overhead is not None else move
    return Replan(step=row["step"], kind=_text(row.get("kind") or row["event"], 40), chosen=str(row["chosen"]),
                  pnode=_text(row.get("pnode"), 80), reason=_text(row.get("reason"), MAX_TEXT),
                  old_step_s=_number(row.get("old_step_s")), new_step_s=_number(row.get("new_step_s")),
                  bytes_moved=_number(row.get("bytes_moved")), predicted_s=predicted,
                  time=_number(row.get("time")))


def machine_spans(rows: Sequence[Mapping[str, Any]]) -> list[MachineSpan]:
    """The metrics rows' `machines` (and their PNodes, the keys of `pnodes`) as spans of consecutive steps;
    rows without a machine count (`vgraph train`'s, an older launch's) are in no span."""
    spans: list[MachineSpan] = []
    for row in rows:
        machines = number_or_none(row.get("machines"), integer=True, low=1)
        if machines is None:
            continue
        figures = row.get("pnodes")
        pnodes = tuple(sorted(_text(p, 80) for p in figures)) if isinstance(figures, Mapping) else ()
        last = spans[-1] if spans else None
        if last is not None and last.machines == machines and last.pnodes == pnodes:
            last.last = row["step"]
        else:
            spans.append(MachineSpan(row["step"], row["step"], machines, pnodes))
    return spans


def _text(value: Any, limit: int) -> str:
    return printable(value, limit) if isinstance(value, str) else ""


def _number(value: Any) -> float | None:
    """A non-negative checked number (seconds, bytes), else None."""
    return number_or_none(value, low=0)


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def _bytes(n: float) -> str:
    """Binary units, as the launcher's lines and the report write bytes (3 digits: a huge count stays short)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
