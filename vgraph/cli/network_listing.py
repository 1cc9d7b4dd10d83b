"""`vgraph networks [--json]`: the networks and fleets that ship with vgraph, by the names commands take.

Why a listing: an installed vgraph has no checkout to look into, and every
command that reads a network or a fleet also takes these names
(`vgraph.base.shipped`), so a user needs to see what there is and what each
one is: its size for a network, its machines for a fleet.
"""
from __future__ import annotations

import json
from typing import Any

from vgraph.base.shipped import shipped
from vgraph.cost.analyze import analyze
from vgraph.cost.fleet import human_bytes, load_fleet
from vgraph.yamlio import load

__all__ = ["listing", "print_listing"]


def listing() -> dict[str, list[dict[str, Any]]]:
    """Every shipped network (VNodes, parameters) and fleet (PNodes, memory), with its file."""
    networks = []
    for name, path in shipped("network").items():
        graph = load(path)
        networks.append({"name": name, "vnodes": len(graph), "params": analyze(graph).params, "file": str(path)})
    fleets = []
    for name, path in shipped("fleet").items():
        fleet = load_fleet(path)
        fleets.append({"name": name, "pnodes": len(fleet), "memory_bytes": sum(p.memory for p in fleet),
                       "file": str(path)})
    return {"networks": networks, "fleets": fleets}


def print_listing(as_json: bool) -> None:
    found = listing()
    if as_json:
        print(json.dumps(found, indent=2))
        return
    width = max((len(n["name"]) for kind in found.values() for n in kind), default=0)
    print("networks (give the name where a command takes a network FILE):")
    for n in found["networks"]:
        print(f"  {n['name']:<{width}}  {n['vnodes']:>4} VNodes, {n['params'] / 1e6:.1f}M parameters")
    print("fleets (give the name to --fleet):")
    for f in found["fleets"]:
        print(f"  {f['name']:<{width}}  {f['pnodes']:>4} PNode{'s' * (f['pnodes'] != 1)}, "
              f"{human_bytes(f['memory_bytes'])} of memory in all")
    print("e.g. vgraph train distributed_attention_example_6_swiglu_head --steps 2")
