"""Files in and out, done the one safe way every command shares.

Why one module: vgraph runs on files from other people, on shared machines
and on full disks.  Each output is written *atomically* (a temporary file in
the same directory, flushed and fsynced, then renamed over the target), so an
interrupted or failed write never leaves a truncated file, and the temporary
is removed when anything goes wrong.  A new file gets the mode the user's
umask allows (like `open(..., "w")`), a replaced file keeps its own mode.
An output that is one of the command's inputs is refused: nothing the user
gave us is ever overwritten.  Inputs are read with a size cap and only from
regular files, so `/dev/zero` or a FIFO as FILE is a diagnostic, not a hang.

Every failure here is a VGraphError naming the path, so the CLI prints it and
exits 2 instead of showing a traceback.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, NoReturn

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.jsonio import decode_text, loads

MAX_INPUT_BYTES = 256 * 2**20  # a network, fleet or placement larger than this is not one (100k VNodes: ~25 MB)


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no way to read it without setting it elsewhere
    os.umask(mask)
    return mask


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


Owner = Callable[[Path], "str | None"]
_OWNERS: list[Owner] = []


def register_owner(owner: Owner) -> None:
    """Add a rule that says why a (resolved) path belongs to something no command may write into, or None.

    The core's one registered rule is the run directory's (vgraph/run/files.py: a run's checkpoints, job
    files, tokens, metrics); this layer knows no run, so the rule is handed in, not imported."""
    if owner not in _OWNERS:
        _OWNERS.append(owner)


def check_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (),
                 what: str = "output") -> Path:
    """`path` as a Path, after refusing what would destroy something: an output that is an existing
    directory or device, that is (the same file as) one of `inputs` or lies inside an input directory,
    or that lies inside something a run owns (`register_owner`), all resolved through symlinks."""
    out = Path(path)
    if str(path) == "":
        raise VGraphError(f"{what}: the path is empty")
    if out.is_dir():
        raise VGraphError(f"{printable(str(out))}: {what} is a directory; give a file name")
    _refuse_special(out)
    _refuse_inputs_and_owned(out, inputs, what)
    return out


def check_output_dir(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (),
                     what: str = "output directory") -> Path:
    """`path` as a Path for a command that writes files into it: refused when it is a file or device, is
    or lies inside an input, or lies inside something a run owns.  An input inside it is fine: each file
    written there is checked with `check_output`, so none replaces an input (see `OutputDir`)."""
    out = Path(path)
    shown = printable(str(out))
    if str(path) == "":
        raise VGraphError(f"{what}: the path is empty")
    if out.exists() and not out.is_dir():
        raise VGraphError(f"{shown}: not a directory; the {what} must be a directory (or not exist yet)")
    _refuse_inputs_and_owned(out, inputs, what)
    return out


def _refuse_inputs_and_owned(out: Path, inputs: Iterable[str | os.PathLike | None], what: str) -> None:
    real = Path(os.path.realpath(out))
    shown = printable(str(out))
    for given in inputs:
        if given is None:
            continue
        source = Path(os.path.realpath(given))
        if same_file(out, Path(given)) or real == source:
            raise VGraphError(f"{shown}: {what} is the input {printable(str(given))}; "
                              f"refusing to overwrite an input (write to another file)")
        if source in real.parents and source.is_dir():
            raise VGraphError(f"{shown}: {what} lies inside the input directory {printable(str(given))}; "
                              f"write it outside what the command reads")
    for owner in _OWNERS:
        why = owner(real)
        if why:
            raise VGraphError(f"{shown}: {why}; a command never writes there (write the {what} elsewhere)")


MANIFEST = ".vgraph-outputs.json"  # in a directory a command writes into: what it wrote there, by content


class OutputDir:
    """A directory a command writes several files into, replacing only files it can prove it wrote.

    Why: `partition -o DIR` used to delete whatever an earlier placement.json listed (a placement.json
    from elsewhere named files it never wrote), and `optimize --dump-dir` wrote over whatever was there.
    The proof is a manifest (MANIFEST, in the directory) of the files this command wrote there and the
    SHA-256 of each: a file may be replaced or removed only when the manifest lists it and its content
    is still what was written (a file edited since, or put there by anyone else, is refused, never
    lost).  Every file is checked with `check_output` (not an input, not inside something a run owns)
    before the first one is written (`plan`), and written atomically; the manifest is rewritten after
    each file, so an interrupted command still knows what it wrote.
    """

    def __init__(self, path: str | os.PathLike, *, command: str,
                 inputs: Iterable[str | os.PathLike | None] = ()) -> None:
        self.inputs = [i for i in inputs if i is not None]
        self.path = check_output_dir(path, inputs=self.inputs)
        self.command = command
        self.previous = self._read_manifest()
        self.written: dict[str, str] = {}

    def plan(self, names: Iterable[str]) -> None:
        """Refuse, before anything is written, any of `names` that may not be (re)written."""
        for name in names:
            self.check(name)

    def check(self, name: str) -> Path:
        """DIR/`name`, if this command may write it: a plain name, checked as an output, and either absent
        or a file this command wrote there and nobody changed since."""
        if not name or Path(name).name != name or name in (".", "..", MANIFEST):
            raise VGraphError(f"{printable(name)}: not a plain file name for {printable(str(self.path))}")
        target = check_output(self.path / name, inputs=self.inputs)
        if (os.path.lexists(target) and name not in self.written) and not self._ours(name):
            raise VGraphError(f"{printable(str(target))}: exists and was not written there by vgraph "
                              f"{self.command} (or was changed since); refusing to replace a file it cannot "
                              f"prove it wrote: move it away or write to another directory")
        return target

    def write(self, name: str, data: bytes | str) -> Path:
        target = self.check(name)
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        atomic_write(target, raw)
        self._record(name, hashlib.sha256(raw).hexdigest())
        return target

    def wrote(self, name: str) -> Path:
        """Record DIR/`name`, just written by another writer (after `check(name)`), as this command's."""
        self._record(name, _digest(self.path / name))
        return self.path / name

    def remove_stale(self) -> list[str]:
        """Remove the files an earlier run of this command wrote here and this one did not (only those
        still as written); returns their names."""
        removed = []
        for name in sorted(set(self.previous) - set(self.written)):
            if self._ours(name) and not any(same_file(self.path / name, Path(i)) for i in self.inputs):
                try:
                    (self.path / name).unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise VGraphError(f"{printable(str(self.path / name))}: left from an earlier {self.command} "
                                      f"and cannot be removed: {_why(exc)}") from None
                removed.append(name)
        self._save({k: v for k, v in {**self.previous, **self.written}.items() if k not in removed})
        return removed

    def _ours(self, name: str) -> bool:
        path = self.path / name
        return (name in self.previous and not path.is_symlink() and path.is_file()
                and _digest(path) == self.previous[name])

    def _record(self, name: str, digest: str) -> None:
        self.written[name] = digest
        self._save({**self.previous, **self.written})

    def _save(self, entries: dict[str, str]) -> None:
        atomic_write(self.path / MANIFEST, json.dumps({"written_by": f"vgraph {self.command}",
                                                       "files": dict(sorted(entries.items()))}, indent=1) + "\n")

    def _read_manifest(self) -> dict[str, str]:
        path = self.path / MANIFEST
        if not os.path.lexists(path):
            return {}
        try:
            doc = read_json(path, what="output manifest", limit=16 * 2**20)
            files = doc["files"]
            return {str(k): str(v) for k, v in files.items() if isinstance(k, str) and Path(k).name == k}
        except (VGraphError, ValueError, KeyError, TypeError, AttributeError):
            raise VGraphError(f"{printable(str(path))}: not a list of outputs vgraph wrote; move it away or write "
                              f"to another directory") from None


