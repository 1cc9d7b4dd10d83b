"""vgraph/placement/drift.py: the fleet rescaled to a run's measured busy times, and the drift watch."""
from __future__ import annotations

import math

import pytest

from conftest import TINY
from test_replan import MB, SIZES, fleet, three_stage, two_stage  # plans for the decision's arithmetic
from vgraph import VGraphError, load
from vgraph.cost.fleet import loads_fleet
from vgraph.placement.drift import (DriftWatch, busy_seconds, fleet_file_text, measured_fleet, predicted_busy,
                                    relative_spread)
from vgraph.placement.export import placement_report
from vgraph.placement.replan import decide
from vgraph.transform.pipeline import run_pipeline

FLEET = """name: two
pnodes:
  - {id: a, memory: 1GiB, flops: 2G, bandwidth: 1GB/s}
  - {id: b, memory: 1GiB, flops: 1G, bandwidth: 1GB/s,
     efficiency: {matmul: {of_peak: 0.5, overhead: 40us}, elementwise: {of_peak: 0.01, overhead: 10us},
                  structural: {overhead: 5us}},
     update: {fixed: 1ms, per_param: 1ns}}
"""


@pytest.fixture(scope="module")
def placed():
    fleet = loads_fleet(FLEET)
    g = load(TINY)
    run_pipeline(g, "partition{batch=8,replicas=1,micro_batches=2}", data={"fleet": fleet})
    report = placement_report(g, fleet)
    busy = predicted_busy(report)
    assert set(busy) == {"a", "b"}, "the premise: the tiny network is placed on both PNodes"
    return g, fleet, report


def test_a_pnode_twice_as_slow_is_priced_twice_as_slow_and_the_other_is_unchanged(placed) -> None:
    g, fleet, report = placed
    before = predicted_busy(report)
    result = measured_fleet(fleet, before, {"a": before["a"], "b": 2 * before["b"]})
    assert result.factors == {"a": pytest.approx(1.0), "b": pytest.approx(2.0)} and not result.skipped
    b = result.fleet.pnode("b")
    assert b.flops == pytest.approx(0.5e9)
    assert b.efficiency.overhead("matmul") == pytest.approx(80e-6) and b.efficiency.of_peak("matmul") == 0.5
    assert (b.update.fixed, b.update.per_param) == (pytest.approx(2e-3), pytest.approx(2e-9))
    again = placement_report(g, result.fleet)
    assert again["pnodes"]["b"]["compute_seconds"] == pytest.approx(2 * before["b"], rel=1e-12)
    assert again["pnodes"]["a"]["compute_seconds"] == pytest.approx(before["a"], rel=1e-12)
    # Written and read back: the same figures (a file the next `vgraph launch --fleet` takes).
    back = loads_fleet(fleet_file_text(result.fleet, "measured"))
    assert placement_report(g, back)["pnodes"]["b"]["compute_seconds"] == pytest.approx(2 * before["b"], rel=1e-4)


def test_hostile_measurements_are_skipped_with_a_reason(placed) -> None:
    _, fleet, report = placed
    before = predicted_busy(report)
    for bad in (math.nan, math.inf, -1.0, 0.0, "1", True, None):
        result = measured_fleet(fleet, before, {"b": bad})
        assert result.fleet.pnode("b") == fleet.pnode("b") and result.factors == {}
        assert "not a finite positive number" in result.skipped["b"]
    result = measured_fleet(fleet, before, {"b": before["b"] * 1e9, "zz": 1.0})
    assert "beyond" in result.skipped["b"] and "no PNode 'zz'" in result.skipped["zz"]
    assert "predicted" in measured_fleet(fleet, {"b": 0.0}, {"b": 1.0}).skipped["b"]
    # flops would drop below one FLOP/s: refused rather than written as a fleet no reader takes
    slow = loads_fleet("pnodes: [{id: s, memory: 1GiB, flops: 100, bandwidth: 1GB/s,"
                       " efficiency: {matmul: {overhead: 10ms}}}]")
    assert "flops would become" in measured_fleet(slow, {"s": 1.0}, {"s": 1e3}).skipped["s"]
    fast = loads_fleet("pnodes: [{id: s, memory: 1GiB, flops: 1G, bandwidth: 1GB/s,"
                       " efficiency: {matmul: {overhead: 10ms}}}]")
    assert "more than an hour" in measured_fleet(fast, {"s": 1.0}, {"s": 1e6}).skipped["s"]


