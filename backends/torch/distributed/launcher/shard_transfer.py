"""Rescue shards from the other machines to machine 0, over the launchers' sealed channel.

Why: machine 0 assembles the checkpoint a rescue resumes from (training/rescue.py), and the survivors' shards
lie in each machine's own run directory: there is no shared file system.  The channel (membership.py: every
line sealed with an HMAC of the run's secret, one request per connection) already carries elastic.py's
files in chunks of membership.CHUNK_BYTES; this is the other direction, a machine pushing to machine 0:

* `rescue-put` {shard, file, offset, data}: one chunk (base64) of one of a shard's files, at `offset`, which
  must be where the file received so far ends (a chunk sent twice, after a lost answer, is taken once);
* `rescue-done` {shard, files: {name: {size, sha256}}}: the shard is whole: machine 0 checks every file's
  size and SHA-256, then renames the shard into place (`RUN/launch/rescue/<shard>`), so the assembly sees
  complete shards only.  A machine lost half way (a second loss during the rescue) leaves a partial shard in
  a dot-folder, which the assembly ignores and the next rescue removes.

Only shard names (`a<attempt>-r<rank>`) and a shard's own file names are taken; nothing a request names is
ever used as a path.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from vgraph.base.diagnostics import printable
from vgraph.data.shards import sha256_file

from ...training.rescue import SHARD_FILES, SHARD_NAME
from .membership import CHUNK_BYTES, FETCH_TIMEOUT_S

__all__ = ["ShardReceiver", "send_shards"]

MAX_SHARD_FILE = 1 << 40  # a rank's parameters and moments: far less; bounds what a request may announce


class ShardReceiver:
    """Machine 0's side: chunks into `folder/.in-<shard>/`, a checked shard renamed to `folder/<shard>`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def answer(self, request: dict) -> dict:
        op = request.get("op")
        machine = request.get("machine")
        if not isinstance(machine, int) or isinstance(machine, bool) or machine < 1:
            return {"error": "only another machine of the run sends rescue shards"}
        shard = request.get("shard")
        if not isinstance(shard, str) or SHARD_NAME.fullmatch(shard) is None:
            return {"error": f"not a rescue shard's name: {printable(str(shard), 40)}"}
        incoming = self.folder / f".in-{shard}"
        if op == "rescue-put":
            return self._put(incoming, request)
        if op == "rescue-done":
            return self._done(incoming, self.folder / shard, request.get("files"))
        return {"error": f"unknown request {printable(str(op), 40)}"}

    def _put(self, incoming: Path, request: dict) -> dict:
        name, offset = request.get("file"), request.get("offset")
        if name not in SHARD_FILES:
            return {"error": f"not a file of a shard: {printable(str(name), 40)}"}
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= MAX_SHARD_FILE:
            return {"error": "a chunk's offset must be a whole number of bytes"}
        try:
            data = base64.b64decode(str(request.get("data", "")), validate=True)
        except ValueError:
            return {"error": "a chunk must be base64"}
        if len(data) > CHUNK_BYTES:
            return {"error": f"a chunk holds at most {CHUNK_BYTES} bytes"}
        incoming.mkdir(parents=True, exist_ok=True)
        path = incoming / name
        have = path.stat().st_size if path.is_file() else 0
        if offset + len(data) <= have:
            return {"ok": True, "have": have}  # sent again after a lost answer
        if offset != have:
            return {"error": f"{name}: chunk at {offset}, but {have} bytes arrived so far"}
        with open(path, "ab") as f:
            f.write(data)
        return {"ok": True, "have": have + len(data)}

    def _done(self, incoming: Path, target: Path, files: Any) -> dict:
        if not isinstance(files, dict) or set(files) != set(SHARD_FILES):
            return {"error": f"a shard has the files {', '.join(SHARD_FILES)}"}
        for name, meta in files.items():
            path = incoming / name
            size, digest = (meta.get("size"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
            if not path.is_file() or path.stat().st_size != size or sha256_file(path) != digest:
                return {"error": f"{name} did not arrive whole (size or SHA-256 differs)"}
        for name in SHARD_FILES:
            with open(incoming / name, "rb") as f:
                os.fsync(f.fileno())
        if target.exists():
            shutil.rmtree(target)  # the same shard sent again: the one that arrived whole now replaces it
        os.rename(incoming, target)
        return {"ok": True}



def send_shards(request: Callable[..., dict], folder: Path, attempt: int, say: Callable[[str], None]) -> list[str]:
    """This machine's shards of `attempt` (in `folder`) to the coordinator (machine 0, or the machine that took
    its role: succession.py), chunk by chunk (`request`: the channel,
    Machines.request); the names that arrived whole.  A shard machine 0 refuses, or a link that fails, is
    said and skipped: machine 0 then assembles from what it has, or falls back to the last checkpoint.  The
    shards stay here until the next rescue (a machine that takes machine 0's role reads its own); earlier
    attempts' are removed."""
    sent: list[str] = []
    if not folder.is_dir():
        return sent
    for shard in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        match = SHARD_NAME.fullmatch(shard.name)
        if match is not None and int(match.group(1)) < attempt and not shard.is_symlink():
            shutil.rmtree(shard, ignore_errors=True)  # an earlier rescue's, decided long since
        if match is None or int(match.group(1)) != attempt:
            continue
        try:
            files = {name: _send_file(request, shard.name, shard / name) for name in SHARD_FILES}
            reply = request("rescue-done", timeout=FETCH_TIMEOUT_S, shard=shard.name, files=files)
        except (OSError, ValueError, _Refused) as exc:
            say(f"launch: rescue shard {shard.name} not sent to the coordinator: {exc}")
            continue
        if "error" in reply:
            say(f"launch: the coordinator refused rescue shard {shard.name}: {reply['error']}")
            continue
        sent.append(shard.name)
    return sent


class _Refused(Exception):
    """The coordinator answered a chunk with an error: this shard is skipped, the others still go."""


def _send_file(request: Callable[..., dict], shard: str, path: Path) -> dict[str, Any]:
    digest, offset = hashlib.sha256(), 0
    size = path.stat().st_size
    with open(path, "rb") as f:
        while True:
            data = f.read(CHUNK_BYTES)
            if not data and offset > 0:
                break
            reply = request("rescue-put", timeout=FETCH_TIMEOUT_S, shard=shard, file=path.name, offset=offset,
                            data=base64.b64encode(data).decode("ascii"))
            if "error" in reply:
                raise _Refused(reply["error"])
            digest.update(data)
            offset += len(data)
            if not data:
                break
    return {"size": size, "sha256": digest.hexdigest()}
