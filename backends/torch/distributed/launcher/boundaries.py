"""Machine 0's side of a run that takes joins: the `Admission` (a join admitted or refused with a reason, the
files and jobs it serves, the leaves, the handover to a successor, the boundary's stop request;
launch/fleet-events.jsonl's one writer: `record_event`; the conversation is described in elastic.py, the
joiner's side), the admission opened (what it offers a joined machine, a join or a leave turned into a re-plan
decision) and the channel's answers besides heartbeats and decisions (the other machines' rescue shards:
shard_transfer.py, the joiners' requests); the one re-plan decision
of a join, a leave and a drift (`replan`, priced by vgraph/placement/replan.py), the workers asked to stop after
the current step with a checkpoint, the boundary taken when every worker is done (`boundary`: the admitted
machines' homes, the leaving ones released), and the move measured from the stop request to the next
attempt's first logged step (`moved`, fleet-events.jsonl).

Apart from the attempt loop because it runs beside it: the decisions come on the admission's and the drift
watch's threads, and what they leave for the loop is the boundary (Admission's fields).  The run's
logged steps are read here from metrics.jsonl's tail (`last_step`), without reading a long run's whole log.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.numbers import number_or_none
from vgraph.base.safeio import atomic_write
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, FleetError, PNode, human_bytes, loads_fleet
from vgraph.ir.graph import Graph
from vgraph.run.files import FLEET_EVENTS_JSONL, LAUNCH_DIR, MEASURED_FLEET, METRICS_JSONL, STOP_FILE

from ...training.rescue import RESCUE_DIR
from . import elastic
from .inputs import Run
from .membership import CHUNK_BYTES
from .emission import Attempt, plan, rank_zero_elsewhere
from .placing import Placement
from .shard_transfer import ShardReceiver

__all__ = ["Admission", "record_event", "smallest_share", "MOVE_POLL_S", "open_admission", "take_admission", "serve_channel",
           "last_step", "trained_after_request",
           "last_drift", "overhead_s", "replan", "watch_drift", "boundary", "watch_move", "move_measured", "watching"]

MOVE_POLL_S = 0.1  # how often the launcher looks for the first step after a boundary (metrics.jsonl's tail)


# -- the admission: joins, leaves, the handover to a successor, the boundary's stop -----------------

MAX_MACHINE_NUMBER = 1 << 20  # machine numbers grow with every join, MAX counting only those present: a bound
# on what an admission record may name, far above any run's joins


def smallest_share(graph: Graph) -> tuple[str, int]:
    """(colocation group or VNode, bytes) of the least any plan can give a PNode: the smallest group that must
    stay together, its parameters, gradients and optimizer state, with one sample's activations."""
    need: dict[str, int] = {}
    for c in cost_model(graph, batch=1).nodes.values():
        key = c.group or c.id
        need[key] = need.get(key, 0) + c.memory_bytes(1)
    name = min(need, key=lambda k: need[k])
    return name, need[name]


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


@dataclass(kw_only=True)
class _Offered:
    """The files machine 0 offers admitted machines (the corpus, network and tokenizer, each attempt's job),
    by name with their size and SHA-256, and the `fetch` requests that read them a chunk at a time (elastic.py
    is the fetching side).  `Admission` is one: who may fetch is its members (`joined`, `static_machines`)."""

    files: dict[str, tuple[Path, int, str]] = field(default_factory=dict)  # name -> (path, size, sha256)

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


@dataclass
class Admission(_Offered, _Departures, _Handover, _Stops):
    """Machine 0's side of an elastic run: admits joins, serves files and jobs, records events.

    `on_join` runs in its own thread after an admission (the re-plan decision: it may take seconds, longer
    than a request may wait); `step` reads the run's last logged step.  Leaves: `_Departures`; a successor's
    take-over: `_Handover`; a re-plan boundary's stop: `_Stops`; the files it offers: `_Offered`."""

    run_dir: Path
    fleet: Fleet
    graph: Graph  # the network, for the smallest share a PNode must hold
    max_machines: int
    static_machines: int  # the machines the run started with (--nnodes MIN)
    step: Callable[[], int]
    on_join: Callable[["Admission", _Joined], None] | None = None
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
    # (inputs.launch_settings: Run.settings), sent with its admission
    lock: threading.Lock = field(default_factory=threading.Lock)

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
        if (not isinstance(text, str) or not isinstance(file, str) or len(text) > elastic.MAX_PNODE_TEXT
                or len(file) > 300):
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



