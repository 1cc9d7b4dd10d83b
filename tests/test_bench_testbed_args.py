"""benchmarks/bench_testbed.py refuses counts it cannot run with before it builds a testbed (its smoke run is in
test_benchmarks_smoke.py): a zero `--passes` would leave a plan without a measured step."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("argv, message", [
    (["--passes", "0"], "--passes must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--micro-batches", "-3"], "--micro-batches must be at least 1, got -3"),
    (["--passes", "two"], "invalid int value: 'two'"),
])
def test_a_count_it_cannot_run_with_is_refused_before_any_testbed(argv, message, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_testbed.py"), *argv,
                        "--workdir", str(tmp_path / "w")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()


@pytest.fixture
def bench():
    """benchmarks/bench_testbed.py as a module (it is a script, not a package member)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_testbed", ROOT / "benchmarks" / "bench_testbed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_testbed"] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["bench_testbed"]
    return module


def test_a_picked_one_host_plan_is_judged_against_its_own_groups_runs(bench):
    """Where the planner picks one host at a later rate, that group ran the one-host plan itself: the verdict
    compares it with that group's plans, not with the same plan measured in another group minutes before
    (the machine's drift); where it picks another shape, the one-host row still counts as a rival."""
    Row = bench.Row
    rows = [Row("n", "1G", "one host", 1, 1, 0.05, 0.050),
            Row("n", "1G", "pipeline x2", 2, 1, 0.04, 0.060, pick=True),
            Row("n", "20M", "pipeline x2", 2, 1, 0.07, 0.068),
            Row("n", "20M", "pick 1x1", 1, 1, 0.05, 0.070, pick=True)]
    worst, pick, lines = bench.verdicts(rows)
    assert lines[0].endswith("1.20x")  # 1G: the pick (60 ms) against the one-host row (50 ms)
    assert lines[1].endswith("1.03x") and "fastest measured is pipeline x2" in lines[1]  # 20M: its own group
    assert pick == pytest.approx(0.060 / 0.050) and worst == pytest.approx(0.04 / 0.060)


def test_every_pass_is_priced_on_a_fleet_probed_just_before_it(bench, tmp_path, monkeypatch):
    """The hosts are probed again before each pass; pass k's launches get pass k's fleet, and a plan's
    prediction is the mean of what its passes' launches priced (the machine drifts between passes)."""
    import argparse

    probed, launched = [], []

    class TwoHosts:
        hosts = [0, 1]

    bursts = []
    monkeypatch.setattr(bench, "probe_hosts", lambda tb, network, fleet, *a, **k: probed.append(fleet)
                        or bursts.append(k["cpu_burst"]))
    monkeypatch.setattr(bench, "planner_pick", lambda *a: (2, 1))
    # the same placement priced on pass k's fleet with the PNodes' cpu_burst left out
    monkeypatch.setattr(bench, "priced_without_burst", lambda network, fleet, placement, batch, micro:
                        0.5 if fleet == probed[0] else 0.8)
    monkeypatch.setattr(bench, "forced_placement", lambda *a: {})

    def run_plan(tb, network, fleet, corpus, placement, hosts, where, args):
        launched.append((fleet, placement.name))
        return (0.01 if fleet == probed[0] else 0.03) * hosts, [0.02 * hosts] * 3

    monkeypatch.setattr(bench, "run_plan", run_plan)
    args = argparse.Namespace(passes=3, link_seconds=1.0, rounds=1, smoke=False, batch=8, micro_batches=4,
                              cpu_burst=True)
    rows = bench.group(TwoHosts(), "net", tmp_path / "net.yml", "1Gbit/s", tmp_path, tmp_path / "c.txt", args,
                       with_one_host=True)
    assert len(probed) == 3 and len(set(probed)) == 3  # one fleet file per pass, each probed before its pass
    assert [f for f, _ in launched] == [probed[0]] * 2 + [probed[1]] * 2 + [probed[2]] * 2
    by_plan = {r.plan: r for r in rows}
    assert by_plan["one host"].predicted == pytest.approx((0.01 + 0.03 + 0.03) / 3)
    assert by_plan["pipeline x2"].predicted == pytest.approx((0.02 + 0.06 + 0.06) / 3)
    assert by_plan["pipeline x2"].measured == pytest.approx(0.04) and by_plan["pipeline x2"].pick
    assert bursts == [True] * 3  # every pass's probes time the quota's burst
    assert by_plan["pipeline x2"].without_burst == pytest.approx((0.5 + 0.8 + 0.8) / 3)
    assert "| 0.04" in bench.table(rows) and bench.table(rows).splitlines()[0].endswith("without cpu_burst |")


def _pnode(seconds: float, rate: float, burst: int = 1000):
    """A probed host whose priced step is `seconds` (flops encode it for the fake pricer) and link `rate`."""
    from vgraph.cost.fleet import PNode

    return PNode("h1", 2**30, 1.0 / seconds, rate, accelerator="cpu", burst=burst)


def _price(p) -> float:
    return 1.0 / p.flops


def test_two_probes_that_agree_keep_the_later_without_a_third(bench):
    first, second = _pnode(0.100, 1e8), _pnode(0.110, 0.95e8)

    def again():
        raise AssertionError("a third probe of two that agree within 15%")

    assert bench.settle([first, second], _price, again) is second


@pytest.mark.parametrize("slow", [0, 1])
@pytest.mark.parametrize("third, kept", [(0.104, 0.104), (0.095, 0.100), (0.200, 0.160)])
def test_a_probe_caught_in_a_slow_spell_is_outvoted_by_a_third(bench, slow, third, kept):
    """Run 14's miss: one probe priced the host 1.6x the other.  A third probe is taken and the median of the
    three kept; keeping either of the first two, the third, or a mean would each be wrong in some case here."""
    samples = [_pnode(0.100, 1e8), _pnode(0.100, 1e8)]
    samples[slow] = _pnode(0.160, 1e8)
    calls = []
    chosen = bench.settle(samples, _price, lambda: calls.append(1) or _pnode(third, 1e8))
    assert calls == [1] and _price(chosen) == pytest.approx(kept)


def test_a_link_measured_slow_once_takes_its_rate_and_burst_from_the_median_probe(bench):
    """The link's rate and burst come from the probe with the median rate, the compute figures from the one
    with the median step: they are separate measurements, and either may be the one caught in a spell."""
    samples = [_pnode(0.100, 1.2e8, burst=5000), _pnode(0.101, 0.6e8, burst=100)]
    kept = bench.settle(samples, _price, lambda: _pnode(0.120, 1.1e8, burst=4000))
    assert kept.bandwidth == 1.1e8 and kept.burst == 4000 and _price(kept) == pytest.approx(0.101)


def test_a_host_is_priced_as_its_one_host_launch_would_be(bench, tmp_path):
    """host_pricer prices through place(), the launcher's own pricing, so two probes are compared by what a
    plan on the host would be priced at: a host of half the speed, twice the step (no per-op overheads here)."""
    import shutil

    network = tmp_path / "tiny.yml"
    shutil.copy(ROOT / "tests" / "fixtures" / "tiny_1l_fp32.yml", network)
    price = bench.host_pricer(network, batch=8, micro=4)
    fast, slow = _pnode(1e-9, 1e8), _pnode(2e-9, 1e8)  # 1 and 0.5 GFLOP/s
    assert price(slow) == pytest.approx(2 * price(fast), rel=0.01) and price(fast) > 0
