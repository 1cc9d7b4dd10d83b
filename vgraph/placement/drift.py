"""Figures from the run itself: each PNode's measured busy time against the plan's prediction.

A plan is priced from figures a probe took once (vgraph/cost/fleet.py); a volunteer's machine that gets busy
afterwards runs slower than they say (issue 36: one-shot figures on a loaded 2-core machine predicted 0.49-1.64 s
for a step measured at 0.10-0.51 s).  A launch run already measures every PNode's step and idle time each step
(backends/torch/distributed/runtime/pnode_figures.py); this module turns them into

* `measured_fleet`: the fleet with each PNode's time figures rescaled so that the cost model's compute time for
  that PNode (placement.json's `compute_seconds`) equals its measured busy time.  Busy, not step: the step's
  idle part (waiting for a neighbour's activations, the all-reduce, the loss reduction) is the slow neighbour's
  fault, not the waiting PNode's.  Every time figure of the PNode is scaled by the same factor c = measured /
  predicted: its `flops` divided by c, its op kinds' `overhead` and its `update` multiplied by c (of_peak is a
  share of `flops`, so it stays).  The compute the cost model prices for the PNode (op_kinds.vnode_seconds: a sum
  of terms each proportional to 1 / flops or to an overhead) is then exactly c times what it was.  The measured
  busy time also holds the rank's batch draw and optimizer step (placement.json's compute_seconds leaves them
  out), so a PNode without an `update` figure carries them in its rescaled compute;
* `DriftWatch`: fed each step's measured busy seconds per PNode, it says when a PNode's ratio measured /
  predicted has stayed outside [1 / 1.25, 1.25] for K consecutive steps, after W warm-up steps, the ratio
  taken as the median of a short window so that one slow step (a checkpoint, a validation) never triggers it.
  One report per episode: a PNode reports again only after its ratio came back inside the band.  Its
  measured figure (`DriftWatch.measured`) is the median over the episode so far, steadier than the window,
  and the report carries the episode's `relative_spread`, which a re-plan decision prices as the
  uncertainty of its figures (vgraph/placement/replan.py: a gain within that spread is not evidence).

What to do with a drift (re-plan now, or when the next membership change re-plans) is the launcher's: the seam
is `measured_fleet` (the fleet the planner should price with) and `DriftWatch.feed`'s `Drift`.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.fleet import Fleet, PNode, fleet_text
from vgraph.cost.op_kinds import Efficiency, KindCost
from vgraph.cost.update import Update

__all__ = ["new_evidence", "relative_spread", "DRIFT_TOLERANCE", "DEFAULT_DRIFT_STEPS", "DEFAULT_WARMUP", "DEFAULT_WINDOW", "MAX_FACTOR",
           "MeasuredFleet", "measured_fleet", "fleet_file_text", "predicted_busy", "busy_seconds",
           "Drift", "DriftWatch"]

DRIFT_TOLERANCE = 1.25  # the plan still holds within 25% either way (issue 36 item 6)
DEFAULT_DRIFT_STEPS = 5  # K: consecutive steps outside the band
DEFAULT_WARMUP = 3  # W: the first steps pay for allocation and warm-up, they say nothing about the machine
DEFAULT_WINDOW = 3  # the median of this many steps: one slow step cannot move it
EPISODE_STEPS = 256  # the busy times of a drift episode its measured figure is the median of
MAX_SKIPPED = 100  # refused figures whose reasons a watch keeps
MAX_FACTOR = 1e6  # measured / predicted beyond this (either way) is not a machine's load: refused
_MAX_OVERHEAD_S = 3600.0  # what a fleet file's overhead may say (op_kinds.parse_seconds)


@dataclass(frozen=True)
class MeasuredFleet:
    """The fleet rescaled to what was measured; `factors`: per rescaled PNode, measured / predicted;
    `skipped`: per PNode left as it was, why."""

    fleet: Fleet
    factors: dict[str, float]
    skipped: dict[str, str]


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _scaled(p: PNode, c: float) -> PNode:
    """`p` with every time figure c times slower."""
    eff = None
    if p.efficiency is not None:
        eff = Efficiency(tuple((kind, KindCost(cost.of_peak, cost.overhead * c)) for kind, cost in p.efficiency.kinds))
    upd = Update(p.update.fixed * c, p.update.per_param * c) if p.update is not None else None
    return replace(p, flops=p.flops / c, efficiency=eff, update=upd, loc=None)


def _factor_problem(p: PNode, c: float) -> str | None:
    """Why `p` cannot be rescaled by c (its figures would leave what a fleet file can say), or None."""
    if not (1 / MAX_FACTOR <= c <= MAX_FACTOR):
        return f"measured / predicted = {c:.3g} is beyond {MAX_FACTOR:g}x either way: not a machine under load"
    if not (1.0 <= p.flops / c <= 1e30):
        return f"its flops would become {p.flops / c:.3g}, outside [1, 1e30]"
    worst = max([cost.overhead for _, cost in p.efficiency.kinds] if p.efficiency else [0.0]
                + ([p.update.fixed] if p.update else []))
    if worst * c > _MAX_OVERHEAD_S:
        return f"an overhead would become {worst * c:.3g} s, more than an hour"
    if p.update is not None and p.update.per_param * c > 1e-3:
        return "its update's per_param would exceed a millisecond per parameter"
    return None


def new_evidence(measured: Mapping[str, float], decided: Mapping[str, float] | None,
                 tolerance: float = DRIFT_TOLERANCE) -> bool:
    """Whether a drift report's measured busy times (PNode -> seconds) say anything the last drift decision
    (`decided`, the figures it priced) did not: a PNode it did not see, or one whose time moved out of the
    drift band around the one it priced.

    Why: rank 0 reports a drift every K steps for as long as the plan's prediction is off, and a decision that
    kept the plan priced those same figures already; deciding again costs the coordinator's CPU (the planner,
    three placements) and says the same.  On bench_churn's 0.35-core hosts (2026-12-07) twenty such decisions
    in one run, each about 0.5 CPU-s, took their time from rank 0's worker on the same host."""
    if not decided:
        return True
    return any(pid not in decided or not (decided[pid] / tolerance <= t <= decided[pid] * tolerance)
               for pid, t in measured.items())


