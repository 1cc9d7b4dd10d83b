"""`--on-failure shrink` from three replicas to two (placing.py's `shrink`, replica_report.rebalanced_shares):
the survivors keep their PNodes, share the whole batch again, and get the least step by brute force over
every split (test_replica_shares.py's oracle), with tie sync and link latency making the fixed seconds of
the replicas differ.  Issue 27, bug 7: survivors keeping their old shares leave samples unassigned."""
from __future__ import annotations

import pytest

from test_replica_shares import REL, brute_force
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch.distributed.launcher.launch import _shrink, place, split_pipeline
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, PNode
from vgraph.cost.fleet_links import Links, Region
from vgraph.cost.stepcost import stage_loads, step_cost
from vgraph.placement.replica_report import rebalanced_shares
from vgraph.transform.pipeline import run_pipeline

GIB = 2 ** 30
BATCH, MICRO = 12, 2
HEAD = ("final_norm", "head_up", "head_swiglu", "head_down", "lm_head", "loss")


@pytest.fixture(scope="module")
def three_replicas():
    """The tiny network cut into 2 stages (its tied embedding split across them: synced every step), 3 replicas
    on slow links (100 kB/s) in two regions: replica 0 fast with both stages in region a, replicas 1 (half
    as fast) and 2 (a quarter) with a stage in each region, so they pay the 30 ms link twice a step and their
    tie sync crosses it at half the rate.  Shares planned for 3 replicas."""
    g = transformer(TransformerSpec("tiny-shrink", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                    head_up=64, precision=None))
    for node_id in HEAD:
        g.node(node_id).set_config(colocate_group="lm_head")
    speeds = {"fast": 1e8, "mid": 5e7, "slow": 2.5e7}
    region = {"fast0": "a", "fast1": "a", "mid0": "a", "mid1": "b", "slow0": "a", "slow1": "b"}
    pnodes = [PNode(f"{kind}{s}", 4 * GIB, f, 1e5, "cpu", region=region[f"{kind}{s}"])
              for kind, f in speeds.items() for s in (0, 1)]
    links = Links({"a": Region("a", 1e9, 0.002), "b": Region("b", 1e9, 0.002)}, {frozenset(("a", "b")): (5e4, 0.03)})
    fleet = Fleet.of("three", *pnodes, links=links)
    rows = [[f"{kind}0", f"{kind}1"] for kind in speeds]
    before, partition, after = split_pipeline(None, True, {"batch": str(BATCH), "micro_batches": str(MICRO)})
    probe = g.copy()
    run_pipeline(probe, before, target="cpu")
    stage1 = {n.id for n in probe.nodes if n.id.startswith("block1") or n.config.get("colocate_group") == "lm_head"}
    assignment = {n.id: rows[0][n.id in stage1] for n in probe.nodes}
    first = place(g, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                  micro_batches=MICRO, assignment=assignment)
    shares = rebalanced_shares(first.graph, fleet, first.final, rows, BATCH, MICRO)
    placed = place(g, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                   micro_batches=MICRO, assignment=assignment, replicas=(rows, shares))
    return placed, fleet, g, (before, partition, after)


def pricer(placement, fleet, final, rows):
    """shares -> StepCost of the plan `rows` (PNodes per replica, in stage order) for the placed graph."""
    cm = cost_model(placement.graph, batch=BATCH, micro_batches=MICRO)
    stage = {p: s for s, p in enumerate(rows[0])}
    loads = stage_loads(cm, {v: stage[p] for v, p in final.items()}, len(rows[0]))
    assert loads.sync.sum() > 0  # the tied weight is synced between the stages: fixed seconds per step
    pnodes = [[fleet.pnode(p) for p in row] for row in rows]
    return lambda shares: step_cost(loads, pnodes, shares, MICRO, fleet)


def test_three_replicas_are_planned_by_speed(three_replicas):
    placement, fleet, _, _ = three_replicas
    assert placement.rows == [["fast0", "fast1"], ["mid0", "mid1"], ["slow0", "slow1"]]
    shares = placement.shares
    assert sum(shares) == BATCH and shares[0] > max(shares[1:])  # the fast replica most (and no link latency)
    best, _ = brute_force(pricer(placement, fleet, placement.final, placement.rows), BATCH, 3)
    assert placement.report["step_seconds"] == pytest.approx(best, rel=REL)


