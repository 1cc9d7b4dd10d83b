"""What mirroring the run's history to the machine next in line costs (launcher/succession.py).

    python benchmarks/bench_mirror.py RUN_DIR [RUN_DIR ...]
    python benchmarks/bench_mirror.py --smoke WORKDIR   # trains the tiny test network 2 steps there, then pulls it

For each run directory (one with a checkpoint and metrics.jsonl, e.g. from `vgraph train --steps 1
--checkpoint-every 1`), machine 0 serves it on the launchers' channel on loopback (membership.Machines, sealed
lines) and machine 1 pulls it once (mirror.Mirror: the rows, then the latest checkpoint in 512 KiB
chunks): the bytes, the seconds the pull took here and the CPU seconds of both sides together (the channel's own
cost: HMAC, base64, SHA-256, no link),
and what the same bytes take over a 100 Mbit/s and a 1 Gbit/s link.  Those decide the cadence: rows every
second are a few hundred bytes; a checkpoint's pull must fit inside the checkpoint interval.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from vgraph.backends.torch.distributed.launcher.membership import Machines
from vgraph.backends.torch.distributed.launcher.mirror import Mirror, MirrorSource
from vgraph.backends.torch.distributed.rendezvous import free_port

TOKEN = "bench-mirror-secret-0123456789"


def measure(run_dir: Path, scratch: Path) -> dict:
    port = free_port()
    zero, one = Machines(), Machines()
    zero.open("127.0.0.1", port, TOKEN, 0, 2, link_timeout=10.0, rejoin_timeout=10.0)
    zero.serve_mirror(MirrorSource(run_dir).answer)
    one.open("127.0.0.1", port, TOKEN, 1, 2, link_timeout=10.0, rejoin_timeout=10.0)
    try:
        mirror = Mirror(one.request, scratch)
        scratch.mkdir(parents=True, exist_ok=True)
        began, cpu = time.perf_counter(), time.process_time()
        mirror.pull()
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    finally:
        one.close()
        zero.close()
    rows = (scratch / "metrics.jsonl").stat().st_size
    checkpoint = sum(f["bytes"] for f in mirror.figures)
    return {"rows_bytes": rows, "checkpoint_bytes": checkpoint, "seconds": seconds, "cpu": cpu}


def smoke_run(workdir: Path) -> Path:
    """A run directory to pull: the tiny test network trained 2 steps, a checkpoint each step (the suite's
    smoke; the corpus is this checkout's docs/distributed.md, so nothing is downloaded)."""
    from vgraph.backends.torch.cli import main as vgraph_main

    root = Path(__file__).resolve().parent.parent
    run = workdir / "run"
    code = vgraph_main(["train", str(root / "tests" / "fixtures" / "tiny_2l.yml"), "--data",
                        str(root / "docs" / "distributed.md"), "--out", str(run), "--steps", "2", "--batch", "2",
                        "--checkpoint-every", "1", "--val-every", "0", "--threads", "1", "--quiet"])
    if code != 0:
        raise SystemExit(f"bench_mirror: the smoke's training run failed (exit {code})")
    return run


def _problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be pulled, or None: the mirror needs a run's metrics.jsonl and a checkpoint."""
    if not run_dir.is_dir():
        return "not a directory"
    if not (run_dir / "metrics.jsonl").is_file():
        return "no metrics.jsonl in it (a run directory of vgraph train or launch, with a checkpoint)"
    return None


def main(argv: list[str]) -> int:
    import tempfile

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--smoke":
        if len(argv) != 2:
            print("bench_mirror: --smoke takes one WORKDIR", file=sys.stderr)
            return 2
        workdir = Path(argv[1])
        if workdir.exists() and not workdir.is_dir():
            print(f"bench_mirror: {workdir}: not a directory", file=sys.stderr)
            return 2
        argv = [str(smoke_run(workdir))]
    for arg in argv:
        why = _problem(Path(arg))
        if why is not None:
            print(f"bench_mirror: {arg}: {why}", file=sys.stderr)
            return 2
    print("| run | checkpoint | rows | pull on loopback | CPU, both sides | at 100 Mbit/s | at 1 Gbit/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    pulled = True
    for arg in argv:
        with tempfile.TemporaryDirectory() as tmp:
            got = measure(Path(arg), Path(tmp) / "mirror")
        total = got["rows_bytes"] + got["checkpoint_bytes"]
        print(f"| {arg} | {got['checkpoint_bytes']:,} B | {got['rows_bytes']:,} B | {got['seconds']:.2f} s | "
              f"{got['cpu']:.2f} s | {total * 8 / 100e6:.2f} s | {total * 8 / 1e9:.3f} s |")
        pulled = pulled and got["checkpoint_bytes"] > 0
    if not pulled:
        print("bench_mirror: a run's checkpoint was not pulled", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
