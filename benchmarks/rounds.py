"""Alternated rounds and the medians read from them: the one rule behind every benchmark's summary (issue 42).

This machine is shared: a neighbour's burst can triple a step and its load drifts over minutes.  So the
variants a figure compares run in the same round, back to back, in an order that turns every round (a burst
or a drift falls on all of them alike, and no variant always runs first, on a cold cache, or last), and a
comparison is the median over rounds of each round's ratio.  Not a ratio of minimums: one lucky round
decides a minimum (bench_grad_sync's last line read 1.17 and 1.25 on an idle machine while every row's
median ratio was 0.90-1.10).  Not a ratio of medians taken apart: that loses the pairing.  A summary line
says how many rounds it rests on (`rounds_note`).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(ways: Sequence[T], round_: int) -> list[T]:
    """The order of `ways` in round `round_`: turned by one each round (two ways: A-B, B-A, A-B...)."""
    ways = list(ways)
    if not ways:
        return []
    k = round_ % len(ways)
    return ways[k:] + ways[:k]


def paired_median(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of a[i] / b[i]: round i ran both, back to back."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired rounds: {len(a)} against {len(b)} figures")
    return statistics.median(x / y for x, y in zip(a, b))


def timed_rounds(ways: dict[str, Callable[[], object]], rounds: int, warmup: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of one call of each way per round, the ways in `rotated` order; `warmup` rounds run first,
    untimed (the allocator, caches, lazy set-up)."""
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in rotated(names, r):
            start = clock()
            ways[name]()
            if r >= warmup:
                times[name].append(clock() - start)
    return times


def rounds_note(rounds: int) -> str:
    """What a summary says of the rounds behind it."""
    return f"median of {rounds} alternated round{'' if rounds == 1 else 's'}"
