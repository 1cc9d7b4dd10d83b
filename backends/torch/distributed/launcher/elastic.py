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
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.safeio import OutputDir, atomic_write, atomic_write_with, read_input
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, FleetError, PNode, human_bytes, load_fleet, loads_fleet
from vgraph.cost.host_memory import available_host_memory
from vgraph.ir.graph import Graph
from vgraph.run.files import FLEET_EVENTS_JSONL, LAUNCH_DIR, STOP_FILE, RunLock

from .membership import CHUNK_BYTES, FETCH_TIMEOUT_S, REQUEST_TIMEOUT_S, ask, channel_key
from .shard_transfer import send_shards
from ...training.rescue import RESCUE_DIR

__all__ = ["Admission", "JoinRefused", "CoordinatorSilent", "TookOver", "Joined", "Leaving", "read_pnode_file", "check_pnode_memory", "smallest_share",
           "join_run", "follow", "follow_attempts", "record_event", "CHUNK_BYTES",
           "FETCH_TIMEOUT_S"]

MAX_PNODE_TEXT = 64 * 1024  # a PNode file: a few hundred bytes, its per-kind figures a few more


MAX_MACHINE_NUMBER = 1 << 20  # machine numbers grow with every join, MAX counting only those present: a bound
# on what an admission record may name, far above any run's joins


class JoinRefused(VGraphError):
    """Machine 0 refused this machine (its reason), or this machine refuses to join (its own check)."""


class CoordinatorSilent(JoinRefused):
    """The coordinator has not answered for the silence allowed while this machine waited for a job: lost
    (a follower's `lost` hook elects a successor: succession.py), or the run is over."""


class TookOver(Exception):
    """This machine took the coordinator's role while it followed jobs (failures.succeed_followed): the attempt
    loop goes on as the coordinator, from attempt `args[0]` + 1 on fleet `args[1]`."""


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


def smallest_share(graph: Graph) -> tuple[str, int]:
    """(colocation group or VNode, bytes) of the least any plan can give a PNode: the smallest group that must
    stay together, its parameters, gradients and optimizer state, with one sample's activations."""
    need: dict[str, int] = {}
    for c in cost_model(graph, batch=1).nodes.values():
        key = c.group or c.id
        need[key] = need.get(key, 0) + c.memory_bytes(1)
    name = min(need, key=lambda k: need[k])
    return name, need[name]


# -- machine 0 ------------------------------------------------------------------------------------

@dataclass
class _Joined:
    machine: int
    pnode: PNode
    step: int  # the run's last logged step when it was admitted


