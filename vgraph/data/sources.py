"""What `vgraph data prepare` reads: inputs found, cut into units of work, and read back as documents.

Inputs are text files (``.txt``, ``.md`` and any other file named
explicitly), JSON Lines (``.jsonl``, one document per line in ``--field``),
Parquet (``.parquet``, ``--column``), a Hugging Face `datasets` dataset saved
with ``save_to_disk`` (a directory with ``state.json``; its Arrow files are
read with pyarrow, memory-mapped, ``--column``), directories (every such file
below, sorted by relative path, hidden entries skipped) and globs (``**``
allowed, matches sorted).  A text file is one document, or several separated
by lines holding only ``<|endoftext|>`` (the GPT-2 / TinyStories convention).

Why units: the corpus is tokenized by several processes and a killed prepare
resumes where it stopped, so the work is cut into units of about
`unit_bytes` (a text file at separator lines, JSONL at line ends, Parquet by
row group, Arrow by record batch) that are each a pure function of the input
bytes.  A unit is named by plain data (`Unit`), so it travels to a worker
process and into the restart plan.

Errors name the file, and the line for JSONL: a line that is not JSON, not
an object, without the field or whose field is not text.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.jsonio import jsonl_lines, loads
from vgraph.base.safeio import read_json

from .shards import DataError

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


def find_sources(inputs: Sequence[str]) -> list[Source]:
    """Every input file, in order (see the module docstring); a DataError names what matches nothing."""
    if not inputs:
        raise DataError("no input given: name text files, directories, globs, JSONL, Parquet or a saved dataset")
    found: list[Source] = []
    for given in inputs:
        target = Path(given).expanduser()
        if target.is_dir():
            found += _directory(target)
        elif target.exists():
            found.append(_source(target, explicit=True))
        else:
            matches = sorted(glob.glob(os.fspath(target), recursive=True))
            if not matches:
                raise DataError(f"{printable(given)}: no such file, directory or matching file")
            for match in matches:
                p = Path(match)
                found += _directory(p) if p.is_dir() else [_source(p, explicit=False)]
    seen: set[str] = set()
    unique = [s for s in found if not (s.path in seen or seen.add(s.path))]
    if not unique:
        raise DataError(f"no text, JSONL, Parquet or Arrow file in {', '.join(printable(i) for i in inputs)}")
    return unique


def _source(path: Path, *, explicit: bool) -> Source:
    try:
        st = path.stat()
    except OSError as exc:
        raise DataError(f"{printable(str(path))}: cannot read: {exc.strerror}") from None
    if not path.is_file():
        raise DataError(f"{printable(str(path))}: not a regular file (a device, FIFO or socket)")
    if not os.access(path, os.R_OK):
        raise DataError(f"{printable(str(path))}: cannot read: permission denied")
    kind = _KIND_BY_SUFFIX.get(path.suffix.lower(), "text" if explicit else "")
    if not kind:
        raise DataError(f"{printable(str(path))}: not a .txt, .md, .jsonl, .parquet or .arrow file")
    return Source(str(path), kind, st.st_size, st.st_mtime_ns)


def _directory(root: Path) -> list[Source]:
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{printable(str(root))}: a saved DatasetDict (splits {', '.join(splits) or 'none'}): give "
                        f"one split's directory, e.g. {printable(str(root / (splits[0] if splits else 'train')))}")
    if (root / "state.json").is_file():
        return _saved_dataset(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith(".") and Path(name).suffix.lower() in _KIND_BY_SUFFIX:
                files.append(Path(dirpath, name))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return [_source(p, explicit=False) for p in files]


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
    reader = _arrow_reader(path)
    if hasattr(reader, "num_record_batches"):  # the IPC file format
        return [reader.get_batch(i) for i in range(reader.num_record_batches)], reader.schema
    return list(reader), reader.schema


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
    pa = _pyarrow()
    if source.kind == "parquet":
        pf = pa.parquet.ParquetFile(source.path)
        schema = pf.schema_arrow
        _check_column(schema, column, source.path)
        tables = (pf.read_row_group(i, columns=[column]) for i in range(unit.start, unit.end))
        arrays = (t.column(column) for t in tables)
    else:
        batches, schema = _arrow_batches(source.path)
        _check_column(schema, column, source.path)
        arrays = (b.column(column) for b in batches[unit.start:unit.end])
    for array in arrays:
        for value in array.to_pylist():
            if value is not None and value.strip():
                yield value


def _check_column(schema, column: str, path: str) -> None:
    pa = _pyarrow()
    if column not in schema.names:
        raise DataError(f"{printable(path)}: no column {column!r} (columns: "
                        f"{', '.join(printable(n, 40) for n in schema.names[:12]) or 'none'}; choose one with --column)")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{printable(path)}: column {column!r} holds {kind}, not text")
