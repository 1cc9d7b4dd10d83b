"""Elastic runs: a machine joins a running `vgraph launch` and takes part from the next attempt.

    machine 0:   vgraph launch NET.yml --fleet FLEET.yml --nnodes 1:4 --master-addr 10.0.0.1 --master-port 29500 ...
    a volunteer: VGRAPH_LAUNCH_TOKEN=<the run's secret> vgraph launch --join 10.0.0.1:29500 --pnode me.yml

Why: a volunteer fleet gains machines while a run goes on, and a run with a fixed set of machines cannot use
them until it is stopped and started again.  The joiner brings only its own figures (PNODE.yml, the fleet of
one PNode `vgraph probe -o` writes) and the run's secret; everything else comes from machine 0.

The conversation is on the launchers' channel (membership.py: machine 0 listens on --master-port - 1; every
line both ways sealed with an HMAC keyed by the run's secret, and a line whose seal does not check is
dropped unread), one request per connection:

* `join` {pnode: the PNode file's text, file: its name}: machine 0 admits or refuses with a reason: the run
  already has --nnodes MAX machines; a PNode id the run already has; a file the fleet reader refuses (the
  reason names the joiner's file and line); memory that cannot hold even the network's smallest colocation
  group with one sample's activations (then no plan can give it a share).  A join while a re-plan is under way
  is admitted and queued, never refused: no decision of its own is priced (the workers are already stopping),
  and the planner places it with the others at that re-plan's boundary.  Before sending, the joiner checks its
  own file against its machine's available memory (vgraph/cost/host_memory.py) and refuses to join with a
  message when the file claims more: a plan built on memory a machine lacks crashes the run later. A joiner
  with the wrong secret gets no answer at all (the channel drops it unread); it says so itself after --join-
  timeout.
* `fetch` {name, offset}: the files an admitted machine needs, in chunks of CHUNK_BYTES (base64 in a line,
  below the channel's 1 MiB line limit; a slow link gets FETCH_TIMEOUT_S per chunk).  Only files machine 0
  registered are served, by name, never a path a request names.  What travels: the whole prepared corpus
  (manifest, tokenizer, shards), not the windows the joiner's ranks will read: every rank draws the global
  batch, so its windows over a run are steps x batch x seq_len tokens, more than the corpus after a few
  hundred steps, and a later re-plan may give it other samples.  Measured: the default corpus (the embedded
  one, prepared for the README's distributed_attention_example_6_swiglu_head, 10,000-token vocabulary) is
  1,064,749 bytes (tokenizer 284,950, shards 778,332, manifest 1,467), where that network's windows at --batch
  8 (seq_len 128, 2-byte tokens) are 2 KiB a step: the shards' size by step 380 of the default 1000.  Each
  file's size and SHA-256 are sent with the admission and checked on arrival, and the corpus's manifest digest
  is the one the workers check again.  The joiner writes them into its own run directory (--out, default
  runs/join-<pnode>) through OutputDir, so a second join into the same directory replaces only what a join
  wrote there.
* `job` {attempt}: the job file of attempt N once machine 0 placed it (the network YAML, the placement and
  the training options are all in it), with the machines' PNodes (`home`), or `done` when the run ended.  The
  joiner rewrites the job's paths to its own copies and starts the workers of its PNodes.

Machine 0 decides what a join changes with the re-plan decision (vgraph/placement/replan.py: the planner's
plan on the fleet with the joiner, against the current plan's predicted step over the steps left, the move's
bytes priced over the links).  When the new plan pays, it asks the workers to stop after the current step
with a checkpoint (the stop file, as Ctrl-C does) and the next attempt is placed on the grown fleet: the
state moves through the checkpoint, as the restart path moves it, until the workers hand state over
themselves.  When it does not pay, the machine stays admitted and takes part from the next boundary there
is (a restart after a failure).  Every join and decision is a row of launch/fleet-events.jsonl.

This module is the other machines' side of that conversation (the joiner's checks, its join, the files and
jobs it receives and follows, a machine's leave); machine 0's side, the `Admission` that answers it, is in
boundaries.py with the re-plan decision and the boundary it feeds: the two call each other at every join,
leave and boundary, and are one job on one machine.
"""
from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import OutputDir, atomic_write_with, read_input
from vgraph.cost.fleet import PNode, human_bytes, load_fleet
from vgraph.cost.host_memory import available_host_memory
from vgraph.run.files import LAUNCH_DIR, RunLock