@dataclass(kw_only=True)
class _Departures:
    """Machine 0's side of graceful leaves (`Leaving` is the leaver's): its own conversation on the channel
    (`leave`, then the `job` answer that releases) with its own state, kept apart from the joins'.
    `Admission` is one: `on_leave` runs in its own thread when a leave needs a boundary; `homes` says whose
    PNodes a leaving machine takes along (PNode -> machine, the launcher's run.home)."""

    on_leave: Callable[[Any, int, list[str], int], None] | None = None  # (admission, machine, its PNodes, step)
    homes: Callable[[], dict[str, int]] | None = None
    leaving: dict[int, int] = field(default_factory=dict)  # machine -> the step it said it leaves at
    left: set[str] = field(default_factory=set)  # PNodes of machines that left (never placed again)
    released: set[int] = field(default_factory=set)  # leaving machines told to go (their `job` answers so)

    def departing(self) -> set[str]:
        """The PNodes of the machines that left or said they leave."""
        homes = self.homes() if self.homes is not None else self.home()
        with self.lock:
            leaving = set(self.leaving)
            return set(self.left) | {p for p, m in homes.items() if m in leaving}

    def _leave(self, request: dict) -> dict:
        """Machine `machine` says it leaves (its launcher got SIGTERM).  Said again (a second signal, a retry
        whose answer was lost): the same answer, nothing more.  A machine whose PNodes the running attempt
        does not use (admitted and waiting, or not placed yet) is released at once; else `on_leave` takes a
        boundary (or, when one is under way, the leave waits for it), and the machine is released when the
        next attempt is placed without it (`release`)."""
        machine = int(request["machine"])
        if machine not in self.joined and not 0 < machine < self.static_machines:
            return {"error": "only a machine of the run (not machine 0) leaves it"}
        step = self.step()
        homes = self.homes() if self.homes is not None else self.home()
        pnodes = sorted(p for p, m in homes.items() if m == machine)
        if machine in self.joined and self.joined[machine].pnode.id not in pnodes:
            pnodes.append(self.joined[machine].pnode.id)
        with self.lock:
            if machine in self.leaving or machine in self.released or self.done:
                return {"leaving": True, "released": machine in self.released or self.done, "again": True}
            self.leaving[machine] = step
            placement = self.current[0] if self.current is not None else None
            # Before the first attempt is placed, a machine the run started with is in it all the same.
            if placement is not None:
                running = set(placement.world)
            else:
                running = set(pnodes) if machine < self.static_machines else set()
            queued = self.replanning
            if not set(pnodes) & running:  # not in the running attempt: nothing of it to hand off
                self.released.add(machine)
                self.left.update(pnodes)
                outcome = "released"
            else:
                outcome = "queued" if queued else "boundary"
        self.event({"event": "leave", "machine": machine, "pnodes": pnodes, "step": step, "outcome": outcome})
        if outcome == "boundary" and self.on_leave is not None:
            threading.Thread(target=self.on_leave, args=(self, machine, pnodes, step), daemon=True).start()
        return {"leaving": True, "released": outcome == "released", "step": step}

    def vanished(self, pnodes: list[str]) -> None:
        """PNodes of machines that vanished (a decision's `gone`): never placed again, as those that left; a
        machine admitted and then SIGKILLed would otherwise be placed again at the next boundary (or by a
        successor, from the mirrored record) and its missing workers stall that attempt's rendezvous."""
        with self.lock:
            self.left.update(pnodes)

    def joined_present(self) -> int:
        """The joined machines still in the run (under the lock): what MAX counts, so that one that left or
        vanished frees its place (its number is never given again: numbers name machines on the channel and in
        the mirrored record)."""
        return sum(1 for m, j in self.joined.items() if m not in self.released and j.pnode.id not in self.left)

    def release(self, step: int) -> list[int]:
        """At a boundary, before the next attempt is placed: the leaving machines may go (their workers ended
        with the boundary's checkpoint, which holds what they held); their PNodes are never placed again."""
        homes = self.homes() if self.homes is not None else self.home()
        with self.lock:
            going = sorted(m for m in self.leaving if m not in self.released)
            self.released.update(going)
            self.left.update(p for p, m in homes.items() if m in going)
            self.left.update(self.joined[m].pnode.id for m in going if m in self.joined)
        for m in going:
            self.event({"event": "release", "machine": m, "step": step,
                        "pnodes": sorted(p for p, h in homes.items() if h == m)})
        return going


