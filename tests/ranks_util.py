"""Running a function on N forked processes of one gloo world, for tests of collectives.

`run_ranks(target, world, *args)` starts `world` processes, each calling `target(rank, port, *args, out)`
with a free rendezvous port (tcp://127.0.0.1:port) and a queue `out` it must put one `(rank, result)` on;
returns {rank: result}.  Results travel pickled: tensors should travel as lists, since a tensor in
shared memory dies with the process that sent it.

The processes come from a forkserver (torch imported there once), not from a fork of the test process: a
pytest worker that has run torch ops has OpenMP threads, and a child forked from it can hang in its first
parallel region (seen under load: a 4-rank layout check waited out its 120 s).  `target` must therefore be a
module-level function.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

from ports import launch_port


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 120) -> dict[int, Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    out = ctx.Queue()
    port = launch_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