def test_busy_is_step_less_idle_and_bad_figures_say_why() -> None:
    assert busy_seconds({"step_s": 0.5, "idle_s": 0.2}) == (pytest.approx(0.3), None)
    for bad in ({"step_s": math.nan, "idle_s": 0}, {"step_s": 1.0, "idle_s": -1}, {"step_s": 1.0, "idle_s": 1.0},
                {"step_s": -1.0}, {"step_s": 1.0, "idle_s": math.inf}, "x", None):
        value, why = busy_seconds(bad)
        assert value is None and why


def feed(watch: DriftWatch, ratios: list[float], predicted: float = 0.1):
    """Drift reports by step (1-based) when PNode p runs `ratio` x its prediction at each step."""
    return {step: d for step, r in enumerate(ratios, 1) if (d := watch.feed(step, {"p": r * predicted}))}


def test_one_slow_step_never_triggers_and_k_consecutive_do() -> None:
    watch = DriftWatch({"p": 0.1}, steps=3, warmup=0, window=3)
    assert feed(watch, [1.0] * 5 + [10.0] + [1.0] * 10) == {}  # a checkpoint's step
    # Even when one step outside would be enough, the window's median keeps a lone spike out...
    assert feed(DriftWatch({"p": 0.1}, steps=1, warmup=0, window=3), [1.0] * 5 + [10.0] + [1.0] * 10) == {}
    # ...which a window of one does not (the premise of the line above).
    assert list(feed(DriftWatch({"p": 0.1}, steps=1, warmup=0, window=1), [1.0] * 5 + [10.0] + [1.0] * 10)) == [6]
    watch = DriftWatch({"p": 0.1}, steps=3, warmup=0, window=3)
    # The window's median is outside from the 2nd slow step on: 3 steps outside at the 4th slow step.
    got = feed(watch, [1.0] * 3 + [2.0] * 3)
    assert got == {}
    got = feed(watch, [2.0] * 4)  # steps 7..10 of the same watch: the 4th slow step is step 7
    assert list(got) == [1] and got[1].pnodes["p"] == (pytest.approx(0.2), 0.1)
    assert feed(watch, [2.0] * 20) == {}  # once per episode
    assert feed(watch, [1.0] * 3 + [0.5] * 4) != {}  # back in the band, then 2x fast: a new episode


def test_the_measured_figure_is_the_episodes_median() -> None:
    watch = DriftWatch({"p": 0.1}, steps=2, warmup=0, window=3)
    feed(watch, [1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 1.5, 1.5, 1.5])
    # The window left the band at the 4th step (1, 3, 3): the episode holds those and every step after,
    # 1 1.5 1.5 1.5 3 3 3 3, whose median is 2.25; the window's (1.5 x 3) is not what the fleet gets.
    assert watch.drifting and watch.measured()["p"] == pytest.approx(0.225)
    assert watch.busy_medians()["p"] == pytest.approx(0.15)
    feed(watch, [1.0] * 3)
    assert not watch.drifting and watch.measured()["p"] == pytest.approx(0.1)


def test_the_report_carries_the_spread_of_its_episode() -> None:
    """relative_spread: half the interquartile range over the median (inclusive quartiles): 1, 2, 3, 4, 5 ->
    quartiles 2 and 4, median 3: 1/3.  A steady episode reports 0, an unsteady one its spread; one spike
    among many steady steps does not widen it (quartiles)."""
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1 / 3)
    assert relative_spread([]) == relative_spread([2.0]) == 0.0 and relative_spread([0.0, 0.0]) == 0.0
    assert relative_spread([1.0] * 9 + [50.0]) == 0.0
    steady = feed(DriftWatch({"p": 0.1}, steps=2, warmup=0, window=1), [0.3] * 4)
    (drift,) = steady.values()
    assert drift.spread == {"p": 0.0} and drift.to_json()["pnodes"]["p"]["spread"] == 0.0
    unsteady = feed(DriftWatch({"p": 0.1}, steps=3, warmup=0, window=1), [0.2, 0.4, 0.3, 0.5])
    (drift,) = unsteady.values()  # the episode so far: 0.2 0.4 0.3 -> quartiles 0.25, 0.35, median 0.3
    assert drift.spread["p"] == pytest.approx(0.05 / 0.3)


def test_warmup_steps_are_ignored_and_zero_disables() -> None:
    watch = DriftWatch({"p": 0.1}, steps=2, warmup=4, window=1)
    assert feed(watch, [5.0] * 4 + [1.0] * 3) == {}  # the slow steps were all warm-up
    watch = DriftWatch({"p": 0.1}, steps=2, warmup=0, window=1)
    assert list(feed(watch, [5.0] * 4)) == [2]  # the premise: without warm-up the same steps trigger
    assert feed(DriftWatch({"p": 0.1}, steps=0, warmup=0, window=1), [5.0] * 10) == {}


