"""The re-plan decision (vgraph/placement/replan.py): the move's bytes and seconds by hand, the choice on
both sides of its threshold, the real planner on a fleet that gains a third PNode, and on random fleets
that the decision agrees with its own prices."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.base.diagnostics import VGraphError
from vgraph.cost.fleet import Fleet, PNode
from vgraph.placement.replan import (DEFAULT_REPLAN_OVERHEAD_S, PlanView, best_plan, decide, price_move,
                                     state_bytes)

MB = 1e6
SIZES = {"embed": 4 * MB, "b1": 8 * MB, "b2": 8 * MB, "head": 4 * MB}


def fleet(*bandwidths: float, flops: float = 1e9, memory: int = 1 << 30) -> Fleet:
    return Fleet.of("f", *(PNode(f"p{i}", memory, flops, bw) for i, bw in enumerate(bandwidths)))


def two_stage(step: float = 1.0) -> PlanView:
    return PlanView.of({"embed": "p0", "b1": "p0", "b2": "p1", "head": "p1"}, None, step)


def three_stage(step: float = 0.8) -> PlanView:
    return PlanView.of({"embed": "p0", "b1": "p1", "b2": "p2", "head": "p2"}, None, step)


def test_a_deeper_pipeline_moves_what_changes_holder_over_the_busiest_link():
    # b1 p0->p1 (8 MB), b2 p1->p2 (8 MB), head p1->p2 (4 MB), all at 100 MB/s: p1 sends 12 MB (0.12 s) and
    # p2 receives 12 MB (0.12 s); embed stays.
    move = price_move(two_stage(), three_stage(), SIZES, fleet(100 * MB, 100 * MB, 100 * MB))
    assert sorted(move.transfers) == [("b1", "p0", "p1", 8 * MB), ("b2", "p1", "p2", 8 * MB),
                                      ("head", "p1", "p2", 4 * MB)]
    assert move.bytes == 20 * MB
    assert move.seconds == pytest.approx(0.12)
    assert move.from_checkpoint == ()


def test_a_replica_on_the_new_pnode_copies_every_vnode_from_the_fastest_holder():
    # One replica on p0 -> two replicas [[p0], [p2]]: every VNode's 24 MB go p0 -> p2.
    old = PlanView.of(dict.fromkeys(SIZES, "p0"), None, 1.0)
    new = PlanView.of(dict.fromkeys(SIZES, "p0"), [["p0"], ["p2"]], 0.55)
    move = price_move(old, new, SIZES, fleet(50 * MB, 100 * MB, 100 * MB))
    assert {t[2] for t in move.transfers} == {"p2"} and {t[1] for t in move.transfers} == {"p0"}
    assert move.bytes == 24 * MB
    assert move.seconds == pytest.approx(24 * MB / (50 * MB))  # p0's 50 MB/s link is the busy one: 0.48 s


def test_a_vnode_two_pnodes_hold_comes_from_the_faster_link_and_never_from_one_that_left():
    # Two replicas [[p0], [p1]] -> three [[p0], [p1], [p2]]: p2 gets all 24 MB from p1 (100 MB/s: 0.24 s), not
    # from p0 (10 MB/s: 2.4 s); with p1 gone, from p0 whatever its link.
    old = PlanView.of(dict.fromkeys(SIZES, "p0"), [["p0"], ["p1"]], 1.0)
    new = PlanView.of(dict.fromkeys(SIZES, "p0"), [["p0"], ["p1"], ["p2"]], 0.7)
    f = fleet(10 * MB, 100 * MB, 100 * MB)
    move = price_move(old, new, SIZES, f)
    assert {(t[1], t[2]) for t in move.transfers} == {("p1", "p2")} and move.seconds == pytest.approx(0.24)
    without_p1 = price_move(old, PlanView.of(dict.fromkeys(SIZES, "p0"), [["p0"], ["p2"]], 0.9), SIZES, f,
                            gone=["p1"])
    assert {(t[1], t[2]) for t in without_p1.transfers} == {("p0", "p2")}
    assert without_p1.seconds == pytest.approx(2.4)


def test_transfers_into_one_pnode_queue_on_its_link():
    # Everything to p2: 12 MB from p0 and 12 MB from p1, each sender busy 0.12 s, but p2 receives 24 MB: 0.24 s.
    move = price_move(two_stage(), PlanView.of(dict.fromkeys(SIZES, "p2"), None, 0.5), SIZES,
                      fleet(100 * MB, 100 * MB, 100 * MB))
    assert move.bytes == 24 * MB and move.seconds == pytest.approx(0.24)


def test_a_gain_over_many_steps_pays_for_the_move():
    # gain (1.0 - 0.8) x 100 = 20 s > 0.12 s + 3 s
    r = decide(two_stage(), three_stage(), SIZES, fleet(100 * MB, 100 * MB, 100 * MB), 100, overhead_s=3.0)
    assert r.chosen == "new"
    assert r.gain_seconds == pytest.approx(20.0)
    assert (r.old_step, r.new_step, r.bytes_moved) == (1.0, 0.8, 20 * MB)
    assert r.move_seconds == pytest.approx(0.12)
    assert "re-plan" in r.describe() and "19.07 MiB" in r.describe()
    assert r.to_json()["vnodes_moved"] == 3 and r.to_json()["gain_s"] == pytest.approx(20.0)


def test_few_steps_left_keep_the_plan():
    # gain (1.0 - 0.8) x 15 = 3 s < 0.12 s + 3 s; one more... 16 steps: 3.2 s > 3.12 s.
    f = fleet(100 * MB, 100 * MB, 100 * MB)
    assert decide(two_stage(), three_stage(), SIZES, f, 15, overhead_s=3.0).chosen == "keep"
    assert decide(two_stage(), three_stage(), SIZES, f, 16, overhead_s=3.0).chosen == "new"
    assert decide(two_stage(), three_stage(), SIZES, f, 0).chosen == "keep"


def test_a_slow_link_to_the_new_pnode_keeps_the_plan():
    # p2 receives 12 MB; its link is the sender's bandwidth: p1 at 100 kB/s -> 120 s, more than the 20 s gained.
    r = decide(two_stage(), three_stage(), SIZES, fleet(100 * MB, 0.1 * MB, 100 * MB), 100, overhead_s=3.0)
    assert r.chosen == "keep" and r.move_seconds == pytest.approx(8 * MB / (0.1 * MB) + 4 * MB / (0.1 * MB))
    assert "not the" in r.reason


def test_a_plan_that_lost_a_pnode_changes_whatever_the_price():
    old = PlanView.of({"embed": "p0", "b1": "p1", "b2": "p1", "head": "p0"}, None, 1.0)
    new = PlanView.of(dict.fromkeys(SIZES, "p0"), None, 2.0)
    r = decide(old, new, SIZES, fleet(100 * MB, 100 * MB), 1, gone=["p1"])
    assert r.chosen == "new" and math.isinf(r.old_step) and r.to_json()["old_step_s"] is None
    assert sorted(r.move.from_checkpoint) == ["b1", "b2"]  # only p1 held them: the checkpoint has them


def test_the_same_plan_is_kept_and_a_slower_one_is_never_chosen():
    f = fleet(100 * MB, 100 * MB, 100 * MB)
    assert decide(two_stage(), two_stage(0.5), SIZES, f, 1000).reason.startswith("the planner's best")
    assert decide(two_stage(), three_stage(1.5), SIZES, f, 1000).chosen == "keep"


def test_a_gain_within_the_figures_spread_keeps_the_plan():
    """A drift's decision prices the spread of its measured figures (replan module docstring): gain (1.0 - 0.8)
    x 100 = 20 s; the change costs 3.12 s; a spread of 10% a step leaves 0.1 x 1.0 x 100 = 10 s uncertain
    (20 > 13.12: re-plan), one of 20% leaves 20 s (20 < 23.12: keep).  Without a spread the same numbers
    re-plan (the premise: it is the margin that keeps)."""
    f = fleet(100 * MB, 100 * MB, 100 * MB)
    r = decide(two_stage(), three_stage(), SIZES, f, 100, overhead_s=3.0, uncertainty=0.1)
    assert r.chosen == "new" and r.margin_s == pytest.approx(10.0) and r.to_json()["margin_s"] == pytest.approx(10.0)
    assert "±10% a step" in r.reason
    r = decide(two_stage(), three_stage(), SIZES, f, 100, overhead_s=3.0, uncertainty=0.2)
    assert r.chosen == "keep" and "saves only 20 s" in r.reason and "the 20 s its figures' spread" in r.reason
    assert decide(two_stage(), three_stage(), SIZES, f, 100, overhead_s=3.0).margin_s == 0.0
    # A plan that lost a PNode changes whatever the spread says (it cannot go on).
    old = PlanView.of({"embed": "p0", "b1": "p1", "b2": "p1", "head": "p0"}, None, 1.0)
    r = decide(old, PlanView.of(dict.fromkeys(SIZES, "p0"), None, 2.0), SIZES, fleet(100 * MB, 100 * MB), 10,
               gone=["p1"], uncertainty=5.0)
    assert r.chosen == "new" and r.margin_s == 0.0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "0.1", True, None])
def test_the_uncertainty_must_be_finite_and_not_negative(bad):
    with pytest.raises(VGraphError, match="uncertainty"):
        decide(two_stage(), three_stage(), SIZES, fleet(1e8, 1e8, 1e8), 10, uncertainty=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_steps_left_must_be_a_count(bad):
    with pytest.raises(VGraphError, match="steps left"):
        decide(two_stage(), three_stage(), SIZES, fleet(1e8, 1e8, 1e8), bad)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "2"])
def test_the_overhead_must_be_finite_and_not_negative(bad):
    with pytest.raises(VGraphError, match="overhead"):
        decide(two_stage(), three_stage(), SIZES, fleet(1e8, 1e8, 1e8), 10, overhead_s=bad)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, None])
def test_a_plan_needs_a_positive_step(bad):
    with pytest.raises(VGraphError, match="predicted step"):
        PlanView.of({"a": "p0"}, None, bad)


# -- with the planner ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return transformer(TransformerSpec("tiny-replan", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                       head_up=64, precision=None))


PARTITION = "partition{batch=8,micro_batches=4,replicas=auto}"


def test_a_third_equal_pnode_pays_over_a_long_run_and_not_over_a_short_one(tiny):
    """The premise: the planner's plan on three equal PNodes is faster than on two (more replicas or a
    deeper pipeline); a long run takes it, a run with a step or two left does not."""
    slow = dict(memory=1 << 30, flops=5e7, bandwidth=1e9)  # compute-bound: more PNodes pay
    two = Fleet.of("two", PNode("a", **slow), PNode("b", **slow))
    three = Fleet.of("three", PNode("a", **slow), PNode("b", **slow), PNode("c", **slow))
    old, _ = best_plan(tiny, two, PARTITION)
    new, _ = best_plan(tiny, three, PARTITION)
    assert "c" in new.pnodes and new.step_seconds < old.step_seconds
    sizes = state_bytes(tiny)
    assert sum(sizes.values()) > 0
    long = decide(old, new, sizes, three, 10_000)
    assert long.chosen == "new" and long.bytes_moved > 0
    assert long.bytes_moved == pytest.approx(sum(sizes[v] * len(new.holders[v] - old.holders[v]) for v in sizes))
    short = decide(old, new, sizes, three, 1)
    assert short.chosen == "keep" and (old.step_seconds - new.step_seconds) < DEFAULT_REPLAN_OVERHEAD_S


@settings(max_examples=8, deadline=None)
@given(flops=st.lists(st.floats(2e7, 2e9), min_size=3, max_size=4),
       bandwidths=st.lists(st.floats(1e5, 1e9), min_size=4, max_size=4),
       steps_left=st.integers(0, 100_000), overhead=st.floats(0.0, 10.0))
def test_on_random_fleets_the_choice_follows_its_own_prices(tiny, flops, bandwidths, steps_left, overhead):
    pnodes = [PNode(f"q{i}", 1 << 30, f, bandwidths[i]) for i, f in enumerate(flops)]
    before = Fleet.of("before", *pnodes[:2])
    after = Fleet.of("after", *pnodes)
    old, _ = best_plan(tiny, before, PARTITION)
    new, _ = best_plan(tiny, after, PARTITION)
    sizes = state_bytes(tiny)
    r = decide(old, new, sizes, after, steps_left, overhead_s=overhead)
    moved = sum(sizes[v] * len(new.holders[v] - old.holders[v]) for v in new.holders)
    assert r.bytes_moved == pytest.approx(moved)
    slowest_single = max((b / after.link(after.pnode(s), after.pnode(d))[0] for _, s, d, b in r.move.transfers),
                         default=0.0)
    assert r.move_seconds >= slowest_single * (1 - 1e-12)
    same = {v: set(p) for v, p in new.holders.items()} == {v: set(p) for v, p in old.holders.items()}
    pays = (old.step_seconds - new.step_seconds) * steps_left > r.move_seconds + overhead
    assert r.chosen == ("new" if pays and not same else "keep")
    # Both sides of the threshold on the same fleets: nothing left never pays, a faster plan over a long
    # enough run always does (the move's seconds are finite).
    assert decide(old, new, sizes, after, 0, overhead_s=overhead).chosen == "keep"
    if new.step_seconds < old.step_seconds and not same:
        assert decide(old, new, sizes, after, 10**12, overhead_s=overhead).chosen == "new"