def relative_spread(values: Sequence[float]) -> float:
    """Half the interquartile range of `values` over their median: how far one step's busy time strays from
    the figure a decision prices, as a share of it (0 for fewer than two values).

    Why quartiles and not the standard error of the median: the error that matters is the machine's, over the
    hundreds of steps a plan change must pay back in, and a volunteer's load is not a stationary noise that
    more samples average away (bench_churn run 7: one host's busy time 0.10, 0.21, 0.10, 0.075, 0.059 s at steps
    8-216); the step-to-step spread is the run's own witness of how unsteady the host is.  Quartiles, so that
    one checkpoint's step does not widen it."""
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2 / median if median > 0 else 0.0


def measured_fleet(fleet: Fleet, predicted: Mapping[str, float], measured: Mapping[str, float]) -> MeasuredFleet:
    """`fleet` with each PNode of `measured` rescaled so that its priced compute (`predicted[pid]`, the
    seconds the plan gave it) becomes its measured busy seconds; PNodes not measured are kept, and a
    measurement that is not a finite positive number, or a PNode without a positive prediction, is skipped
    with its reason (the figures come from other processes and files: a bad one must not poison the fleet)."""
    factors: dict[str, float] = {}
    skipped: dict[str, str] = {}
    pnodes = []
    for p in fleet:
        if p.id not in measured:
            pnodes.append(p)
            continue
        m, pred = measured[p.id], predicted.get(p.id)
        why = None
        if not _finite_positive(m):
            why = f"measured busy seconds {m!r} is not a finite positive number"
        elif not _finite_positive(pred):
            why = f"the plan's predicted seconds {pred!r} is not a finite positive number"
        else:
            c = float(m) / float(pred)
            why = _factor_problem(p, c)
        if why is not None:
            skipped[p.id] = why
            pnodes.append(p)
            continue
        factors[p.id] = c
        pnodes.append(_scaled(p, c))
    unknown = sorted(set(measured) - set(fleet.ids))
    for pid in unknown:
        skipped[pid] = f"fleet {fleet.name!r} has no PNode {pid!r}"
    return MeasuredFleet(Fleet(fleet.name, tuple(pnodes), None, fleet.links, fleet.collectives), factors, skipped)


