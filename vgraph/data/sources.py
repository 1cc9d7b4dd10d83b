"""What `vgraph data prepare` reads: inputs found, cut into units of work, and read back as documents.

Inputs are text files (``.txt``, ``.md`` and any other file named
explicitly), JSON Lines (``.jsonl``, one document per line in ``--field``),
Parquet (``.parquet``, ``--column``), a Hugging Face `datasets` dataset saved
with ``save_to_disk`` (a directory with ``state.json``; its Arrow files are
read with pyarrow, memory-mapped, ``--column``), directories (every such file
below, sorted by relative path, hidden entries skipped) and globs (``**``
allowed, matches sorted).  Files of other kinds found in a directory or by a
glob are counted in one message by suffix (``--include PATTERN`` reads
files whose names match as text); a directory reached twice (symbolic links
to a parent, loops) is walked once, and a file reached by several paths is
read once (by device and inode).  A text file is one document, or several separated
by lines holding only ``<|endoftext|>`` (the GPT-2 / TinyStories convention).

Why units: the corpus is tokenized by several processes and a killed prepare
resumes where it stopped, so the work is cut into units of about
`unit_bytes` (a text file at separator lines, JSONL at line ends, Parquet by
row group, Arrow by record batch) that are each a pure function of the input
bytes.  A unit is named by plain data (`Unit`), so it travels to a worker
process and into the restart plan.

Errors name the file, and the line for JSONL: a line that is not JSON, not
an object, without the field or whose field is not text; for Parquet and
Arrow the row group or record batch (and the row, for text that is not
UTF-8).
"""
from __future__ import annotations

import fnmatch
import glob
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Sequence

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.jsonio import jsonl_lines, loads
from vgraph.base.safeio import read_json

from vgraph.data.shards import DataError

__all__ = ["Source", "Unit", "find_sources", "plan_units", "read_unit", "SEPARATOR", "TEXT_SUFFIXES"]

SEPARATOR = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md")
_KIND_BY_SUFFIX = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_SEPARATOR_LINE = re.compile(r"^<\|endoftext\|>\r?$\n?", re.MULTILINE)
_SEPARATOR_BYTES = re.compile(rb"(?m)^<\|endoftext\|>\r?(\n|\Z)")


@dataclass(frozen=True)
class Source:
    """One input file: its path, how it is read, and its identity (size, mtime) for the restart plan."""

    path: str
    kind: str  # text | jsonl | parquet | arrow
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Unit:
    """A slice of one source: bytes [start, end) of a text/JSONL file, or row groups / record batches."""

    source: int  # index into the source list
    start: int
    end: int

    def to_json(self) -> dict:
        return asdict(self)


def find_sources(inputs: Sequence[str], include: Sequence[str] = (),
                 report: Callable[[str], None] | None = None) -> list[Source]:
    """Every input file, in order (see the module docstring); a DataError names what matches nothing.
    `include`: name patterns of files read as text whatever their suffix; `report` gets the message
    counting the files skipped (by suffix), when any were."""
    if not inputs:
        raise DataError("no input given: name text files, directories, globs, JSONL, Parquet or a saved dataset")
    found: list[Source] = []
    skipped: dict[tuple[int, int], str] = {}  # (device, inode) -> suffix: a file met twice counts once
    for given in inputs:
        target = Path(given).expanduser()
        if target.is_dir():
            found += _directory(target, include, skipped)
        elif target.exists():
            found.append(_source(target, explicit=True))
        else:
            matches = _glob(os.fspath(target))
            if not matches:
                raise DataError(f"{printable(given)}: no such file, directory or matching file")
            for match in matches:
                p = Path(match)
                if p.is_dir():
                    found += _directory(p, include, skipped)
                elif _kind(p, include):
                    found.append(_source(p, explicit=False, include=include))
                else:
                    _skip(p, skipped)
    unique = _once(found)
    read = {(st.st_dev, st.st_ino) for st in map(os.stat, (s.path for s in unique))}
    counts = Counter(suffix for key, suffix in skipped.items() if key not in read)
    if counts and report is not None:
        report(_skipped_message(counts))
    if not unique:
        kinds = f" (only files of other kinds: {_counts(counts)}; name them with --include)" if counts else ""
        raise DataError(f"no text, JSONL, Parquet or Arrow file in {', '.join(printable(i) for i in inputs)}{kinds}")
    return unique


