"""A CPU quota's burst: a PNode whose CPU share is capped (a cgroup quota, a container's CPU limit) computes
faster right after idling than continuously, and `vgraph probe` measures it continuously.

Why (issue 36 item 6): the testbed's hosts (tools/netlab.py) run under CFS quotas of 0.35 core (2 ms of CPU
every 5.7 ms).  A host that has idled has its period's quota unspent and runs flat out until it is used,
then stops until the period ends.  `vgraph probe` times the program in loops (its figures are the quota's
average rate), and the one-host and replica plans compute without pause, so they run at that rate; a
pipeline's stage waits for its neighbour between micro-batches and spends those waits refilling, so its
short ops run at the CPU's own speed.  On an idle AMD EPYC the 2-stage pipeline ran 1.32-1.44x faster than
priced.  Measured on the testbed (2026-12-07, one 0.35-core host, a 256^3 GEMM, the machine at load 12):
continuously 1,839 us a GEMM; right after 12 ms idle, 788 us a GEMM in a chunk of 5 (2.33x), 1,425 in a
chunk of 10, 1,747 in a chunk of 40: the burst is as long as the quota a period gives.

The probe writes it as

    - id: host0
      cpu_burst: {speedup: 2.7, bucket: 0.75ms}

and the step cost's pipeline simulation (vgraph/cost/makespan.py) charges a rank's compute as a token
bucket, the CPU twin of a link's `burst`: the bucket holds up to `bucket` seconds of work at the CPU's own
speed (`speedup` times the figures' rate), it refills at the figures' rate (1 / speedup of a second each
second) whether the rank computes or waits, and an op runs at `speedup` while tokens last and at the
figures' rate after (`burst_seconds`).  A rank that never waits gets no tokens beyond the refill, which
its op at the figures' rate already is: one-host and replica plans are priced as before, and a PNode
without the figure (no quota) too.

Status: `vgraph probe --cpu-burst` writes the figure only when asked (since 2026-12-07 fitted to runs of small
ops after idling: backends/torch/probe/measure.py `cpu_burst`).  Checked on a quiet testbed run (AMD EPYC,
0.35-core hosts, tb-small, BENCHMARKS.md): every plan within 0.80-1.04 of its measured step and the pick the
fastest, where the same fleets without the figure priced the pipelines 1.05-1.29x their step (worst 1.29).
It now errs the other way: the lowest rows (0.80) are 2x2 replicas at 1 Gbit/s and both pipelines at 20 Mbit/s.
Not modelled: hosts that share the cores they burst on (the testbed's four hosts on two cores) cannot all burst
at once, and a stage's first op after a wait pays cold caches (the probe takes them off its fit).  Not yet
checked on an Intel machine, where the runs before it met the goal without the figure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vgraph.cost.op_kinds import check_both_keys, format_seconds, parse_seconds

CPU_BURST_KEYS = ("speedup", "bucket")
MAX_SPEEDUP = 1000.0  # a quota of a thousandth of a core: the kernel's least quota is 1 ms a period


@dataclass(frozen=True)
class CpuBurst:
    """`speedup`: the CPU's own speed over the rate the PNode's figures were measured at (>= 1); `bucket`:
    seconds of work at that speed its quota passes after idling."""

    speedup: float
    bucket: float

    def flow(self) -> str:
        """The YAML flow mapping a fleet entry carries (`fleet.pnode_flow`)."""
        return f"{{speedup: {self.speedup:.4g}, bucket: {format_seconds(self.bucket)}}}"


def parse_cpu_burst(fields: dict[str, str]) -> CpuBurst:
    """`{speedup: X, bucket: T}` as read from YAML text (both required); ValueError naming what is wrong."""
    check_both_keys(fields, CPU_BURST_KEYS, "{speedup: 2.7, bucket: 0.75ms}")
    try:
        speedup = float(fields["speedup"])
    except ValueError:
        raise ValueError(f"speedup must be a number, got {fields['speedup']!r}") from None
    if not (math.isfinite(speedup) and 1.0 <= speedup <= MAX_SPEEDUP):
        raise ValueError(f"speedup must be from 1 to {MAX_SPEEDUP:g} (the CPU's own speed over the figures' "
                         f"rate), got {fields['speedup']!r}")
    try:
        bucket = parse_seconds(fields["bucket"])
    except ValueError as exc:
        raise ValueError(f"bucket: {exc}") from None
    return CpuBurst(speedup, bucket)


def burst_seconds(duration: np.ndarray, tokens: np.ndarray, speedup: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(seconds an op takes, tokens left) for an op of `duration` at the figures' rate, started with
    `tokens` seconds of work at the CPU's own speed in its bucket (refilled up to the op's start).

    At the CPU's speed the bucket drains by 1 - 1/speedup a second (it refills at 1/speedup meanwhile);
    it lasts `tokens / (1 - 1/speedup)` seconds, doing that much of the op's `duration / speedup` seconds
    of work at that speed; the rest runs at the figures' rate.  Speedup 1 (no quota): the duration."""
    q = 1.0 / np.maximum(speedup, 1.0)
    work = duration * q  # seconds of the op at the CPU's own speed
    drain = 1.0 - q
    fast = np.where(drain > 0, np.minimum(work, tokens / np.where(drain > 0, drain, 1.0)), 0.0)
    seconds = fast + (work - fast) / q
    return seconds, np.maximum(tokens - drain * fast, 0.0)


__all__ = ["CpuBurst", "CPU_BURST_KEYS", "parse_cpu_burst", "burst_seconds"]