def open_admission(run: Run) -> Admission:
    """Machine 0 of a run that takes joins: what it offers a joined machine (the prepared corpus's files,
    by the names its manifest gives) and how it decides on a join, served on the launchers' channel."""
    from vgraph.data.shards import MANIFEST, SPLITS, TOKENIZER_FILE, open_prepared

    admission = Admission(run.run_dir, run.fleet, run.source, run.max_nnodes, run.nnodes,
                                  step=lambda: last_step(run.run_dir), on_join=lambda adm, joined: _on_join(run, joined),
                                  on_leave=lambda adm, machine, pnodes, step: _on_leave(run, machine, pnodes, step),
                                  homes=lambda: {**(run.home or {}), **admission.home()},
                                  successors=list(range(run.node_rank + 1, run.nnodes)) if run.succeeds else [],
                                  settings=run.settings)
    corpus = Path(run.data_dir)
    splits = open_prepared(corpus, verify="size").manifest["splits"]  # checked: names inside the directory
    for name in (MANIFEST, TOKENIZER_FILE):
        admission.serve(name, corpus / name)
    for shard in (shard for split in SPLITS for shard in splits[split]["shards"]):
        for key in ("bin", "idx"):  # the manifest's SHA-256 of each: a large corpus is not read again here
            admission.serve(shard[key], corpus / shard[key], shard[f"{key}_sha256"])
    return admission


def take_admission(run: Run, fleet: Fleet) -> Fleet:
    """An elastic run's successor: the admission machine 0 held, served from here (later joiners ask this
    machine; the channel's address moved with the role), with the machines it had admitted, released or was
    releasing, from the record this machine mirrored (its `Mirror`'s, launch/mirror/admission.json; none on a
    machine that mirrored nothing: then only the machines of the last job are known); the next attempt's
    fleet: `fleet` with the admitted machines and without the leaving ones (`Admission.grown_fleet`)."""
    run.admission = open_admission(run)
    run.admission.me = run.node_rank
    run.admission.restore(run.mirror.admission if run.mirror is not None else None, run.emit)
    run.home = {**(run.home or {}), **run.admission.home()}  # where the admitted machines' PNodes run
    return run.admission.grown_fleet(fleet)


def serve_channel(run: Run) -> None:
    """Machine 0: what its channel answers besides heartbeats and decisions: the other machines' rescue shards
    (shard_transfer.py) and, in a run that takes joins, the joiners' requests (elastic.py)."""
    receiver = ShardReceiver(run.launch_dir / RESCUE_DIR)

    def answer(request: dict) -> dict:
        if str(request.get("op", "")).startswith("rescue-"):
            return receiver.answer(request)
        if run.admission is not None:
            return run.admission.answer(request)
        if run.elastic:  # a successor taking the run over: its admission opens once it decided (failures.py)
            return {"wait": "the coordinator is being taken over"}
        return {"error": "this run takes no joins (--nnodes MIN:MAX)"}

    run.machines.serve_extra(answer)


def _on_join(run: Run, joined: Any) -> None:
    """A machine was admitted (its own thread): re-plan onto the grown fleet when it pays (`replan`)."""
    replan(run, "join", joined.step, run.admission.grown_fleet,
            {"pnode": joined.pnode.id, "machine": joined.machine}, label=f"join {joined.pnode.id}")


def _on_leave(run: Run, machine: int, pnodes: list[str], step: int) -> None:
    """Machine `machine` said it leaves (its own thread): the running plan cannot go on without its PNodes,
    so the boundary is taken whatever the price; the decision's figures say what the next plan predicts."""
    replan(run, "leave", step, run.admission.grown_fleet, {"pnodes": pnodes, "machine": machine},
            label=f"leave {', '.join(pnodes)} (machine {machine})", gone=pnodes)


def last_step(run_dir: Path) -> int:
    """The run's last logged step (rank 0 writes metrics.jsonl about once a second)."""
    return _last_of(_tail_rows(run_dir))


def _last_of(rows: Sequence[dict[str, Any]]) -> int:
    return max(0, rows[-1]["step"]) if rows else 0


def _tail_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The complete rows in the last 64 KiB of metrics.jsonl, in order: a join or a drift watch must not
    wait for a read of a long run's whole log."""
    from vgraph.base.jsonio import loads

    path = run_dir / METRICS_JSONL
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read()
    except OSError:
        return []
    rows = []
    for line in tail.split(b"\n")[1:] if len(tail) == 65536 else tail.split(b"\n"):
        try:
            row = loads(line, str(path)) if line.strip() else None
        except VGraphError:
            continue  # a line being written
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
    return rows


