"""The S x R step cost model (vgraph/cost/stepcost.py): hand-computed cases, agreement with the partition
pass's objective, ring all-reduce bytes, batch shares (optimal by brute force), region links.  The pipeline
itself is simulated (vgraph/cost/makespan.py, tests/test_makespan.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, PNode, load_fleet
from vgraph.cost.fleet_links import Links, Region
from vgraph.cost.stepcost import (FleetArrays, StageLoads, batch_shares, bubble, compute_seconds, resident_array,
                                  resident_samples, ring_allreduce_bytes, stage_loads, step_cost, step_cost_of)
from vgraph.passes.partition import plan_partition

GIB = 2 ** 30


def two_stages() -> StageLoads:
    """Stage 0: 1e9 FLOPs and 100 B of weights' gradients; stage 1: 3e9 FLOPs, 300 B; 10 B/sample between."""
    return StageLoads(flops=np.array([1e9, 3e9]), p2p=np.array([[0.0, 10.0], [10.0, 0.0]]),
                      sync=np.array([[0.0, 4.0], [4.0, 0.0]]), grad_bytes=np.array([100.0, 300.0]),
                      static_bytes=np.array([1000.0, 2000.0]), activation_bytes=np.array([5.0, 7.0]))


def test_two_stages_two_replicas_by_hand():
    fast = [PNode(f"f{i}", GIB, 4e9, 100.0) for i in range(2)]
    slow = [PNode(f"s{i}", GIB, 2e9, 50.0) for i in range(2)]
    cost = step_cost(two_stages(), [fast, slow], [6, 2], micro_batches=2)
    # Sends are asynchronous and links full duplex: a stage's work is the longer of its compute and its
    # busier link direction.  These hand-made loads carry 10 B/sample between the stages, 5 each way.
    # replica 0 (b=6, M=2): stage 1 compute 6*3e9/4e9 = 4.5, link 6*5/100 = 0.3; sync 4/100
    assert cost.stage_seconds[0, 1] == pytest.approx(4.5 + 0.04)
    # The pipeline is the makespan of the workers' 1F1B orders (rank 0: F0 F1 B0 B1, rank 1: F0 B0 F1 B1),
    # a forward a third of a task's time.  Replica 0, micro-batches of 3: stage 0 F 0.25 B 0.5, stage 1
    # F 0.75 B 1.5, a message 3*5/100 = 0.15 on the sender's link.  Rank 0: F0 0-0.25, F1 -0.5; its
    # activations arrive at 0.4 and 0.65.  Rank 1: F0 0.4-1.15, B0 -2.65 (gradient there at 2.8), F1
    # -3.4, B1 -4.9 (gradient at 5.05).  Rank 0: B0 2.8-3.3, B1 5.05-5.55; then the tie sync, 4 B at
    # 100 B/s half each way: 5.59.  (The bubble formula said 1.5 x 4.5 + 0.04 = 6.79.)
    assert cost.replica_seconds[0] == pytest.approx(5.59)
    # Replica 1 (b=2, micro-batches of 1, 2e9 FLOP/s, 50 B/s): stage 0 F 1/6 B 1/3, stage 1 F 0.5 B 1,
    # messages 0.1.  Rank 1: F0 0.2667-0.7667, B0 -1.7667, F1 -2.2667, B1 -3.2667 (gradient at 3.3667);
    # rank 0's B0 1.8667-2.2, B1 3.3667-3.7; the sync 4/50: 3.78.
    assert cost.replica_seconds[1] == pytest.approx(3.78)
    # all-reduce of stage 1 over its group's slowest link (50 B/s): 2 (R-1)/R * 300 / 50
    assert cost.allreduce_stage_seconds.tolist() == pytest.approx([100 / 50, 300 / 50])
    assert cost.step_seconds == pytest.approx(5.59 + 6.0)
    assert cost.bottleneck_seconds == pytest.approx(4.54)
    # each rank's own compute, as priced (the replica report reads it): b x FLOPs / FLOP/s, no communication
    assert cost.compute_seconds.ravel().tolist() == pytest.approx([6 * 1e9 / 4e9, 6 * 3e9 / 4e9,
                                                                  2 * 1e9 / 2e9, 2 * 3e9 / 2e9])
    # On a slow link the traffic is the stage's work: 6 samples x 5 B each way at 1 B/s
    crawl = [PNode(f"c{i}", GIB, 4e9, 1.0) for i in range(2)]
    slowed = step_cost(two_stages(), [crawl], [6], micro_batches=2)
    assert slowed.stage_seconds[0].tolist() == pytest.approx([30.0 + 4.0, 30.0 + 4.0])
    # bytes: replica r sends b_r * 10 + 4 inside; each group 2 (R - 1) x its gradients
    assert cost.p2p_bytes.tolist() == [64.0, 24.0]
    assert cost.allreduce_bytes.tolist() == [200.0, 600.0]
    assert cost.bytes_per_step == 64 + 24 + 800
    # memory: static + activations of ceil(b / M) * min(M, S) resident samples
    assert cost.memory[0].tolist() == [1000 + 5 * 6, 2000 + 7 * 6]
    assert cost.fits


