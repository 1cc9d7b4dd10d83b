"""Load + validate + shape inference: the 8-layer production network and generated ones.

For each network the YAML text is made once (`vgraph.dumps`) and `vgraph.loads`
is timed end to end (median of repeated runs, the garbage collector settled
before each).  The same work is also timed phase by phase, so the table
splits it into reading the YAML text and building + verifying the IR.  The
last column times the general PyYAML reader on the same text, i.e. what
loading costs when the fast reader for the canonical layout does not apply.

Targets (issue 2): under 20 ms for the 8-layer network, under 5 s for 100k
VNodes, and linear growth: the 100k/10k ratio at most 12.

    .venv/bin/python benchmarks/bench_load.py [--sizes 1000,10000,100000] [--no-pyyaml]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.gen_networks import synthetic  # noqa: E402
from vgraph import dumps, loads  # noqa: E402
from vgraph.base.diagnostics import DiagnosticSink  # noqa: E402
from vgraph.base.gcpause import paused_gc  # noqa: E402
from vgraph.yamlio.build import Builder  # noqa: E402
from vgraph.yamlio.fast_reader import read_fast  # noqa: E402
from vgraph.yamlio.loading import read_network  # noqa: E402

NET8 = ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml"
TARGET_NET8_S = 0.020
TARGET_100K_S = 5.0
TARGET_RATIO = 12.0


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result  # freeing the graph is not part of loading it
    return statistics.median(times)


class _Discard(Builder):
    """Takes the fast reader's records and builds nothing: times reading alone."""

    def node(self, rec) -> None:
        pass

    def edge(self, rec) -> None:
        pass

    def endpoint(self, rec) -> None:
        pass


def _read_time(text: str, repeat: int) -> float:
    """Median seconds of reading the text into records (the fast reader, nothing built)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        with paused_gc():
            start = time.perf_counter()
            ok = read_fast(text, _Discard("<bench>", DiagnosticSink()))
            times.append(time.perf_counter() - start)
        assert ok, "dumps output must be in the canonical layout"
    return statistics.median(times)


def _repeats(vnodes: int) -> int:
    return 31 if vnodes < 500 else 11 if vnodes < 5_000 else 5 if vnodes < 50_000 else 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="generated network sizes (VNodes)")
    ap.add_argument("--no-pyyaml", action="store_true", help="skip timing the general PyYAML reader")
    args = ap.parse_args(argv)

    cases = [("8-layer production", NET8.read_text(encoding="utf-8"))]
    for size in (int(s) for s in args.sizes.split(",") if s):
        cases.append((f"synthetic({size})", dumps(synthetic(size))))

    rows = []
    totals: dict[str, float] = {}
    for label, text in cases:
        graph = loads(text)
        vnodes = len(graph)
        repeat = _repeats(vnodes)
        total = _median_time(lambda: loads(text), repeat)
        read = _read_time(text, repeat)
        build = total - read
        pyyaml = None
        if not args.no_pyyaml:
            pyyaml = _median_time(lambda: read_network(text, "<bench>", fast=False), max(1, repeat // 3))
        totals[label] = total
        rows.append((label, f"{vnodes:,}", f"{len(text) / 1e6:.2f}", str(repeat), _fmt(read), _fmt(build),
                     _fmt(total), "-" if pyyaml is None else _fmt(pyyaml)))
        print(f"  measured {label}", file=sys.stderr, flush=True)

    header = ("network", "VNodes", "MB", "runs", "read YAML", "build+verify", "loads total",
              "PyYAML reader")
    _table(header, rows)
    print()
    checks = [("8-layer network", totals.get("8-layer production"), TARGET_NET8_S, "s")]
    small, big = totals.get("synthetic(10000)"), totals.get("synthetic(100000)")
    checks.append(("100k VNodes", big, TARGET_100K_S, "s"))
    checks.append(("100k/10k ratio", big / small if big and small else None, TARGET_RATIO, "x"))
    runs = {"8-layer network": "8-layer production", "100k VNodes": "synthetic(100000)",
            "100k/10k ratio": "synthetic(100000)"}
    counts = {row[0]: row[3] for row in rows}
    for what, value, target, unit in checks:
        if value is None:
            print(f"{what}: not measured")
            continue
        shown = _fmt(value) if unit == "s" else f"{value:.1f}"
        limit = _fmt(target) if unit == "s" else f"{target:g}"
        print(f"{what}: {shown} (target <= {limit}) {'OK' if value <= target else 'MISSED'} (medians of "
              f"{counts.get(runs[what], '?')} runs)")
    return 0


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    sys.exit(main())