def _once(found: list[Source]) -> list[Source]:
    """Each file once, by device and inode (a file reached through links or by several inputs)."""
    seen: set[tuple[int, int]] = set()
    unique = []
    for source in found:
        st = os.stat(source.path)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            unique.append(source)
    return unique


def _counts(skipped: Counter[str]) -> str:
    return ", ".join(f"{printable(suffix, 20)} ({n:,})" for suffix, n in skipped.most_common(8)) + \
        (", ..." if len(skipped) > 8 else "")


def _skip(path: Path, skipped: dict[tuple[int, int], str]) -> None:
    try:
        st = path.stat()
    except OSError:  # a dangling link: counted by its name
        skipped[(-1, hash(str(path)))] = path.suffix.lower() or "(no suffix)"
        return
    skipped[(st.st_dev, st.st_ino)] = path.suffix.lower() or "(no suffix)"


#: Suffixes of files that are not text: never the example the skipped-files message gives for --include.
_BINARY_SUFFIXES = frozenset(".pyc .pyo .so .o .a .dll .dylib .exe .gz .bz2 .xz .zst .zip .tar .whl .png .jpg "
                             ".jpeg .gif .ico .pdf .bin .npy .npz .pt .pth .safetensors .onnx .db .sqlite .wav .mp3 "
                             ".mp4 .idx".split())


def _skipped_message(skipped: Counter[str]) -> str:
    total = sum(skipped.values())
    text = [suffix for suffix, _ in skipped.most_common() if suffix.startswith(".") and suffix not in _BINARY_SUFFIXES]
    hint = f"--include '*{text[0]}'" if text else "--include PATTERN"
    return (f"prepare: skipped {total:,} file(s) of kinds it does not read: {_counts(skipped)}; name them with "
            f"{hint} to read them as text")


def _kind(path: Path, include: Sequence[str]) -> str:
    """How a file found in a directory or by a glob is read ('' when it is not)."""
    kind = _KIND_BY_SUFFIX.get(path.suffix.lower(), "")
    return kind or ("text" if any(fnmatch.fnmatch(path.name, p) for p in include) else "")


def _source(path: Path, *, explicit: bool, include: Sequence[str] = ()) -> Source:
    try:
        st = path.stat()
    except OSError as exc:
        raise DataError(f"{printable(str(path))}: cannot read: {exc.strerror}") from None
    if not path.is_file():
        raise DataError(f"{printable(str(path))}: not a regular file (a device, FIFO or socket)")
    if not os.access(path, os.R_OK):
        raise DataError(f"{printable(str(path))}: cannot read: permission denied")
    kind = _kind(path, include) or ("text" if explicit else "")
    if not kind:
        raise DataError(f"{printable(str(path))}: not a .txt, .md, .jsonl, .parquet or .arrow file")
    return Source(str(path), kind, st.st_size, st.st_mtime_ns)


def _walk(root: Path, *, hidden: bool = False, depth: int | None = None) -> Iterator[tuple[str, list[str]]]:
    """(directory, its file names) below `root` (hidden names only when `hidden`, at most `depth` levels
    down), sorted, following links to directories but entering each directory (by device and inode) once:
    a link to a parent is no loop."""
    seen: set[tuple[int, int]] = set()
    top = len(Path(root).parts)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        level = len(Path(dirpath).parts) - top
        dirnames[:] = [] if depth is not None and level >= depth else \
            sorted(d for d in dirnames if hidden or not d.startswith("."))
        yield dirpath, sorted(n for n in filenames if hidden or not n.startswith("."))