from .membership import CHUNK_BYTES, FETCH_TIMEOUT_S, REQUEST_TIMEOUT_S, ask, channel_key
from .shard_transfer import send_shards
from ...training.rescue import RESCUE_DIR

__all__ = ["JoinRefused", "CoordinatorSilent", "TookOver", "fetch_chunks", "Joined", "Leaving", "read_pnode_file", "check_pnode_memory",
           "join_run", "follow", "follow_attempts", "CHUNK_BYTES", "FETCH_TIMEOUT_S", "MAX_PNODE_TEXT"]

MAX_PNODE_TEXT = 64 * 1024  # a PNode file: a few hundred bytes, its per-kind figures a few more


class JoinRefused(VGraphError):
    """Machine 0 refused this machine (its reason), or this machine refuses to join (its own check)."""


class CoordinatorSilent(JoinRefused):
    """The coordinator has not answered for the silence allowed while this machine waited for a job: lost
    (a follower's `lost` hook elects a successor: succession.py), or the run is over."""


class TookOver(Exception):
    """This machine took the coordinator's role while it followed jobs (succession.succeed_followed): the attempt
    loop goes on as the coordinator from attempt `next_attempt` on `fleet`, `redone` steps to train again."""

    def __init__(self, followed: int, fleet: Any, redone: int) -> None:
        super().__init__(followed, fleet, redone)
        self.next_attempt, self.fleet, self.redone = followed + 1, fleet, redone


# -- the joiner's own checks --------------------------------------------------------------------------

def read_pnode_file(path: str | Path) -> tuple[PNode, str]:
    """The one PNode of a PNode file (a fleet of one, as `vgraph probe -o` writes it) and its text; the fleet
    reader's errors name the file and line."""
    fleet = load_fleet(path)
    if len(fleet) != 1:
        raise JoinRefused(f"{path}: a PNode file describes one machine (vgraph probe -o writes one); this one "
                          f"lists {len(fleet)} PNodes ({', '.join(fleet.ids[:5])})")
    text = read_input(path, what="PNode file", limit=MAX_PNODE_TEXT)  # what the fleet reader just took
    return fleet.pnodes[0], str(text)


def check_pnode_memory(pnode: PNode, where: str, available: tuple[int | None, str] | None = None) -> None:
    """Refuse to join when the file claims more memory than this machine has available now: the plan would
    give it a share it cannot hold, and the run would crash there instead of being refused here."""
    have, source = available if available is not None else available_host_memory()
    if have is not None and pnode.memory > have:
        raise JoinRefused(f"{where}: PNode {pnode.id!r} claims {human_bytes(pnode.memory)} of memory, and this "
                          f"machine has {human_bytes(have)} available ({source}): measure it again (vgraph probe "
                          f"-o) or give the memory it has")


# -- a machine that leaves ---------------------------------------------------------------------------


