"""`vgraph data prepare`: a corpus tokenized once, in parallel processes, into a prepared directory.

The steps, each said on stderr with its time: find the inputs and cut them
into units (sources.py); take the tokenizer (given, or trained on a sample
of every unit: tokenizer.py); tokenize the units in `workers` spawned
processes with a progress bar (encode.py); check the splits (a corpus of one
document gives validation the tail of it; otherwise at least one document
each); write ``tokenizer.json`` and, last and atomically, ``manifest.json``.

**Atomic and restartable.**  Work in progress lives in ``DIR/.prepare/``:
the plan (inputs with size and mtime, settings, units) and one record per
finished unit, written after the unit's shards (each shard itself written
atomically).  A killed prepare run again with the same inputs and settings
resumes with the units not yet recorded; with others it starts clean
(removing only its own files).  The manifest exists only once every shard
it names does, so no reader ever sees a manifest describing missing shards.
A directory that holds something else, an output over or inside an input,
or inside a training run is refused before anything is written.

**Its own outputs only.**  ``tokenizer.json`` and ``manifest.json`` are
written through `safeio.OutputDir`, whose manifest (``.vgraph-outputs.json``)
proves which files prepare wrote: a ``tokenizer.json`` the user put there is
never replaced nor removed (the directory is refused), and a ``--tokenizer``
inside the output directory is refused as an input there.  A damaged record
in ``.prepare/`` is not trusted: its unit is encoded again.

**Stopped.**  SIGINT or SIGTERM stops the worker processes (and waits for
them), keeps the units already recorded and says how to resume; the exit
status is 128 + the signal.
"""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import stat
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.safeio import MANIFEST as OUTPUTS_MANIFEST
from vgraph.base.safeio import OutputDir, atomic_write, read_json
from vgraph.base.safeio import check_output_dir as check_output_dir_of_every_command

from vgraph.data import encode
from vgraph.data.shards import (FORMAT, FORMAT_VERSION, MANIFEST, SPLITS, TOKENIZER_FILE, DataError, PreparedCorpus,
                     open_prepared, token_dtype)
from vgraph.data.sources import Source, Unit, find_sources, plan_units, read_unit
from vgraph.data.tokenizer import EOT_TOKEN, load_tokenizer, tokenizer_kind, train_tokenizer, vocabulary_span

__all__ = ["PrepareOptions", "prepare", "prepare_corpus", "check_output_dir", "WORK_DIR", "exclusive"]

WORK_DIR = ".prepare"
LOCK_FILE = ".prepare.lock"
_IN_PROCESS_BYTES = 8 * 2**20  # below this, spawning workers costs more than it saves


@dataclass(frozen=True)
class PrepareOptions:
    """What decides the prepared corpus (all of it is in the plan a restart must match)."""

    vocab: int | None = None  # train a tokenizer of this size on a sample ...
    tokenizer: str | None = None  # ... or use this tokenizers JSON file
    field: str = "text"  # JSONL
    column: str = "text"  # Parquet, saved datasets
    val_fraction: float = 0.05
    sample_bytes: int = 64 * 2**20  # text the tokenizer is trained on
    unit_bytes: int = 32 * 2**20  # input per unit of work (and per shard)
    workers: int = 0  # 0: the CPUs this process may use
    include: tuple[str, ...] = ()  # name patterns of files in directories and globs read as text
    small_vocab: bool = True  # a trained tokenizer under half of `vocab` is an error when False (the CLI's default)

    def worker_count(self) -> int:
        if self.workers:
            return self.workers
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(inputs: Sequence[str], out: str | os.PathLike, options: PrepareOptions, *,
            say: Callable[[str], None] = lambda m: print(m, file=sys.stderr), progress: bool = True,
            warn: Callable[[str], None] | None = None) -> PreparedCorpus:
    """Prepare the files `inputs` name into `out`: the inputs found first (`find_sources`, the module
    docstring's first step), then `prepare_corpus`.  Returns the prepared corpus, opened.  `warn` (default
    `say`) gets what the user should read even when status lines are off (a tokenizer smaller than asked,
    inputs skipped)."""
    warn = warn or say
    _check_options(options)
    return prepare_corpus(out, options, sources=find_sources(inputs, options.include, report=warn), inputs=inputs,
                          say=say, progress=progress, warn=warn)


