"""The worker processes `vgraph launch` starts on its machine: forked fast, their output relayed, their fate watched.

Why a module of its own: the launcher decides *what* runs (placement, job,
restarts: emission.py, attempts.py, failures.py); this is *how* the local
workers run: forked from a forkserver that imported torch once (a worker, and a restart, starts in milliseconds instead
of seconds), with the torchrun environment, their stdout and stderr relayed
line by line prefixed with their PNode, killed with the launcher (Linux
PR_SET_PDEATHSIG), and watched until all succeed or the first one fails
(then the others are stopped: SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from vgraph.base.safeio import atomic_write
from vgraph.run.files import RUN_LOCK_ENV

from ..job import RESCUE_SIGNAL
from ..runtime.progress import PROGRESS_ENV
from ..rendezvous import TOKEN_ENV, free_port, gloo_environment, probe_port

__all__ = ["Supervisor", "TERMINATE_GRACE_S", "RESCUE_GRACE_S", "warm"]

TERMINATE_GRACE_S = 5.0
RESCUE_GRACE_S = 5.0  # a survivor's shard is written in well under a second on the test networks


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so no orphan keeps a port or a GPU.

    A worker's parent is the forkserver, which exits when the launcher does."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker_process(job_path: str, env: dict[str, str], output: Any, umask: int) -> None:
    """A worker's entry point, forked from the forkserver (torch is already imported there).

    Its stdout and stderr, Python's and C's alike, go into `output`, a pipe the
    launcher reads and prefixes with the PNode id.  It takes the launcher's
    umask of now: a fork inherits the forkserver's, which is the umask of
    whenever the forkserver started (an earlier launch of the same process).
    """
    # Before any thread exists: every thread of the worker inherits the block, and only its rescue watch
    # takes the signal (runtime/worker.watch_rescue_requests; `ask_rescue`).
    signal.pthread_sigmask(signal.SIG_BLOCK, {RESCUE_SIGNAL})
    os.umask(umask)
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    os.environ.update(env)
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the launcher alone decides (a stop request, launch()).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..runtime.worker import main as worker_main

    sys.exit(worker_main([job_path]))


def _current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting one: put it straight back
    os.umask(mask)
    return mask


# What a worker runs (its module: torch, the lowering, the training loop; the supervisor's fork target) and writes
# (safetensors' torch writer: checkpoints, rescue shards), imported once in the server: the launcher itself imports
# none of it (backends/torch/__init__.py says why).
WORKER_PRELOAD = ["vgraph.backends.torch.distributed.runtime.worker", "vgraph.backends.torch.distributed.launcher.supervisor",
                  "safetensors.torch", "torch._dynamo"]
RANK_ZERO_PRELOAD = ["matplotlib.figure", "matplotlib.backends.backend_agg", "torch.utils.tensorboard"]


def _context(rank_zero: bool = True) -> Any:
    """Workers fork from a forkserver that imported vgraph and torch once: a worker (and a restart)
    starts in milliseconds instead of seconds, and nothing is forked from the launcher's threads.
    `rank_zero`: this machine may run world rank 0 (only the coordinator's machine does: a joined machine
    never), whose imports the server takes too; the preload counts only when the server starts."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the first optimizer built imports it (1-2 s), once here instead of in every worker.
    # matplotlib's figure and Agg canvas, TensorBoard's writer: rank 0 draws the loss curve at every checkpoint and
    # at the end, and logs to TensorBoard (0.7-1.1 CPU-s of imports), once here instead of in every attempt's
    # rank 0; a machine without rank 0 leaves them out (at 0.35 of a core, 2 s of a joiner's wait to be admitted).
    ctx.set_forkserver_preload(WORKER_PRELOAD + (RANK_ZERO_PRELOAD if rank_zero else []))
    return ctx