def _glob(pattern: str) -> list[str]:
    """The paths `pattern` matches (glob's rules: ``**`` any directories, hidden names only by a pattern
    that starts with a dot), sorted; walked by `_walk`, so links looping back are entered once (glob.glob
    followed two links to "." down 40 levels, reading each file ~40 times before the kernel stopped it)."""
    if not glob.has_magic(pattern):
        return [pattern] if os.path.lexists(pattern) else []
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base, pats = Path(*parts[:first]) if first else Path("."), parts[first:]
    if not base.is_dir():
        return []

    @lru_cache(maxsize=None)
    def match(names: tuple[str, ...], i: int) -> bool:
        if i == len(pats):
            return not names
        if pats[i] == "**":
            return match(names, i + 1) or bool(names) and not names[0].startswith(".") and match(names[1:], i)
        return bool(names) and (not names[0].startswith(".") or pats[i].startswith(".")) and \
            fnmatch.fnmatchcase(names[0], pats[i]) and match(names[1:], i + 1)

    out = []
    hidden = any(p.startswith(".") for p in pats)
    for dirpath, filenames in _walk(base, hidden=hidden, depth=None if "**" in pats else len(pats)):
        rel = Path(dirpath).relative_to(base).parts
        if rel and match(rel, 0):
            out.append(dirpath)
        out += [os.path.join(dirpath, name) for name in filenames if match(rel + (name,), 0)]
    prefix = "" if first else "./"
    return sorted(p[len(prefix):] if prefix and p.startswith(prefix) else p for p in out)


def _directory(root: Path, include: Sequence[str] = (),
               skipped: dict[tuple[int, int], str] | None = None) -> list[Source]:
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{printable(str(root))}: a saved DatasetDict (splits {', '.join(splits) or 'none'}): give "
                        f"one split's directory, e.g. {printable(str(root / (splits[0] if splits else 'train')))}")
    if (root / "state.json").is_file():
        return _saved_dataset(root)
    files = []
    for dirpath, filenames in _walk(root):
        for name in filenames:
            path = Path(dirpath, name)
            if _kind(path, include):
                files.append(path)
            elif skipped is not None:
                _skip(path, skipped)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return [_source(p, explicit=False, include=include) for p in files]


def _saved_dataset(root: Path) -> list[Source]:
    """The Arrow files of a `datasets` dataset saved with save_to_disk, in the order its state.json lists."""
    state_path = root / "state.json"
    state = read_json(state_path, what="`datasets` state file", error=DataError)
    try:
        names = [entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError) as exc:
        raise DataError(f"{printable(str(state_path))}: not a `datasets` state file "
                        f"({type(exc).__name__}: {printable(exc, 200)})") from None
    sources = []
    for name in names:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+\.arrow", name) or name.startswith("."):
            raise DataError(f"{printable(str(state_path))}: data file {printable(repr(name), 80)} is not an .arrow "
                            f"name inside the dataset directory")
        sources.append(_source(root / name, explicit=False))
    if not sources:
        raise DataError(f"{printable(str(state_path))}: the dataset lists no data files")
    return sources


# -- units ------------------------------------------------------------------------------------------------


def plan_units(sources: Sequence[Source], unit_bytes: int) -> list[Unit]:
    """The units of work, in corpus order; each about `unit_bytes` of input (at least one per source)."""
    units: list[Unit] = []
    for i, source in enumerate(sources):
        if source.kind == "text":
            cuts = _cuts(source.path, source.size, unit_bytes, _next_separator_end)
        elif source.kind == "jsonl":
            cuts = _cuts(source.path, source.size, unit_bytes, _next_line_end)
        else:
            cuts = _table_cuts(source, unit_bytes)
        units += [Unit(i, a, b) for a, b in zip(cuts, cuts[1:])]
    return units


