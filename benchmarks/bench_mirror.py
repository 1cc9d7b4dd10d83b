"""What mirroring the run's history to the machine next in line costs (launcher/succession.py).

    python benchmarks/bench_mirror.py RUN_DIR [RUN_DIR ...]

For each run directory (one with a checkpoint and metrics.jsonl, e.g. from `vgraph train --steps 1
--checkpoint-every 1`), machine 0 serves it on the launchers' channel on loopback (membership.Machines, sealed
lines) and machine 1 pulls it once (succession.Mirror: the rows, then the latest checkpoint in 512 KiB
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
from vgraph.backends.torch.distributed.launcher.succession import Mirror, MirrorSource
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


def main(argv: list[str]) -> int:
    import tempfile

    if not argv:
        print(__doc__)
        return 2
    for arg in argv:
        with tempfile.TemporaryDirectory() as tmp:
            got = measure(Path(arg), Path(tmp) / "mirror")
        total = got["rows_bytes"] + got["checkpoint_bytes"]
        print(f"{arg}: checkpoint {got['checkpoint_bytes']:,} bytes, rows {got['rows_bytes']:,} bytes; pulled in "
              f"{got['seconds']:.2f} s on loopback (CPU {got['cpu']:.2f} s, both sides); "
              f"{total * 8 / 100e6:.2f} s at 100 Mbit/s, "
              f"{total * 8 / 1e9:.3f} s at 1 Gbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