def fleet_file_text(fleet: Fleet, comment: str = "") -> str:
    """A fleet file of `fleet` (regions and links kept), read back by `loads_fleet` as the same fleet (what a
    launch worker is handed, and what it writes as fleet.measured.yml)."""
    text = fleet_text(fleet.name, fleet.pnodes, comment, fleet.collectives)
    if fleet.links.regions:
        links = fleet.links.to_json()
        regions = [{k: v for k, v in r.items() if v is not None} for r in links["regions"]]
        head, _, rest = text.partition("pnodes:\n")
        text = (head + f"regions: {json.dumps(regions)}\n"
                + (f"links: {json.dumps(links['links'])}\n" if links["links"] else "") + "pnodes:\n" + rest)
    return text


def predicted_busy(placement: Mapping[str, Any]) -> dict[str, float]:
    """Per PNode, the compute seconds placement.json predicts for it (`pnodes[pid].compute_seconds`); a PNode
    whose entry is not a finite positive number is left out (nothing to compare with)."""
    pnodes = placement.get("pnodes") if isinstance(placement, Mapping) else None
    if not isinstance(pnodes, Mapping):
        raise VGraphError("placement.json has no 'pnodes' mapping: no per-PNode prediction to compare with")
    out = {}
    for pid, info in pnodes.items():
        seconds = info.get("compute_seconds") if isinstance(info, Mapping) else None
        if _finite_positive(seconds):
            out[str(pid)] = float(seconds)
    return out


def busy_seconds(figures: Any) -> tuple[float | None, str | None]:
    """(busy seconds, None) of one PNode's step figures (`{"step_s", "idle_s", ...}`), or (None, why not)."""
    if not isinstance(figures, Mapping):
        return None, f"figures {figures!r} are not a mapping"
    step, idle = figures.get("step_s"), figures.get("idle_s", 0.0)
    if not _finite_positive(step):
        return None, f"step_s {step!r} is not a finite positive number"
    if not (isinstance(idle, (int, float)) and not isinstance(idle, bool) and math.isfinite(idle) and idle >= 0):
        return None, f"idle_s {idle!r} is not a finite number >= 0"
    busy = float(step) - float(idle)
    if busy <= 0:
        return None, f"idle_s {idle!r} is the whole step ({step!r} s): no busy time to compare"
    return busy, None


@dataclass(frozen=True)
class Drift:
    """A drift episode's start: at `step`, per drifting PNode (measured busy median, predicted) seconds."""

    step: int
    pnodes: dict[str, tuple[float, float]]
    spread: dict[str, float] = field(default_factory=dict)  # per PNode, its episode's relative_spread

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "pnodes": {pid: {"measured_s": m, "predicted_s": p, "ratio": m / p,
                                                    **({"spread": self.spread[pid]} if pid in self.spread else {})}
                                              for pid, (m, p) in self.pnodes.items()}}

    def describe(self) -> str:
        return ", ".join(f"{pid} {m / p:.2f}x ({m:.3g} s measured, {p:.3g} s predicted)"
                         for pid, (m, p) in sorted(self.pnodes.items()))