def test_one_replica_between_its_compute_and_the_serial_sum(net8):
    """The partition pass's pipeline of the 8-layer network: its first PNode holds the tied embedding and LM
    head, so it runs the first task and the last (t4-1 -> t4-2 -> t4-3 -> t4-1), which the bubble formula
    (M + S - 1) / M x the slowest stage did not price: with one micro-batch every op and every message runs
    one after another (the step is their sum exactly), and with four the first PNode's two tasks hold the
    pipeline back beyond that formula."""
    fleet = load_fleet(ROOT / "networks" / "fleets" / "t4x4.yml")
    fa = FleetArrays(fleet)
    for micro in (1, 4):
        plan, cm = plan_partition(net8, fleet, batch=16, micro_batches=micro)
        order = list(dict.fromkeys(plan.pnode_of(n.id) for n in net8.topo_order()))
        stage_of = {n.id: order.index(plan.pnode_of(n.id)) for n in net8.nodes}
        loads = stage_loads(cm, stage_of, len(order))
        cost = step_cost(loads, [[fleet.pnode(p) for p in order]], [16], micro, fleet)
        # The pass's objective adds a PNode's traffic, both directions, to its compute (a bound for the cut
        # search); the step model overlaps them on full-duplex links: between the compute and that bound.
        idx = np.array([[fa.index[p] for p in order]])
        compute = compute_seconds(loads, fa, idx, [16], micro)[0]
        assert compute.max() * (1 - 1e-12) <= cost.bottleneck_seconds <= plan.evaluation.bottleneck * (1 + 1e-9)
        assert cost.allreduce_seconds == 0 and cost.allreduce_bytes.sum() == 0
        tasks = loads.task_view()
        assert list(zip(tasks.stage.tolist(), tasks.depth.tolist())) == [(0, 0), (1, 1), (2, 2), (0, 3)]
        src, dst = (tasks.stage[[getattr(e, end) for e in tasks.edges]] for end in ("src", "dst"))
        bw, latency = fa.link(idx[0, src], idx[0, dst])
        back, _ = fa.link(idx[0, dst], idx[0, src])
        serial = compute.sum() + 16 * (tasks.act / bw + tasks.grad / back).sum() + 2 * latency.sum()
        assert loads.sync.sum() == 0  # the tied pair is on one PNode
        if micro == 1:
            assert cost.step_seconds == pytest.approx(serial, rel=1e-12)
        else:
            assert compute.max() < cost.step_seconds < serial
            assert cost.step_seconds > bubble(micro, len(order)) * cost.bottleneck_seconds
        assert cost.p2p_bytes[0] == pytest.approx(plan.evaluation.cut)
        assert cost.memory.max() <= max(plan.evaluation.memory) * (1 + 1e-12)


def test_stage_loads_conserve_the_cost_model(net8):
    cm = cost_model(net8, batch=4)
    one = stage_loads(cm, {n.id: 0 for n in net8.nodes}, 1)
    halves = stage_loads(cm, {n.id: int("block" in n.id and int(n.id[5]) >= 4) for n in net8.nodes}, 2)
    assert one.p2p.sum() == 0 and one.sync.sum() == 0
    assert halves.flops.sum() == pytest.approx(one.flops.sum())
    assert halves.grad_bytes.sum() == one.grad_bytes.sum() == cm.totals()["grad_bytes"]
    assert one.flops.sum() * 4 == pytest.approx(cm.totals()["flops_per_step"])
    assert (halves.p2p == halves.p2p.T).all() and halves.p2p[0, 1] > 0


