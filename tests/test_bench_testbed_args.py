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


def test_a_picked_one_host_plan_is_judged_against_its_own_groups_runs():
    """Where the planner picks one host at a later rate, that group ran the one-host plan itself: the verdict
    compares it with that group's plans, not with the same plan measured in another group minutes before
    (the machine's drift); where it picks another shape, the one-host row still counts as a rival."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_testbed", ROOT / "benchmarks" / "bench_testbed.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_testbed"] = bench  # its dataclass looks its module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["bench_testbed"]
    Row = bench.Row
    rows = [Row("n", "1G", "one host", 1, 1, 0.05, 0.050),
            Row("n", "1G", "pipeline x2", 2, 1, 0.04, 0.060, pick=True),
            Row("n", "20M", "pipeline x2", 2, 1, 0.07, 0.068),
            Row("n", "20M", "pick 1x1", 1, 1, 0.05, 0.070, pick=True)]
    worst, pick, lines = bench.verdicts(rows)
    assert lines[0].endswith("1.20x")  # 1G: the pick (60 ms) against the one-host row (50 ms)
    assert lines[1].endswith("1.03x") and "fastest measured is pipeline x2" in lines[1]  # 20M: its own group
    assert pick == pytest.approx(0.060 / 0.050) and worst == pytest.approx(0.04 / 0.060)


def test_every_pass_is_priced_on_a_fleet_probed_just_before_it(tmp_path, monkeypatch):
    """The hosts are probed again before each pass; pass k's launches get pass k's fleet, and a plan's
    prediction is the mean of what its passes' launches priced (the machine drifts between passes)."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_testbed", ROOT / "benchmarks" / "bench_testbed.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_testbed"] = bench
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["bench_testbed"]
    probed, launched = [], []

    class TwoHosts:
        hosts = [0, 1]

    monkeypatch.setattr(bench, "probe_hosts", lambda tb, network, fleet, *a, **k: probed.append(fleet))
    monkeypatch.setattr(bench, "planner_pick", lambda *a: (2, 1))
    monkeypatch.setattr(bench, "forced_placement", lambda *a: {})

    def run_plan(tb, network, fleet, corpus, placement, hosts, where, args):
        launched.append((fleet, placement.name))
        return (0.01 if fleet == probed[0] else 0.03) * hosts, [0.02 * hosts] * 3

    monkeypatch.setattr(bench, "run_plan", run_plan)
    args = argparse.Namespace(passes=3, link_seconds=1.0, rounds=1, smoke=False, batch=8, micro_batches=4)
    rows = bench.group(TwoHosts(), "net", tmp_path / "net.yml", "1Gbit/s", tmp_path, tmp_path / "c.txt", args,
                       with_one_host=True)
    assert len(probed) == 3 and len(set(probed)) == 3  # one fleet file per pass, each probed before its pass
    assert [f for f, _ in launched] == [probed[0]] * 2 + [probed[1]] * 2 + [probed[2]] * 2
    by_plan = {r.plan: r for r in rows}
    assert by_plan["one host"].predicted == pytest.approx((0.01 + 0.03 + 0.03) / 3)
    assert by_plan["pipeline x2"].predicted == pytest.approx((0.02 + 0.06 + 0.06) / 3)
    assert by_plan["pipeline x2"].measured == pytest.approx(0.04) and by_plan["pipeline x2"].pick
