"""The run's history mirrored to the machines next in line, and where the machines are: what a successor needs
when machine 0 (the coordinator) is lost (succession.py has the design and the role's move).

The coordinator answers `mirror` and `mirror-fetch` on the launchers' channel (`MirrorSource`: new rows of
metrics.jsonl, the latest checkpoint's files in chunks); the MIRRORS machines next in line pull them every
MIRROR_EVERY_S into RUN/launch/mirror/ (`Mirror`), with an elastic run's admission record (ADMISSION_JSON).
The coordinator records the machines' addresses in RUN/launch/machines.json (`record_machines`), so a machine 0
started again asks them who coordinates and refuses to split the run in two (`superseded`).

Apart from succession.py because it runs all along, beside the attempts, and needs nothing of the run but its
directory and the channel; the succession reads what it left.
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
from typing import Any, Callable

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.safeio import atomic_write, read_json
from vgraph.data.shards import sha256_file
from vgraph.run.files import CHECKPOINT_PREFIX, LATEST, LAUNCH_DIR, METRICS_JSONL

from ...training import checkpoint as ckpt
from .elastic import CHUNK_BYTES, FETCH_TIMEOUT_S, fetch_chunks
from .membership import REQUEST_TIMEOUT_S, ask

__all__ = ["MirrorSource", "Mirror", "MIRROR_DIR", "MACHINES_JSON", "ADMISSION_JSON", "MIRRORS", "MIRROR_EVERY_S",
           "record_machines", "superseded", "serve_history", "pull_history", "keep_history"]

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
                    fetch_chunks(ask_chunk, file, int(meta["size"]), str(meta["sha256"]), f.write, 0)
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


def keep_history(machines: Any, run_dir: Path, lead: bool, admission: Any, say: Callable[[str], None]
                 ) -> Mirror | None:
    """A run whose coordinator role can move, at its start: the coordinator (`lead`) serves the run's history
    with its `admission`'s record (boundaries.Admission, or None: a run that takes no joins); a machine next in
    line pulls it (its `Mirror`, the successor's history); the others keep none (None)."""
    if not lead:
        return pull_history(machines, run_dir / LAUNCH_DIR, say) if machines.node_rank <= MIRRORS else None
    serve_history(machines, run_dir, admission.record if admission is not None else lambda: None)
    return None


def serve_history(machines: Any, run_dir: Path, admission: Callable[[], dict | None]) -> None:
    """The coordinator: serve the run's history (`MirrorSource`, with the admission's record) on the channel and
    record where the machines are (`record_machines`) now and whenever a beat changes them."""
    machines.serve_mirror(MirrorSource(run_dir, admission).answer)
    port = machines.port
    machines.on_addresses(lambda addrs: record_machines(run_dir, port, addrs))


def pull_history(machines: Any, launch_dir: Path, say: Callable[[str], None]) -> Mirror:
    """A machine next in line (started or joined): pull the coordinator's history into launch/mirror/ while
    another machine coordinates and the channel is up."""
    return Mirror(machines.request, launch_dir / MIRROR_DIR, say,
                  active=lambda: machines.coordinator != machines.node_rank,
                  over=lambda: not machines.active).start()


def _recorded(run_dir: Path) -> tuple[int, dict[int, str]] | None:
    """(port, machine -> address) of launch/machines.json, or None when there is none or it is damaged."""
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