def warm(wait: bool = False, rank_zero: bool = True) -> None:
    """Start the forkserver the workers fork from now: it imports vgraph, torch and torch._dynamo in its own
    process while this launcher places the plan or receives its files.  `wait`: return only once it has
    (a process forked from it and ended), which is what a joiner does before it asks to be admitted;
    `rank_zero`: whether this machine may run world rank 0 (`_context`).

    Why: started at the first attempt instead, those imports are on the path of the first step, and a
    machine that joins runs its first attempt right after a boundary that every machine waits for: in
    bench_churn (0.35 of a core a host, 2026-12-07) the first join's boundary took 20-23 s where a leave's,
    every server warm, took 3.9 s; the fleet trains on while the newcomer imports.  Spawning the server does
    not wait for its imports (multiprocessing.forkserver.ensure_running); the first fork does."""
    ctx = _context(rank_zero)
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    with _main_module_hidden():  # the server would import the launcher's main script otherwise
        forkserver.ensure_running()
        if wait:
            ready = ctx.Process(target=os.getpid, name="vgraph-forkserver-ready", daemon=True)
            ready.start()
    if wait:
        ready.join()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """multiprocessing re-runs the parent's main script in a child unless it is guarded by
    `if __name__ == "__main__"`; a worker needs nothing from it, so it is hidden while starting one."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@dataclass
class _Worker:
    rank: int
    pnode: str
    process: Any  # multiprocessing.Process
    relay: threading.Thread


class Supervisor:
    """Starts the local workers of one attempt, relays their output, and waits for the outcome."""

    def __init__(self, emit: Callable[[str], None], token: str = "", take: Callable[[str], bool] | None = None,
                 lock_key: str = "") -> None:
        self.emit = emit
        self.token = token  # the run's shared secret (rendezvous.py), handed to each worker
        self.lock_key = lock_key  # the key of the launcher's run lock: rank 0 writes the run under it (files.py)
        self.take = take  # rank 0's progress events go there instead of the output (progress.LaunchBar)
        self.workers: list[_Worker] = []

    def run(self, job_path: Path, ranks: Sequence[int], pnodes: Sequence[str], addr: str, port: int | None,
            threads: int, *, hosts: bool = False, trouble: Callable[[], str | None] | None = None,
            pids: tuple[Path, int] | None = None) -> tuple[bool, dict[int, int], list[int]]:
        """One attempt of this machine's workers `ranks` (world ranks of `pnodes`, the attempt's every rank): started
        (`start`), their pids recorded in `pids` (the file and the attempt: RUN/launch/workers.json, for an outside
        supervisor), waited for (`wait`: its outcome); stopped when anything ends that early (an error, Ctrl-C)."""
        try:
            self.start(job_path, ranks, pnodes, len(pnodes), addr, port, threads, hosts=hosts)
            if pids is not None:
                atomic_write(pids[0], json.dumps({"attempt": pids[1], "pids": self.pids()}))
            return self.wait(trouble=trouble)
        except BaseException:
            self.stop()
            raise

    def start(self, job_path: Path, ranks: Sequence[int], pnodes: Sequence[str], world: int, addr: str,
              port: int | None, threads: int, hosts: bool = False) -> None:
        """Fork the workers with the torchrun environment; their rendezvous is on `addr`:`port` (None: a port free
        there now).  `hosts`: this machine hosts the rendezvous (its rank 0 serves the store), so the port is
        probed first: a busy port is a diagnostic, not a burnt restart."""
        if port is None:
            port = free_port(addr)
        if hosts:
            probe_port(addr, port)
        ctx = _context()
        for local_rank, rank in enumerate(ranks):
            env = dict(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(len(ranks)), OMP_NUM_THREADS=str(threads),
                       MKL_NUM_THREADS=str(threads), VGRAPH_PNODE=pnodes[rank], **{TOKEN_ENV: self.token},
                       **({RUN_LOCK_ENV: self.lock_key} if self.lock_key else {}),
                       **{PROGRESS_ENV: "events" if self.take is not None else "lines"},
                       **gloo_environment(addr))  # gloo on the interface towards the master, not loopback
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_process, args=(str(job_path), env, writer, _current_umask()),
                                  name=f"vgraph-worker-{pnodes[rank]}", daemon=True)
            with _main_module_hidden():
                process.start()
            writer.close()
            relay = threading.Thread(target=self._relay, args=(pnodes[rank], reader), daemon=True)
            relay.start()
            self.workers.append(_Worker(rank, pnodes[rank], process, relay))

    def _relay(self, pnode: str, reader: Any) -> None:
        fd = reader.fileno()
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode("utf-8", "replace").rstrip()
                if self.take is None or not self.take(text):
                    self.emit(f"[{pnode}] {text}")
        if pending.strip():
            self.emit(f"[{pnode}] {pending.decode('utf-8', 'replace').rstrip()}")
        reader.close()

    def pids(self) -> dict[str, int]:
        return {w.pnode: w.process.pid for w in self.workers}

    def wait(self, poll_s: float = 0.02, trouble: Callable[[], str | None] | None = None
             ) -> tuple[bool, dict[int, int], list[int]]:
        """(all succeeded, exit code per rank, ranks that failed first).  `trouble` (several machines:
        membership.py) says why the workers must stop although none failed here: then none counts as lost."""
        while True:
            why = trouble() if trouble is not None else None
            if why:
                self.emit(f"launch: {why}; stopping this machine's workers")
                self.ask_rescue()  # a machine that went dark closed nothing: they may wait in a collective
                self._let_survivors_finish(poll_s)  # a failure elsewhere reaches them as a lost peer too
                self.stop()
                return False, {w.rank: w.process.exitcode for w in self.workers}, []
            codes = {w.rank: w.process.exitcode for w in self.workers}
            failed = [r for r, c in codes.items() if c not in (None, 0)]
            if failed:
                first = {r: codes[r] for r in failed}
                self._let_survivors_finish(poll_s)
                self.stop()
                final = {w.rank: w.process.exitcode for w in self.workers}
                # Ranks killed by a signal before we stopped anyone are the lost ones; else the first to exit.
                lost = [r for r, c in first.items() if c is not None and c < 0] or failed
                return False, final, lost
            if all(c == 0 for c in codes.values()):
                self._join()
                return True, {r: 0 for r in codes}, []
            time.sleep(poll_s)

    def ask_rescue(self) -> None:
        """Ask every live worker for its rescue shard (training/rescue.py) and its exit: a worker waiting on a
        machine that went dark without closing its connections waits in gloo until --comm-timeout, and would
        otherwise be stopped with the state of its last completed step unsaved (runtime/worker.py's rescue
        watch writes it; a worker that already wrote one after a lost peer writes nothing more)."""
        for w in self.workers:
            if w.process.exitcode is None and w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, RESCUE_SIGNAL)

    def _let_survivors_finish(self, poll_s: float) -> None:
        """After a worker failed (here or on another machine), the others see their peer lost (a closed
        connection fails their collective at once), write their rescue shard (training/rescue.py) and exit by
        themselves: wait up to RESCUE_GRACE_S for that before stopping those that did not (a SIGTERM would
        lose the shard; a worker waiting on a link that went dark does not exit, and costs the wait)."""
        deadline = time.monotonic() + RESCUE_GRACE_S
        while time.monotonic() < deadline and any(w.process.exitcode is None for w in self.workers):
            time.sleep(poll_s)

    def stop(self) -> None:
        alive = [w for w in self.workers if w.process.exitcode is None]
        for w in alive:
            w.process.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for w in alive:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join()
        self._join()

    def _join(self) -> None:
        for w in self.workers:
            w.relay.join(timeout=5)