def _cuts(path: str, size: int, unit_bytes: int, next_cut) -> list[int]:
    cuts = [0]
    with open(path, "rb") as fh:
        while size - cuts[-1] > unit_bytes:
            cut = next_cut(fh, cuts[-1] + unit_bytes, size)
            if cut >= size:
                break
            cuts.append(cut)
    cuts.append(size)
    return cuts


def _next_line_end(fh, at: int, size: int) -> int:
    """The offset just after the first newline at or after `at` (or the end of the file)."""
    fh.seek(at)
    pos = at
    while block := fh.read(1 << 16):
        hit = block.find(b"\n")
        if hit >= 0:
            return pos + hit + 1
        pos += len(block)
    return size


def _next_separator_end(fh, at: int, size: int) -> int:
    """The offset just after the first separator line that starts at or after `at` (else the end)."""
    pos = _next_line_end(fh, at - 1, size) if at > 0 else 0  # a line start: the regex's ^ holds there
    while pos < size:
        fh.seek(pos)
        block = fh.read(1 << 20)
        match = _SEPARATOR_BYTES.search(block)
        if match is not None and (match.end() < len(block) or pos + len(block) >= size):
            return pos + match.end()
        if pos + len(block) >= size:
            return size
        last = block.rfind(b"\n")  # go on from the last line start in the block (its line may be cut)
        pos = pos + last + 1 if last >= 0 else _next_line_end(fh, pos + len(block) - 1, size)
    return size


def _table_cuts(source: Source, unit_bytes: int) -> list[int]:
    """Parquet: row groups; Arrow: record batches; consecutive ones grouped to about `unit_bytes`."""
    sizes = _parquet_group_bytes(source.path) if source.kind == "parquet" else _arrow_batch_bytes(source.path)
    cuts, acc = [0], 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= unit_bytes and i + 1 < len(sizes):
            cuts.append(i + 1)
            acc = 0
    cuts.append(max(len(sizes), 1))
    return cuts


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading Parquet or a saved `datasets` dataset needs pyarrow: pip install 'vgraph[data]' "
                        "(or pip install pyarrow)") from None
    return pyarrow


def _parquet_group_bytes(path: str) -> list[int]:
    pa = _pyarrow()
    try:
        meta = pa.parquet.ParquetFile(path).metadata
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{printable(path)}: not a Parquet file ({printable(exc, 200)})") from None
    return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def _arrow_reader(path: str):
    pa = _pyarrow()
    try:
        source = pa.memory_map(path, "r")
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{printable(path)}: not an Arrow file ({printable(exc, 200)})") from None


def _arrow_batches(path: str):
    pa = _pyarrow()
    reader = _arrow_reader(path)
    try:
        if hasattr(reader, "num_record_batches"):  # the IPC file format
            return [reader.get_batch(i) for i in range(reader.num_record_batches)], reader.schema
        return list(reader), reader.schema
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{printable(path)}: a damaged Arrow file ({printable(exc, 200)})") from None


def _arrow_batch_bytes(path: str) -> list[int]:
    batches, _ = _arrow_batches(path)
    return [b.nbytes for b in batches]


# -- reading a unit ------------------------------------------------------------------------------------------


def read_unit(source: Source, unit: Unit, *, field: str, column: str) -> Iterator[str]:
    """The documents of `unit`, in order (empty and whitespace-only documents are skipped)."""
    if source.kind == "text":
        yield from _text_documents(source.path, unit)
    elif source.kind == "jsonl":
        yield from _jsonl_documents(source.path, unit, field)
    else:
        yield from _table_documents(source, unit, column)


def _read_bytes(path: str, unit: Unit) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(unit.start)
            raw = fh.read(unit.end - unit.start)
    except OSError as exc:
        raise DataError(f"{printable(path)}: cannot read: {exc.strerror}") from None
    if len(raw) != unit.end - unit.start:
        raise DataError(f"{printable(path)}: shorter than when the prepare began (changed while it ran?)")
    return raw


