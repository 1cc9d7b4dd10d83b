"""Efficiency per op kind in a fleet entry (vgraph/cost/op_kinds.py): read with every problem named, written and
read back (property-tested), appended to a fleet file without touching the rest, and priced by the step cost
model exactly as its formula says (a stage's seconds computed here by hand); a PNode without the figures
keeps the single-figure model."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import TINY_FP32
from vgraph import load
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, FleetError, PNode, append_pnode, fleet_text, loads_fleet, pnode_flow
from vgraph.cost.op_kinds import KINDS, Efficiency, KindCost, format_seconds, parse_seconds
from vgraph.cost.stepcost import FleetArrays, compute_seconds, effective_flops, stage_loads, step_cost

ENTRY = ("name: f\npnodes:\n  - {{id: a, memory: 1GiB, flops: 10G, bandwidth: 1GB/s, accelerator: cpu,\n"
         "     efficiency: {}}}\n")


def test_seconds_read_with_units() -> None:
    assert parse_seconds("45us") == 4.5e-05 and parse_seconds("0.2ms") == 2e-4 and parse_seconds("1e-5") == 1e-5
    assert parse_seconds("2 s") == 2.0 and parse_seconds("10ns") == 1e-8 and parse_seconds("3µs") == 3e-6
    for bad in ("", "-1us", "fast", "1 hour", "inf", "nan", "1e400", "5 min", "7200"):
        with pytest.raises(ValueError):
            parse_seconds(bad)


def test_a_fleet_entry_with_efficiency_reads_back() -> None:
    fleet = loads_fleet(ENTRY.format("{matmul: {of_peak: 0.5, overhead: 40us}, structural: {overhead: 1e-5}}"))
    e = fleet.pnodes[0].efficiency
    assert e.get("matmul") == KindCost(0.5, 4e-5) and e.get("structural") == KindCost(None, 1e-5)
    assert e.of_peak("attention") == 1.0 and e.overhead("attention") == 0.0  # not named: the single figure
    assert loads_fleet(ENTRY.format("{}")).pnodes[0].efficiency == Efficiency(())


@pytest.mark.parametrize("text, message", [
    ("{matmull: {of_peak: 0.5}}", "unknown op kind 'matmull'"),
    ("{matmul: {share: 0.5}}", "unknown key 'share'"),
    ("{matmul: {of_peak: 0}}", "of_peak must be in (0, 1]"), ("{matmul: {of_peak: 1.5}}", "of_peak must be in"),
    ("{matmul: {of_peak: nan}}", "of_peak must be in"), ("{matmul: {of_peak: abc}}", "of_peak must be a number"),
    ("{structural: {of_peak: 0.5}}", "no FLOPs"), ("{matmul: {overhead: -1us}}", "expected a time"),
    ("{matmul: {overhead: inf}}", "expected a time"), ("{matmul: {overhead: 2h}}", "expected a time"),
    ("{matmul: 0.5}", "must be a mapping"), ("[matmul]", "must be a mapping"), ("0.5", "must be a mapping"),
    ("{matmul: {of_peak: [1]}}", "must be a single value"), ("{matmul: {of_peak: }}", "is empty"),
])
def test_a_bad_efficiency_is_a_diagnostic_naming_file_line_and_pnode(text, message) -> None:
    with pytest.raises(FleetError) as exc:
        loads_fleet(ENTRY.format(text), "fleet.yml")
    shown = str(exc.value)
    assert message in shown and shown.startswith("fleet.yml:") and "pnode 'a'" in shown, shown


kind_costs = st.builds(KindCost, st.one_of(st.none(), st.floats(1e-6, 1.0)), st.floats(0.0, 100.0))


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KINDS), kind_costs), unique_by=lambda x: x[0], max_size=4),
       st.integers(1, 2 ** 50), st.floats(1e3, 1e18), st.floats(1.0, 1e15))
def test_an_entry_written_by_a_probe_reads_back(kinds, memory, flops, bandwidth) -> None:
    kinds = [(k, KindCost(None, c.overhead) if k == "structural" else c) for k, c in kinds]
    p = PNode("h0", memory, flops, bandwidth, "cpu", efficiency=Efficiency(tuple(kinds)))
    back = loads_fleet(fleet_text("f", [p], "a comment\nover two lines")).pnodes[0]
    assert (back.id, back.memory, back.accelerator) == ("h0", memory, "cpu")
    assert math.isclose(back.flops, flops, rel_tol=1e-5) and math.isclose(back.bandwidth, bandwidth, rel_tol=1e-5)
    for kind, cost in kinds:
        got = back.efficiency.get(kind)
        assert (got.of_peak is None) == (cost.of_peak is None)
        if cost.of_peak is not None:
            assert math.isclose(got.of_peak, cost.of_peak, rel_tol=1e-3)
        assert math.isclose(got.overhead, cost.overhead, rel_tol=1e-3, abs_tol=1e-12)
        assert parse_seconds(format_seconds(cost.overhead)) == pytest.approx(cost.overhead, rel=1e-3, abs=1e-12)


def test_appending_keeps_the_fleet_as_written() -> None:
    new = PNode("h9", 2 ** 30, 1e10, 2.5e6, "cpu", efficiency=Efficiency((("matmul", KindCost(0.5, 4e-5)),)))
    block = "# my fleet\nname: f\npnodes:\n  - id: a   # the first\n    memory: 1GiB\n    flops: 1G\n" \
            "    bandwidth: 1GB/s\n# after the list\n"
    out = append_pnode(block, "f.yml", new)
    assert out.startswith(block.split("# after")[0]) and "# after the list" in out and "# the first" in out
    assert loads_fleet(out).ids == ["a", "h9"] and loads_fleet(out).pnodes[1].efficiency == new.efficiency
    flow = "name: f\npnodes: [{id: a, memory: 1GiB, flops: 1G, bandwidth: 1GB/s}]\n"
    assert loads_fleet(append_pnode(flow, "f.yml", new)).ids == ["a", "h9"]
    with pytest.raises(FleetError, match="already has a PNode 'a'"):
        append_pnode(flow, "f.yml", PNode("a", 1, 1.0, 1.0))
    with pytest.raises(FleetError, match="f.yml:"):
        append_pnode("name: f\n", "f.yml", new)


def _by_hand(cm, stage_of: dict[str, int], p: PNode, share: int, micro: int, stage: int) -> float:
    """Stage `stage`'s compute seconds per step, written out from the formula of vgraph/cost/stepcost.py."""
    kind = {"linear": "matmul", "tied_lm_head_ce": "matmul", "attention": "attention", "attention_head": "attention"}
    total = 0.0
    for node in cm.nodes.values():
        if stage_of[node.id] != stage:
            continue
        k = kind.get(node.type) or ("elementwise" if node.flops else "structural")
        train = 3 * node.flops + node.recompute_flops
        total += share * train / (p.flops * p.efficiency.of_peak(k)) + min(micro, share) * p.efficiency.overhead(k)
    return total


