"""What a step's small collectives cost among a fleet's hosts: measured together, not derived from links.

Every launch step runs collectives over all its N ranks besides the pipeline's messages and the
gradients' ring: an all-reduce on the control group (loss, gradient norm, traffic, a stop request, rank
0's vote for a sync point: every rank decides alike) and, at sync points (about once a second unless
--log-every asks for more; every step until issue 42), the gather of the ranks' metrics to rank 0.  Both are latency-bound, a few bytes over 2 (N - 1) hops, and a link probed between
two idle hosts does not tell their price.  On the netlab testbed a gloo all-reduce of 8 numbers over 4
hosts took 5.7-6.9 ms and 0.27 ms over 2, while a round trip between two of the 4 took 0.26-0.34 ms
(docs/benchmarks-history.md, `bench_hop_latency.py`): with 4 ranks each one spends ~1.6 ms of CPU in a gloo
collective of 8 numbers, and these hosts share 2 cores.  The cost model priced none of it and every
4-host plan ran 10-55 ms a step over its prediction.  So `vgraph probe --collectives`, run on the fleet's
hosts at once, times them as the workers run them, and the fleet carries the table:

    collectives:                  # measured among the first `ranks` hosts, all of them communicating
      - {ranks: 1, control: 0.4ms, hop: 0ms}
      - {ranks: 2, control: 1.4ms, hop: 0.16ms, ring: 110MB/s}
      - {ranks: 4, control: 7.4ms, hop: 0.94ms, ring: 61MB/s}

`control`: what a step costs besides training over that many ranks: the control all-reduce.  (It was
also the metrics gather and rank 0's metrics row while workers gathered every step: on one 0.5-core
testbed host 0.8 ms went to the all-reduce and 2.9 ms to gathering and writing the row of tb-medium's
step, and a one-host plan ran 6-13 ms over its prediction without them; at a sync point a second that is
well under 1% of any step, and not priced.)  `hop`: one message between two of them while all communicate (a small
all-reduce's time over its 2 (ranks - 1) ring hops; 0 for one rank).  `ring` (optional): the bytes a
second a gloo all-reduce of 1 MiB moves among them (its algorithm bandwidth, 2 (ranks - 1) / ranks x
bytes / seconds): with 4 hosts on this machine's 2 cores the ring's reductions and four TCP streams at
once ran replicas' all-reduces at 70-80% of the rate a probe measured between two idle hosts.

The step cost (stepcost.py) adds `control` once a step and `hop` to every message of a pipeline, to each
of a gradient ring's 2 (R - 1) hops and to a tied pair's sync, and caps a gradient ring's bandwidth at
`ring`.  Between measured rank counts both are interpolated linearly; beyond the largest (below the
smallest) `control` scales with the ring's N - 1 hops (a table of one rank alone: stays) and `hop` is the
nearest measured one.  A fleet without the table prices none of this (zero), as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from vgraph.cost.fleet_links import parse_latency, read_quantity, report_unknown_keys

ENTRY_KEYS = ("ranks", "control", "hop", "ring")
MAX_RANKS = 1_000_000


@dataclass(frozen=True)
class Collectives:
    """The measured table, by rank count (ascending, at least 1 each): (ranks, control s, hop s)."""

    rows: tuple[tuple[int, float, float], ...] = ()
    rings: tuple[tuple[int, float], ...] = ()  # (ranks, bytes/s) where measured

    def ring(self, ranks: int) -> float:
        """The all-reduce's bytes a second among `ranks` ranks: the nearest measured rank count's at or
        above (the largest's beyond it); inf where none was measured (no cap)."""
        if ranks < 2 or not self.rings:
            return math.inf
        return next((rate for n, rate in self.rings if n >= ranks), self.rings[-1][1])

    def at(self, ranks: int) -> tuple[float, float]:
        """(control seconds a step, seconds a message) for a plan of `ranks` ranks (one rank sends none)."""
        if ranks < 1 or not self.rows:
            return 0.0, 0.0
        control, hop = self._lookup(ranks)
        return control, hop if ranks > 1 else 0.0

    def _lookup(self, ranks: int) -> tuple[float, float]:
        first, last = self.rows[0], self.rows[-1]
        if ranks <= first[0]:
            return (first[1] if ranks == first[0] else first[1] * (ranks - 1) / (first[0] - 1)), first[2]
        if ranks >= last[0]:
            return last[1] * ((ranks - 1) / (last[0] - 1) if last[0] > 1 else 1.0), last[2]
        for (a, ca, ha), (b, cb, hb) in zip(self.rows, self.rows[1:]):
            if a <= ranks <= b:
                w = (ranks - a) / (b - a)
                return ca + w * (cb - ca), ha + w * (hb - ha)
        raise AssertionError("rows are sorted by rank count")

    def flow(self) -> str:
        """The table as the fleet file's `collectives` block (what `vgraph probe --collectives` writes)."""
        rings = dict(self.rings)
        return "collectives:\n" + "".join(
            f"  - {{ranks: {n}, control: {c * 1e3:.6g}ms, hop: {h * 1e3:.6g}ms"
            + (f", ring: {rings[n]:.6g}B/s" if n in rings else "") + "}\n" for n, c, h in self.rows)


NO_COLLECTIVES = Collectives()


def collectives_of(rows: "list[tuple[int, float, float]]", rings: "dict[int, float] | None" = None) -> Collectives:
    """A table from measured rows (and all-reduce rates by rank count); ValueError when a row cannot be one
    (the reader's rules, for code)."""
    out = sorted(rows)
    rings = dict(rings or {})
    for n, rate in rings.items():
        if n not in {k for k, _, _ in out} or not (isinstance(rate, (int, float)) and 1 <= rate <= 1e30):
            raise ValueError(f"a ring rate needs a row of its rank count and at least 1 byte/s, got {n}: {rate!r}")
    for n, control, hop in out:
        if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_RANKS):
            raise ValueError(f"ranks must be a whole number from 1 to {MAX_RANKS:,}, got {n!r}")
        for what, value in (("control", control), ("hop", hop)):
            if not (0 <= value <= 3600):
                raise ValueError(f"{what} must be between 0 and 3600 seconds, got {value!r}")
    if len({n for n, _, _ in out}) != len(out):
        raise ValueError("two rows for the same number of ranks")
    return Collectives(tuple(out), tuple(sorted(rings.items())))