def _decode(raw: bytes, path: str, unit: Unit) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = _line_of(path, unit.start) + raw.count(b"\n", 0, exc.start)
        raise DataError(f"{printable(path)}:{line}: not UTF-8 text (byte {unit.start + exc.start})") from None


def _line_of(path: str, offset: int) -> int:
    """The 1-based line number at byte `offset` (counted only when a message needs it)."""
    count = 1
    with open(path, "rb") as fh:
        remaining = offset
        while remaining > 0 and (block := fh.read(min(remaining, 1 << 20))):
            count += block.count(b"\n")
            remaining -= len(block)
    return count


def _text_documents(path: str, unit: Unit) -> Iterator[str]:
    text = _decode(_read_bytes(path, unit), path, unit)
    for doc in _SEPARATOR_LINE.split(text):
        if doc.strip():
            yield doc


def _jsonl_documents(path: str, unit: Unit, field: str) -> Iterator[str]:
    text = _decode(_read_bytes(path, unit), path, unit)
    first_line: int | None = None
    for number, line in jsonl_lines(text, 0):
        problem = None
        try:
            record = loads(line, printable(path))
        except VGraphError as exc:
            problem = exc.diagnostics[0].message
        else:
            if not isinstance(record, dict):
                problem = f"a JSON {type(record).__name__}, not an object with a {field!r} field"
            elif field not in record:
                keys = ", ".join(printable(repr(k), 40) for k in list(record)[:8])
                problem = f"no field {field!r} (fields: {keys or 'none'}; choose one with --field)"
            elif not isinstance(record[field], str):
                problem = f"field {field!r} is a {type(record[field]).__name__}, not text"
        if problem is not None:
            first_line = _line_of(path, unit.start) if first_line is None else first_line
            raise DataError(f"{printable(path)}:{first_line + number}: {problem}")
        if record[field].strip():
            yield record[field]


def _table_documents(source: Source, unit: Unit, column: str) -> Iterator[str]:
    """The column's texts, row group by row group (Parquet) or batch by batch (Arrow); whatever pyarrow
    finds wrong in the file is a DataError naming it and the group or batch."""
    pa = _pyarrow()
    part = "row group" if source.kind == "parquet" else "record batch"
    where = f"{printable(source.path)}"
    try:
        if source.kind == "parquet":
            pf = pa.parquet.ParquetFile(source.path)
            schema = pf.schema_arrow
        else:
            batches, schema = _arrow_batches(source.path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{where}: a damaged {source.kind.capitalize()} file ({printable(exc, 200)})") from None
    _check_column(schema, column, source.path)
    for i in range(unit.start, unit.end):
        try:
            array = pf.read_row_group(i, columns=[column]).column(column) if source.kind == "parquet" else \
                batches[i].column(column)
            values = array.to_pylist()
        except UnicodeDecodeError:
            raise DataError(f"{where}: {part} {i}, row {_first_undecodable(array)}: column {column!r} holds text "
                            f"that is not UTF-8") from None
        except (pa.ArrowException, OSError, IndexError) as exc:
            raise DataError(f"{where}: {part} {i}: damaged ({printable(exc, 200)})") from None
        for value in values:
            if value is not None and value.strip():
                yield value


def _first_undecodable(array) -> int:
    """The row (in its group or batch) of the first value that is not UTF-8."""
    row = 0
    for chunk in getattr(array, "chunks", [array]):
        for value in chunk.cast(_pyarrow().large_binary()).to_pylist():
            try:
                if value is not None:
                    value.decode("utf-8")
            except UnicodeDecodeError:
                return row
            row += 1
    return row


def _check_column(schema, column: str, path: str) -> None:
    pa = _pyarrow()
    if column not in schema.names:
        raise DataError(f"{printable(path)}: no column {column!r} (columns: "
                        f"{', '.join(printable(n, 40) for n in schema.names[:12]) or 'none'}; choose one with --column)")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{printable(path)}: column {column!r} holds {kind}, not text")