@pytest.mark.parametrize("shares, micro", [([8], 4), ([8], 1), ([7, 1], 4)])
def test_the_step_cost_prices_each_kind_at_its_share_plus_its_overhead(shares, micro) -> None:
    """Every replica and stage by hand: one micro-batch (no bubble of overheads to share), and a replica whose
    one sample runs one micro-batch however many the others run (the overhead counted once, not M times)."""
    graph = load(TINY_FP32)
    batch = sum(shares)
    cm = cost_model(graph, batch=batch, micro_batches=micro)
    eff = Efficiency((("matmul", KindCost(0.5, 4e-5)), ("attention", KindCost(0.1, 2e-4)),
                      ("elementwise", KindCost(0.01, 2e-5)), ("structural", KindCost(None, 5e-6))))
    p = PNode("a", 2 ** 34, 1e10, 1e12, "cpu", efficiency=eff)
    q = PNode("b", 2 ** 34, 1e10, 1e12, "cpu", efficiency=eff)
    order = [n.id for n in graph.topo_order()]
    stage_of = {v: (0 if i < len(order) // 2 else 1) for i, v in enumerate(order)}
    loads = stage_loads(cm, stage_of, 2)
    cost = step_cost(loads, [[p, q]] * len(shares), shares, micro)
    fa = FleetArrays(Fleet.of("pq", p, q))
    compute = compute_seconds(loads, fa, np.array([[0, 1]] * len(shares)), shares, micro)  # placement.json's
    for r, share in enumerate(shares):
        for s, pnode in enumerate((p, q)):  # compute or traffic, the longer (fast links here: the compute)
            by_hand = _by_hand(cm, stage_of, pnode, share, micro, s)
            traffic = share * max(loads.send[s].sum(), loads.send[:, s].sum()) / pnode.bandwidth
            assert cost.stage_seconds[r, s] == pytest.approx(max(by_hand, traffic)
                                                             + loads.sync[s].sum() / pnode.bandwidth, rel=1e-12), (r, s)
            assert compute[r, s] == pytest.approx(by_hand, rel=1e-12), (r, s)
    # Without the figures: FLOPs / peak, as before.
    plain = step_cost(loads, [[PNode("a", 2 ** 34, 1e10, 1e12), PNode("b", 2 ** 34, 1e10, 1e12)]], [batch], micro)
    assert plain.stage_seconds[0, 0] == pytest.approx(batch * loads.flops[0] / 1e10 + loads.sync[0].sum() / 1e12)
    assert cost.step_seconds > 10 * plain.step_seconds  # small ops at a hundredth of the peak, and overheads


def test_the_partition_heuristic_balances_time_when_the_fleet_is_probed() -> None:
    graph = load(TINY_FP32)
    cm = cost_model(graph, batch=8, micro_batches=2)
    plain = loads_fleet("name: f\npnodes:\n  - {id: a, memory: 1GiB, flops: 10G, bandwidth: 1GB/s}\n")
    assert np.array_equal(effective_flops(cm, plain), cm.train_flops_per_sample() * 8)
    probed = loads_fleet(ENTRY.format("{attention: {of_peak: 0.1, overhead: 1ms}}"))
    eff = effective_flops(cm, probed)
    ids = cm.node_columns["id"]
    att = ids.index("block0_attention") if "block0_attention" in ids else next(
        i for i, t in enumerate(cm.node_columns["type"]) if t in ("attention", "attention_head"))
    other = next(i for i, t in enumerate(cm.node_columns["type"]) if t == "linear")
    flops = cm.train_flops_per_sample() * 8
    assert eff[att] == pytest.approx(flops[att] / 0.1 + 2 * 1e-3 * 10e9) and eff[other] == flops[other]