def replan(run: Run, trigger: str, step: int, target_of: Callable[[Fleet], Fleet], fields_: dict[str, Any], *,
            label: str, gone: Sequence[str] = (), measured: Fleet | None = None, why: str = "",
            uncertainty: float = 0.0) -> None:
    """The one re-plan decision of a join, a leave and a drift (vgraph/placement/replan.py): the planner's plan
    on `target_of(the running attempt's fleet)` priced against the running plan over the steps left; when it
    pays (a leave: always, the running plan loses `gone`), ask the workers for a boundary: they stop after the
    current step with a checkpoint and the next attempt runs on that fleet (`boundary`).  A drift prices the
    running plan on the `measured` fleet too, so both steps come from the same figures.  Every decision is a
    `replan` row of fleet-events.jsonl and one line.  `uncertainty`: a drift's spread (`_spread`), priced as
    the margin a gain must clear besides the change's cost."""
    admission = run.admission
    row: dict[str, Any] = {"event": "replan", "kind": trigger, "step": step, **fields_}
    try:
        placement, fleet = _running(admission, wait_s=run.comm_timeout if gone else 0.0)
        target = target_of(fleet)
        decision, machines, handed = _decision(run, placement, target, step, gone, measured is not None, uncertainty)
    except Exception as exc:  # in its own thread: whatever went wrong is said and recorded, the run goes on
        said = str(exc) if isinstance(exc, VGraphError) else f"{type(exc).__name__}: {exc}"
        admission.event({**row, "chosen": "new" if gone else "keep", "reason": said})
        run.emit(f"launch: {label} at step {step}: {'boundary all the same' if gone else 'no re-plan now'}: {said}")
        if gone:
            admission.ask_boundary()
        return
    if gone and machines < run.nnodes:  # documented: the run goes on below MIN (docs/distributed.md)
        row["below_min"] = machines
        run.emit(f"launch: warning: after {label} the run has {machines} machine(s), fewer than --nnodes MIN "
                 f"{run.nnodes}; it goes on with them")
    row.update(decision.to_json())
    if gone:  # what only the leaving machine held: its VNodes' state, through the boundary's checkpoint
        row["checkpoint_bytes"] = handed
    if why:
        why = f"{why}; the planner's plan predicts {decision.new_step:.3g} s a step"
        row["reason"] = f"{why}; {decision.reason}"
    admission.event(row)
    run.say(f"launch: {label} at step {step}: {why + '; ' if why else ''}{decision.describe()}")
    if decision.chosen == "new":
        if measured is not None:
            with admission.lock:
                admission.next_fleet = measured
        admission.ask_boundary()


def _running(admission: Admission, wait_s: float) -> tuple[Any, Fleet]:
    """The running attempt's (placement, fleet); a leave before the first attempt is placed waits for it."""
    deadline = time.monotonic() + wait_s
    while True:
        with admission.lock:
            current = admission.current
        if current is not None:
            return current
        if time.monotonic() >= deadline:
            raise VGraphError("no attempt is running yet: the change takes effect at the first boundary")
        time.sleep(0.1)


def _decision(run: Run, placement: Placement, target: Fleet, step: int, gone: Sequence[str], reprice: bool,
              uncertainty: float = 0.0) -> tuple[Any, int, float]:
    """(replan.Replan, machines left on `target`, state bytes of the VNodes only `gone` held): the planner's
    plan on `target` against `placement` (`reprice`: the running plan's step priced on `target` as well, a
    drift's measured figures)."""
    from vgraph.placement.replan import PlanView, decide, state_bytes

    admission = run.admission
    homes = {**(run.home or {}), **admission.home()}  # what run.home is after the boundary
    new = plan(run, target, homes=homes)
    refusal = rank_zero_elsewhere(new.world[0], homes, run.machines.coordinator)
    if refusal is not None:
        raise VGraphError(refusal)
    old = placement
    if reprice:
        layout = (placement.rows, placement.shares) if len(placement.rows) > 1 else None
        old = plan(run, target, placement.assignment, layout)
    views = [PlanView.of(p.assignment, p.rows, p.report.get("step_seconds", p.report["bottleneck_seconds"]))
             for p in (old, new)]
    sizes = state_bytes(new.assigned)  # the VNodes as plans assign them; their state is what moves
    gone = sorted(set(gone) | admission.departing())  # another leave at the same step: no sender either
    decision = decide(*views, sizes, target, max(0, run.steps - step), gone=gone, overhead_s=overhead_s(run),
                      uncertainty=uncertainty)
    handed = sum(sizes.get(v, 0.0) for v in decision.move.from_checkpoint)
    return decision, len({homes.get(p, 0) for p in target.ids}), handed