@settings(derandomize=True, max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64))
def test_the_bubble_factor(micro, stages):
    """(M + S - 1) / M slots of the slowest stage: one micro-batch runs the stages one after another (S), one
    stage has no bubble (1), and the simulated pipeline of S equal stages with no traffic takes exactly that."""
    assert bubble(1, stages) == stages
    assert bubble(micro, 1) == 1
    assert bubble(micro, stages) == pytest.approx((micro + stages - 1) / micro, rel=1e-15)
    loads = StageLoads(*(np.array(x, dtype=float) for x in ([1.0] * stages, np.zeros((stages, stages)),
                                                            np.zeros((stages, stages)), [0.0] * stages,
                                                            [0.0] * stages, [0.0] * stages)))
    fa = FleetArrays(Fleet.of("s", *[PNode(f"p{i}", GIB, 1.0, 1.0) for i in range(stages)]))
    share = 2 * micro  # every replica runs all M micro-batches
    cost = step_cost_of(loads, fa, np.arange(stages).reshape(1, stages), [share], micro)
    assert cost.step_seconds == pytest.approx(share * bubble(micro, stages), rel=1e-12)


def test_a_tied_weight_split_over_stages_is_synced_and_replicated():
    """The embedder (stage 0) publishes the LM head's weight (stage 1): both stages send the tie's sync
    bytes every step, and the user's stage holds a replica of the weight."""
    from tools.gen_networks import TransformerSpec, transformer

    g = transformer(TransformerSpec("tied", layers=1, vocab=64, seq_len=16, dim=32, heads=2, ffn=64, head_up=64,
                                    precision=None))
    cm = cost_model(g, batch=4)
    (tie,) = cm.ties
    assert (tie.publisher, tie.user) == ("embedder", "lm_head") and tie.sync_bytes_per_step > 0
    head = {n.id for n in g.nodes if n.id in ("final_norm", "head_up", "head_swiglu", "head_down", "lm_head", "loss")}
    for user_stage in (1, 0):  # the user after the publisher, and (the same cut numbered the other way) before
        stage_of = {n.id: int(n.id in head) == user_stage for n in g.nodes}
        split = stage_loads(cm, {v: int(x) for v, x in stage_of.items()}, 2)
        whole = stage_loads(cm, {n.id: 0 for n in g.nodes}, 1)
        assert split.sync.tolist()[user_stage][1 - user_stage] == split.sync[1 - user_stage, user_stage] \
            == tie.sync_bytes_per_step
        assert split.static_bytes.sum() == pytest.approx(whole.static_bytes.sum() + tie.replica_bytes)
        assert whole.sync.sum() == 0


def test_stages_that_do_not_talk_pay_no_latency():
    """A chain of three stages in three regions: the pipeline pays the latency of the links it uses
    (0-1 and 1-2, twice: fill and drain, with one 8-byte message each way over each), not of the link
    between the first and the last stage."""
    links = Links({r: Region(r, 1e9, 0.0) for r in "abc"},
                  {frozenset("ab"): (1e9, 0.010), frozenset("bc"): (1e9, 0.020), frozenset("ac"): (1e9, 0.400)})
    p = [PNode(r, GIB, 1e12, 1e9, region=r) for r in "abc"]
    fleet = Fleet.of("chain", *p, links=links)
    p2p = np.array([[0.0, 8.0, 0.0], [8.0, 0.0, 8.0], [0.0, 8.0, 0.0]])
    loads = StageLoads(np.full(3, 1e9), p2p, np.zeros((3, 3)), np.ones(3), np.ones(3), np.ones(3))
    cost = step_cost(loads, [p], [4], 2, fleet)
    work = 4 * 1e9 / 1e12  # every stage's compute (its 4-byte messages overlap it)
    assert cost.replica_seconds[0] == pytest.approx((2 + 3 - 1) / 2 * work + 2 * (0.010 + 0.020) + 4 * 8 / 1e9,
                                                    rel=1e-12)


