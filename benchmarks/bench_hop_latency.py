"""What one message and one small collective cost between testbed hosts, by host count and CPU quota.

The quiet testbed run (docs/benchmarks-history.md, issue 26) measured every 4-host plan at 1 Gbit/s
10-55 ms a step slower than predicted, whatever the network's size, and the 2-host plans close to their prediction: a fixed cost per
step that grows with the hosts, not with the bytes.  This script isolates it.  In each of 2 and 4 netlab
hosts (1 Gbit/s, with and without a 0.5-core quota), one gloo process (the workers' backend and transport)
times, after a barrier, 200 times each:

* `all_reduce` of 8 float64 (what every launch step runs once on the control group for its decisions),
* `gather_object` of a small dict to rank 0 (the per-step metrics gather),
* a ping-pong of 4 bytes and of 64 KiB between ranks 0 and 1 (a pipeline's point-to-point message),

and prints the median and minimum in milliseconds.  The cost model charged none of the first two when this
was written and a probed link's latency (0 without `links`) for the last; it now prices them with the
fleet's measured `collectives` table (`vgraph probe --collectives`, vgraph/cost/collectives.py).

    .venv/bin/python benchmarks/bench_hop_latency.py          # as root, ~1 min; a quiet machine
    .venv/bin/python benchmarks/bench_hop_latency.py --smoke  # 2 hosts with a quota, 3 rounds (the suite's)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.netlab import Testbed, check_available  # noqa: E402

PORT = 29555
ROUNDS = 200


def _timed(op, rounds: int) -> tuple[float, float]:
    import torch.distributed as dist

    seconds = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        op()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3, min(seconds) * 1e3


def host_main(rank: int, world: int, rounds: int) -> None:
    """One testbed host's process: join the group on host 0, time the four operations, rank 0 prints them."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    ips = os.environ["NETLAB_IPS"].split(",")
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    store = dist.TCPStore(ips[0], PORT, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    small = torch.zeros(8, dtype=torch.float64)
    rows = {"all_reduce, 8 float64": _timed(lambda: dist.all_reduce(small), rounds),
            "gather_object to rank 0": _timed(lambda: dist.gather_object(
                {"loss": 1.0, "step_s": 0.1}, [None] * world if rank == 0 else None, dst=0), rounds)}
    for size in (4, 65536):
        buf = torch.zeros(size // 4)

        def ping_pong() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        rows[f"ping-pong ranks 0-1, {size:,} B"] = _timed(ping_pong, rounds)
    if rank == 0:
        for name, (median, least) in rows.items():
            print(f"ROW\t{name}\t{median:.3f}\t{least:.3f}", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1Gbit/s")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--smoke", action="store_true", help="2 hosts with a 0.5-core quota, 3 rounds")
    parser.add_argument("--host", nargs=2, type=int, metavar=("RANK", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.host:
        host_main(*args.host, args.rounds)
        return 0
    if not 1 <= args.rounds <= 100_000:
        parser.error(f"--rounds must be between 1 and 100000, got {args.rounds}")
    check_available()
    shapes = [(0.5, 2)] if args.smoke else [(cpu, hosts) for cpu in (0.5, None) for hosts in (2, 4)]
    if args.smoke:
        args.rounds = 3
    print(f"load {os.getloadavg()[0]:.2f}; {args.rate} links; {args.rounds} rounds each; one gloo process per host\n")
    print("| hosts | CPU quota per host | operation | median ms | min ms |\n|---:|---|---|---:|---:|")
    for cpu, hosts in shapes:
        with Testbed(hosts, rate=args.rate, cpu=cpu) as tb:
            argvs = [[sys.executable, __file__, "--host", str(i), str(hosts), "--rounds", str(args.rounds)]
                     for i in range(hosts)]
            done = tb.run_all(argvs, timeout=600)
        if any(d.returncode for d in done):
            raise SystemExit(f"a host failed:\n{next(d.stdout for d in done if d.returncode)[-2000:]}")
        for line in done[0].stdout.splitlines():
            if line.startswith("ROW\t"):
                _, name, median, least = line.split("\t")
                print(f"| {hosts} | {cpu if cpu else 'none'} | {name} | {median} | {least} |", flush=True)
    print(f"\nload {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
