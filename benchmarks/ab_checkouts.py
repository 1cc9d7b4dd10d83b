"""Two checkouts, one benchmark, alternated in one run: is a change neutral for speed?

    python benchmarks/ab_checkouts.py OLD_CHECKOUT NEW_CHECKOUT --rounds 6 \
        --metric '8-layer=8-layer production\\s+\\d+\\s+\\d+\\s+([\\d.]+) ms' -- benchmarks/bench_passes.py --sizes 10000

Each round runs the benchmark script once in each checkout (with that checkout's own .venv and its own copy
of the script), in A-B order on even rounds and B-A on odd ones, so drift of the machine's load falls on both
alike; each metric is a regular expression whose first group is a number in the script's output.  Printed:
per metric the median of each side and the median of the per-round ratios B/A with its spread.  These
machines are noisy; a ratio is "within noise" when the spread of the per-round ratios contains 1.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rounds import paired_median, rotated, rounds_note  # noqa: E402


def run_once(checkout: Path, script: str, args: list[str], timeout: float) -> str:
    python = checkout / ".venv" / "bin" / "python"
    done = subprocess.run([str(python), str(checkout / script), *args], cwd=checkout, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        sys.exit(f"{checkout}: {script} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def measure(text: str, metrics: dict[str, re.Pattern]) -> dict[str, float]:
    found = {}
    for name, pattern in metrics.items():
        m = pattern.search(text)
        if not m:
            sys.exit(f"metric {name!r} not found in the output:\n{text[-2000:]}")
        found[name] = float(m.group(1))
    return found


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="checkout A (the baseline)")
    ap.add_argument("b", type=Path, help="checkout B (the change)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--metric", action="append", required=True, metavar="NAME=REGEX")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv[:split])
    bench = argv[split + 1:]
    if not bench:
        ap.error("give the benchmark script and its arguments after --")
    metrics = {m.split("=", 1)[0]: re.compile(m.split("=", 1)[1]) for m in args.metric}
    sides: dict[str, dict[str, list[float]]] = {"A": {k: [] for k in metrics}, "B": {k: [] for k in metrics}}
    for r in range(args.rounds):
        for side, checkout in rotated([("A", args.a), ("B", args.b)], r):
            for name, value in measure(run_once(checkout, bench[0], bench[1:], args.timeout), metrics).items():
                sides[side][name].append(value)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} A {sides['A'][k][-1]:.4g} B {sides['B'][k][-1]:.4g}" for k in metrics), flush=True)
    print(f"\nA = {args.a}\nB = {args.b}\nbenchmark: {' '.join(bench)}; {args.rounds} rounds, alternated; "
          f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| metric | A median | B median | B/A (median of per-round ratios) | per-round B/A min-max |")
    print("|---|---:|---:|---:|---:|")
    for k in metrics:
        ratios = [b / a for a, b in zip(sides["A"][k], sides["B"][k])]
        print(f"| {k} | {statistics.median(sides['A'][k]):.4g} | {statistics.median(sides['B'][k]):.4g} | "
              f"{paired_median(sides['B'][k], sides['A'][k]):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")
    print("\nB/A: " + "; ".join(f"{k} {paired_median(sides['B'][k], sides['A'][k]):.3f}" for k in metrics)
          + f" ({rounds_note(args.rounds)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