def test_a_share_smaller_than_the_micro_batches_runs_one_per_sample():
    """A replica with one sample runs one micro-batch, whatever M: its stages and messages one after another."""
    fast = [PNode(f"f{i}", GIB, 4e9, 100.0) for i in range(2)]
    cost = step_cost(two_stages(), [fast, fast], [7, 1], micro_batches=4)
    # stage 0 0.25 s a sample, stage 1 0.75, 5 bytes each way at 100 B/s, the tie sync 4 / 100
    assert cost.replica_seconds[1] == pytest.approx(0.25 + 0.75 + 2 * 5 / 100 + 0.04)
    # Seven samples in micro-batches of 2, 2, 2, 1: stage 1 is busy from the first activations (stage 0's first
    # forward, a third of 2 x 0.25, then 2 x 5 bytes) to its last backward (7 x 0.75 in all); then the last
    # gradient (1 x 5 bytes) and stage 0's last backward (two thirds of 0.25), then the sync.
    assert cost.replica_seconds[0] == pytest.approx(2 * 0.25 / 3 + 2 * 5 / 100 + 7 * 0.75 + 5 / 100 + 2 * 0.25 / 3
                                                    + 0.04)
    assert cost.memory[1].tolist() == [1000 + 5 * 1, 2000 + 7 * 1]  # one sample resident


@pytest.mark.parametrize("R, grads, expected", [(1, 100, 0), (2, 100, 200), (4, 100, 600), (8, 7, 98)])
def test_ring_allreduce_bytes(R, grads, expected):
    assert ring_allreduce_bytes(R, grads) == expected


def test_batch_shares_follow_speed_and_memory():
    assert batch_shares(8, [1, 3]) == [6, 2]
    assert sorted(batch_shares(8, [1, 1, 1])) == [2, 3, 3]
    assert batch_shares(10, [1, 1], caps=[2, 20]) == [2, 8]
    assert batch_shares(3, [1, 1, 1, 1]) is None  # more replicas than samples
    assert batch_shares(10, [1, 1], caps=[2, 2]) is None  # memory holds 4 of 10 samples
    assert batch_shares(5, [1, 1], caps=[0, 5]) is None  # a replica that holds no sample


def greedy(batch, a, c, caps):
    """Brute force: one sample at a time, each to whoever would finish it earliest (optimal min-max)."""
    b = [1] * len(a)
    for _ in range(batch - len(a)):
        r = min((i for i in range(len(a)) if b[i] < caps[i]), key=lambda i: ((b[i] + 1) * a[i] + c[i], i))
        b[r] += 1
    return max(x * y + z for x, y, z in zip(b, a, c))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 100), st.floats(0, 50), st.integers(1, 40)), min_size=1, max_size=7),
       st.integers(1, 120))
def test_batch_shares_are_optimal(rows, batch):
    a, c, caps = ([r[i] for r in rows] for i in range(3))
    shares = batch_shares(batch, a, c, caps)
    if len(rows) > batch or sum(min(x, batch) for x in caps) < batch:
        assert shares is None
        return
    assert sum(shares) == batch and all(1 <= s <= m for s, m in zip(shares, caps))
    finish = max(s * x + z for s, x, z in zip(shares, a, c))
    assert finish <= greedy(batch, a, c, caps) * (1 + 1e-9)


@given(st.integers(1, 300), st.integers(1, 64), st.integers(1, 16))
def test_resident_array_matches_resident_samples(share, micro, stages):
    assert int(resident_array(np.array([share]), micro, stages)[0]) == resident_samples(share, micro, stages)


