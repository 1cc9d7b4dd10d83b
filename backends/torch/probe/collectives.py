"""`vgraph probe --collectives`: what a step's small collectives cost among the fleet's hosts, all at once.

    VGRAPH_LAUNCH_TOKEN=<secret> vgraph probe --collectives --nnodes N --node-rank I --master-addr HOST0
                                             [--master-port P] [--rounds K] [--append FLEET.yml]

Run on every host of the fleet at the same time, as `vgraph launch` is (the same rendezvous, token rule
and gloo backend: rendezvous.py).  For k = 1 .. N hosts (every k up to 16, then powers of two and N), the
first k ranks time, `--rounds` times back to back, what the workers run every step besides training
(`ControlGroup`, comm.py: the all-reduce of the step's six decisions; the gather of the metrics rows to
rank 0 and their writing happen at sync points about once a second (worker.py), a millisecond or two a
second, and are not timed), a gloo all-reduce of 8 numbers,
whose time over its 2 (k - 1) ring hops is one message's while k ranks communicate, and (RING_ROUNDS
times) one of RING_BYTES, the bytes a second a replicas' gradient all-reduce gets among them (its hops'
latency taken out); the other ranks wait.  Rank 0 writes the medians as the fleet's
`collectives` table (vgraph/cost/collectives.py: why a link between two idle hosts does not tell them)
into FLEET.yml (replacing a table there; everything else kept), or prints it.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable


from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.safeio import atomic_write, read_input
from vgraph.cost.collectives import Collectives, collectives_of
from vgraph.cost.fleet import MAX_FLEET_BYTES, FleetError, loads_fleet
from vgraph.yamlio.yaml_reader import compose


RENDEZVOUS_S = 300.0  # how long rank 0 waits for the others to join
RING_BYTES, RING_ROUNDS = 1 << 20, 5  # the all-reduce whose rate is measured (0.7 s a round at 20 Mbit/s)
MAX_ROUNDS = 100_000

def rank_counts(world: int) -> list[int]:
    """The host counts measured: every one up to 16, then the powers of two below `world`, and `world`."""
    small = list(range(1, min(world, 16) + 1))
    return small + [k for k in (2 ** i for i in range(5, 31)) if k < world] + ([world] if world > 16 else [])


def measure(rank: int, world: int, rounds: int, env: dict[str, str] | None = None) -> Collectives | None:
    """Join the fleet's process group and time the collectives; the table on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    from ..distributed.runtime.comm import ControlGroup
    from ..distributed.rendezvous import gloo_environment, rendezvous_store

    env = dict(os.environ if env is None else env)
    os.environ.update(gloo_environment(env.get("MASTER_ADDR", "127.0.0.1"), env))
    torch.set_num_threads(1)
    store = rendezvous_store(rank, world, timedelta(seconds=RENDEZVOUS_S), env)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=RENDEZVOUS_S))
    try:
        rows, rings = [], {}
        for k in rank_counts(world):
            group = dist.new_group(list(range(k)))  # every rank creates every group, in the same order
            if rank < k:
                ctrl = ControlGroup(rank, k, group)
                small = torch.zeros(8, dtype=torch.float64)
                control = _median(lambda: ctrl.all_reduce([0.0] * 6), rounds)
                hop = _median(lambda: dist.all_reduce(small, group=group), rounds) / (2 * (k - 1)) if k > 1 else 0.0
                rows.append((k, control, hop))
                if k > 1:
                    big = torch.zeros(RING_BYTES // 4)
                    seconds = _median(lambda: dist.all_reduce(big, group=group), min(rounds, RING_ROUNDS))
                    moved = 2 * (k - 1) / k * RING_BYTES
                    rings[k] = max(1.0, moved / max(seconds - 2 * (k - 1) * hop, seconds / 10))
            dist.barrier()
        return collectives_of(rows, rings) if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _median(op: Callable[[], Any], rounds: int) -> float:
    op()  # the first call sets up the group's connections
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        op()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def with_collectives(text: str, file: str, table: Collectives) -> str:
    """The fleet file `text` with its `collectives` table replaced by (or given) `table`; the rest kept."""
    fleet = loads_fleet(text, file)
    root = compose(text)
    keys = {k.value: (k, v) for k, v in root.value}
    block = table.flow()
    if "collectives" in keys:
        key, value = keys["collectives"]
        rest = text[value.end_mark.index:]
        new = text[:key.start_mark.index] + block + (rest[1:] if rest.startswith("\n") else rest)
    else:
        key, _ = keys["pnodes"]
        start = key.start_mark.index - key.start_mark.column
        new = text[:start] + block + text[start:]
    try:
        again = loads_fleet(new, file)
    except FleetError:
        again = None
    if again is None or again.ids != fleet.ids or not _same(again.collectives, table):
        raise VGraphError(f"{file}: could not write the collectives table into this fleet's layout; add it by "
                          f"hand:\n{block}")
    return new


def _same(a: Collectives, b: Collectives) -> bool:
    """The same table up to the 6 significant digits it is written with."""
    close = lambda x, y: math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-12)  # noqa: E731
    return (len(a.rows) == len(b.rows) and len(a.rings) == len(b.rings)
            and all(n == m and close(c, d) and close(h, g) for (n, c, h), (m, d, g) in zip(a.rows, b.rows))
            and all(n == m and close(x, y) for (n, x), (m, y) in zip(a.rings, b.rings)))


def check_output_fleet(path: str | Path) -> str:
    """The text of the fleet `--append` names (it must exist: the table belongs to its PNodes)."""
    p = Path(path)
    if not p.exists():
        raise VGraphError(f"--append {quote(str(path))}: no such fleet file (probe the hosts first: `vgraph probe "
                          f"NETWORK --append {quote(str(path))}` on each)")
    return read_input(p, what="fleet file", limit=MAX_FLEET_BYTES)


def run_collectives(rank: int, world: int, rounds: int, append: str | Path | None, env: dict[str, str],
                    say: Callable[[str], None]) -> None:
    """The command: measure, then rank 0 writes the table (into `append`) or prints it."""
    text = check_output_fleet(append) if append is not None and rank == 0 else None
    if text is not None:
        with_collectives(text, str(append), Collectives(((2, 0.0, 0.0),)))  # the fleet takes a table: before
    try:
        table = measure(rank, world, rounds, env)
    except (RuntimeError, OSError) as exc:  # torch's store and gloo errors: a host missing, a port taken
        raise VGraphError(f"probe --collectives: the {world} hosts did not all meet at {env.get('MASTER_ADDR')}:"
                          f"{env.get('MASTER_PORT')} within {RENDEZVOUS_S:g} s, or one left ({str(exc)[:300]}); "
                          f"start it on every host with the same --nnodes, --master-addr, --master-port and "
                          f"VGRAPH_LAUNCH_TOKEN") from None
    if table is None:
        return
    for k, control, hop in table.rows:
        ring = table.ring(k) if k > 1 else None
        say(f"probe: {k} host{'s' * (k > 1)}: control collectives {control * 1e3:.3f} ms a step, {hop * 1e3:.3f} ms "
            f"a message" + (f", all-reduce {ring * 8 / 1e6:.4g} Mbit/s" if ring else ""))
    if append is None:
        print(table.flow(), end="")
        return
    current = read_input(Path(append), what="fleet file", limit=MAX_FLEET_BYTES)  # as it is now, not at start
    atomic_write(append, with_collectives(current, str(append), table))


__all__ = ["measure", "rank_counts", "with_collectives", "run_collectives", "MAX_ROUNDS"]