def _digest(path: Path) -> str:
    """SHA-256 of a file's content, read in chunks."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (links and `..` included); False when either is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        try:
            return a.resolve() == b.resolve()
        except (OSError, RuntimeError):
            return False


def _refuse_special(target: Path) -> None:
    """An existing output that is a device, FIFO or socket (`-o /dev/null`, `-o /dev/zero`) is
    refused: renaming over it would replace the device node itself."""
    try:
        st = target.stat()
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise VGraphError(f"{printable(str(target))}: not a regular file (a device, FIFO or socket); "
                          f"refusing to replace it")


def atomic_write(path: str | os.PathLike, data: bytes | str, *, make_parents: bool = True,
                 durable: bool = True) -> Path:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never a part.

    The temporary sits next to the target (same file system, so the rename is
    atomic), is fsynced before the rename when `durable` (a crash after the
    rename then cannot leave an empty file), and is removed on any failure.
    Mode: the replaced file's, else 0o666 minus the umask.  OS errors (disk
    full, read-only, permission, a directory in the way) become a VGraphError
    naming the path.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)

    def fill(fd: int) -> None:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]

    return _write_via_temporary(path, make_parents, durable, fill=fill)


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None], *,
                      make_parents: bool = True) -> Path:
    """`atomic_write` for a file a library writes by name: `write(tmp)` writes the temporary beside `path`.

    Why: safetensors' `save_file` writes a file of its own and renames it
    into place with mode 0600 whatever the umask (checkpoints came out
    0600), so the mode is set here afterwards, on whatever file `write`
    left under the temporary's name; then fsync and rename as above.
    """
    return _write_via_temporary(path, make_parents, True, by_name=write)


def _write_via_temporary(path: str | os.PathLike, make_parents: bool, durable: bool, *,
                         fill: Callable[[int], None] | None = None,
                         by_name: Callable[[Path], None] | None = None) -> Path:
    """A temporary beside `path`, written through its descriptor (`fill`) or by name (`by_name`), given its
    mode, fsynced when `durable`, renamed over `path`; removed on any failure."""
    target, shown, mode, fd, tmp = _temporary_beside(path, make_parents)
    try:
        if by_name is not None:
            os.close(fd)
            by_name(Path(tmp))
            fd = os.open(tmp, os.O_RDONLY)  # the file the writer left there, perhaps a new one
        try:
            if fill is not None:
                fill(fd)
            if durable:
                os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:
        _discard(tmp, shown, exc)
    return target


def _temporary_beside(path: str | os.PathLike, make_parents: bool) -> tuple[Path, str, int, int, str]:
    """(target, its printable name, the mode it will have, fd and name of a fresh temporary beside it)."""
    target = Path(path)
    shown = printable(str(target))
    if target.is_dir():
        raise VGraphError(f"{shown}: is a directory; cannot write a file there")
    _refuse_special(target)
    try:
        if make_parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = stat.S_IMODE(target.stat().st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise VGraphError(f"{shown}: cannot write: {_why(exc)}") from None
    return target, shown, mode, fd, tmp


def _discard(tmp: str, shown: str, exc: BaseException) -> NoReturn:
    """Remove a failed write's temporary and raise: an OSError as a VGraphError naming the target."""
    try:
        os.unlink(tmp)
    except OSError:
        pass
    if isinstance(exc, OSError):
        raise VGraphError(f"{shown}: cannot write: {_why(exc)}") from None
    raise exc


