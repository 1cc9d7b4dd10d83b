"""Who talks to whom how fast: per-pair links of a fleet, declared as regions.

A fleet whose PNodes are spread over the world cannot be described by one
bandwidth per PNode: two machines in one data centre talk at 10 Gbit/s, the
same machines across an ocean at a few hundred Mbit/s with 100 ms latency.  A
fleet may therefore declare regions and the links between them:

    regions:
      - {name: oregon, bandwidth: 2Gbit/s, latency: 10ms}   # inside the region
      - {name: tokyo, bandwidth: 2Gbit/s, latency: 10ms}
    links:
      - {between: [oregon, tokyo], bandwidth: 523Mbit/s, latency: 96ms}
    pnodes:
      - {id: a, memory: 16GiB, flops: 25T, bandwidth: 10Gbit/s, region: oregon}

A transfer from PNode p to PNode q then runs at min(p's bandwidth, the
link's) and pays the link's latency.  Every pair of declared regions needs a
link (the planner must not guess the slowest path of a plan), a region's own
bandwidth and latency are optional (default: the PNodes' own bandwidth, no
latency), and a fleet either puts every PNode in a region or none.  Without
regions every link is the sending PNode's bandwidth with no latency: the
cost model's original rule.

Latency: `67ms`, `0.067s`, `150us` or a plain number of seconds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


class Host(Protocol):
    """What a link needs of a PNode (`vgraph.cost.fleet.PNode` is one): where it is and how fast it sends.
    A protocol rather than the class, so that the fleet reader may import this module and not the reverse."""

    region: str | None
    bandwidth: float

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_LATENCY = re.compile(rf"^{_NUMBER}\s*(s|ms|us|µs)?$")
_LATENCY_UNIT = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
REGION_KEYS = ("name", "bandwidth", "latency")
LINK_KEYS = ("between", "bandwidth", "latency")
MAX_LATENCY_S = 3600.0  # a link slower than this is a typo, not a network


def parse_latency(text: str) -> float:
    """Seconds: '67ms' -> 0.067, '0.5s' -> 0.5, '150us' -> 1.5e-4, '0' -> 0."""
    m = _LATENCY.match(str(text).strip())
    if not m:
        raise ValueError(f"expected a latency like 67ms, 0.067s or 150us, got {text!r}")
    value = float(m.group(1)) * _LATENCY_UNIT[m.group(2)]
    if not math.isfinite(value) or value > MAX_LATENCY_S:
        raise ValueError(f"latency {text!r} is not a plausible network latency (at most {MAX_LATENCY_S:g} s)")
    return value


@dataclass(frozen=True)
class Region:
    name: str
    bandwidth: float | None = None  # bytes/s between two PNodes of the region (None: theirs)
    latency: float = 0.0  # seconds


@dataclass(frozen=True)
class Links:
    """Regions and the links between them; `between(p, q)` is what a transfer p -> q gets."""

    regions: dict[str, Region] = field(default_factory=dict)
    pairs: dict[frozenset, tuple[float, float]] = field(default_factory=dict)  # {a, b} -> (bytes/s, s)

    def between(self, p: Host, q: Host) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a transfer from p to q."""
        if p.region is None or q.region is None:
            return p.bandwidth, 0.0
        if p.region == q.region:
            r = self.regions[p.region]
            return (min(p.bandwidth, r.bandwidth) if r.bandwidth else p.bandwidth), r.latency
        bw, lat = self.pairs[frozenset((p.region, q.region))]
        return min(p.bandwidth, bw), lat

    def to_json(self) -> dict[str, Any]:
        return {"regions": [{"name": r.name, "bandwidth": r.bandwidth, "latency": r.latency}
                            for r in self.regions.values()],
                "links": [{"between": sorted(k), "bandwidth": v[0], "latency": v[1]} for k, v in self.pairs.items()]}


NO_LINKS = Links()