def _check_options(options: PrepareOptions) -> None:
    """Refuse options that cannot prepare anything: `prepare` checks them before it searches the inputs."""
    if (options.vocab is None) == (options.tokenizer is None):
        raise DataError("give exactly one of --vocab N (train a tokenizer) and --tokenizer FILE")
    if not 0.0 < options.val_fraction < 1.0:
        raise DataError(f"--val-fraction must be between 0 and 1 (exclusive), not {options.val_fraction}")


def prepare_corpus(out: str | os.PathLike, options: PrepareOptions, *, sources: Sequence[Source] | None = None,
                   inputs: Sequence[str] = (), documents: Sequence[str] | None = None, description: str | None = None,
                   say: Callable[[str], None] = lambda m: print(m, file=sys.stderr), progress: bool = True,
                   warn: Callable[[str], None] | None = None) -> PreparedCorpus:
    """Prepare into `out` the files found already for `inputs` (`sources`: `prepare` finds them; the cache
    finds them first, to key a corpus by their content, so the files keyed are the files prepared, found once)
    or the in-memory `documents`, named `description`.  Returns the prepared corpus, opened."""
    warn = warn or say
    _check_options(options)
    root = Path(out)
    t0 = time.perf_counter()
    given = load_tokenizer(options.tokenizer) if options.tokenizer is not None else None  # read bounded, checked
    if documents is None:
        if sources is None:
            raise ValueError("prepare_corpus needs the files found (sources) or documents")
        sources = list(sources)
        check_output_dir(root, [s.path for s in sources] + list(inputs) + [t for t in [options.tokenizer] if t])
        units = plan_units(sources, options.unit_bytes)
    else:
        sources, units = _document_units(documents, description or "documents", options.unit_bytes)
    outputs = _output_dir(root, ([s.path for s in sources] if documents is None else []) + [options.tokenizer])
    _refuse_foreign(root, outputs)
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / LOCK_FILE), _stoppable():  # one prepare at a time per directory
        try:
            plan = _plan(sources, units, options, given)
            done = _restart_state(root, plan, say, outputs)
            if done is None:  # already prepared, the same plan
                return open_prepared(root, verify="size")
            total = sum(s.size for s in sources)
            say(f"prepare: {len(sources)} input file(s), {total / 1e6:,.1f} MB in {len(units)} unit(s) -> {root} "
                f"({time.perf_counter() - t0:.2f} s)")
            tokenizer = given or _tokenizer(root, sources, units, options, documents, say, warn)
            job = _Job(root, sources, units, options, tokenizer, documents)
            records = job.run(done, say, progress)
            records = job.fix_splits(records, say)
            return _finish(root, plan, job, records, say, outputs)
        except _Stop as stop:
            raise _stopped_error(root, len(units), stop.signum) from None


