"""Write tests/durations.json from the `--durations=0` report of a suite run: the order the suite is dealt in.

    bash tools/test.sh --durations=0 | tee /tmp/suite.log
    .venv/bin/python tools/durations.py /tmp/suite.log          # rewrites tests/durations.json

The suite runs on two pytest-xdist workers, and a test dealt last that takes a minute leaves one core idle for
that minute: the CI run of stop 31 spent 1.5-2 minutes at 99% (3,369 tests, 2 cores, 1.4 cores busy on
average).  tests/conftest.py deals the tests longest first (the classic LPT rule: the tail is then at most one
short test) from the seconds this file records: setup + call + teardown of every test that took at least
MIN_SECONDS.  A stale file costs only speed (an unknown test counts as fast), never a result.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from any directory: vgraph from this checkout

from vgraph.base.diagnostics import VGraphError  # noqa: E402
from vgraph.base.safeio import atomic_write  # noqa: E402

OUT = ROOT / "tests" / "durations.json"
MIN_SECONDS = 0.5  # below this a test's place in the order does not matter
LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(tests/\S+::\S.*?)\s*$")


def parse(text: str) -> dict[str, float]:
    """Seconds per test node id (its phases summed) from pytest's `--durations` lines."""
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(3).split("@")[0]] += float(m.group(1))  # '@group': xdist's loadgroup suffix
    return dict(seconds)


def write(seconds: dict[str, float], out: Path) -> int:
    """Atomically replace `out` with the tests of at least MIN_SECONDS, longest first; returns how many."""
    kept = {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= MIN_SECONDS}
    atomic_write(out, json.dumps(kept, indent=0) + "\n", make_parents=False, durable=False)
    return len(kept)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="the output of a suite run with --durations=0")
    ap.add_argument("-o", "--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    try:
        text = args.log.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        print(f"durations: cannot read {args.log}: {e.strerror or e}", file=sys.stderr)
        return 2
    seconds = parse(text)
    if not seconds:
        print(f"durations: {args.log} has no --durations lines (run the suite with --durations=0)", file=sys.stderr)
        return 2
    if args.out.is_dir() or not args.out.parent.is_dir():
        print(f"durations: {args.out} is a directory or has no directory to go in", file=sys.stderr)
        return 2
    if args.out.resolve() == args.log.resolve():
        print("durations: the output would replace the log it is read from", file=sys.stderr)
        return 2
    try:
        n = write(seconds, args.out)
    except VGraphError as e:
        print(f"durations: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {n} tests of at least {MIN_SECONDS} s, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
