"""Fleet specs: the PNodes (physical machines) a network is placed onto.

    name: t4x4
    pnodes:
      - id: t4-0
        memory: 16GiB          # bytes, or a number with a unit
        flops: 25T             # sustained FLOP/s the machine really delivers
        bandwidth: 10Gbit/s    # to the other PNodes
        accelerator: cuda-sm75 # optional: cpu | cuda-smXY
        burst: 16KiB           # optional: bytes its link passes at once after idling (vgraph/cost/makespan.py)
        update: {fixed: 1.4ms, per_param: 0.6ns}  # optional: a rank's work a step beyond its program (update.py)
        cpu_burst: {speedup: 2.7, bucket: 0.75ms}  # optional: a CPU quota's speed after idling (cpu_quota.py)

Optional beside `pnodes`: `regions` and `links` (vgraph/cost/fleet_links.py) and `collectives`, the
measured table of a step's small collectives among the hosts (vgraph/cost/collectives.py).  `vgraph
probe` writes `efficiency` (vgraph/cost/op_kinds.py), `burst`, `update`, `cpu_burst` and the table.

Units (case matters only for bits versus bytes):

- memory: a plain number is bytes; `B`, `kB`/`KB`, `MB`, `GB`, `TB` are powers of
  1000, `KiB`, `MiB`, `GiB`, `TiB` powers of 1024 (`16GiB`, `512MB`, `16 GiB`).
- flops: a plain number (`65e12`) or one with an SI prefix `k`, `M`, `G`, `T`, `P`,
  optionally followed by `FLOP/s`, `FLOPS` or `flops` (`8.1T`, `25 TFLOPS`).
- bandwidth: a plain number is bytes per second.  A unit with a capital `B`
  counts bytes (`1.25GB/s`, `1.25 GiB/s`, `100MB/s`), one spelled with `bit` or
  `bps`/`b/s` (lower-case b) counts bits and is divided by 8 (`10Gbit/s`,
  `10Gbps`, `10 Gb/s` are all 1.25e9 bytes/s).

The reader reuses the network loader's YAML machinery (vgraph.yamlio: a safe
compose, every scalar as text, line numbers on every node), and every problem
is reported at once as "FILE:LINE: pnode 'ID': message".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from vgraph.base.diagnostics import (MAX_MESSAGE_CHARS, Diagnostic, DiagnosticSink, SourceLoc, VGraphError, printable,
                                     quote)
from vgraph.base.numbers import NumberError, checked_number
from vgraph.base.safeio import read_input
from vgraph.cost.collectives import NO_COLLECTIVES, Collectives, read_collectives
from vgraph.cost.fleet_links import NO_LINKS, Links, read_links
from vgraph.cost.op_kinds import Efficiency, parse_kind
from vgraph.cost.cpu_quota import CpuBurst, parse_cpu_burst
from vgraph.cost.update import Update, parse_update
from vgraph.ops.schema import suggest
from vgraph.yamlio.yaml_reader import compose as _compose  # the network loader's safe YAML composer
from vgraph.yamlio.yaml_reader import YamlReader as _YamlReader, line_of as _line

FLEET_KEYS = ("name", "pnodes", "regions", "links", "collectives")
MAX_FLEET_BYTES = 16 * 2**20  # a fleet of 100k PNodes is ~10 MB
PNODE_KEYS = ("id", "memory", "flops", "bandwidth", "accelerator", "region", "efficiency", "burst", "update",
              "cpu_burst")
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")  # fullmatch: also a file name, DIR/<id>.yml
_ACCELERATOR = re.compile(r"^(cpu|cuda-sm\d\d+)$")
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"

_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40, "Pi": 2.0 ** 50}

_MEMORY = re.compile(rf"^{_NUMBER}\s*(?:([kKMGTP]i?)?B)?$")
_FLOPS = re.compile(rf"^{_NUMBER}\s*([kKMGTP]?)\s*(?:FLOP/s|FLOPS|flops|FLOPs|flop/s)?$")
_BANDWIDTH = re.compile(rf"^{_NUMBER}\s*(?:([kKMGTP]i?)?(B/s|Bps|bit/s|bits/s|bps|b/s))?$")


class FleetError(VGraphError):
    """A fleet spec that cannot be used."""


@dataclass(frozen=True)
class FleetDiagnostic(Diagnostic):
    """A diagnostic about a PNode: "FILE:LINE: pnode 'ID': message"."""

    def __str__(self) -> str:
        where = f"{printable(self.loc)}: " if self.loc else "<fleet>: "
        what = f"pnode {quote(self.node, 200)}: " if self.node is not None else "fleet: "
        return f"{where}{what}{printable(self.message, MAX_MESSAGE_CHARS)}"


@dataclass(frozen=True)
class PNode:
    """One machine: capacity (bytes), sustained speed (FLOP/s) and network bandwidth (bytes/s)."""

    id: str
    memory: int
    flops: float
    bandwidth: float
    accelerator: str | None = None
    loc: SourceLoc | None = None
    region: str | None = None  # see vgraph/cost/fleet_links.py
    efficiency: Efficiency | None = None  # per op kind, measured by `vgraph probe` (vgraph/cost/op_kinds.py)
    burst: int = 0  # bytes its link passes at once after idling (a token bucket's depth; `vgraph probe`)
    update: Update | None = None  # a rank's seconds a step beyond its program (vgraph/cost/update.py)
    cpu_burst: CpuBurst | None = None  # a CPU quota's speed after idling (vgraph/cost/cpu_quota.py)

    def __str__(self) -> str:
        acc = f", {self.accelerator}" if self.accelerator else ""
        return (f"{self.id} ({human_bytes(self.memory)}, {self.flops / 1e12:.3g} TFLOP/s, "
                f"{self.bandwidth / 1e9:.3g} GB/s{acc})")


@dataclass(frozen=True)
class Fleet:
    name: str
    pnodes: tuple[PNode, ...]
    source: str | None = None
    links: Links = NO_LINKS  # per-pair bandwidth and latency (regions), see fleet_links.py
    collectives: Collectives = NO_COLLECTIVES  # the step's small collectives, measured (collectives.py)

    def __len__(self) -> int:
        return len(self.pnodes)

    def __iter__(self) -> Iterator[PNode]:
        return iter(self.pnodes)

    def pnode(self, pnode_id: str) -> PNode:
        for p in self.pnodes:
            if p.id == pnode_id:
                return p
        raise KeyError(f"no PNode {pnode_id!r} in fleet {self.name!r}")

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.pnodes]

    def largest(self) -> PNode:
        """The PNode with the most memory (the first of equals)."""
        return max(self.pnodes, key=lambda p: p.memory)

    def link(self, p: PNode, q: PNode) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a transfer from p to q."""
        return self.links.between(p, q)

    def without(self, lost: "set[str] | list[str] | tuple[str, ...]") -> "Fleet":
        """The fleet less the PNodes `lost` (regions and links kept)."""
        gone = set(lost)
        return Fleet(self.name, tuple(p for p in self.pnodes if p.id not in gone), self.source, self.links,
                     self.collectives)

    @classmethod
    def of(cls, name: str, *pnodes: PNode, links: Links = NO_LINKS, collectives: Collectives = NO_COLLECTIVES
           ) -> "Fleet":
        """A fleet built in code (tests, benchmarks); checked like a loaded one."""
        fleet = cls(name, tuple(pnodes), None, links, collectives)
        problems = [f"{p.id}: {msg}" for p in pnodes for msg in _pnode_problems(p)]
        ids = [p.id for p in pnodes]
        problems += [f"duplicate PNode id {i!r}" for i in sorted({i for i in ids if ids.count(i) > 1})]
        if not pnodes:
            problems.append("a fleet needs at least one PNode")
        problems += [f"{pid}: {msg}" if pid else msg for pid, msg in _region_problems(pnodes, links)]
        if problems:
            raise FleetError("; ".join(problems))
        return fleet