def overhead_s(run: Run) -> float:
    """What a boundary costs besides moving state, for the next decision: this run's last boundary as measured
    (its `moved` row's `lost_s`: stop request to the next attempt's first step, less the steps trained in
    between: `trained_after_request`), else the launch's setting
    (replan.DEFAULT_REPLAN_OVERHEAD_S, measured on a loopback run).  Why the run's own figure: a boundary
    costs what this fleet's slowest machine takes to stop, place and start again, 2-3 s on loopback and 20 s at
    0.35 of a core (bench_churn, 2026-12-07); a decision priced with the loopback figure takes changes that do
    not pay."""
    return run.moved_s if run.moved_s is not None else run.replan_overhead_s


def watch_drift(run: Run, start: int, ended: threading.Event) -> None:
    """Machine 0, while an attempt runs (its own thread): a drift rank 0 reported in this attempt's rows (a
    metrics row with `drift`, at a step after `start`) is a re-plan decision on the measured fleet
    (fleet.measured.yml) through `replan`.  Fresh evidence only: the rows of this attempt, whose rank 0 watches
    its own plan's prediction from its own warm-up (so a re-plan's next one needs K steps measured under the
    new plan), and once a drift re-plan is chosen this watch ends.  A report whose figures the last decision
    already priced (within the drift band: placement/drift.new_evidence) is not decided again."""
    from dataclasses import replace

    from vgraph.cost.fleet import load_fleet
    from vgraph.placement.drift import new_evidence

    seen, decided = start, None
    while not ended.wait(0.5):
        row = last_drift(run.run_dir, seen)
        if row is None:
            continue
        seen = row["step"]
        try:  # the file rank 0 wrote with the row; not the fleet's own file: a boundary's fleet is this one
            measured = replace(load_fleet(run.run_dir / MEASURED_FLEET), source=None)
        except VGraphError as exc:
            run.emit(f"launch: drift at step {seen}: no re-plan: {exc}")
            continue
        pnodes = row["drift"].get("pnodes")
        figures = {pid: float(p["measured_s"]) for pid, p in (pnodes if isinstance(pnodes, dict) else {}).items()
                   if isinstance(p, dict) and isinstance(p.get("measured_s"), (int, float))}
        if not new_evidence(figures, decided):
            continue
        decided = figures
        why = "drift: " + ", ".join(
            f"{pid} measured {p['measured_s']:.3g} s vs predicted {p['predicted_s']:.3g} s busy for "
            f"{run.drift_steps} steps" for pid, p in sorted((pnodes if isinstance(pnodes, dict) else {}).items())
            if isinstance(p, dict) and all(isinstance(p.get(k), (int, float)) for k in ("measured_s", "predicted_s")))
        replan(run, "drift", seen, lambda fleet: run.admission.grown_fleet(measured), {"drift": row["drift"]},
                label="drift", measured=measured, why=why, uncertainty=_spread(pnodes))
        with run.admission.lock:
            if run.admission.next_fleet is not None:
                return


def _spread(pnodes: Any) -> float:
    """The uncertainty a drift's decision prices (replan.decide): the widest relative spread of the drifting
    PNodes' busy times (placement/drift.relative_spread), from rank 0's row; a figure that is missing or not a
    finite number from 0 to 10 counts as 0 (the decision then prices the figures as exact, as before)."""
    spreads = [number_or_none(p.get("spread"), low=0, high=10)
               for p in (pnodes.values() if isinstance(pnodes, dict) else ()) if isinstance(p, dict)]
    return max([float(x) for x in spreads if x is not None] or [0.0])


def last_drift(run_dir: Path, after: int) -> dict[str, Any] | None:
    """The last metrics row with a drift report at a step after `after`, or None (read from the log's tail)."""
    for row in reversed(_tail_rows(run_dir)):
        if isinstance(row.get("drift"), dict) and row["step"] > after:
            return row
    return None


