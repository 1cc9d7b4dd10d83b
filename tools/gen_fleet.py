"""Generate heterogeneous fleets for simulation: volunteer PNodes from laptops to data-centre GPUs.

    python tools/gen_fleet.py 1000 -o fleet1000.yml [--seed 0] [--world]

`heterogeneous(n)` draws n PNodes from `CLASSES` (seeded, so a benchmark's
fleet is reproducible): a machine class fixes memory and sustained FLOP/s
(about 40% of the published fp16/fp32 peak, what training sustains), and
its network link is drawn from the class's range, 100 Mbit/s (a home uplink)
to 100 Gbit/s (a data-centre fabric).  `--world` spreads them over the eight
AWS regions whose inter-region bandwidth and latency Yuan et al. measured
(`WORLD_LINKS`, see benchmarks/bench_fleet_scale.py for the citation).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vgraph.cost.fleet import Fleet, PNode
from vgraph.cost.fleet_links import Links, Region

GIB = 2 ** 30
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class MachineClass:
    name: str
    weight: float  # share of the fleet
    memory: int  # bytes
    flops: float  # sustained FLOP/s
    links_mbit: tuple[float, ...]  # network links this class is found with (Mbit/s)
    accelerator: str


CLASSES = (
    MachineClass("laptop-cpu", 0.15, 16 * GIB, 0.3e12, (100, 1000), "cpu"),
    MachineClass("gtx1080ti", 0.20, 11 * GIB, 4.5e12, (100, 1000), "cuda-sm61"),
    MachineClass("rtx3090", 0.25, 24 * GIB, 28e12, (100, 1000, 10_000), "cuda-sm86"),
    MachineClass("t4", 0.20, 16 * GIB, 25e12, (1000, 10_000), "cuda-sm75"),
    MachineClass("a100", 0.15, 80 * GIB, 120e12, (10_000, 25_000, 100_000), "cuda-sm80"),
    MachineClass("h100", 0.05, 80 * GIB, 300e12, (25_000, 100_000), "cuda-sm90"),
)

# Yuan et al. (NeurIPS 2022), measured between AWS regions: (latency ms, bandwidth Gbit/s); inside a region
# 10 ms and 2 Gbit/s.  Published with the paper's code (DS3Lab/DT-FM, scheduler/generate_sim_com_matrices.py).
WORLD_CITIES = ("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland")
WORLD_LINKS = {
    ("Oregon", "Virginia"): (67, 0.79), ("Oregon", "Ohio"): (49, 1.10), ("Oregon", "Tokyo"): (96, 0.523),
    ("Oregon", "Seoul"): (124, 0.46), ("Oregon", "London"): (136, 0.42), ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482), ("Virginia", "Ohio"): (11, 1.12), ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.500), ("Virginia", "London"): (76, 1.16), ("Virginia", "Frankfurt"): (90, 1.02),
    ("Virginia", "Ireland"): (67, 1.05), ("Ohio", "Tokyo"): (130, 0.694), ("Ohio", "Seoul"): (159, 0.529),
    ("Ohio", "London"): (86, 1.05), ("Ohio", "Frankfurt"): (99, 0.799), ("Ohio", "Ireland"): (77, 1.14),
    ("Tokyo", "Seoul"): (34, 1.10), ("Tokyo", "London"): (210, 0.366), ("Tokyo", "Frankfurt"): (223, 0.36),
    ("Tokyo", "Ireland"): (199, 0.465), ("Seoul", "London"): (238, 0.342), ("Seoul", "Frankfurt"): (235, 0.358),
    ("Seoul", "Ireland"): (228, 0.335), ("London", "Frankfurt"): (14, 1.14), ("London", "Ireland"): (12, 1.09),
    ("Frankfurt", "Ireland"): (24, 1.08),
}
WORLD_INSIDE = (10, 2.0)  # latency ms, Gbit/s inside one region


def world_links(cities: tuple[str, ...] = WORLD_CITIES) -> Links:
    gbit = 1e9 / 8
    regions = {c: Region(c, WORLD_INSIDE[1] * gbit, WORLD_INSIDE[0] / 1e3) for c in cities}
    pairs = {frozenset(k): (v[1] * gbit, v[0] / 1e3) for k, v in WORLD_LINKS.items()
             if k[0] in regions and k[1] in regions}
    return Links(regions, pairs)


def heterogeneous(n: int, *, seed: int = 0, world: bool = False, name: str | None = None) -> Fleet:
    """n PNodes drawn from CLASSES (seeded); with `world`, spread evenly over WORLD_CITIES."""
    if n < 1:
        raise ValueError("a fleet needs at least one PNode")
    rng = np.random.default_rng(seed)
    weights = np.array([c.weight for c in CLASSES])
    kinds = rng.choice(len(CLASSES), size=n, p=weights / weights.sum())
    pnodes = []
    for i, k in enumerate(kinds):
        c = CLASSES[int(k)]
        link = float(rng.choice(c.links_mbit)) * MBIT
        region = WORLD_CITIES[i % len(WORLD_CITIES)] if world else None
        pnodes.append(PNode(f"{c.name}-{i:04d}", c.memory, c.flops, link, c.accelerator, None, region))
    return Fleet.of(name or f"hetero{n}{'-world' if world else ''}", *pnodes,
                    links=world_links() if world else Links())


def to_yaml(fleet: Fleet) -> str:
    """The fleet in the fleet-spec format (vgraph/cost/fleet.py, vgraph/cost/fleet_links.py)."""
    lines = [f"name: {fleet.name}"]
    if fleet.links.regions:
        lines.append("regions:")
        for r in fleet.links.regions.values():
            lines.append(f"  - {{name: {r.name}, bandwidth: {r.bandwidth:.6g}, latency: {r.latency:.6g}s}}")
        lines.append("links:")
        for pair, (bw, lat) in fleet.links.pairs.items():
            a, b = sorted(pair)
            lines.append(f"  - {{between: [{a}, {b}], bandwidth: {bw:.6g}, latency: {lat:.6g}s}}")
    lines.append("pnodes:")
    for p in fleet:
        extra = f", accelerator: {p.accelerator}" if p.accelerator else ""
        extra += f", region: {p.region}" if p.region else ""
        lines.append(f"  - {{id: {p.id}, memory: {p.memory}, flops: {p.flops:.6g}, bandwidth: {p.bandwidth:.6g}"
                     f"{extra}}}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pnodes", type=int, help="how many PNodes")
    ap.add_argument("-o", "--output", required=True, help="fleet YAML to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world", action="store_true", help="spread over 8 AWS regions (measured links)")
    args = ap.parse_args(argv)
    if not 1 <= args.pnodes <= 1_000_000:
        ap.error("pnodes must be between 1 and 1000000")
    out = Path(args.output)
    if out.is_dir():
        ap.error(f"{out} is a directory")
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(to_yaml(heterogeneous(args.pnodes, seed=args.seed, world=args.world)))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