class Leaving:
    """This machine's graceful leave (a machine k != 0 of a run that takes joins): SIGTERM, or a first Ctrl-C,
    on its launcher tells machine 0 it leaves (`leave` on the channel, sealed like every line, resent until
    machine 0 answers); this machine's workers go on until machine 0's boundary stops them with a checkpoint,
    and the launcher exits 0 when machine 0 releases it (its `job` answer), not before: the checkpoint must
    hold what only its workers held.

    A repeated SIGTERM is said and ignored: process managers send it again, and stopping the workers now
    would lose the step the boundary saves (SIGKILL still stops at once; then the machine is a lost one).
    A second Ctrl-C is a person who wants out now: KeyboardInterrupt, as everywhere else."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.asked = threading.Event()
        self.answered = threading.Event()
        self.released = False  # machine 0 released it when it said it leaves (it held nothing running)
        self._channel: Any = None
        self._lock = threading.Lock()
        self._sender: threading.Thread | None = None
        self._closed = threading.Event()

    def install(self) -> Callable[[], None]:
        """Handle SIGTERM and SIGINT as a leave from now on (main thread only); returns what restores them."""
        import signal

        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            self._closed.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return restore

    def _handle(self, signum: int, frame: Any) -> None:
        import signal

        if self.asked.is_set() and signum == signal.SIGINT:
            self.emit("launch: second interrupt: stopping now, without handing anything off")
            raise KeyboardInterrupt
        self.ask(signal.Signals(signum).name)

    def ask(self, why: str = "asked") -> None:
        """Leave the run (what a signal does; tests call it directly)."""
        if self.asked.is_set():
            self.emit(f"launch: {why}: this machine is already leaving; it exits when machine 0 releases it "
                      f"(SIGKILL stops it at once)")
            return
        self.asked.set()
        self.emit(f"launch: {why}: leaving the run: machine 0 takes a boundary (the workers stop after this step "
                  f"with a checkpoint) and releases this machine")
        self._start()

    def attach(self, channel: Any) -> None:
        """The channel to machine 0 is open (membership.Machines): a leave asked before now is sent."""
        self._channel = channel
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self.asked.is_set() and self._channel is not None and self._sender is None:
                self._sender = threading.Thread(target=self._send, daemon=True)
                self._sender.start()

    def _send(self) -> None:
        while not self._closed.is_set():
            try:
                reply = self._channel.request("leave")
            except (OSError, ValueError):
                reply = {}
            if reply.get("leaving"):
                self.released = bool(reply.get("released"))
                self.answered.set()
                return
            self._closed.wait(0.5)  # machine 0 not reachable yet, or not taking requests yet: again

    def close(self) -> None:
        self._closed.set()


# -- the joiner ------------------------------------------------------------------------------------

def join_run(addr: str, port: int, token: str, pnode_file: str | Path, timeout: float,
             available: tuple[int | None, str] | None = None) -> dict[str, Any]:
    """Ask machine 0 (its channel, `port` = --master-port - 1) to admit this machine: machine 0's answer
    ({"admitted": True, "machine": m, "files": ...}); a JoinRefused with its reason, or with what this
    machine can tell when no answer came within `timeout` seconds."""
    pnode, text = read_pnode_file(pnode_file)
    check_pnode_memory(pnode, str(pnode_file), available)
    key = channel_key(token)
    message = {"op": "join", "machine": -1, "pnode": text, "file": str(pnode_file)}
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            reply = ask(addr, port, key, message, REQUEST_TIMEOUT_S)
            if not reply.get("wait"):
                break
            last = str(reply["wait"])  # a successor taking the run over: its admission opens in a moment
        except ValueError as exc:  # an answer without the run's seal, or none: another secret
            last = str(exc)
        except OSError as exc:
            last = f"cannot reach {addr}:{port}: {exc.strerror or exc}"
        if time.monotonic() > deadline:
            raise JoinRefused(f"no admission from machine 0 at {addr}:{port} within {timeout:g} s ({last}); is "
                              f"VGRAPH_LAUNCH_TOKEN the run's secret, and does the run take joins (--nnodes "
                              f"MIN:MAX)?")
        time.sleep(0.5)
    if not reply.get("admitted"):
        raise JoinRefused(f"machine 0 refused PNode {pnode.id!r}: {reply.get('reason') or reply.get('error')}")
    return {**reply, "pnode_object": pnode}


def _answered(request: Callable[..., dict], op: str, silence_s: float, waiting_for: str, **fields: Any) -> dict:
    """The coordinator's first answer to `op` that is not "wait" (an error included), asked twice a second.
    A failed request (the link, or a reply without the run's seal) is silence and a "wait" is an answer;
    CoordinatorSilent once the coordinator has not answered for `silence_s` while this machine waited for
    `waiting_for` (a follower's `lost` hook then finds the machine that took its role)."""
    heard = time.monotonic()
    while True:
        try:
            reply = request(op, **fields)
            heard = time.monotonic()
        except (OSError, ValueError):
            reply = {"wait": True}
        if not reply.get("wait"):
            return reply
        if time.monotonic() - heard > silence_s:
            raise CoordinatorSilent(f"machine 0 has not answered for {silence_s:g} s while this machine waited for "
                                    f"{waiting_for}: the run is over or its link is lost")
        time.sleep(0.5)


def wait_for_job(request: Callable[..., dict], attempt: int, silence_s: float) -> dict[str, Any]:
    """Machine 0's job for attempt `attempt` or a later one, or {"done": True}; polls twice a second for as
    long as machine 0 answers (a run that keeps its plan keeps a joined machine waiting for the next
    boundary), and gives up when it has not answered for `silence_s`."""
    reply = _answered(request, "job", silence_s, f"attempt {attempt}", attempt=attempt)
    if "error" in reply:
        raise JoinRefused(f"machine 0: {reply['error']}")
    return reply


def fetch_chunks(request: Callable[..., dict], name: str, size: int, sha256: str, sink: Callable[[bytes], None],
           silence_s: float) -> None:
    """`name` from the coordinator, chunk by chunk into `sink`, checked against the size and SHA-256 it
    announced (a JoinRefused otherwise, after which what `sink` got must be thrown away).  A chunk that does
    not come (the link failed, or a successor taking the run over answers "wait") is asked for again, at the
    same offset, until the coordinator has been silent for `silence_s` (`_answered`)."""
    digest, got = hashlib.sha256(), 0
    while got < size:
        reply = _answered(request, "fetch", silence_s, name, timeout=FETCH_TIMEOUT_S, name=name, offset=got)
        if "error" in reply:
            raise JoinRefused(f"machine 0 would not send {name}: {reply['error']}")
        chunk = base64.b64decode(str(reply.get("data", "")), validate=True)
        if not chunk or got + len(chunk) > size:
            raise JoinRefused(f"{name}: machine 0 sent {got + len(chunk):,} bytes of {size:,}")
        sink(chunk)
        digest.update(chunk)
        got += len(chunk)
    if digest.hexdigest() != sha256:
        raise JoinRefused(f"{name}: the {size:,} bytes that arrived do not have the SHA-256 machine 0 announced")


def _fetch_bytes(request: Callable[..., dict], name: str, size: int, sha256: str, silence_s: float) -> bytes:
    parts: list[bytes] = []
    fetch_chunks(request, name, size, sha256, parts.append, silence_s)
    return b"".join(parts)


def _fetch_file(request: Callable[..., dict], name: str, size: int, sha256: str, folder: OutputDir,
                silence_s: float) -> None:
    """`name` into `folder`, streamed into a temporary beside it and renamed into place only when complete
    and checked (a shard may be large: it is never held in memory whole); recorded in the folder's manifest."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            fetch_chunks(request, name, size, sha256, f.write, silence_s)

    atomic_write_with(folder.check(name), write)
    folder.wrote(name)


def _receive(machines: Any, files: dict[str, dict], folder: OutputDir, silence_s: float, result: "Joined",
             lost: Callable[[Exception, int, dict | None], dict]) -> None:
    """The run's files into `folder`, each whole and checked.  The coordinator lost midway (machine 0 killed
    while a shard streams): `lost` follows the machine that took its role, which offers the same files (its
    own prepared corpus, by the manifest's names and digests), and the file under way starts again there; the
    files already received are kept."""
    for name, meta in files.items():
        while True:
            try:
                _fetch_file(machines.request, name, int(meta["size"]), str(meta["sha256"]), folder, silence_s)
                break
            except CoordinatorSilent as exc:
                lost(exc, -1, None)  # nothing to report: only follow
        result.received_bytes += int(meta["size"])


@dataclass
class Joined:
    """What `follow` did: the attempts this machine ran workers in, and the bytes it received."""

    machine: int
    pnode: str
    run_dir: Path
    attempts: list[int] = field(default_factory=list)
    received_bytes: int = 0
    released: bool = False  # it left the run (Leaving) and machine 0 released it
    coordinated: Any = None  # the LaunchResult of the attempts it ran as the coordinator, when it took the role


def follow(addr: str, master_port: int, pnode_file: str | Path, out: str | Path | None, *, join_timeout: float,
           link_timeout: float, comm_timeout: float, emit: Callable[[str], None],
           leave: Leaving | None = None, successor: Any = None) -> Joined:
    """`vgraph launch --join ADDR:PORT --pnode FILE`: be admitted, receive the run's files into this machine's
    run directory, then run this machine's workers in every attempt machine 0 places them in, until machine 0
    says the run is done (`follow_attempts`).  With `successor` (attempts.JoinedSuccession) this machine is in
    the line of succession: should the coordinator be lost while it is the lowest surviving machine, it takes
    the role and the run goes on here (`Joined.coordinated`)."""
    from ..rendezvous import TOKEN_ENV, check_token
    from .membership import Machines, MachineLost

    token = check_token(os.environ.get(TOKEN_ENV) or None, 2)
    channel = master_port - 1
    if not 1 <= channel <= 65535:
        raise JoinRefused(f"--join {addr}:{master_port}: the launchers' channel is that port - 1; give machine 0's "
                          f"--master-port (2 to 65535)")
    from .supervisor import warm

    emit("launch --join: readying this machine's worker processes (their imports) before asking to join")
    # The workers' imports before the admission: a boundary must not wait for them (warm); never rank 0's: world
    # rank 0 stays on the coordinator's machine (emission.plan), which a joined machine is only after a succession
    # (its rank 0 then imports what it needs when it starts).
    warm(wait=True, rank_zero=False)
    admitted = join_run(addr, channel, token, pnode_file, join_timeout)
    machine, pid = int(admitted["machine"]), admitted["pnode_object"].id  # its own id names its directory
    emit(f"launch --join: admitted as machine {machine} with PNode {pid}"
         f"{' (queued behind a re-plan under way)' if admitted.get('queued') else ''}")
    run_dir = Path(out) if out is not None else Path("runs") / f"join-{pid}"
    corpus_dir = run_dir / LAUNCH_DIR / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    data = OutputDir(corpus_dir, command="launch --join", inputs=[pnode_file])
    files = {str(k): v for k, v in dict(admitted.get("files") or {}).items()}
    data.plan(files)
    machines = Machines()
    try:
        machines.open(addr, channel, token, machine, machine + 1, link_timeout, comm_timeout)
    except MachineLost as exc:
        raise JoinRefused(str(exc)) from None
    result = Joined(machine, pid, run_dir)
    if leave is not None:
        leave.attach(machines)
    silence = comm_timeout + link_timeout
    lost = _successor_of(machines, [int(k) for k in admitted.get("successors") or []], run_dir, emit)
    try:
        if successor is not None:  # the settings checked (a JoinRefused) before any file is fetched
            lost = successor.bind(machines, admitted, run_dir, corpus_dir.absolute(), master_port, leave, lost)
        with RunLock.held():  # the run directory's lock, taken should this machine take the coordinator's role
            try:
                _receive(machines, files, data, silence, result, lost)
            except MachineLost as exc:  # no successor took the coordinator's role
                raise JoinRefused(str(exc)) from None
            emit(f"launch --join: received the run's corpus and tokenizer ({human_bytes(result.received_bytes)}) "
                 f"into {corpus_dir}")
            try:
                follow_attempts(machines, token, addr, master_port, run_dir, corpus_dir.absolute(),
                                f"{LAUNCH_DIR}/corpus/tokenizer.json", 0, silence, emit, result, leave, lost)
            except TookOver as took:
                result.coordinated = successor.coordinate(took)
        return result
    finally:
        if leave is not None:
            leave.close()
        machines.close()


def _successor_of(machines: Any, successors: list[int], run_dir: Path, emit: Callable[[str], None]
                  ) -> Callable[[Exception, int, dict | None], dict]:
    """A joined machine's answer to the coordinator's loss while it cannot take the role itself (it holds no
    job yet, or the run's --on-failure moves no role): follow the machine that takes it (one of `successors`,
    the machines the run started with, or another machine the coordinator's table names: a joined one in
    line, attempts.JoinedSuccession), sending it this machine's rescue shards of the attempt first
    (succession.follow_successor)."""
    from .membership import REQUEST_TIMEOUT_S as REQUEST_S, follow_successor

    def lost(why: Exception, attempt: int, report: dict | None) -> dict:
        emit(f"launch: machine {machines.coordinator} (the coordinator) is lost: {why}; looking for the machine "
             f"that takes its role among {', '.join(map(str, successors)) or 'the others'}")
        others = sorted(set(successors) | set(machines.addrs))  # the machines the last beats' answers named
        return follow_successor(machines, others, report, 2 * (machines.link_timeout + REQUEST_S),
                                lambda: send_shards(machines.request, run_dir / LAUNCH_DIR / RESCUE_DIR, attempt, emit),
                                emit)
    return lost


def follow_attempts(machines: Any, token: str, addr: str, master_port: int, run_dir: Path, data_dir: Path,
                    tokenizer: str, attempt: int, silence_s: float, emit: Callable[[str], None],
                    result: Joined, leave: Leaving | None = None,
                    lost: Callable[[Exception, int, dict | None], dict] | None = None) -> Joined:
    """Run this machine's workers in attempt `attempt` and every later one machine 0 publishes, from its job
    file with the paths made this machine's (`run_dir`, the corpus in `data_dir`, `tokenizer` relative to the
    run directory), until machine 0 says the run is done.  A joined machine follows from its admission; a
    machine the run started with (--nnodes MIN:MAX, MIN > 1) from its second attempt, since the fleet may have
    grown by then and only machine 0 knows it.  A failed attempt is reported (membership.py) and machine 0's
    decision read: an error ends here too.  A machine that leaves (`leave`) ends here when machine 0 releases
    it.  When the coordinator is lost (no decision within the rejoin timeout, or silent while this machine
    waits for a job: no report), `lost(why, attempt, report)` finds the coordinator that takes its role
    (succession.py) and returns that one's decision; without it, or when it finds none, the run ends here with
    the reason."""
    from ..job import Job
    from .membership import MachineLost
    from .supervisor import Supervisor

    try:
        while True:
            try:
                reply = wait_for_job(machines.request, attempt, silence_s)
                raw = b"" if reply.get("done") else _fetch_bytes(
                    machines.request, str(reply["file"]), int(reply["size"]), str(reply["sha256"]), silence_s)
            except CoordinatorSilent as exc:  # lost between attempts (during a boundary, say)
                if lost is None:
                    raise
                lost(exc, attempt - 1, None)  # nothing to report: the next attempt is the successor's job
                continue
            if reply.get("done"):
                if reply.get("failure"):
                    raise JoinRefused(f"machine 0 ended the run: {str(reply['failure'])[:2000]}")
                result.released = bool(reply.get("released"))
                if result.released:
                    emit(f"launch: machine 0 released this machine (machine {result.machine}): it has left the run")
                return result
            number, home = int(reply["attempt"]), {str(k): int(v) for k, v in dict(reply["home"]).items()}
            job_path = run_dir / LAUNCH_DIR / f"job-{number}.json"
            job = Job.loads(raw, job_path)  # checked field by field, as every worker reads it
            job.run_dir, job.data_dir, job.tokenizer, job.plugins = "..", str(data_dir), tokenizer, []
            job.write(job_path)
            local = [r for r, p in enumerate(job.ranks) if home.get(p) == result.machine]
            machines.begin(number, set())
            attempt = number + 1
            if not local:
                emit(f"launch: attempt {number} runs without this machine; waiting for the next")
                continue
            emit(f"launch: attempt {number}: {', '.join(job.ranks[r] for r in local)} of {len(job.ranks)} "
                 f"worker(s)")
            ok, codes, failed = Supervisor(emit, token).run(
                job_path, local, job.ranks, machines.addr, master_port + number,
                job.train.threads or max(1, (os.cpu_count() or 1) // len(local)), trouble=machines.trouble)
            result.attempts.append(number)
            if not ok:
                send_shards(machines.request, run_dir / LAUNCH_DIR / RESCUE_DIR, number, emit)
                described = ", ".join(f"{job.ranks[r]} (rank {r}, exit {codes[r]})" for r in failed)
                report = {"lost": [job.ranks[r] for r in failed], "described": described, "error": ""}
                try:
                    plan = machines.settle(report, lambda reports, missing: {}, wait_for_all=True)
                except MachineLost as exc:
                    if lost is None:
                        raise
                    plan = lost(exc, number, report)
                if plan.get("error"):
                    raise JoinRefused(f"machine 0 ended the run: {plan['error']}")
    except MachineLost as exc:
        raise JoinRefused(str(exc)) from None
