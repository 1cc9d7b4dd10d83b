"""Every benchmark script runs on its smallest setting and prints its table.

Benchmarks are not run by CI for their numbers (those go into BENCHMARKS.md, measured on a quiet
machine), but a benchmark that no longer runs is found out only when someone needs it.  Here each
script in benchmarks/ (and gpu_check.sh, on the CPU) runs once with the settings below, in a fresh
process, writing nothing into the checkout, and must exit 0 and print a table.  A new benchmark script
must add its smallest setting here: the test fails for a script it does not know.  The fresh process is forked
from a zygote that imported torch once (tests/zygote.py): a script, its vgraph modules and its registries load
in it as in a new interpreter, without paying torch's import (~5 CPU-s with torch._dynamo) once a script.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from zygote import run_python

BENCH = ROOT / "benchmarks"
TINY_FP32 = str(ROOT / "tests" / "fixtures" / "tiny_1l_fp32.yml")  # the scripts run in a scratch directory

# The smallest setting of each script: tiny networks, one round, no warmup, one thread.  {tmp} is a
# scratch directory for anything a script writes, {root} this checkout, {cache} the session's corpus cache.
SMOKE: dict[str, list[str] | None] = {
    "bench_passes.py": ["--sizes", "200", "--repeat", "1"],
    "bench_load.py": ["--sizes", "200", "--no-pyyaml"],
    "bench_partition.py": ["--repeat", "1", "--no-100k", "--ilp-limit", "5", "--only", "time"],
    "bench_fleet_scale.py": ["--sizes", "10", "--seeds", "1", "--generations", "1", "--plot", "{tmp}/fleet_scale.png"],
    "bench_dropout.py": ["--batch", "2", "--seq", "16", "--dim", "32", "--rounds", "1", "--threads", "1"],
    "bench_memory.py": ["--network", "tiny", "--batch", "2", "--threads", "1"],
    "bench_remat.py": ["--smoke"],
    "bench_train_cpu.py": ["--network", "tiny", "--batch", "2", "--rounds", "1", "--warmup", "0", "--threads", "1",
                           "--gemm-size", "64"],
    "bench_gpu.py": None,  # run by gpu_check.sh below
    "bench_graph_breaks.py": ["--networks", "tiny"],
    "bench_onnx.py": ["--batch", "1", "--repeat", "1", "--warmup", "0"],
    "bench_generate.py": ["--smoke", "{tmp}", "--tokens", "4", "--repeat", "1"],
    # --data: a text of this checkout, so that the embedded corpus is not prepared (seconds) for two steps
    "bench_distributed.py": ["--network", TINY_FP32, "--data", "{root}/docs/plugins.md", "--steps", "2", "--warmup",
                             "1", "--batch", "2", "--micro-batches", "1", "--rounds", "1"],
    "bench_launch_pair.py": None,  # run by gpu_check.sh below
    "bench_grad_sync.py": ["--network", "tiny", "--procs", "2", "--mib", "1", "--rounds", "1", "--steps", "1",
                           "--batch", "2", "--micro-batches", "1"],
    "bench_data.py": ["--smoke", "--workdir", "{tmp}/bench-data"],
    # the session's corpus cache ({cache}, conftest): the tiny corpus is prepared once for the suite, not again here;
    # --runs 0: the first run only (a timed run is the same command again)
    "bench_first_step.py": ["--runs", "0", "--cache", "{cache}"],
    "bench_compress.py": ["--smoke"],
    # Two checkouts alternated: here this checkout against itself, one round of the pass benchmark.
    "ab_checkouts.py": ["{root}", "{root}", "--rounds", "1",
                        "--metric", r"8-layer=8-layer production\s+\d+\s+\d+\s+([\d.]+) ms",
                        "--", "benchmarks/bench_passes.py", "--sizes", "200", "--repeat", "1"],
    "bench_testbed.py": ["--smoke", "--plot", "{tmp}/testbed.png", "--workdir", "{tmp}/bench-testbed"],
    "bench_hop_latency.py": ["--smoke"],
    # loopback, the tiny network: one machine, two join as soon as the first plan is placed, one leaves, one is
    # SIGKILLed (each once it trains), then machine 0 is stopped; elastic only
    "bench_churn.py": ["--smoke", "--workdir", "{tmp}/bench-churn"],
    "bench_mirror.py": ["--smoke", "{tmp}/bench-mirror"],
    # the tiny network, 2 processes, 3 steps of each way, equal hosts only (--smoke); --data as above
    "bench_vs_torch.py": ["--smoke", "--data", "{root}/docs/plugins.md"],
}
NEEDS_ROOT = {"bench_testbed.py", "bench_hop_latency.py"}  # the netlab testbed (network namespaces, cgroups): CI runs as root
# What a script's table must show besides numbers: bench_churn reports a way failed (and exits 0) when its launcher
# failed, it logged too few steps or the run ended before an event of the schedule.
SUCCEEDED = {"bench_churn.py": re.compile(r"^\| elastic \| \d", re.M)}
# gpu_check.sh without CUDA runs bench_gpu.py and bench_launch_pair.py on tiny shapes (its CPU fallback);
# its extra arguments go to bench_gpu.py: two variants keep the aot_eager compiles to two, and tiny's one-block
# twin (same shapes and precision policy) is what they trace (~1.2 CPU-s less than two blocks).
GPU_CHECK = ["--variants", "fused,handwritten", "--network", "tiny-1l"]

# A table: a markdown separator row (|---|---:|), the dashed underline of an aligned text table, or
# (bench_partition) a header and rows of three or more columns aligned by runs of spaces.
TABLE = re.compile(r"^\s*(\|\s*:?-{3,}:?\s*)+\|\s*$|^-{3,}(\s+-{3,})+\s*$|(^\S.*?\S {2,}\S.*?\S {2,}\S.*\n){2,}",
                   re.M)


def benchmark_scripts() -> list[str]:
    """The runnable scripts of benchmarks/ (helper modules have no __main__ block)."""
    return sorted(p.name for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8"))


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def test_every_benchmark_script_has_a_smoke_setting() -> None:
    assert benchmark_scripts() == sorted(SMOKE), "add the new script's smallest setting to SMOKE"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(name for name, args in SMOKE.items() if args is not None))
def test_benchmark_runs_on_its_smallest_setting(script: str, tmp_path: Path) -> None:
    if not (BENCH / script).is_file():
        pytest.fail(f"benchmarks/{script} is listed in SMOKE but does not exist")
    if script in NEEDS_ROOT and os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip(f"{script} needs root (the testbed); CI runs as root, so there it runs")
    given = {"{tmp}": str(tmp_path), "{root}": str(ROOT), "{cache}": os.environ["VGRAPH_CACHE_DIR"]}
    args = [re.sub(r"\{(tmp|root|cache)\}", lambda m: given[m.group(0)], a) for a in SMOKE[script]]
    r = run_python([BENCH / script, *args], cwd=tmp_path, env=_env(), timeout=600)
    assert r.returncode == 0, f"{script} {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert TABLE.search(r.stdout), f"{script} printed no table:\n{r.stdout[-3000:]}"
    assert re.search(r"\d", r.stdout)
    if script in SUCCEEDED:
        assert SUCCEEDED[script].search(r.stdout), f"{script}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    """Without CUDA the script takes its own CPU fallback (tiny shapes, aot_eager compile, gloo launch)."""
    env = dict(_env(), PYTHON=sys.executable, OUT=str(tmp_path / "gpu_check"))
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), *GPU_CHECK], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    results = tmp_path / "gpu_check"
    for table in ("gpu_results.md", "launch_results.md"):
        assert TABLE.search((results / table).read_text(encoding="utf-8")), table
    assert (results / "gpu_results.json").is_file()
    assert "on cpu: tiny-1l," in (results / "gpu_results.md").read_text(encoding="utf-8")  # the override took


@pytest.mark.parametrize("script, args, message", [
    ("bench_gpu.py", ["--network", "tiny-3l"], "invalid choice: 'tiny-3l'"),
    ("bench_launch_pair.py", ["--words", "0"], "--words must be at least 1, got 0"),
    ("bench_launch_pair.py", ["--words", "-5"], "--words must be at least 1, got -5"),
    ("bench_launch_pair.py", ["--words", "nan"], "invalid int value: 'nan'"),
    ("bench_launch_pair.py", ["--words", "2.5"], "invalid int value: '2.5'"),
])
def test_gpu_check_scripts_refuse_a_network_or_corpus_they_cannot_run(script: str, args: list[str], message: str,
                                                                      tmp_path: Path) -> None:
    """The smoke's settings of gpu_check.sh's two scripts, wrong: exit 2 at parsing, nothing written."""
    r = run_python([BENCH / script, *args], cwd=tmp_path, env=_env(), timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_bench_testbed_refuses_a_file_for_its_workdir(tmp_path: Path) -> None:
    """--workdir keeps the probed fleets and placements: a file there is refused before any testbed is built."""
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    r = run_python([BENCH / "bench_testbed.py", "--workdir", taken], cwd=tmp_path, env=_env(), timeout=120)
    assert r.returncode == 2 and "is not a directory" in r.stderr and "Traceback" not in r.stderr
    assert taken.read_text() == "not a directory"


@pytest.mark.parametrize("args, message", [
    (["--procs", "1"], "each count must be 2 to 64"),
    (["--procs", "2,x"], "process counts separated by commas"),
    (["--procs", ""], "process counts separated by commas"),
    (["--batch", "6", "--procs", "4"], "must split evenly into 4 processes"),
    (["--batch", "8", "--micro-batches", "3"], "must split evenly"),
    (["--steps", "3", "--warmup", "2"], "exceed --warmup by at least 2"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--no-equal"], "give --uneven too"),
    (["--no-equal", "--no-uneven"], "give --uneven too"),
])
def test_bench_vs_torch_refuses_settings_that_compare_nothing(args: list[str], message: str, tmp_path: Path) -> None:
    """Refused before anything runs: exit 2, the option named, no traceback."""
    r = run_python([BENCH / "bench_vs_torch.py", *args], cwd=tmp_path, env=_env(), timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("runs, message", [("-1", "--runs must be 0 or more, got -1"), ("x", "invalid int value")])
def test_bench_first_step_refuses_a_negative_or_non_integer_runs(runs: str, message: str, tmp_path: Path) -> None:
    """--runs 0 is the smoke's first run alone; below that nothing is measured: exit 2 before any `vgraph train`."""
    r = run_python([BENCH / "bench_first_step.py", "--runs", runs], cwd=tmp_path, env=_env(), timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