def read_links(reader: Any, error: Callable[[int, str], None], top: dict, line: Callable[[Any], int],
               parse_bandwidth: Callable[[str], float], suggest: Callable[[str, tuple], str]) -> Links:
    """The `regions` and `links` of a fleet's top-level mapping; problems go to `error(line, message)`."""
    regions: dict[str, Region] = {}
    first: dict[str, int] = {}
    if "regions" in top:
        for item in reader.sequence(top["regions"][1], "regions"):
            m = reader.mapping(item, "a region")
            if m is None:
                continue
            report_unknown_keys(m, REGION_KEYS, "region", error, line, suggest)
            name = reader.scalar(m["name"][1], "region 'name'") if "name" in m else None
            if name is None:
                if "name" not in m:
                    error(line(item), "region has no 'name'")
                continue
            if name in first:
                error(line(item), f"duplicate region {name!r} (first defined at line {first[name]})")
                continue
            first[name] = line(item)
            bw = read_quantity(reader, m, "bandwidth", parse_bandwidth, error, line, f"region {name!r}")
            lat = read_quantity(reader, m, "latency", parse_latency, error, line, f"region {name!r}", zero_ok=True)
            regions[name] = Region(name, bw, lat or 0.0)
    pairs: dict[frozenset, tuple[float, float]] = {}
    pair_line: dict[frozenset, int] = {}
    if "links" in top:
        if not regions:
            error(line(top["links"][0]), "'links' connect regions, but the fleet declares no 'regions'")
        for item in reader.sequence(top["links"][1], "links"):
            m = reader.mapping(item, "a link")
            if m is None:
                continue
            report_unknown_keys(m, LINK_KEYS, "link", error, line, suggest)
            ends = _ends(reader, m, item, regions, error, line)
            bw = read_quantity(reader, m, "bandwidth", parse_bandwidth, error, line, "link", required=True)
            lat = read_quantity(reader, m, "latency", parse_latency, error, line, "link", zero_ok=True)
            if ends is None or bw is None:
                continue
            key = frozenset(ends)
            if key in pairs:
                error(line(item), f"duplicate link between {ends[0]!r} and {ends[1]!r} (first at line "
                                  f"{pair_line[key]})")
                continue
            pairs[key] = (bw, lat or 0.0)
            pair_line[key] = line(item)
    _missing_links(list(regions), pairs, error,
                   line(top["links"][0]) if "links" in top else line(top["regions"][0]) if "regions" in top else 1)
    return Links(regions, pairs) if regions else NO_LINKS


MAX_MISSING_LISTED = 20


def _missing_links(names: list[str], pairs: dict, error: Callable[[int, str], None], where: int) -> None:
    """Every pair of regions needs a link: the first MAX_MISSING_LISTED missing pairs are named, the rest
    counted (n regions have n(n-1)/2 pairs: 3,000 regions without links are 4.5 million of them, which
    were once listed one by one, for minutes and gigabytes)."""
    missing = len(names) * (len(names) - 1) // 2 - len(pairs)  # `pairs` holds only declared regions' pairs
    listed = 0
    for i, a in enumerate(names):
        if listed == min(missing, MAX_MISSING_LISTED):
            break
        for b in names[i + 1:]:
            if frozenset((a, b)) not in pairs:
                error(where, f"no link between regions {a!r} and {b!r}: give every pair of regions a "
                             f"'links' entry (between: [{a}, {b}], bandwidth, latency)")
                listed += 1
                if listed == MAX_MISSING_LISTED:
                    break
    if missing > listed:
        error(where, f"... and {missing - listed:,} more pairs of regions without a link ({missing:,} of "
                     f"{len(names) * (len(names) - 1) // 2:,} pairs have none)")


def report_unknown_keys(m: dict, keys: tuple, what: str, error: Callable, line: Callable, suggest: Callable) -> None:
    for key, (kn, _) in m.items():
        if key not in keys:
            error(line(kn), f"unknown {what} key {key!r}{suggest(key, keys)} (a {what} has "
                            f"{', '.join(repr(k) for k in keys)})")


def _ends(reader: Any, m: dict, item: Any, regions: dict, error: Callable, line: Callable
          ) -> tuple[str, str] | None:
    if "between" not in m:
        error(line(item), "link has no 'between' (a list of two region names)")
        return None
    node = m["between"][1]
    values = reader.sequence(node, "between")
    names = [reader.scalar(v, "a region name in 'between'") for v in values]
    if len(names) != 2 or any(n is None for n in names):
        error(line(node), f"'between' must name exactly two regions, got {len(values)}")
        return None
    if names[0] == names[1]:
        error(line(node), f"a link joins two different regions; {names[0]!r} is given twice (a region's own "
                          f"bandwidth and latency go in its 'regions' entry)")
        return None
    bad = [n for n in names if n not in regions]
    if bad:
        error(line(node), f"link names undeclared region(s) {', '.join(map(repr, bad))} (declared: "
                          f"{', '.join(regions) or 'none'})")
        return None
    return names[0], names[1]


def read_quantity(reader: Any, m: dict, key: str, parse: Callable[[str], float], error: Callable, line: Callable,
              what: str, *, required: bool = False, zero_ok: bool = False) -> float | None:
    if key not in m:
        if required:
            error(line(next(iter(m.values()))[0]), f"{what} has no '{key}'")
        return None
    text = reader.scalar(m[key][1], f"{what} '{key}'")
    if text is None:
        return None
    try:
        value = parse(text)
    except ValueError as exc:
        error(line(m[key][1]), f"{what} {key}: {exc}")
        return None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        error(line(m[key][1]), f"{what} {key} must be {'non-negative' if zero_ok else 'positive'}, got {text!r}")
        return None
    return value


__all__ = ["Links", "Region", "NO_LINKS", "parse_latency", "read_links", "read_quantity", "report_unknown_keys"]