def read_input(path: str | os.PathLike, *, what: str = "file", limit: int = MAX_INPUT_BYTES,
               binary: bool = False) -> str | bytes:
    """The content of a user's input file, refused unless it is a regular file of at most `limit` bytes.

    A FIFO, a device (`/dev/zero`), a directory, a missing or unreadable file
    or (text) one that is not UTF-8 is a VGraphError naming the path; at most
    `limit` + 1 bytes are ever read, so nothing can make us read forever.
    """
    p = Path(path)
    shown = printable(str(p))
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # O_NONBLOCK: a FIFO must not block open()
    except IsADirectoryError:
        raise VGraphError(f"{shown}: is a directory, not a {what}") from None
    except FileNotFoundError:
        raise VGraphError(f"{shown}: no such {what}") from None
    except OSError as exc:
        raise VGraphError(f"{shown}: cannot read: {_why(exc)}") from None
    raw = read_open_file(fd, shown, what=what, limit=limit)
    return raw if binary else decode_text(raw, shown)


def read_open_file(fd: int, shown: str, *, what: str = "file", limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the file open as `fd` (closed here), refused unless it is a regular file of at most
    `limit` bytes; at most `limit` + 1 bytes are read.  Shared by `read_input` and the run reader
    (vgraph/run/files.py), which opens its files itself (relative to the run, through no symlink)."""
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise VGraphError(f"{shown}: is a directory, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise VGraphError(f"{shown}: not a regular file (a device, FIFO or socket); give a {what}")
        if st.st_size > limit:
            raise VGraphError(f"{shown}: {st.st_size} bytes; a {what} is at most {limit} bytes")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise VGraphError(f"{shown}: cannot read: {_why(exc)}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise VGraphError(f"{shown}: more than {limit} bytes; a {what} is at most {limit} bytes")
    return b"".join(chunks)


def read_json(path: str | os.PathLike, *, what: str = "JSON file", limit: int = MAX_INPUT_BYTES,
              allow_nonfinite: bool = False, error: type[VGraphError] = VGraphError) -> object:
    """The JSON value of a user's (or a run's) file: `read_input`'s checks (a regular file of at most
    `limit` bytes, UTF-8), then the one JSON reader's (`vgraph/base/jsonio.py`: depth, numbers,
    surrogates), every refusal a diagnostic naming the file and line."""
    try:
        raw = read_input(path, what=what, limit=limit, binary=True)
    except VGraphError as exc:
        if error is VGraphError:
            raise
        raise error(exc.diagnostics) from None
    return loads(raw, printable(str(path)), limit=limit, allow_nonfinite=allow_nonfinite, error=error)


__all__ = ["atomic_write", "atomic_write_with", "check_output", "check_output_dir", "OutputDir", "register_owner",
           "read_input", "read_json", "read_open_file", "decode_text", "same_file", "MAX_INPUT_BYTES", "MANIFEST"]