@pytest.mark.parametrize("lost, survivors", [("mid1", ["fast", "slow"]), ("fast0", ["mid", "slow"]),
                                             ("slow0", ["fast", "mid"])])
def test_shrink_from_three_replicas_to_two_shares_the_whole_batch_by_speed(three_replicas, lost, survivors):
    """`--on-failure shrink` (placing.py's `shrink`): the survivors keep their PNodes and share the whole batch
    again, the least step by brute force (keeping their old shares would leave samples unassigned)."""
    placement, fleet, source, (before, partition, after) = three_replicas
    assignment, (rows, shares) = _shrink(placement, fleet, [lost], f"{lost} (rank 3, exit -9)", BATCH, MICRO)
    assert rows == [[f"{kind}0", f"{kind}1"] for kind in survivors]
    assert set(assignment.values()) == set(rows[0])  # replica 0's assignment moved to the first survivor
    assert sum(shares) == BATCH and shares[0] > shares[1] >= 1  # the whole batch, the faster replica more
    final = {v: rows[0][placement.rows[0].index(p)] for v, p in placement.final.items()}
    price = pricer(placement, fleet, final, rows)
    best, best_shares = brute_force(price, BATCH, 2)
    assert price(shares).fits and price(shares).step_seconds == pytest.approx(best, rel=REL), (shares, best_shares)
    # the launcher's next attempt places exactly that plan
    again = place(source, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                  micro_batches=MICRO, assignment=assignment, replicas=(rows, shares))
    assert again.rows == rows and again.shares == shares and again.final == final
    assert again.report["step_seconds"] == pytest.approx(best, rel=REL)


def test_shrink_without_a_whole_replica_left_is_an_error(three_replicas):
    from vgraph.backends.torch import TrainingError

    placement, fleet, _, _ = three_replicas
    with pytest.raises(TrainingError, match="no complete replica is left"):
        _shrink(placement, fleet, ["fast0", "mid1", "slow0"], "three workers", BATCH, MICRO)


def _fleet_with(fleet, memory: dict[str, int]):
    """`fleet` with some PNodes' memory replaced."""
    import dataclasses

    return Fleet.of(fleet.name, *[dataclasses.replace(p, memory=memory.get(p.id, p.memory)) for p in fleet],
                    links=fleet.links)


def test_shrink_shares_respect_memory_to_the_last_sample(three_replicas):
    """A survivor whose PNodes hold exactly one sample gets one; one byte less and the plan is refused by name;
    a single survivor takes the whole batch."""
    from vgraph.base.diagnostics import VGraphError

    placement, fleet, _, _ = three_replicas
    rows = [placement.rows[0], placement.rows[2]]
    final = placement.final
    need = step_cost(stage_loads(cost_model(placement.graph, batch=BATCH, micro_batches=MICRO),
                                 {v: placement.rows[0].index(p) for v, p in final.items()}, 2),
                     [[fleet.pnode(p) for p in rows[1]]], [1], MICRO, fleet).memory[0]
    tight = _fleet_with(fleet, {p: int(b) for p, b in zip(rows[1], need)})
    assert rebalanced_shares(placement.graph, tight, final, rows, BATCH, MICRO) == [BATCH - 1, 1]
    too_small = _fleet_with(fleet, {rows[1][0]: int(need[0]) - 1})
    with pytest.raises(VGraphError, match="2 replica\\(s\\) cannot hold the batch of 12"):
        rebalanced_shares(placement.graph, too_small, final, rows, BATCH, MICRO)
    assert rebalanced_shares(placement.graph, fleet, final, rows[:1], BATCH, MICRO) == [BATCH]


