"""Remat marks outside the pass: partition falls back to them, the per-PNode export keeps them, render shows them."""
from __future__ import annotations

import pytest

from conftest import TINY
from vgraph import load
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, PNode
from vgraph.cost.remat import RECOMPUTE, candidates, closed, marked_ids, plain_activation, remat_cost, remat_layout
from vgraph.passes.partition import Partition, PartitionError
from vgraph.placement.export import export_partition, load_parts
from vgraph.report.render import to_dot
from vgraph.transform.pass_api import PassContext
from vgraph.transform.pipeline import run_pipeline


def tiny_graph():
    g = load(TINY)
    run_pipeline(g, "dead-nodes,precision", target="cpu")
    return g


def one_pnode_between(g, batch):
    """A one-PNode fleet that holds the network with every candidate recomputed, but not with all kept."""
    cm = cost_model(g, batch=batch)
    ids = list(cm.node_columns["id"])
    t = cm.totals()
    static = t["param_bytes"] + t["grad_bytes"] + t["optimizer_bytes"]
    act = plain_activation(cm)
    flops = dict(zip(ids, cm.node_columns["flops"]))
    least = remat_cost(remat_layout(g, closed(g, [c for cs in candidates(g, cm, ids, {}).values() for c in cs])),
                       act, flops, ids).peak_bytes
    memory = static + (least + (sum(act.values()) - least) // 2) * batch
    return Fleet.of("one", PNode("p0", int(memory), 1e12, 1e9))


def test_partition_recomputes_when_nothing_else_fits_and_says_so():
    g = tiny_graph()
    fleet = one_pnode_between(g, 4)
    with pytest.raises(PartitionError):
        Partition(batch=4, remat="off").run(g.copy(), PassContext(data={"fleet": fleet}))
    ctx = PassContext(data={"fleet": fleet})
    Partition(batch=4).run(g, ctx)
    assert marked_ids(g) and any("recomputed in backward" in note for note in ctx.notes)
    assert cost_model(g, batch=4).totals()["memory_bytes"] <= fleet.pnodes[0].memory
    # the remat pass after partition keeps only the marks the PNode needs, and still fits
    run_pipeline(g, "remat", data={"fleet": fleet})
    assert 0 < len(marked_ids(g))
    assert cost_model(g, batch=4).totals()["memory_bytes"] <= fleet.pnodes[0].memory


def test_per_pnode_export_keeps_the_marks(tmp_path):
    g = tiny_graph()
    g.node("block0_ffn_gelu").set_config(remat=RECOMPUTE)
    fleet = Fleet.of("two", PNode("a", 2**34, 1e12, 1e9), PNode("b", 2**34, 1e12, 1e9))
    run_pipeline(g, "partition{batch=2,replicas=1}", data={"fleet": fleet})
    export_partition(g, fleet, tmp_path / "parts")
    parts, _ = load_parts(tmp_path / "parts")
    holders = [p for p in parts.values() if "block0_ffn_gelu" in p]
    assert holders and all(p.node("block0_ffn_gelu").config.get("remat") == RECOMPUTE for p in holders)
    assert sum(len(marked_ids(p)) for p in parts.values()) == len(holders)


def test_render_shows_recomputed_nodes():
    g = tiny_graph()
    g.node("block0_ffn_gelu").set_config(remat=RECOMPUTE)
    dot = to_dot(g)
    line = next(x for x in dot.splitlines() if x.strip().startswith('"block0_ffn_gelu"'))
    assert "recomputed in backward" in line and "dashed" in line
    other = next(x for x in dot.splitlines() if x.strip().startswith('"block0_ffn_up"'))
    assert "recomputed" not in other