def _region_problems(pnodes: "tuple[PNode, ...] | list[PNode]", links: Links) -> list[tuple[str | None, str]]:
    """(PNode id or None, message): regions are all or nothing, and a PNode's region must be declared."""
    placed = [p for p in pnodes if p.region is not None]
    if not placed:
        return []
    out: list[tuple[str | None, str]] = [(p.id, f"region {quote(p.region)} is not declared in 'regions'")
                                         for p in placed if p.region not in links.regions]
    if len(placed) != len(pnodes):
        bare = [p.id for p in pnodes if p.region is None]
        out.append((bare[0], f"has no 'region' while other PNodes do ({len(bare)} without): give every PNode "
                             f"a region, or none"))
    return out


def _pnode_problems(p: PNode) -> list[str]:
    out = []
    if not _ID.fullmatch(p.id):
        out.append(f"id {quote(p.id)} must be letters, digits, '_', '.' or '-' (it names a file)")
    if p.memory <= 0:
        out.append("memory must be positive")
    for what, value in (("flops", p.flops), ("bandwidth", p.bandwidth)):
        try:
            checked_number(value, what, low=1.0, high=1e30)
        except NumberError as exc:
            out.append(f"{exc} (per second)")
    if p.accelerator is not None and not _ACCELERATOR.match(p.accelerator):
        out.append(f"accelerator {p.accelerator!r} must be cpu or cuda-smXY")
    if not (isinstance(p.burst, int) and 0 <= p.burst <= 1e30):
        out.append(f"burst must be a whole number of bytes, at least 0, got {p.burst!r}")
    return out