def test_region_links_price_pipeline_and_allreduce():
    gbit = 1e9 / 8
    links = Links({"eu": Region("eu", 2 * gbit, 0.010), "us": Region("us", 2 * gbit, 0.010)},
                  {frozenset(("eu", "us")): (0.5 * gbit, 0.080)})
    p = [PNode(f"{r}{i}", GIB, 1e12, 10 * gbit, region=r) for r in ("eu", "us") for i in range(2)]
    fleet = Fleet.of("geo", *p, links=links)
    loads = two_stages()
    # replicas inside a region: the pipeline stays local, the all-reduce crosses the ocean
    local = step_cost(loads, [[p[0], p[1]], [p[2], p[3]]], [4, 4], 1, fleet)
    # stage groups inside a region: the all-reduce is local, the pipeline crosses
    groups = step_cost(loads, [[p[0], p[2]], [p[1], p[3]]], [4, 4], 1, fleet)
    assert local.allreduce_stage_seconds[1] == pytest.approx(300 / (0.5 * gbit) + 2 * 0.080)
    assert groups.allreduce_stage_seconds[1] == pytest.approx(300 / (2 * gbit) + 2 * 0.010)
    # One micro-batch runs the stages one after another: stage 0's forward, 20 B and a latency to stage 1,
    # its forward and backward, 20 B and a latency back, stage 0's backward, then the tie sync (4 B, half
    # each way, and a latency each way): 4e-3 + 12e-3 of compute, 44 B over the replica's link, 4 latencies.
    for cost, bw, latency in ((local, 2 * gbit, 0.010), (groups, 0.5 * gbit, 0.080)):
        assert cost.replica_seconds[0] == pytest.approx(4 * 1e9 / 1e12 + 4 * 3e9 / 1e12 + 44 / bw + 4 * latency)
    fa = FleetArrays(fleet)
    for x in p:
        for y in p:
            bw, lat = fa.link(np.array([fa.index[x.id]]), np.array([fa.index[y.id]]))
            assert (float(bw[0]), float(lat[0])) == fleet.link(x, y)


def test_a_ring_pays_the_links_its_members_use():
    """The all-reduce of a stage group runs over the slowest link a ring through its members uses: a region's
    own link only when two members share the region (three in one region: its latency, 2 (R - 1) times),
    the link between two regions when the members are spread over them."""
    gbit = 1e9 / 8
    links = Links({"eu": Region("eu", 0.1 * gbit, 0.050), "us": Region("us", 0.1 * gbit, 0.050)},
                  {frozenset(("eu", "us")): (1 * gbit, 0.005)})
    p = [PNode(f"{r}{i}", GIB, 1e12, 10 * gbit, region=r) for r in ("eu", "us") for i in range(3)]
    fleet = Fleet.of("geo", *p, links=links)
    one = StageLoads(*(np.array(x, dtype=float) for x in ([1e9], [[0.0]], [[0.0]], [300.0], [1.0], [1.0])))
    together = step_cost(one, [[p[0]], [p[1]], [p[2]]], [2, 2, 2], 1, fleet)  # three in eu
    assert together.allreduce_seconds == pytest.approx(2 * 2 / 3 * 300 / (0.1 * gbit) + 2 * 2 * 0.050)
    apart = step_cost(one, [[p[0]], [p[3]]], [3, 3], 1, fleet)  # one in eu, one in us: only the link between
    assert apart.allreduce_seconds == pytest.approx(2 * 1 / 2 * 300 / (1 * gbit) + 2 * 1 * 0.005)


def test_a_plan_must_be_rectangular():
    p = PNode("a", GIB, 1e9, 1e9)
    with pytest.raises(ValueError, match="rows of 2 PNodes"):
        step_cost(two_stages(), [[p]], [1], 1)
    fa = FleetArrays(Fleet.of("one", p))
    with pytest.raises(ValueError):
        step_cost_of(two_stages(), fa, np.zeros((1, 2), dtype=np.int64), [1, 1], 1)
    with pytest.raises(ValueError, match="R >= 1"):  # no replica at all
        step_cost_of(two_stages(), fa, np.zeros((0, 2), dtype=np.int64), [], 1)
    for idx, shares in ((np.zeros((2, 2)), [1]), (np.zeros((1, 3)), [1])):  # a share missing; a stage too many
        with pytest.raises(ValueError, match="R >= 1"):
            step_cost_of(two_stages(), fa, idx.astype(np.int64), shares, 1)
    assert math.isfinite(step_cost_of(StageLoads(*(np.array(x, dtype=float) for x in (
        [1.0], [[0.0]], [[0.0]], [1.0], [1.0], [1.0]))), fa, np.zeros((1, 1), dtype=np.int64), [3], 2).step_seconds)