def test_the_watch_skips_hostile_figures_and_refuses_bad_settings() -> None:
    watch = DriftWatch({"p": 0.1, "q": math.nan}, steps=2, warmup=0, window=1)
    assert "q" not in watch.predicted
    for step, bad in enumerate((math.nan, math.inf, -0.1, 0.0, None), 1):
        assert watch.feed(step, {"p": bad, "q": 1.0}) is None
    assert [why for _, pid, why in watch.skipped] == ["busy seconds " + repr(b) + " is not a finite positive number"
                                                      for b in (math.nan, math.inf, -0.1, 0.0, None)]
    for step in range(6, 300):
        watch.feed(step, {"p": math.nan})
    assert len(watch.skipped) == 100 and watch.skipped_count == 299  # reasons kept are bounded, all counted
    for kwargs in ({"steps": -1}, {"steps": 1.5}, {"steps": True}, {"window": 0}, {"warmup": 10**9},
                   {"tolerance": 1.0}, {"tolerance": math.inf}, {"tolerance": math.nan}):
        with pytest.raises(VGraphError):
            DriftWatch({"p": 0.1}, **kwargs)
    with pytest.raises(VGraphError, match="no 'pnodes'"):
        predicted_busy({"pnodes": []})


def test_the_run_reader_keeps_a_drift_field_with_only_its_numbers() -> None:
    from vgraph.run.files import metrics_row

    row, dropped = metrics_row({"step": 7, "drift": {"step": 7, "pnodes": {"w1": {"measured_s": 0.2, "predicted_s": 0.1,
                                                                                   "ratio": 2.0}}}})
    assert row["drift"] == {"step": 7, "pnodes": {"w1": {"measured_s": 0.2, "predicted_s": 0.1, "ratio": 2.0}}}
    assert dropped == 0
    row, dropped = metrics_row({"step": 7, "drift": {"step": "x", "pnodes": {"w1": {"ratio": "nan", "x": [1]},
                                                                             "w2": 3}, "evil": 1}})
    assert row["drift"] == {"pnodes": {"w1": {}}} and dropped == 4
    row, dropped = metrics_row({"step": 7, "drift": "slow"})
    assert "drift" not in row and dropped == 1


def test_bench_churn_run_7s_first_drift_is_kept_once_its_spread_is_priced() -> None:
    """Replayed from bench_churn run 7 (2026-12-07; the elastic way's first 8 rows, busy = step - idle, rounded to
    0.1 ms): h1's window left the band at step 4 and the report at step 8 measured 0.1005 s against 0.1276 s,
    as the run's own report did.  The run's decision (replan.decide) priced a gain of 5.17 s over 292 steps
    against a 3.01 s change at 0.1703 s a step, and re-planned onto a plan that measured 0.24 s a step; the
    episode's spread, 0.197, adds 0.197 x 0.1703 x 292 = 9.8 s: kept."""
    busy = [{"h0": 0.4771, "h1": 0.5}, {"h0": 0.2954, "h1": 0.449}, {"h0": 0.0889, "h1": 0.1642},
            {"h0": 0.0993, "h1": 0.0617}, {"h0": 0.1217, "h1": 0.0859}, {"h0": 0.1392, "h1": 0.1005},
            {"h0": 0.1147, "h1": 0.1152}, {"h0": 0.1535, "h1": 0.0667}]
    watch = DriftWatch({"h0": 0.0912, "h1": 0.1276})  # placement.json's compute_seconds; K, W, window as launch's
    reports = {step: d for step, b in enumerate(busy, 1) if (d := watch.feed(step, b))}
    (drift,) = reports.values()
    assert list(reports) == [8] and list(drift.pnodes) == ["h1"]
    assert drift.pnodes["h1"][0] == pytest.approx(0.1005) and drift.spread["h1"] == pytest.approx(0.197, abs=5e-3)
    gain_per_step = 5.17 / 292
    old, new = two_stage(0.1703), three_stage(0.1703 - gain_per_step)
    f = fleet(100 * MB, 100 * MB, 100 * MB)
    overhead = 3.01 - decide(old, new, SIZES, f, 292, overhead_s=0.0).move_seconds
    assert decide(old, new, SIZES, f, 292, overhead_s=overhead).chosen == "new"  # as the run chose
    kept = decide(old, new, SIZES, f, 292, overhead_s=overhead, uncertainty=drift.spread["h1"])
    assert kept.chosen == "keep" and kept.margin_s == pytest.approx(9.8, abs=0.2)