# -- quantities ------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184, '512MB' -> 512000000, '1024' -> 1024."""
    m = _MEMORY.match(str(text).strip())
    if not m:
        raise ValueError(f"expected bytes like 16GiB, 512MB or 1073741824, got {text!r}")
    prefix = m.group(2) or ""
    factor = _BIN[prefix.replace("K", "k").replace("ki", "Ki")] if prefix.endswith("i") else _SI[prefix]
    value = _finite(float(m.group(1)) * factor, text)
    if value != int(value) and value < 1:
        raise ValueError(f"expected at least one byte, got {text!r}")
    return int(round(value))


def parse_flops(text: str) -> float:
    """'8.1T' -> 8.1e12, '65e12' -> 6.5e13, '25 TFLOPS' -> 2.5e13."""
    m = _FLOPS.match(str(text).strip())
    if not m:
        raise ValueError(f"expected FLOP/s like 8.1T, 25 TFLOPS or 65e12, got {text!r}")
    return _finite(float(m.group(1)) * _SI[m.group(2)], text)


def parse_bandwidth(text: str) -> float:
    """Bytes per second: '10Gbit/s' and '10Gbps' -> 1.25e9, '1.25GB/s' -> 1.25e9, '1e9' -> 1e9."""
    m = _BANDWIDTH.match(str(text).strip())
    if not m:
        raise ValueError(f"expected bandwidth like 10Gbit/s, 10Gbps, 1.25GB/s or bytes/s, got {text!r}")
    prefix, unit = m.group(2) or "", m.group(3) or "B/s"
    factor = _BIN[prefix.replace("K", "k").replace("ki", "Ki")] if prefix.endswith("i") else _SI[prefix]
    bits = unit in ("bit/s", "bits/s", "bps", "b/s")
    return _finite(float(m.group(1)) * factor / (8 if bits else 1), text)


def _finite(value: float, text: str) -> float:
    """A quantity a machine can have: '1e400' overflows to inf, which no arithmetic survives, and less
    than one byte (FLOP) per second is not a machine either: '1e-310' is subnormal and its inverse, a
    time, infinite.  0 is returned as 0 for the caller to refuse (or allow) in its own words."""
    if not math.isfinite(value) or value > 1e30:
        raise ValueError(f"{quote(text)} is beyond any machine (at most 1e30)")
    if value == 0:
        return value
    try:
        return float(checked_number(value, quote(text), low=1.0))
    except NumberError as exc:
        raise ValueError(f"{exc} (a quantity per second or in bytes is at least 1)") from None


def human_bytes(n: float) -> str:
    for unit, factor in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


# -- reading -----------------------------------------------------------------------------

