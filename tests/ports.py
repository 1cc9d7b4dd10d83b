"""Rendezvous ports for the tests' launches: a block below the kernel's ephemeral range, a slice of it per
xdist worker.

Why not `rendezvous.free_port()`: it returns an ephemeral port that is free at that instant, but a launch
uses the block around the port it is given (the launchers' channel on port - 1, attempt n's store on
port + n), and every gloo pair and TCP client of the tests running beside it takes ephemeral ports.  On CI
one took port + 1 between the pick and attempt 1 ("cannot listen on 127.0.0.1:36882: Address already in
use", test_elastic_launch).  A port below the ephemeral range is only ever bound by whoever names it, and
each xdist worker names ports of its own slice, so no other test can hold one.
"""
from __future__ import annotations

import itertools
import os
import socket

BLOCK = 12  # port - 1 .. port + 10: the channel and eleven attempts
_LOW = 10000


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker() -> tuple[int, int]:
    """(this process's xdist worker number, how many there are); (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    number = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return number % max(count, 1), max(count, 1)


def _blocks():
    number, count = _worker()
    top = max(_ephemeral_low(), _LOW + BLOCK * count * 4)
    per_worker = (top - _LOW) // count // BLOCK  # blocks in this worker's slice
    first = _LOW + number * per_worker * BLOCK
    start = os.getpid() % per_worker  # consecutive sessions start at different blocks
    for i in itertools.count():
        yield first + ((start + i) % per_worker) * BLOCK + 1


_next = _blocks()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the launcher binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_port() -> int:
    """A --master-port whose whole block (port - 1 .. port + 10) can be listened on now and belongs to this
    worker: the same contract as `free_port()` for one port, kept for the block a launch uses."""
    for _ in range(10000):
        port = next(_next)
        if all(_bindable(p) for p in range(port - 1, port - 1 + BLOCK)):
            return port
    raise RuntimeError("no block of free ports below the ephemeral range")