class _Stop(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stoppable() -> Iterator[None]:
    """SIGINT and SIGTERM raise `_Stop` in the main thread for the block (the worker pool's cleanup then
    stops and waits for its processes); a second signal during that cleanup is noted, not raised, so the
    workers are still waited for.  Outside the main thread nothing is installed (a library caller's
    thread: signals behave as before)."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame) -> None:
        seen.append(signum)
        if len(seen) == 1:  # a second signal while the first is being handled must not cut the cleanup
            raise _Stop(signum)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stopped_error(root: Path, units: int, signum: int) -> DataError:
    """What a stopped prepare kept, as the diagnostic the CLI prints (exit status 128 + the signal)."""
    for stray in root.glob(".*.tmp"):  # a write a stopped worker was in the middle of
        stray.unlink(missing_ok=True)
    kept = sorted(int(m.group(1)) for p in (root / WORK_DIR).glob("unit-*.json")
                  if (m := re.fullmatch(r"unit-([0-9]{5,9})\.json", p.name)))
    shown = printable(str(root))
    listed = ", ".join(str(k) for k in kept[:20]) + (", ..." if len(kept) > 20 else "")
    error = DataError(f"{shown}: prepare stopped by {signal.Signals(signum).name}; its worker processes were "
                      f"stopped and have exited. Kept: {len(kept)} of {units} unit(s) complete"
                      f"{f' ({listed})' if kept else ''} in {printable(str(root / WORK_DIR))}; run the same "
                      f"command again to resume with the rest")
    error.exit_status = 128 + signum  # type: ignore[attr-defined]
    return error


def _document_units(documents: Sequence[str], description: str, unit_bytes: int) -> tuple[list[Source], list[Unit]]:
    """In-memory documents as one pseudo-source cut into units of about `unit_bytes` of text."""
    sizes = [len(d.encode("utf-8")) for d in documents]
    cuts, acc = [0], 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= unit_bytes and i + 1 < len(sizes):
            cuts.append(i + 1)
            acc = 0
    cuts.append(len(sizes))
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(hashlib.sha256(doc.encode("utf-8")).digest())
    source = Source(description, "documents", sum(sizes), int.from_bytes(digest.digest()[:7], "little"))
    return [source], [Unit(0, a, b) for a, b in zip(cuts, cuts[1:])]


# -- the output directory ------------------------------------------------------------------------------------


def check_output_dir(out: Path, inputs: Sequence[str]) -> None:
    """Refuse an output that would destroy or mix with something: every command's rule for an output
    directory (`safeio.check_output_dir`: not a file or device, not an input nor inside one), and prepare's
    own stricter ones, since starting clean empties what it wrote there and the shards must never be read
    back as text: a printable name, no input inside it, and not inside a training run at all."""
    shown = printable(str(out))
    if not str(out) or not str(out).isprintable():
        raise DataError(f"{shown}: an output directory name must be printable (no control characters)")
    try:
        check_output_dir_of_every_command(out, inputs=inputs, what="output directory")
    except VGraphError as exc:
        raise DataError(exc.diagnostics) from None
    resolved = out.resolve()
    for given in inputs:
        inp = Path(given)
        if inp.exists() and resolved in inp.resolve().parents:
            raise DataError(f"{shown}: the output directory is, holds or lies inside the input "
                            f"{printable(given)}; choose a directory apart from the inputs")
    for parent in [resolved, *resolved.parents]:
        if (parent / "run.json").is_file() and (parent / "network.yml").is_file():
            raise DataError(f"{shown}: inside the training run {printable(str(parent))}; prepare the corpus "
                            f"outside run directories")

def _output_dir(root: Path, inputs: Sequence[str | None]) -> OutputDir:
    try:
        return OutputDir(root, command="data prepare", inputs=inputs)
    except VGraphError as exc:
        raise DataError(exc.diagnostics) from None


@contextmanager
def exclusive(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold `path`'s lock file (created if missing) for the block: one process at a time; `on_wait` is called
    once when another holds it, then this one waits.  The file is opened without following a link and must be
    a regular file: a planted symlink would make the lock create or open a file elsewhere."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        raise DataError(f"{printable(str(path))}: cannot open the lock file ({exc.strerror}"
                        f"{'; it is a symbolic link' if os.path.islink(path) else ''}); remove it "
                        f"or choose another directory") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"{printable(str(path))}: not a regular file; remove it or choose "
                            f"another directory")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _plan(sources: list[Source], units: list[Unit], options: PrepareOptions, given) -> dict[str, Any]:
    settings = asdict(options)
    settings.pop("workers")  # how many processes does not change the result
    settings.pop("small_vocab")  # nor whether a small tokenizer is accepted
    if given is not None:
        settings["tokenizer"] = hashlib.sha256(given.to_str().encode()).hexdigest()
    import tokenizers

    plan = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizers": tokenizers.__version__,
            "sources": [asdict(s) for s in sources], "units": [u.to_json() for u in units], "settings": settings}
    plan["sha256"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    return plan


def _restart_state(root: Path, plan: dict, say: Callable[[str], None], out: OutputDir) -> dict[int, dict] | None:
    """Units already done (a resumed prepare), {} for a fresh one, None when `root` is prepared as planned."""
    manifest = root / MANIFEST
    if manifest.is_file():
        try:
            same = read_json(manifest, what="manifest", error=DataError).get("plan_sha256") == plan["sha256"]
        except (DataError, AttributeError):
            same = False
        if same:
            say(f"prepare: {root} already holds this corpus, prepared with these settings")
            return None
        raise DataError(f"{printable(str(root))}: holds a corpus prepared from other inputs or settings; choose "
                        f"another -o or remove it")
    work = root / WORK_DIR
    try:
        old = read_json(work / "plan.json", what="prepare plan", error=DataError) if work.is_dir() else None
    except DataError:
        old = None
    if isinstance(old, dict) and old.get("sha256") == plan["sha256"]:
        done = _finished_units(root, work, len(plan["units"]), say)
        say(f"prepare: resuming: {len(done)} of {len(plan['units'])} unit(s) already done")
        return done
    if work.exists() or any(_is_shard_name(p.name) for p in root.iterdir()):
        say(f"prepare: {root} holds an unfinished prepare of other inputs or settings: starting clean")
    _clean(root, out)
    work.mkdir()
    atomic_write(work / "plan.json", json.dumps(plan, indent=1))
    return {}


def _refuse_foreign(root: Path, out: OutputDir) -> None:
    """A directory holding anything but a prepared (or half-prepared) corpus is not ours to write into; a
    tokenizer.json is ours only when the outputs manifest proves prepare wrote it (`OutputDir`), and the
    work directory and lock file only when they are what prepare makes (a link would send its writes and
    removals elsewhere)."""
    if not root.is_dir():
        return
    work = root / WORK_DIR
    if work.is_symlink() or os.path.lexists(work) and not work.is_dir():
        raise DataError(f"{printable(str(work))}: not the work directory prepare makes (a symbolic link or a file); "
                        f"remove it or choose another directory")
    if (root / MANIFEST).is_file():
        return
    ours = {LOCK_FILE, WORK_DIR, OUTPUTS_MANIFEST} | ({TOKENIZER_FILE} if _may_replace(out, TOKENIZER_FILE) else set())
    others = [p.name for p in root.iterdir() if p.name not in ours and not _is_shard_name(p.name)]
    if others or (not (root / WORK_DIR).is_dir() and any(_is_shard_name(p.name) for p in root.iterdir())):
        raise DataError(f"{printable(str(root))}: not empty and not a corpus being prepared (holds "
                        f"{printable(', '.join(sorted(others)[:5]) or 'shards without a plan', 200)}); choose an empty "
                        f"or new directory")


def _is_shard_name(name: str) -> bool:
    return name.startswith(tuple(f"{s}-" for s in SPLITS)) and name.endswith((".bin", ".idx")) or \
        name.startswith(".") and name.endswith(".tmp")


def _may_replace(out: OutputDir, name: str) -> bool:
    """Whether DIR/`name` is absent or a file this command wrote there and nobody changed since."""
    try:
        out.check(name)
    except VGraphError:
        return False
    return True


def _clean(root: Path, out: OutputDir) -> None:
    for p in root.iterdir():
        if _is_shard_name(p.name) or p.name == TOKENIZER_FILE and _may_replace(out, TOKENIZER_FILE):
            p.unlink()
    shutil.rmtree(root / WORK_DIR, ignore_errors=True)


def _finished_units(root: Path, work: Path, units: int, say: Callable[[str], None]) -> dict[int, dict]:
    """Records of units whose shards are all there with the recorded size and hash; a record that is not
    what encode.encode_unit writes (damaged, edited, another unit's) is not trusted: its unit is redone."""
    done = {}
    for path in sorted(work.glob("unit-*.json")):
        match = re.fullmatch(r"unit-([0-9]{5,9})\.json", path.name)
        try:
            record = read_json(path, what="unit record", error=DataError) if match else None
            ok = match is not None and _valid_record(record, int(match.group(1)), units) and \
                all(_shard_intact(root, record[s]) for s in SPLITS if record[s])
        except (DataError, OSError, ValueError, UnicodeDecodeError, RecursionError):
            ok = False
        if ok:
            done[record["unit"]] = record
        else:
            say(f"prepare: {printable(str(path))} is not a complete record of its unit; encoding that unit again")
    return done


def _valid_record(record: Any, unit: int, units: int) -> bool:
    """`record` has the shape and types `encode.encode_unit` gives, for unit number `unit` of `units`."""
    def count(v: Any) -> bool:
        return type(v) is int and 0 <= v < 2**62

    def key(v: Any) -> bool:
        return v is None or (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
                             and 0 <= v[0] < 2**64 and 0 <= v[1] < 2**62)

    if not (isinstance(record, dict) and record.get("unit") == unit and type(record.get("unit")) is int
            and unit < units and count(record.get("documents")) and count(record.get("bytes"))
            and key(record.get("min_key")) and key(record.get("max_key"))):
        return False
    for split in SPLITS:
        shard = record.get(split)
        if shard is None and split in record:
            continue
        names = dict(zip(("bin", "idx"), encode.shard_names(split, unit)))
        if not (isinstance(shard, dict) and all(shard.get(k) == names[k] for k in names)
                and count(shard.get("tokens")) and count(shard.get("documents"))
                and all(isinstance(shard.get(f"{k}_sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", shard[f"{k}_sha256"])
                        for k in names)):
            return False
    return True


def _shard_intact(root: Path, shard: dict) -> bool:
    from vgraph.data.shards import sha256_file

    return all((root / shard[k]).is_file() and not (root / shard[k]).is_symlink()
               and sha256_file(root / shard[k]) == shard[f"{k}_sha256"] for k in ("bin", "idx"))


# -- the tokenizer --------------------------------------------------------------------------------------------


def _tokenizer(root: Path, sources: list[Source], units: list[Unit], options: PrepareOptions,
               documents: Sequence[str] | None, say: Callable[[str], None], warn: Callable[[str], None]):
    from tokenizers import Tokenizer

    saved = root / WORK_DIR / TOKENIZER_FILE
    if saved.is_file():  # a resumed prepare: the tokenizer its finished units were encoded with
        return Tokenizer.from_file(str(saved))
    t0 = time.perf_counter()
    sample = _sample(sources, units, options, documents)
    kind = tokenizer_kind(options.vocab)
    say(f"prepare: training a {options.vocab}-token {'byte-level BPE' if kind == 'bpe' else 'character'} tokenizer "
        f"on {sum(map(len, sample)) / 1e6:,.1f} MB of sample text ...")
    tokenizer = train_tokenizer(sample, options.vocab)
    _check_size(tokenizer.get_vocab_size(), options, sum(map(len, sample)), warn)
    atomic_write(saved, tokenizer.to_str())
    say(f"prepare: tokenizer trained ({tokenizer.get_vocab_size()} tokens, {time.perf_counter() - t0:.1f} s)")
    return tokenizer


def _check_size(actual: int, options: PrepareOptions, sample_chars: int, warn: Callable[[str], None]) -> None:
    """A tokenizer that came out smaller than asked: said on stderr; under half the size asked an error
    unless `options.small_vocab` (the BPE ran out of byte pairs to merge: the text is too small or too
    uniform for the vocabulary, and a network sized for `--vocab` would hold mostly unused embeddings)."""
    asked = int(options.vocab or 0)
    if actual >= asked:
        return
    why = (f"the tokenizer came out at {actual:,} tokens of the {asked:,} asked: its sample "
           f"({sample_chars:,} characters) has too few distinct byte pairs to merge")
    if actual * 2 < asked and not options.small_vocab:
        raise DataError(f"{why}; give more text, a smaller --vocab (at most {actual:,}), or --allow-small-vocab "
                        f"to accept a tokenizer under half the size asked")
    warn(f"prepare: note: {why}; the corpus uses {actual:,} token ids")


def _sample(sources: list[Source], units: list[Unit], options: PrepareOptions,
            documents: Sequence[str] | None) -> list[str]:
    """The first documents of every unit, an equal share of `sample_bytes` each: the whole corpus seen."""
    share = max(1, options.sample_bytes // max(1, len(units)))
    sample: list[str] = []
    for unit in units:
        taken = 0
        docs = documents[unit.start:unit.end] if documents is not None else \
            read_unit(sources[unit.source], unit, field=options.field, column=options.column)
        for doc in docs:
            if taken >= share:
                break
            text = doc[: share - taken]
            sample.extend(encode.pieces(text))  # one 32 MB document: trained on in pieces, as it is encoded
            taken += len(text)
    return sample


# -- the units ---------------------------------------------------------------------------------------------


class _Job:
    """The units' tasks, run in worker processes (or here, for small corpora) with a progress bar."""

    def __init__(self, root: Path, sources: list[Source], units: list[Unit], options: PrepareOptions, tokenizer,
                 documents: Sequence[str] | None) -> None:
        self.root, self.sources, self.units, self.options = root, sources, units, options
        self.tokenizer, self.documents = tokenizer, documents
        self.vocab_size = vocabulary_span(tokenizer)  # the largest id + 1: ids of a given tokenizer may be sparse
        self.dtype = token_dtype(self.vocab_size)
        self.eot_id = tokenizer.token_to_id(EOT_TOKEN)

    def task(self, k: int, **fallback: Any) -> dict[str, Any]:
        unit = self.units[k]
        source = self.sources[unit.source]
        size = source.size if len(self.units) == 1 else _unit_bytes(source, unit, self.units)
        return {"unit": k, "span": unit.to_json(), "source": asdict(source), "field": self.options.field,
                "column": self.options.column, "dtype": self.dtype, "eot_id": self.eot_id, "bytes": size,
                "val_fraction": self.options.val_fraction, "out": str(self.root), **fallback}

    def run(self, done: dict[int, dict], say: Callable[[str], None], progress: bool) -> dict[int, dict]:
        todo = [k for k in range(len(self.units)) if k not in done]
        tasks = [self.task(k) for k in todo]
        total = sum(t["bytes"] for t in tasks)
        workers = min(self.options.worker_count(), len(tasks)) if total >= _IN_PROCESS_BYTES else 1
        t0 = time.perf_counter()
        bar = _bar(total, progress)
        records = dict(done)
        try:
            for record in (self._pool(tasks, workers, bar) if workers > 1 else self._here(tasks, bar)):
                atomic_write(self.root / WORK_DIR / f"unit-{record['unit']:05d}.json", json.dumps(record))
                records[record["unit"]] = record
        finally:
            bar.close()
        seconds = time.perf_counter() - t0
        say(f"prepare: tokenized {total / 1e6:,.1f} MB in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):,.1f} "
            f"MB/s, {workers} process(es))")
        return records

    def _here(self, tasks: list[dict], bar) -> Iterator[dict]:
        for task in tasks:
            record = encode.encode_unit(task, self.tokenizer, None, self.documents)
            bar.update(task["bytes"])
            yield record

    def _pool(self, tasks: list[dict], workers: int, bar) -> Iterator[dict]:
        ctx = mp.get_context("spawn")  # clean children: no inherited tokenizer thread pool, no torch
        counter = ctx.Value("q", 0)
        with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=encode.init_worker,
                                    initargs=(self.tokenizer.to_str(), counter)) as pool:
            pending = {pool.submit(encode.encode_unit, task) for task in tasks}
            try:
                while pending:
                    finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                    bar.update(counter.value - bar.n)
                    for future in finished:
                        yield future.result()
            except BaseException:
                _stop_workers(pool, pending)
                raise

    def fix_splits(self, records: dict[int, dict], say: Callable[[str], None]) -> dict[int, dict]:
        """Validation and training both get at least one document (re-encoding the one unit that changes)."""
        docs = sum(r["documents"] for r in records.values())
        if docs == 0:
            raise DataError(f"the corpus is empty: no document with text in {self.sources[0].path}"
                            f"{' and the other inputs' if len(self.sources) > 1 else ''}")
        count = {s: sum(r[s]["documents"] for r in records.values() if r.get(s)) for s in SPLITS}
        if docs == 1:
            k = next(k for k, r in records.items() if r["documents"])
            say("prepare: one document: its last part is the validation split")
            records[k] = self._redo(k, tail=True)
            if not records[k].get("train"):
                raise DataError(f"the corpus is too small to split: {records[k]['val']['tokens']} token(s)")
        elif count["val"] == 0 or count["train"] == 0:
            want, pick = ("val", "min_key") if count["val"] == 0 else ("train", "max_key")
            k = min(records, key=lambda u: records[u][pick] or [2**64]) if want == "val" else \
                max(records, key=lambda u: records[u][pick] or [-1])
            say(f"prepare: no document fell into the {want} split by its hash; moving one there")
            records[k] = self._redo(k, force={str(records[k][pick][1]): want})
        return records

    def _redo(self, k: int, **fallback: Any) -> dict:
        record = encode.encode_unit(self.task(k, **fallback), self.tokenizer, None, self.documents)
        atomic_write(self.root / WORK_DIR / f"unit-{k:05d}.json", json.dumps(record))
        for split in SPLITS:  # a shard the redone unit no longer has
            if not record.get(split):
                for name in encode.shard_names(split, k):
                    (self.root / name).unlink(missing_ok=True)
        return record


def _stop_workers(pool: cf.ProcessPoolExecutor, pending: set) -> None:
    """Stop the pool's processes now and wait for them (a stopped or failed prepare leaves nobody writing).

    Why not just leave the `with` block: `shutdown(wait=True)` lets every running unit finish and write its
    shards, after the command has ended (a SIGTERM used to leave workers writing for seconds).  The
    executor has no public way to kill its workers before Python 3.14 (`terminate_workers`), hence
    `_processes`.  The executor's manager thread is waited for too (`_executor_manager_thread`, which
    shutdown forgets): Python 3.11's exit hook wakes it through a pipe the thread closes as it ends, checked
    and written without a lock, and an exit while it was still ending printed "Exception ignored ... Bad file
    descriptor" with a traceback under the stop message (a CI run, 2026-12-07; left running 15 times in 20)."""
    for future in pending:
        future.cancel()
    processes = list(getattr(pool, "_processes", {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()
    if manager is not None:
        manager.join(timeout=30)


def _unit_bytes(source: Source, unit: Unit, units: list[Unit]) -> int:
    """Input bytes of a unit (table units: the source's bytes shared by its units, for the progress bar)."""
    if source.kind in ("text", "jsonl"):
        return unit.end - unit.start
    siblings = sum(1 for u in units if u.source == unit.source)
    return source.size // max(1, siblings)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not enabled, file=sys.stderr,
                mininterval=0.5 if tty else 15.0, ascii=not tty, dynamic_ncols=tty)


# -- the end ------------------------------------------------------------------------------------------------


def _finish(root: Path, plan: dict, job: _Job, records: dict[int, dict], say: Callable[[str], None],
            out: OutputDir) -> PreparedCorpus:
    splits = {}
    for split in SPLITS:
        shards = [records[k][split] for k in sorted(records) if records[k].get(split)]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                         "shards": shards}
    tokenizer_text = job.tokenizer.to_str()
    out.plan([TOKENIZER_FILE, MANIFEST])
    _write_output(out, TOKENIZER_FILE, tokenizer_text)
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "dtype": job.dtype, "vocab_size": job.vocab_size,
        "eot_id": job.eot_id, "plan_sha256": plan["sha256"],
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": hashlib.sha256(tokenizer_text.encode()).hexdigest(),
                      "kind": "given" if job.options.tokenizer else tokenizer_kind(job.options.vocab or 0),
                      "vocab_size": job.vocab_size},
        "val_split": "tail of the only document" if sum(r["documents"] for r in records.values()) == 1
        else "documents by content hash",
        "splits": splits, "sources": [{"path": s.path, "kind": s.kind, "bytes": s.size} for s in job.sources],
        "settings": plan["settings"], "tokenizers_version": plan["tokenizers"],
    }
    _write_output(out, MANIFEST, json.dumps(manifest, indent=1) + "\n")  # last: now the corpus exists
    shutil.rmtree(root / WORK_DIR, ignore_errors=True)
    say(f"prepare: {root}: {splits['train']['tokens']:,} train tokens in {splits['train']['documents']:,} documents, "
        f"{splits['val']['tokens']:,} val tokens in {splits['val']['documents']:,}; {job.dtype}, vocabulary "
        f"{job.vocab_size}")
    return open_prepared(root, verify="size")


def _write_output(out: OutputDir, name: str, text: str) -> None:
    try:
        out.write(name, text)
    except VGraphError as exc:
        raise DataError(exc.diagnostics) from None