def boundary(run: Run, fleet: Fleet) -> Fleet | None:
    """Machine 0, every worker done: was it a re-plan boundary (`replan`: a join, a leave, a drift) with steps
    left?  Then the next attempt's fleet: `fleet`, or the measured one a drift re-plan chose, with the admitted
    machines (their PNodes' homes given) and without the leaving ones (released: the boundary's checkpoint
    holds what they held); else None.  The log's tail is read once: the workers are done, it no longer moves."""
    rows = _tail_rows(run.run_dir)
    taken = run.admission.close_boundary(_last_of(rows), run.steps)
    if taken is None:
        return None
    run.home = {**(run.home or {}), **run.admission.home()}
    run.moving = (taken.step, taken.requested, trained_after_request(rows, taken.asked, taken.step))
    run.say(f"launch: re-plan boundary after step {taken.step}: the next attempt runs on {', '.join(taken.pnodes)}"
            f"{f'; machine(s) {taken.released} released' if taken.released else ''}")
    with run.admission.lock:  # a drift re-plan's measured fleet, once
        measured, run.admission.next_fleet = run.admission.next_fleet, None
    return run.admission.grown_fleet(measured or fleet)


def trained_after_request(rows: Sequence[dict[str, Any]], asked: int | None, boundary: int) -> float:
    """Seconds of a boundary's wall that were training, not the boundary's cost: the steps logged after the
    stop request (`asked`: the last logged step then) up to the boundary, and the next attempt's first step,
    each at the old attempt's median step (its rows' `elapsed_s` differences, a restart's reset left out).

    Why: the workers finish the step they are in and agree on the stop at a sync point, so steps go on after
    the request; bench_churn run 7's first drift boundary came 7 steps (1.7 s) after it, and its 5.6 s from
    request to first step priced the next decisions' boundary a quarter too dear.  0 when the rows or the
    request's step are unknown (the whole wall is priced, as before)."""
    if asked is None or boundary < asked:
        return 0.0
    kept = [r for r in rows if r["step"] <= boundary and number_or_none(r.get("elapsed_s")) is not None]
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(kept[-11:], kept[-10:]) if b["step"] == a["step"] + 1]
    gaps = [g for g in gaps if g > 0]
    return (boundary - asked + 1) * statistics.median(gaps) if gaps else 0.0


def watch_move(run: Run, attempt: int) -> Callable[[], str | None]:
    """The supervisor's `trouble` poll, which also measures a boundary's move (`move_measured`) every
    MOVE_POLL_S while one is pending: the seconds a re-plan took, from its stop request to this attempt's
    first logged step (rank 0 logs a resumed attempt's first step at once: training/loop.py)."""
    trouble, due = run.machines.trouble, [0.0]

    def poll() -> str | None:
        if run.moving is not None and time.monotonic() >= due[0]:
            due[0] = time.monotonic() + MOVE_POLL_S
            move_measured(run, attempt)
        return trouble()
    return poll


@contextlib.contextmanager
def watching(run: Run, attempt: Attempt) -> Iterator[Callable[[], str | None]]:
    """While this machine's workers of `attempt` run, the boundaries' side of it: the attempt's job published to
    the machines that follow (`Admission.publish`: its placement and fleet are what the next join is decided
    from), the supervisor's `trouble` poll given (`watch_move`: a boundary's move measured while they run) and
    a drift decided from the step they start at (`watch_drift`, its own thread, ended with the block); once
    they are done, the move of an attempt too short for the poll to see its first step."""
    if run.admission is not None:
        run.admission.publish(attempt.number, attempt.job_path, dict(run.home or {}), attempt.placement,
                              attempt.fleet)
    number = attempt.number
    ended = threading.Event()
    if run.admission is not None and run.drift_steps:  # a drift is a re-plan decision
        threading.Thread(target=watch_drift, args=(run, last_step(run.run_dir), ended), daemon=True).start()
    try:
        yield watch_move(run, number)
        move_measured(run, number)
    finally:
        ended.set()


def move_measured(run: Run, attempt: int) -> None:
    """When the attempt after a boundary has logged a step: its `moved` row (fleet-events.jsonl) and a line."""
    if run.moving is None or run.admission is None:
        return
    step, requested, training = run.moving
    first = last_step(run.run_dir)
    if first <= step:
        return
    run.moving = None
    seconds = max(0.0, time.time() - requested)
    run.moved_s = max(0.0, seconds - training)
    run.admission.event({"event": "moved", "step": step, "first_step": first, "attempt": attempt,
                         "seconds": round(seconds, 3), "lost_s": round(run.moved_s, 3)})
    run.say(f"launch: the re-plan at step {step} took {seconds:.1f} s, from the stop request to attempt {attempt}'s "
            f"first step ({run.moved_s:.1f} s of it not training)")