def test_a_placement_whose_replicas_do_not_match_the_graph_is_refused(three_replicas):
    """placement.json's replica fields against the graph they came with: replica 0 must use the graph's PNodes
    and the shares must be one per replica and add up to the batch; one replica takes whatever the batch is."""
    from vgraph.base.diagnostics import VGraphError
    from vgraph.placement.replica_report import replica_layout

    placement, _, _, _ = three_replicas
    graph, final = placement.graph.copy(), placement.final
    used = list(dict.fromkeys(final[n.id] for n in graph.topo_order()))
    rows = placement.rows

    def layout(**fields):
        graph.meta["placement"] = fields
        return replica_layout(graph, final, BATCH)

    assert layout() == ([used], [BATCH])
    assert layout(replica_pnodes=[used], batch_shares=[5]) == ([used], [BATCH])  # planned for another batch
    assert layout(replica_pnodes=rows, batch_shares=placement.shares) == (rows, placement.shares)
    for bad in ({"replica_pnodes": rows[1:] + rows[:1], "batch_shares": placement.shares},  # replica 0 elsewhere
                {"replica_pnodes": [rows[1]], "batch_shares": [BATCH]},
                {"replica_pnodes": [used[:1]], "batch_shares": [BATCH]},  # one replica on part of the PNodes
                {"replica_pnodes": rows, "batch_shares": placement.shares[:2]},
                {"replica_pnodes": rows, "batch_shares": placement.shares + [1]},
                {"replica_pnodes": rows, "batch_shares": [BATCH, 1, 1]},
                {"replica_pnodes": [used + [rows[1][0]]], "batch_shares": [BATCH]},  # one replica, a PNode more
                {"replica_pnodes": rows, "batch_shares": [placement.shares[0] - 1, *placement.shares[1:], 1]}):
        with pytest.raises(VGraphError, match="replicas do not match the graph: replica 0 uses "
                                              f"{', '.join(bad['replica_pnodes'][0])}, "):
            layout(**bad)


def test_shrink_caps_a_fast_survivor_at_the_samples_its_memory_holds(three_replicas):
    """The fast survivor would take about 4/5 of the batch by speed; with its PNodes' memory at what a share
    of 4 needs (1F1B keeps ceil(b / M) x min(M, S) samples: 4 for shares 3 and 4, 6 for 5) it gets exactly 4,
    and one byte less drops it to 2 (what fits in the next smaller footprint); the slow survivor takes the
    rest.  A cap counted from a share of 0, or memory that does not grow with the resident samples, gives
    the fast one more than its memory holds."""
    placement, fleet, _, _ = three_replicas
    rows = [placement.rows[0], placement.rows[2]]
    final = placement.final
    loads = stage_loads(cost_model(placement.graph, batch=BATCH, micro_batches=MICRO),
                        {v: placement.rows[0].index(p) for v, p in final.items()}, 2)
    assert rebalanced_shares(placement.graph, fleet, final, rows, BATCH, MICRO)[0] > 5  # speed alone: more

    def need(share: int) -> list[int]:
        return [int(b) for b in step_cost(loads, [[fleet.pnode(p) for p in rows[0]]], [share], MICRO, fleet).memory[0]]

    assert need(3) == need(4) and all(a < b for a, b in zip(need(4), need(5)))
    exact = _fleet_with(fleet, dict(zip(rows[0], need(4))))
    assert rebalanced_shares(placement.graph, exact, final, rows, BATCH, MICRO) == [4, BATCH - 4]
    short = _fleet_with(fleet, {rows[0][0]: need(4)[0] - 1, rows[0][1]: need(4)[1]})
    assert rebalanced_shares(placement.graph, short, final, rows, BATCH, MICRO) == [2, BATCH - 2]


def test_shrink_drops_the_replica_of_a_machine_that_leaves(three_replicas):
    """bench_churn's smoke (2026-12-07): a joined machine SIGKILLed while another one's leave waited for its
    boundary stopped machine 0 with KeyError 'h1' in rebalanced_shares: the restart's fleet (the admission's
    grown_fleet) lacks the leaving machine's PNodes, and shrink kept its replica.  Now that replica goes too, the
    shares are priced on the replicas the next attempt runs, and without a whole replica left it says so."""
    from vgraph.backends.torch import TrainingError

    placement, fleet, _, _ = three_replicas
    leaving = fleet.without(["mid0", "mid1"])  # the machine of replica 1 said it leaves
    assignment, (rows, shares) = _shrink(placement, leaving, ["slow0"], "slow0 (rank 4, exit -9)", BATCH, MICRO)
    assert rows == [["fast0", "fast1"]] and shares == [BATCH] and set(assignment.values()) == {"fast0", "fast1"}
    with pytest.raises(TrainingError, match="no complete replica is left"):
        _shrink(placement, fleet.without(["fast0", "fast1"]), ["slow0", "mid1"], "two workers", BATCH, MICRO)