class _Handover:
    """What a successor takes over of an `Admission` when machine 0 is lost (succession.py mirrors `record`;
    the successor's admission `restore`s it).  Kept apart from the joins and the leaves: only a succession
    reads it."""

    def record(self) -> dict[str, Any]:
        """What a successor needs to admit as this admission does (succession.py mirrors it): every admitted
        machine with its PNode's figures (a fleet file of one) and the step it was admitted at, the machines
        that left, were released or are leaving."""
        from vgraph.placement.drift import fleet_file_text

        with self.lock:
            return {"joined": {str(m): {"pnode": fleet_file_text(Fleet.of(j.pnode.id, j.pnode)), "step": j.step}
                               for m, j in self.joined.items()},
                    "left": sorted(self.left), "released": sorted(self.released),
                    "leaving": {str(m): s for m, s in self.leaving.items()}}

    def restore(self, record: Any, say: Callable[[str], None]) -> None:
        """A successor's admission: take over the admitted machines, leaves and releases of the lost
        coordinator's `record` (a machine that was leaving is released); a malformed entry is said and left out (the machine it names is then refused
        when it asks for a job, and ends with that message, instead of the run stopping here)."""
        if not isinstance(record, dict):
            return
        joined = record.get("joined") if isinstance(record.get("joined"), dict) else {}
        for key, entry in joined.items():
            try:
                machine = int(key)
                fleet = loads_fleet(str(entry["pnode"]), f"<the admission record of machine {machine}>")
                if len(fleet) != 1 or not self.static_machines <= machine < MAX_MACHINE_NUMBER:
                    raise ValueError(f"machine {machine}: not one joined PNode")
                self.joined[machine] = _Joined(machine, fleet.pnodes[0], int(entry["step"]))
            except (KeyError, TypeError, ValueError, FleetError) as exc:
                say(f"launch: the admission record's machine {quote(str(key), 20)} is left out: {quote(str(exc), 200)}")
        self.left.update(str(p) for p in record.get("left") or [] if isinstance(p, str))
        self.released.update(int(m) for m in record.get("released") or [] if isinstance(m, int))
        leaving = record.get("leaving") if isinstance(record.get("leaving"), dict) else {}
        self.leaving.update({int(m): int(s) for m, s in leaving.items() if str(m).isdigit() and isinstance(s, int)})
        # A machine that was leaving goes now: its workers stopped with the lost coordinator's attempt, and the
        # successor's next one is placed without it (`departing`), so no boundary of its own is owed to it.
        self.released.update(self.leaving)


@dataclass(frozen=True)
class _Boundary:
    """A re-plan boundary taken (`Admission.close_boundary`): its step, when its stop was asked for and the step
    logged then, the PNodes the next attempt runs on and the machines released."""

    step: int
    requested: float
    asked: int | None  # the last logged step when the stop was asked for (None: unknown)
    pnodes: list[str]
    released: list[int]


class _Stops:
    """An `Admission`'s side of a re-plan boundary: the stop it asks the workers for (the stop file, as Ctrl-C
    writes it) and the boundary it closes when they are done, with its row.  Kept apart from the joins: only
    the boundaries (boundaries.py) ask for them."""

    def ask_boundary(self) -> bool:
        """Ask the workers to stop after the current step with a checkpoint (once, while none is under way):
        the stop file, as Ctrl-C writes it; its time is where the boundary's measured move starts.  False when
        the run is over (nothing asked)."""
        with self.lock:
            if self.done:
                return False
            self.replanning = True
        self.asked_step = self.step()  # the steps logged after it are progress, not the boundary's cost
        atomic_write(self.run_dir / LAUNCH_DIR / STOP_FILE, "boundary\n")
        return True

    def close_boundary(self, step: int, steps: int) -> "_Boundary | None":
        """Every worker is done at `step` (the run's last logged one; `steps` the run's): the stop file read
        for its time and removed; a re-plan boundary with steps left gets its row and the leaving machines
        their release, else (None) only the release (the run is over: a leaving machine goes).  Here because
        the admission asked for the stop and keeps the homes, the leaves and the rows it is decided from."""
        stop_file = self.run_dir / LAUNCH_DIR / STOP_FILE
        with self.lock:
            asked, self.replanning = self.replanning, False
            queued, self.queued = self.queued, []
            asked_step, self.asked_step = self.asked_step, None  # this boundary's request, read once
        try:
            requested = stop_file.stat().st_mtime
        except OSError:  # none: the stop was never written (measured from now)
            requested = time.time()
        stop_file.unlink(missing_ok=True)
        released = self.release(step)  # their workers ended with this boundary's checkpoint
        if not asked or step >= steps:
            return None
        homes = self.homes() if self.homes is not None else self.home()
        pnodes = sorted(set(homes) - self.departing())
        self.event({"event": "boundary", "step": step, "pnodes": pnodes, "released": released,
                    "requested": round(requested, 3), "queued": [self.joined[m].pnode.id for m in queued]})
        return _Boundary(step, requested, asked_step, pnodes, released)