@dataclass
class DriftWatch:
    """Says when the run has drifted from the plan; see the module docstring.  `steps` is K (0: never)."""

    predicted: Mapping[str, float]
    steps: int = DEFAULT_DRIFT_STEPS
    warmup: int = DEFAULT_WARMUP
    window: int = DEFAULT_WINDOW
    tolerance: float = DRIFT_TOLERANCE
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (step, PNode, why): the first refused figures
    skipped_count: int = 0  # all of them (a worker that always sends nonsense must not grow `skipped` for ever)
    _seen: int = 0
    _recent: dict[str, deque] = field(default_factory=dict)
    _outside: dict[str, int] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)
    _episode: dict[str, deque] = field(default_factory=dict)  # per PNode off the band: its busy times since then

    def __post_init__(self) -> None:
        for what, value, low in (("steps", self.steps, 0), ("warmup", self.warmup, 0), ("window", self.window, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1_000_000:
                raise VGraphError(f"drift watch: {what} must be a whole number in [{low}, 1000000], got {value!r}")
        if not (_finite_positive(self.tolerance) and self.tolerance > 1):
            raise VGraphError(f"drift watch: tolerance must be a finite number above 1, got {self.tolerance!r}")
        self.predicted = {pid: float(s) for pid, s in self.predicted.items() if _finite_positive(s)}

    def skip(self, step: int, pnode: str, why: str) -> None:
        """A figure refused: counted, and its reason kept while fewer than `MAX_SKIPPED` are."""
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED:
            self.skipped.append((step, pnode, why))

    def busy_medians(self) -> dict[str, float]:
        """Per PNode, the median busy seconds of the current window (what the band is checked on)."""
        return {pid: statistics.median(d) for pid, d in self._recent.items() if d}

    def measured(self) -> dict[str, float]:
        """Per PNode, what `measured_fleet` should be given: for a PNode off the band, the median busy seconds
        since its window's median left the band (up to `EPISODE_STEPS` of them: the longer the episode,
        the steadier the figure); for the others, the window's median."""
        out = self.busy_medians()
        out.update({pid: statistics.median(d) for pid, d in self._episode.items() if d})
        return out

    @property
    def drifting(self) -> bool:
        """Whether some PNode's drift episode is on (reported and not over)."""
        return bool(self._reported)

    def feed(self, step: int, busy: Mapping[str, Any]) -> Drift | None:
        """One step's measured busy seconds per PNode; the Drift when an episode starts at this step."""
        self._seen += 1
        if self.steps == 0 or self._seen <= self.warmup:
            return None
        for pid, value in busy.items():
            if pid not in self.predicted:
                continue  # no prediction to compare with (a PNode the plan priced at zero)
            if not _finite_positive(value):
                self.skip(step, pid, f"busy seconds {value!r} is not a finite positive number")
                continue  # neither counts nor breaks the run of steps outside the band
            self._recent.setdefault(pid, deque(maxlen=self.window)).append(float(value))
        started: dict[str, tuple[float, float]] = {}
        spread: dict[str, float] = {}
        for pid, median in self.busy_medians().items():
            ratio = median / self.predicted[pid]
            if 1 / self.tolerance <= ratio <= self.tolerance:
                self._outside[pid] = 0
                self._reported.discard(pid)  # the episode is over: a later drift reports again
                self._episode.pop(pid, None)
                continue
            self._outside[pid] = self._outside.get(pid, 0) + 1
            if self._outside[pid] == 1:  # the window that left the band is the episode's first figures
                self._episode[pid] = deque(self._recent[pid], maxlen=EPISODE_STEPS)
            elif pid in busy and _finite_positive(busy[pid]):
                self._episode[pid].append(float(busy[pid]))
            if self._outside[pid] >= self.steps and pid not in self._reported:
                self._reported.add(pid)
                started[pid] = (median, self.predicted[pid])
                spread[pid] = relative_spread(self._episode[pid])
        return Drift(step, started, spread) if started else None