def read_collectives(reader: Any, error: Callable[[int, str], None], top: dict, line: Callable[[Any], int],
                     suggest: Callable[[str, tuple], str], parse_bandwidth: Callable[[str], float]) -> Collectives:
    """The `collectives` list of a fleet's top-level mapping; problems go to `error(line, message)`."""
    if "collectives" not in top:
        return NO_COLLECTIVES
    rows: list[tuple[int, float, float]] = []
    rings: dict[int, float] = {}
    first: dict[int, int] = {}
    items = reader.sequence(top["collectives"][1], "collectives")
    for item in items:
        m = reader.mapping(item, "a collectives entry")
        if m is None:
            continue
        report_unknown_keys(m, ENTRY_KEYS, "collectives entry", error, line, suggest)
        ranks = _ranks(reader, m, item, error, line)
        what = "collectives entry"
        control = read_quantity(reader, m, "control", parse_latency, error, line, what, required=True, zero_ok=True)
        hop = read_quantity(reader, m, "hop", parse_latency, error, line, what, required=True, zero_ok=True)
        ring = read_quantity(reader, m, "ring", parse_bandwidth, error, line, what)
        if ranks is None or control is None or hop is None or ("ring" in m and ring is None):
            continue
        if ranks in first:
            error(line(item), f"a second collectives entry for {ranks} ranks (first at line {first[ranks]})")
            continue
        first[ranks] = line(item)
        rows.append((ranks, control, hop))
        if ring is not None:
            rings[ranks] = ring
    if not items and getattr(top["collectives"][1], "id", None) == "sequence":
        error(line(top["collectives"][0]), "'collectives' is empty: give at least one measured entry or leave it out")
    return Collectives(tuple(sorted(rows)), tuple(sorted(rings.items())))


def _ranks(reader: Any, m: dict, item: Any, error: Callable, line: Callable) -> int | None:
    if "ranks" not in m:
        error(line(item), "collectives entry has no 'ranks' (how many hosts the figures were measured among)")
        return None
    text = reader.scalar(m["ranks"][1], "collectives 'ranks'")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_RANKS):
        error(line(m["ranks"][1]), f"collectives ranks must be a whole number from 1 to {MAX_RANKS:,}, got {text!r}")
        return None
    return int(text)


__all__ = ["Collectives", "NO_COLLECTIVES", "collectives_of", "read_collectives"]
