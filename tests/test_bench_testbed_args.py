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
