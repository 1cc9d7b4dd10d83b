"""No single holder: the run survives the loss of machine 0 (the coordinator) when another replica holds
every VNode (`--on-failure shrink` or `restart`, `--nnodes N`, or `--nnodes MIN:MAX`, MIN = 1 included).

Why: machine 0's launcher serves the launchers' channel, and its rank 0 writes metrics.jsonl and the
checkpoints into ITS run directory.  Everything else a successor needs it already has: the job's settings
(every machine of a static run runs the same command), the prepared corpus (each machine prepares it), the
fleet and the machines' addresses (membership.py: every beat's answer carries them).  What only machine 0 had
is the run's history, so it is mirrored, and the coordinator role moves:

* **Mirror.** The machines next in line (the MIRRORS lowest node ranks after the coordinator) pull, every
  MIRROR_EVERY_S over the sealed channel: the new bytes of metrics.jsonl (from the offset they hold, checked by
  the last bytes they hold, so a restart's rewrite of the file is noticed and the mirror starts over), and,
  when `latest` names a checkpoint they lack, that checkpoint's files in the chunks elastic.py's joins use
  (512 KiB, size and SHA-256 checked).  They land in the follower's own `RUN/launch/mirror/` (a folder per
  checkpoint, renamed into place when complete, then the `latest` pointer; the older one removed).  Two
  machines mirror so that the successor may die during its succession and the next one still has the run.
* **Succession.** When a follower's channel to the coordinator has failed for the rejoin timeout
  (membership.settle's MachineLost), the survivors are the attempt's machines without it; each asks the
  survivors of lower rank, in rank order, for up to ELECT_WINDOW (who serves the channel there?).  The first
  that answers as coordinator is followed: reports and beats go to its address, same port.  When none of
  them answers, this machine takes over: it serves the channel on its own address (membership.take_over),
  collects the survivors' reports, decides the next attempt (the lost coordinator's PNodes lost and `gone`:
  shrink drops its replicas, restart re-plans on the rest), and only then installs the newest state into its own run directory (`install`) and writes
  the run from there on (its rank 0, its metrics.jsonl, its checkpoints).  Ties go by rank: a successor that
  finds a lower-ranked one serving while it collects reports steps down and follows it.
* **Where things are.** Metrics and checkpoints continue in the new coordinator's run directory (its
  `--out`): metrics.jsonl there holds the rows up to the installed checkpoint, and the steps after it are
  redone once (rows machine 0 had logged past it are dropped, as after any restart).  A row of
  `launch/fleet-events.jsonl` there records the succession: the new coordinator, the step resumed from,
  the steps redone, where the state came from.
* **A machine 0 that comes back** (started again with the same command) asks the machines it recorded in
  `launch/machines.json` who coordinates; when one answers with another machine, it refuses to start
  (`superseded`: a VGraphError naming the coordinator, exit 2), so the run is never split in two.

An elastic run (`--nnodes MIN:MAX`) carries more: the machines that joined.  The coordinator's admission
(boundaries.Admission.record: each admitted machine's PNode figures, the machines that left) travels with the
rows (`admission.json` in the mirror), so the successor admits as machine 0 did and knows the machines still
waiting for a boundary; the fleet of the attempt that was running is in its job.  The line of succession is
the lowest surviving machine number, started or joined: a machine that joined has the launch settings its
admission carried (inputs.launch_settings) and the latest job (the training options, network and fleet), and
builds from them the `Run` a started machine has from its command (attempts.JoinedSuccession); joined machines
numbered up to MIRRORS mirror as started ones do.  A joined machine without a job yet (still receiving the
run's files) follows whoever takes the role (`follow_successor`), and a later joiner asks the successor.

The newest state wins (`newest_state`): the mirrored checkpoint, or any other consistent checkpoint handed to
`install`, whichever has the higher step; a checkpoint that does not load is skipped and said.  The other
candidate is the survivors' rescue shards (`rescued_state`, training/rescue.py's assembly): each follower
sends its own to the coordinator it follows before its report (`succeed`'s `send`), so the successor holds
every survivor's shards once it has every report, and a replica that survived gives the step the workers
reached: 0 steps redone, provided that step's row was mirrored (the log must hold every step once).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.safeio import atomic_write
from vgraph.data.shards import sha256_file
from vgraph.run.files import CHECKPOINT_PREFIX, LATEST, LAUNCH_DIR, METRICS_JSONL

from ...training import checkpoint as ckpt
from ...training.rescue import RESCUE_DIR, rescue_saved
from .elastic import CHUNK_BYTES, FETCH_TIMEOUT_S, _fetch
from .membership import (REQUEST_TIMEOUT_S, ask, elect, follow_successor, rival,  # noqa: F401 (this module's API too)
                         serving)

__all__ = ["MirrorSource", "Mirror", "elect", "serving", "succeed", "follow_successor", "install", "newest_state",
           "superseded",
           "record_machines", "rescued_state",
           "MIRROR_DIR", "MACHINES_JSON", "ADMISSION_JSON", "mirrored_admission", "MIRRORS", "MIRROR_EVERY_S",
           "Installed"]

MIRROR_DIR = "mirror"  # in the follower's RUN/launch/
MACHINES_JSON = "machines.json"  # in the coordinator's RUN/launch/: the machines' addresses and the channel port
MIRRORS = 2  # the successor, and the next in line should the successor die during its succession
MIRROR_EVERY_S = 1.0  # rows: metrics.jsonl is written about once a second (metrics_log.py); see docs
ADMISSION_JSON = "admission.json"  # in the mirror: an elastic run's admitted machines (boundaries.Admission.record)
TAIL_BYTES = 64  # the last bytes a mirror holds, sent with its offset: a rewritten metrics.jsonl is noticed



class MirrorSource:
    """The coordinator's side: answers `mirror` (new metrics bytes, the latest checkpoint's file list) and
    `mirror-fetch` (a chunk of one of that checkpoint's files, named by the list it sent: never a path the
    request makes up)."""

    def __init__(self, run_dir: Path, admission: Callable[[], dict | None] = lambda: None) -> None:
        self.run_dir = run_dir
        self.admission = admission  # an elastic run's admitted machines (boundaries.Admission.record), or None
        self._listed: tuple[str, dict[str, tuple[int, str]]] | None = None  # (checkpoint, file -> (size, sha))
        self._lock = threading.Lock()

    def answer(self, request: dict) -> dict:
        try:
            if request.get("op") == "mirror":
                return self._rows(int(request.get("offset", 0)), str(request.get("tail", "")))
            return self._chunk(str(request["checkpoint"]), str(request["name"]), int(request["offset"]))
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"malformed mirror request: {quote(str(exc), 120)}"}
        except (OSError, ckpt.CheckpointError) as exc:  # a checkpoint pruned or being replaced: ask again later
            return {"error": f"not available now: {quote(str(exc), 200)}"}

    def _rows(self, offset: int, tail: str) -> dict:
        path = self.run_dir / METRICS_JSONL
        held = base64.b64decode(tail, validate=True)  # a ValueError when it is not base64: said, not served
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if not 0 <= offset <= size or len(held) > TAIL_BYTES or len(held) > offset:
                    offset = 0
                elif held:
                    f.seek(offset - len(held))
                    if f.read(len(held)) != held:  # rewritten (a restart cut it back): start over
                        offset = 0
                f.seek(offset)
                data = f.read(CHUNK_BYTES)
        except FileNotFoundError:
            offset, data, size = 0, b"", 0
        return {"offset": offset, "rows": base64.b64encode(data).decode("ascii"), "size": size,
                "checkpoint": self._latest(), "admission": self.admission()}

    def _latest(self) -> dict | None:
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is None:
            return None
        with self._lock:
            if self._listed is None or self._listed[0] != latest.name:
                files = {p.name: (p.stat().st_size, sha256_file(p)) for p in sorted(latest.iterdir())
                         if p.is_file()}
                self._listed = (latest.name, files)
            name, files = self._listed
        return {"name": name, "files": {n: {"size": s, "sha256": d} for n, (s, d) in files.items()}}

    def _chunk(self, checkpoint: str, name: str, offset: int) -> dict:
        with self._lock:
            listed = self._listed
        if listed is None or listed[0] != checkpoint or name not in listed[1]:
            return {"error": f"{quote(checkpoint, 60)}/{quote(name, 60)} is not offered (a newer checkpoint?)"}
        size, digest = listed[1][name]
        if not 0 <= offset <= size:
            return {"error": f"offset {offset} outside {name} ({size} bytes)"}
        with open(self.run_dir / checkpoint / name, "rb") as f:
            f.seek(offset)
            data = f.read(CHUNK_BYTES)
        return {"data": base64.b64encode(data).decode("ascii"), "size": size, "sha256": digest}


@dataclass
class Mirror:
    """A follower's side: pulls the coordinator's history into RUN/launch/mirror/ (see the module docstring).
    `request(op, timeout, **fields)` asks the coordinator of the moment (membership.Machines.request)."""

    request: Callable[..., dict]
    folder: Path
    say: Callable[[str], None] = lambda line: None
    every: float = MIRROR_EVERY_S
    active: Callable[[], bool] = lambda: True  # False while this machine is itself the coordinator
    over: Callable[[], bool] = lambda: False  # True once this machine's channel is closed: the thread ends
    offset: int = 0
    checkpoint: str | None = None
    admission: dict | None = None  # the last admission record written (elastic runs)
    figures: list[dict[str, Any]] = field(default_factory=list)  # per mirrored checkpoint: bytes, seconds
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Mirror":
        """Start pulling, into a fresh folder (a mirror left by an earlier run of this directory is not this
        run's history)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self._thread = threading.Thread(target=self._run, daemon=True, name="vgraph-mirror")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop pulling; a round under way finishes first (its files are complete or thrown away)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * FETCH_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(self.every) and not self.over():
            if not self.active():
                continue
            try:
                self.pull()
            except (OSError, ValueError, TypeError, KeyError, VGraphError):
                # The coordinator is busy or gone (the channel's own clocks decide what that means), or its answer
                # was not what this version reads: the mirror keeps what it holds and asks again.
                continue

    def pull(self) -> None:
        """One round: the new rows, then the latest checkpoint when it is not the one held."""
        rows = self.folder / METRICS_JSONL
        tail = b""
        if self.offset:
            with open(rows, "rb") as f:
                f.seek(max(0, self.offset - TAIL_BYTES))
                tail = f.read(TAIL_BYTES)
        reply = self.request("mirror", REQUEST_TIMEOUT_S, offset=self.offset,
                             tail=base64.b64encode(tail).decode("ascii"))
        if "error" in reply:
            return
        start, data = int(reply["offset"]), base64.b64decode(str(reply["rows"]), validate=True)
        if start not in (0, self.offset):  # the coordinator answers from the offset asked, or from the start
            raise ValueError(f"the coordinator answered rows from offset {start}, not {self.offset} or 0")
        with open(rows, "r+b" if rows.exists() else "wb") as f:
            f.truncate(start)
            f.seek(start)
            f.write(data)
        self.offset = start + len(data)
        admitted = reply.get("admission")
        if isinstance(admitted, dict) and admitted != self.admission:  # an elastic run's machines, as they change
            atomic_write(self.folder / ADMISSION_JSON, json.dumps(admitted) + "\n")
            self.admission = admitted
        latest = reply.get("checkpoint")
        if isinstance(latest, dict) and latest.get("name") != self.checkpoint:
            self._fetch_checkpoint(str(latest["name"]), dict(latest["files"]))

    def _fetch_checkpoint(self, name: str, files: dict[str, Any]) -> None:
        if not name.startswith(CHECKPOINT_PREFIX) or Path(name).name != name or not name.isprintable():
            raise ValueError(f"the coordinator names a checkpoint {quote(name, 60)}")
        began, total = time.monotonic(), 0
        incoming = self.folder / f".incoming-{name}"
        shutil.rmtree(incoming, ignore_errors=True)
        incoming.mkdir()

        def ask_chunk(op: str, timeout: float = FETCH_TIMEOUT_S, **kw: Any) -> dict:
            return self.request("mirror-fetch", timeout, checkpoint=name, **kw)

        try:
            for file, meta in files.items():
                if Path(file).name != file or file in (".", "..") or not file.isprintable():
                    raise ValueError(f"the coordinator names a checkpoint file {quote(file, 60)}")
                with open(incoming / file, "wb") as f:
                    # silence 0: a chunk that does not come ends this round (the next round starts over)
                    _fetch(ask_chunk, file, int(meta["size"]), str(meta["sha256"]), f.write, 0)
                total += int(meta["size"])
            target = self.folder / name
            shutil.rmtree(target, ignore_errors=True)
            os.rename(incoming, target)
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
        atomic_write(self.folder / LATEST, name + "\n")
        previous, self.checkpoint = self.checkpoint, name
        if previous and previous != name:
            shutil.rmtree(self.folder / previous, ignore_errors=True)
        seconds = time.monotonic() - began
        self.figures.append({"checkpoint": name, "bytes": total, "seconds": round(seconds, 3)})
        self.say(f"launch: mirrored {name} from the coordinator ({total:,} bytes in {seconds:.2f} s)")


def succeed(machines: Any, lost: int, survivors: set[int], report: dict,
            decide: Callable[[dict[int, dict], list[int]], dict], window: float,
            send: Callable[[], Any] = lambda: None, serve: Callable[[], Any] = lambda: None) -> dict:
    """After this machine lost coordinator `lost`: elect the new one among `survivors` (this machine
    included), follow it or take over, and return the decision for the next attempt (membership.settle's).
    `machines.coordinator` says who won.  A rival of lower rank wins a tie; MachineLost when the coordinator
    followed is lost in turn (the caller elects again without it).

    `send`: a follower's rescue shards to the coordinator it follows, before its report (shard_transfer.py),
    so the successor has every survivor's shards once it has every report; `serve`: the successor answers
    them (and whatever else machine 0's channel answered) from the moment it serves the channel.  The lost
    coordinator's PNodes are `gone` in the decision (vanished machines: `restart` re-plans without them)."""
    from .membership import SteppedDown

    def follow(k: int) -> dict:
        machines.follow(k)
        send()
        return machines.settle(report, lambda reports, missing: {}, wait_for_all=True)

    me = machines.node_rank
    chosen = elect(me, survivors, lambda k: serving(machines, k, window))
    if chosen != me:
        return follow(chosen)
    serve()  # before the channel is up: a follower that finds it serving may send its shards at once
    try:
        machines.take_over(lost, set(survivors))
    except VGraphError:  # the address is taken: a survivor of lower rank serves there after all?
        chosen = elect(me, survivors, lambda k: serving(machines, k, 0.0))
        if chosen == me:
            raise
        return follow(chosen)

    def decide_without_lost(reports: dict[int, dict], missing: list[int]) -> dict:
        plan = decide(reports, missing)  # a survivor that did not report loses its PNodes, and only those count
        if plan.get("error"):
            return plan
        return {**plan, "lost": sorted(set(plan["lost"]) | set(report["lost"])),  # ... and the lost coordinators'
                "gone": sorted(set(plan.get("gone") or []) | set(report["lost"]))}

    machines.superior = rival(machines, set(survivors))
    try:
        return machines.settle(report, decide_without_lost, wait_for_all=True)
    except SteppedDown as down:
        machines.step_down(int(down.args[0]))
        send()
        return machines.settle(report, lambda reports, missing: {}, wait_for_all=True)
    finally:
        machines.superior = None


@dataclass
class Installed:
    step: int  # the step the next attempt resumes from (0: from the start)
    redone: int  # steps the lost coordinator had logged past it, trained again
    source: str  # where the state came from


def newest_state(candidates: Iterable[Path], say: Callable[[str], None]) -> tuple[Path, int] | None:
    """(checkpoint folder, step) of the candidate with the highest step that loads; None when none does.
    Candidates are checkpoint folders in `vgraph train`'s format (the mirrored one, a rescue)."""
    best: tuple[Path, int] | None = None
    for path in candidates:
        try:
            step = ckpt.load_checkpoint(path, map_location="cpu").step
        except (ckpt.CheckpointError, OSError, VGraphError) as exc:
            say(f"launch: not resuming from {path}: {exc}")
            continue
        if best is None or step > best[1]:
            best = (path, step)
    return best


def rescued_state(run_dir: Path, *, run: str, attempt: int, keys: set[str], ceiling: int, extra: dict[str, Any],
                  keep: int, per_rank_state: str = "", say: Callable[[str], None] = lambda line: None) -> list[Path]:
    """The successor's candidate from the survivors' rescue shards of `attempt` (its own, and those the others
    sent it: RUN/launch/rescue/): a checkpoint in `run_dir` at the latest step they hold every VNode of
    (`keys`) later than the mirrored checkpoint, and no later than the last mirrored row (a step without its
    row would be missing from the log, as rescue.assemble rules for machine 0's log); [] when there is none,
    the reason said.  Shards of another run or attempt (the old coordinator's, an earlier one's) and
    damaged ones are refused by read_shards/assemble and said."""
    mirror = run_dir / LAUNCH_DIR / MIRROR_DIR
    logged = max((r["step"] for r in _rows(mirror / METRICS_JSONL)), default=0)
    mirrored = ckpt.latest_checkpoint(mirror) if (mirror / LATEST).exists() else None
    try:
        floor = ckpt.checkpoint_step(mirrored) if mirrored is not None else 0
    except (ckpt.CheckpointError, OSError):
        floor = 0  # damaged: install says so and skips it; the shards then compete with nothing
    found = rescue_saved(run_dir / LAUNCH_DIR / RESCUE_DIR, run_dir, run=run, attempt=attempt, keys=keys, floor=floor,
                         ceiling=ceiling, logged=logged, extra=extra, keep=keep, per_rank_state=per_rank_state, say=say)
    if found.step is None:
        say(f"launch: the survivors' shards give no newer state than the mirrored checkpoint: {found.why}")
        return []
    say(f"launch: the survivors hold every VNode at step {found.step} (the shards of ranks {found.ranks}; the "
        f"mirrored checkpoint is step {floor})")
    if found.saved is None:  # a full disk: the mirrored checkpoint is still there
        say(f"launch: the survivors' state at step {found.step} could not be written: {found.unsaved}")
        return []
    return [found.saved]


def _rows(path: Path) -> list[dict]:
    """The complete rows of a mirrored metrics.jsonl (the last line may be cut off mid-row)."""
    rows = []
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def install(run_dir: Path, rescued: Iterable[Path] = (), say: Callable[[str], None] = lambda line: None
            ) -> Installed:
    """Make `run_dir` (the new coordinator's, locked by the caller) hold the run's newest state: the newest
    checkpoint among the mirrored one and `rescued`, copied in with its `latest` pointer, and metrics.jsonl
    with the mirrored rows up to that step (the rank 0 of the next attempt resumes there and logs the
    rest once)."""
    mirror = run_dir / LAUNCH_DIR / MIRROR_DIR
    mirrored = ckpt.latest_checkpoint(mirror) if (mirror / LATEST).exists() else None
    rows = _rows(mirror / METRICS_JSONL)
    last = max((r["step"] for r in rows), default=0)
    chosen = newest_state([p for p in (mirrored, *rescued) if p is not None], say)
    if chosen is None:
        atomic_write(run_dir / METRICS_JSONL, "")
        return Installed(0, last, "none: from the start")
    path, step = chosen
    target = run_dir / path.name
    if path.resolve() != target.resolve():
        staging = run_dir / f".{path.name}.tmp-succession"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(path, staging)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)
    atomic_write(run_dir / LATEST, target.name + "\n")
    atomic_write(run_dir / METRICS_JSONL, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
    source = "mirrored checkpoint" if path == mirrored else f"rescued state {path}"
    return Installed(step, max(0, last - step), source)


def mirrored_admission(run_dir: Path) -> dict | None:
    """The admission record this machine mirrored (an elastic run's admitted machines), or None when there is
    none or it does not read (then only the machines of the last job are known: boundaries.Admission.restore)."""
    from vgraph.base.safeio import read_json

    path = run_dir / LAUNCH_DIR / MIRROR_DIR / ADMISSION_JSON
    if not path.is_file():
        return None
    try:
        record = read_json(path, what="the mirrored admission record")
    except VGraphError:
        return None
    return record if isinstance(record, dict) else None


def _recorded(run_dir: Path) -> tuple[int, dict[int, str]] | None:
    """(port, machine -> address) of launch/machines.json, or None when there is none or it is damaged."""
    from vgraph.base.safeio import read_json

    path = run_dir / LAUNCH_DIR / MACHINES_JSON
    if not path.is_file():
        return None
    try:
        data = read_json(path, what="launch/machines.json")
        return int(data["port"]), {int(m): str(a) for m, a in dict(data["machines"]).items()}
    except (VGraphError, KeyError, TypeError, ValueError):
        return None  # not ours to judge: a damaged record names no coordinator


def record_machines(run_dir: Path, port: int, addrs: dict[int, str]) -> None:
    """The coordinator: where the machines are (launch/machines.json), for a machine 0 that comes back.  Merged
    with what the file held for the same port: a machine 0 started again has not heard every machine yet, and
    the one that took its run over must still be asked (`superseded`)."""
    before = _recorded(run_dir)
    table = {**(before[1] if before is not None and before[0] == port else {}), **addrs}
    atomic_write(run_dir / LAUNCH_DIR / MACHINES_JSON,
                 json.dumps({"port": port, "machines": {str(m): a for m, a in sorted(table.items())}}) + "\n")


def superseded(run_dir: Path, key: str, me: int = 0, timeout: float = 1.0) -> str | None:
    """Machine `me` starting on, or going on with, a run it coordinated: why it must not (another machine
    coordinates the run now: its rank and address), or None.  It asks every machine recorded in
    launch/machines.json who serves the channel; silence is no objection (the run is over, or those machines
    are gone)."""
    recorded = _recorded(run_dir)
    if recorded is None:
        return None
    port, addrs = recorded
    for addr in dict.fromkeys(addrs.values()):
        try:
            reply = ask(addr, port, key, {"op": "coordinator", "machine": me}, timeout)
        except (OSError, ValueError):
            continue
        who = reply.get("coordinator")
        if isinstance(who, int) and who != me:
            return (f"machine {who} ({addr}) took over this run as its coordinator after machine {me} was lost, "
                    f"and it goes on there: going on here would split it in two. Its metrics and checkpoints "
                    f"are in machine {who}'s run directory; stop that run first to continue here with --resume")
    return None