class _FleetBuild:
    """What yamlio's reader reports into: errors become pnode diagnostics."""

    def __init__(self, file: str, sink: DiagnosticSink) -> None:
        self.file = file
        self.sink = sink

    def loc(self, line: int) -> SourceLoc:
        return SourceLoc(self.file, line)

    def error(self, line: int, msg: str, node: str | None = None) -> None:
        self.sink.add(FleetDiagnostic(msg, SourceLoc(self.file, line), node))


def loads_fleet(text: str, file: str = "<string>") -> Fleet:
    """Parse a fleet spec; raise FleetError listing every problem."""
    sink = DiagnosticSink()
    build = _FleetBuild(file, sink)
    try:
        root = _compose(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        build.error(mark.line + 1 if mark else 1, f"YAML syntax error: {exc.problem or exc.context}")
        root = None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        build.error(1, f"YAML error: {exc}")
        root = None
    else:
        if root is None:
            build.error(1, "empty file: expected a mapping with a 'pnodes' list")
    fleet = _read(root, build) if root is not None else None
    if sink.items or sink.dropped or fleet is None:
        raise FleetError(sink.sorted())
    return fleet


def load_fleet(path: str | Path) -> Fleet:
    path = Path(path)
    try:
        text = read_input(path, what="fleet file", limit=MAX_FLEET_BYTES)
    except VGraphError as exc:
        raise FleetError(exc.diagnostics) from None
    return loads_fleet(text, str(path))


def _read(root: yaml.Node, build: _FleetBuild) -> Fleet | None:
    reader = _YamlReader(build)  # type: ignore[arg-type]  # duck-typed: file, sink, error
    top = reader.mapping(root, "a fleet")
    if top is None:
        return None
    for key, (kn, _) in top.items():
        if key not in FLEET_KEYS:
            build.error(_line(kn), f"unknown top-level key {key!r}{suggest(key, FLEET_KEYS)} "
                                   f"(a fleet has 'name' and 'pnodes')")
    name = Path(build.file).stem if build.file != "<string>" else "fleet"
    if "name" in top:
        name = reader.scalar(top["name"][1], "'name'") or name
    if "pnodes" not in top:
        build.error(_line(root), "the fleet has no 'pnodes' list")
        return None
    items = reader.sequence(top["pnodes"][1], "pnodes")
    if not items and isinstance(top["pnodes"][1], (yaml.ScalarNode, yaml.SequenceNode)):
        build.error(_line(top["pnodes"][1]), "'pnodes' is empty: a fleet needs at least one PNode")
    pnodes: list[PNode] = []
    first_line: dict[str, int] = {}
    for item in items:
        pid, p = _pnode(reader, build, item)
        if pid is None:
            continue
        if pid in first_line:
            build.error(_line(item), f"duplicate PNode id (first defined at line {first_line[pid]})", pid)
            continue
        first_line[pid] = _line(item)
        if p is not None:
            pnodes.append(p)
    links = read_links(reader, build.error, top, _line, parse_bandwidth, suggest)
    collectives = read_collectives(reader, build.error, top, _line, suggest, parse_bandwidth)
    known = {p.id: p for p in pnodes}
    for pid, msg in _region_problems(pnodes, links):
        loc = known[pid].loc if pid in known else None
        build.error(loc.line if loc else _line(top["pnodes"][1]), msg, pid)
    return Fleet(name, tuple(pnodes), build.file, links, collectives)


_PARSERS = {"memory": (parse_bytes, "memory"), "flops": (parse_flops, "flops"),
            "bandwidth": (parse_bandwidth, "bandwidth")}


def _pnode(reader: _YamlReader, build: _FleetBuild, item: yaml.Node) -> tuple[str | None, PNode | None]:
    """(id, PNode); the PNode is None when something about it was reported."""
    m = reader.mapping(item, "a PNode")
    if m is None:
        return None, None
    pid = reader.scalar(m["id"][1], "'id'") if "id" in m else None
    if pid is None:
        if "id" not in m:
            build.error(_line(item), "PNode has no 'id'")
        return None, None
    ok = True
    if not _ID.fullmatch(pid):
        build.error(_line(m["id"][1]), "id must be letters, digits, '_', '.' or '-', at most 200 (it names the "
                                       "PNode's file when a partition is exported)", pid)
        ok = False
    for key, (kn, _) in m.items():
        if key not in PNODE_KEYS:
            build.error(_line(kn), f"unknown PNode key {key!r}{suggest(key, PNODE_KEYS)}", pid)
            ok = False
    values: dict[str, float] = {}
    for key, (parse, what) in _PARSERS.items():
        if key not in m:
            build.error(_line(item), f"PNode has no '{key}'", pid)
            ok = False
            continue
        text = reader.scalar(m[key][1], f"'{key}'", pid)
        if text is None:
            ok = False
            continue
        try:
            value = parse(text)
        except ValueError as exc:
            build.error(_line(m[key][1]), f"{what}: {exc}", pid)
            ok = False
            continue
        if not (value > 0 and math.isfinite(value)):
            build.error(_line(m[key][1]), f"{what} must be positive, got {text!r}", pid)
            ok = False
            continue
        values[key] = value
    region = reader.scalar(m["region"][1], "'region'", pid) if "region" in m else None
    if "region" in m and region is None:
        ok = False
    accelerator = None
    if "accelerator" in m:
        accelerator = reader.scalar(m["accelerator"][1], "'accelerator'", pid)
        if accelerator is not None and not _ACCELERATOR.match(accelerator):
            build.error(_line(m["accelerator"][1]), f"accelerator {accelerator!r} must be cpu or "
                                                    f"cuda-smXY (e.g. cuda-sm75, cuda-sm80)", pid)
            ok = False
    measured = {}  # what `vgraph probe` writes: each read by its own function, None when it reported
    for key, read in _MEASURED.items():
        if key in m:
            measured[key] = read(reader, build, m[key][1], pid)
            ok = ok and measured[key] is not None
    if not ok:
        return pid, None
    return pid, PNode(pid, int(values["memory"]), float(values["flops"]), float(values["bandwidth"]),
                 accelerator, SourceLoc(build.file, _line(item)), region, **measured)


def _burst(reader: _YamlReader, build: _FleetBuild, ynode: yaml.Node, pid: str) -> int | None:
    """`burst: 16KiB` (bytes, 0 allowed: no bucket); None when reported."""
    text = reader.scalar(ynode, "'burst'", pid)
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        build.error(_line(ynode), f"burst: {exc}", pid)
        return None


def _update(reader: _YamlReader, build: _FleetBuild, ynode: yaml.Node, pid: str) -> Update | None:
    """`update: {fixed: T, per_param: T}` (vgraph/cost/update.py); None when reported."""
    return _scalar_fields(reader, build, ynode, pid, "'update'", "update", "update", parse_update)


def _cpu_burst(reader: _YamlReader, build: _FleetBuild, ynode: yaml.Node, pid: str) -> CpuBurst | None:
    """`cpu_burst: {speedup: X, bucket: T}` (vgraph/cost/cpu_quota.py); None when reported."""
    return _scalar_fields(reader, build, ynode, pid, "'cpu_burst'", "cpu_burst", "cpu_burst", parse_cpu_burst)


def _scalar_fields(reader: _YamlReader, build: _FleetBuild, ynode: yaml.Node, pid: str, label: str, prefix: str,
                   what: str, parse):
    """`parse` of the mapping `ynode` of scalars (`label` names it, `prefix` its keys, `what` the mistake in
    messages); None when reported."""
    fields = reader.mapping(ynode, label, pid)
    if fields is None:
        return None
    texts = {key: reader.scalar(v, f"{prefix} {key!r}", pid) for key, (_, v) in fields.items()}
    if any(t is None for t in texts.values()):
        return None
    try:
        return parse(texts)
    except ValueError as exc:
        build.error(_line(ynode), f"{what}: {exc}", pid)
        return None


def _efficiency(reader: _YamlReader, build: _FleetBuild, ynode: yaml.Node, pid: str) -> Efficiency | None:
    """`efficiency: {kind: {of_peak: F, overhead: T}, ...}` (vgraph/cost/op_kinds.py); None when reported."""
    kinds = reader.mapping(ynode, "'efficiency'", pid)
    if kinds is None:
        return None
    out = []
    for kind, (_, vnode) in kinds.items():
        cost = _scalar_fields(reader, build, vnode, pid, f"efficiency {kind!r}", f"efficiency {kind!r}", "efficiency",
                              lambda texts, kind=kind: parse_kind(kind, texts))
        if cost is None:
            return None
        out.append((kind, cost))
    return Efficiency(tuple(out))


# PNode keys a probe measures
_MEASURED = {"efficiency": _efficiency, "burst": _burst, "update": _update, "cpu_burst": _cpu_burst}


# -- writing ---------------------------------------------------------------------------

def pnode_flow(p: PNode) -> str:
    """One PNode as the YAML flow mapping a fleet's `pnodes` list holds (what `vgraph probe` writes)."""
    parts = [f"id: {p.id}", f"memory: {p.memory}", f"flops: {p.flops:.6g}", f"bandwidth: {p.bandwidth:.6g}B/s"]
    if p.accelerator:
        parts.append(f"accelerator: {p.accelerator}")
    if p.region:
        parts.append(f"region: {p.region}")
    if p.burst:
        parts.append(f"burst: {p.burst}")
    if p.efficiency is not None:
        parts.append(f"efficiency: {p.efficiency.flow()}")
    if p.update is not None:
        parts.append(f"update: {p.update.flow()}")
    if p.cpu_burst is not None:
        parts.append(f"cpu_burst: {p.cpu_burst.flow()}")
    return "{" + ", ".join(parts) + "}"


def fleet_text(name: str, pnodes: "list[PNode] | tuple[PNode, ...]", comment: str = "",
               collectives: Collectives = NO_COLLECTIVES) -> str:
    """A fleet file of `pnodes` (no regions), read back by `loads_fleet` as the same PNodes (and table)."""
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    table = collectives.flow() if collectives.rows else ""
    return head + f"name: {name}\n{table}pnodes:\n" + "".join(f"  - {pnode_flow(p)}\n" for p in pnodes)


def append_pnode(text: str, file: str, pnode: PNode) -> str:
    """`text` (a fleet file) with `pnode` added at the end of its `pnodes` list, everything else (comments,
    regions, links, layout) kept; FleetError when the fleet is invalid or already has that id."""
    fleet = loads_fleet(text, file)
    if pnode.id in fleet.ids:
        raise FleetError(f"{file}: fleet {fleet.name!r} already has a PNode {pnode.id!r} (choose another id)")
    root = _compose(text)
    seq = next(v for k, v in root.value if k.value == "pnodes")
    if seq.flow_style:  # pnodes: [{...}, {...}]: before the closing bracket
        end = seq.end_mark.index - 1
        new = text[:end].rstrip() + f", {pnode_flow(pnode)}" + text[end:]
    else:  # a block list: one more item at the first item's column, after the last one
        column = seq.start_mark.column
        lines = text[:seq.end_mark.index].rstrip("\n").split("\n")
        new = "\n".join(lines) + "\n" + " " * column + f"- {pnode_flow(pnode)}\n" + text[seq.end_mark.index:]
    again = loads_fleet(new, file)
    if again.ids != [*fleet.ids, pnode.id]:
        raise FleetError(f"{file}: could not add PNode {pnode.id!r} to this fleet's layout; add it by hand:\n"
                         f"  - {pnode_flow(pnode)}")
    return new


def resolve_fleet(fleet: "Fleet | str | Path") -> Fleet:
    """A Fleet, or the path of a fleet spec to load."""
    return fleet if isinstance(fleet, Fleet) else load_fleet(fleet)


__all__ = ["Fleet", "PNode", "FleetError", "FleetDiagnostic", "load_fleet", "loads_fleet", "resolve_fleet",
           "pnode_flow", "fleet_text", "append_pnode",
           "parse_bytes", "parse_flops", "parse_bandwidth", "human_bytes"]