@dataclass
class Admission(_Departures, _Handover, _Stops):
    """Machine 0's side of an elastic run: admits joins, serves files and jobs, records events.

    `on_join` runs in its own thread after an admission (the re-plan decision: it may take seconds, longer
    than a request may wait); `step` reads the run's last logged step.  Leaves: `_Departures`; a successor's
    take-over: `_Handover`; a re-plan boundary's stop: `_Stops`."""

    run_dir: Path
    fleet: Fleet
    graph: Graph  # the network, for the smallest share a PNode must hold
    max_machines: int
    static_machines: int  # the machines the run started with (--nnodes MIN)
    step: Callable[[], int]
    on_join: Callable[["Admission", _Joined], None] | None = None
    files: dict[str, tuple[Path, int, str]] = field(default_factory=dict)  # name -> (path, size, sha256)
    joined: dict[int, _Joined] = field(default_factory=dict)
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)  # attempt -> what followers need
    done: bool = False
    replanning: bool = False  # a boundary was asked for and its next attempt is not placed yet
    queued: list[int] = field(default_factory=list)  # machines admitted during a re-plan: placed at its boundary
    told_done: set[int] = field(default_factory=set)  # machines that read `done`
    current: tuple[Any, Fleet] | None = None  # the running attempt's placement (launch.Placement) and fleet
    next_fleet: Fleet | None = None  # the fleet a drift re-plan chose for the boundary's attempt
    asked_step: int | None = None  # the last logged step when the pending boundary was asked for (`_Stops`)
    error: str = ""  # why the run ended, when it failed
    successors: list[int] = field(default_factory=list)  # started machines in line (joined ones: the table's)
    me: int = 0  # the machine serving this admission: 0, or the successor that took machine 0's role
    settings: dict[str, Any] = field(default_factory=dict)  # the launch settings a joiner takes the role with
    # (inputs.launch_settings), sent with its admission
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, name: str, path: Path, sha256: str | None = None) -> None:
        """Offer `path` to admitted machines as `name`: its size now and its SHA-256 (given, as a corpus's
        manifest records its shards', or computed here a megabyte at a time)."""
        size = path.stat().st_size
        if sha256 is None:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            sha256 = digest.hexdigest()
        self.files[name] = (path, size, sha256)

    def event(self, row: dict[str, Any]) -> None:
        """One row of launch/fleet-events.jsonl (appended; the file is machine 0's, in the run it owns)."""
        with self.lock:
            record_event(self.run_dir, row)

    @property
    def pnodes(self) -> list[PNode]:
        """The joined PNodes, in order of admission."""
        return [j.pnode for j in sorted(self.joined.values(), key=lambda j: j.machine)]

    def grown_fleet(self, fleet: Fleet) -> Fleet:
        """`fleet` with every admitted PNode it lacks and without the PNodes of machines that left or are
        leaving (the regions and links kept)."""
        gone = self.departing()
        have = set(fleet.ids)
        extra = [p for p in self.pnodes if p.id not in have and p.id not in gone]
        if gone & have:
            fleet = fleet.without(gone)
        if not extra:
            return fleet
        return Fleet.of(fleet.name, *fleet.pnodes, *extra, links=fleet.links, collectives=fleet.collectives)

    def home(self) -> dict[str, int]:
        """Where the joined PNodes run (PNode -> machine), but this machine's own: a joined machine that took
        the coordinator's role (succession.py) holds rank 0 on its PNode and is nobody's follower."""
        return {j.pnode.id: j.machine for j in self.joined.values() if j.machine != self.me}

    def publish(self, attempt: int, job_path: Path, home: dict[str, int], placement: Any, fleet: Fleet) -> None:
        """Attempt `attempt`'s job, for the machines that follow machine 0 (the joined ones); its placement
        and fleet are what the next join's decision starts from."""
        name = f"job-{attempt}.json"
        self.serve(name, job_path)
        with self.lock:
            self.current = (placement, fleet)
            self.asked_step = None  # a boundary asked of an attempt that failed instead is not this one's
            self.jobs[attempt] = {"attempt": attempt, "file": name, "home": dict(home)}

    def finish(self, error: str = "") -> None:
        """The run is over (with machine 0's `error` when it failed): followers stop waiting for jobs."""
        with self.lock:
            self.done, self.error = True, error

    # -- requests -------------------------------------------------------------------------------
    def answer(self, request: dict) -> dict:
        op = request.get("op")
        try:
            if op == "join":
                return self._join(request)
            if op == "fetch":
                return self._fetch(request)
            if op == "job":
                return self._job(request)
            if op == "leave":
                return self._leave(request)
        except (TypeError, ValueError, KeyError) as exc:
            return {"error": f"malformed {op} request: {quote(str(exc), 120)}"}
        return {"error": f"unknown request {quote(str(op), 40)}"}

    def _join(self, request: dict) -> dict:
        text, file = request.get("pnode"), request.get("file")
        if not isinstance(text, str) or not isinstance(file, str) or len(text) > MAX_PNODE_TEXT or len(file) > 300:
            return self._refuse(None, "the join request carries no PNode file text (or an oversized one)")
        file = "".join(c if c.isprintable() else "?" for c in file)
        try:
            fleet = loads_fleet(text, file)
        except FleetError as exc:
            return self._refuse(None, str(exc))
        if len(fleet) != 1:
            return self._refuse(None, f"{file}: a PNode file describes one machine; this one lists {len(fleet)}")
        pnode = fleet.pnodes[0]
        group, need = smallest_share(self.graph)
        try:
            Fleet.of(self.fleet.name, *self.fleet.pnodes, pnode, links=self.fleet.links,
                     collectives=self.fleet.collectives)
            fits = ""
        except FleetError as exc:
            fits = str(exc)
        step = self.step()
        with self.lock:  # checked and taken at once: two joins racing for the last place get one each
            reason = self._refusal(pnode, need, group, fits)
            if reason is None:
                machine = self.static_machines + len(self.joined)
                joined = _Joined(machine, pnode, step)
                self.joined[machine] = joined
                queued = self.replanning
                if queued:
                    self.queued.append(machine)
        if reason is not None:
            return self._refuse(pnode.id, reason)
        self.event({"event": "join", "pnode": pnode.id, "machine": machine, "step": joined.step,
                    "outcome": "admitted", "queued": queued})
        if self.on_join is not None and not queued:
            threading.Thread(target=self.on_join, args=(self, joined), daemon=True).start()
        return {"admitted": True, "machine": machine, "pnode": pnode.id, "queued": queued,
                "successors": list(self.successors),
                "settings": dict(self.settings),
                "files": {n: {"size": s, "sha256": d} for n, (_, s, d) in self.files.items()
                          if not n.startswith("job-")}}

    def _refusal(self, pnode: PNode, need: int, group: str, fits: str) -> str | None:
        """Why `pnode` may not join now, or None (under the lock)."""
        if pnode.id in self.left:
            return (f"PNode id {pnode.id!r} was in the run and is gone (it left or was lost): a machine that comes "
                    f"back joins under a new id (vgraph probe --id)")
        if pnode.id in set(self.fleet.ids) | {j.pnode.id for j in self.joined.values()}:
            return f"PNode id {pnode.id!r} is already in the run: every machine needs its own id (vgraph probe --id)"
        if self.static_machines + self.joined_present() >= self.max_machines:
            return f"the run has its {self.max_machines} machines (--nnodes {self.static_machines}:{self.max_machines})"
        if pnode.memory < need:
            return (f"PNode {pnode.id!r} has {human_bytes(pnode.memory)} of memory; no plan can give it a share: the "
                    f"smallest, {group!r} with one sample, needs {human_bytes(need)}")
        if fits:
            return f"PNode {pnode.id!r} does not fit the run's fleet: {fits}"
        return None

    def _refuse(self, pnode: str | None, reason: str) -> dict:
        self.event({"event": "join", "pnode": pnode, "outcome": "refused", "reason": reason})
        return {"admitted": False, "reason": reason}

    def _fetch(self, request: dict) -> dict:
        machine, name, offset = int(request["machine"]), str(request["name"]), int(request["offset"])
        if machine not in self.joined and not 0 < machine < self.static_machines:
            return {"error": "only a machine of the run fetches its files"}
        if name not in self.files:
            return {"error": f"no file {quote(name, 80)} is offered"}
        path, size, digest = self.files[name]
        if not 0 <= offset <= size:
            return {"error": f"offset {offset} outside {name} ({size} bytes)"}
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(CHUNK_BYTES)
        return {"data": base64.b64encode(data).decode("ascii"), "size": size, "sha256": digest}

    def _job(self, request: dict) -> dict:
        machine, attempt = int(request["machine"]), int(request["attempt"])
        if machine not in self.joined and not 0 < machine < self.static_machines:
            return {"error": "only a machine of the run reads its jobs"}
        with self.lock:
            if machine in self.released:
                self.told_done.add(machine)
                return {"done": True, "released": True, "failure": ""}
            later = sorted(a for a in self.jobs if a >= attempt)
            if later:
                job = self.jobs[later[0]]
                name = job["file"]
                _, size, digest = self.files[name]
                return {**job, "size": size, "sha256": digest}
            if self.done:
                self.told_done.add(machine)
                return {"done": True, "failure": self.error}
            return {"wait": True}

    def wait_told(self, timeout: float) -> None:
        """Machine 0 at the end: give the other machines up to `timeout` s to read `done`
        (they would otherwise wait for machine 0 until their link timeout and end with an error)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                others = (set(self.joined) | set(range(self.me + 1, self.static_machines))) - {self.me}
                if others <= self.told_done | self.released:
                    return
            time.sleep(0.05)


def record_event(run_dir: Path, row: dict[str, Any]) -> None:
    """Append one row to machine 0's launch/fleet-events.jsonl: joins, re-plans, boundaries, rescues."""
    line = json.dumps({"time": round(time.time(), 3), **row}, allow_nan=False) + "\n"
    with open(run_dir / LAUNCH_DIR / FLEET_EVENTS_JSONL, "a", encoding="utf-8") as f:
        f.write(line)


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


def _fetch(request: Callable[..., dict], name: str, size: int, sha256: str, sink: Callable[[bytes], None],
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
    _fetch(request, name, size, sha256, parts.append, silence_s)
    return b"".join(parts)


def _fetch_file(request: Callable[..., dict], name: str, size: int, sha256: str, folder: OutputDir,
                silence_s: float) -> None:
    """`name` into `folder`, streamed into a temporary beside it and renamed into place only when complete
    and checked (a shard may be large: it is never held in memory whole); recorded in the folder's manifest."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            _fetch(request, name, size, sha256, f.write, silence_s)

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
            atomic_write(job_path, raw)
            job = Job.read(job_path)  # checked field by field, as every worker reads it
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
            supervisor = Supervisor(emit, token)
            try:
                supervisor.start(job_path, local, job.ranks, len(job.ranks), machines.addr, master_port + number,
                                 job.train.threads or max(1, (os.cpu_count() or 1) // len(local)))
                ok, codes, failed = supervisor.wait(trouble=machines.trouble)
            except BaseException:
                supervisor.stop()
                raise
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
