"""Prepared corpora kept on disk for every run: the embedded corpus, and text given to `--data`.

Why: building the embedded corpus (parsing the standard library's
docstrings, training a tokenizer, tokenizing) took ~16 s of every `vgraph
train`, `launch` and worker process.  Now it goes through the same prepare
as any corpus (prepare.py) once, into ``<cache>/corpora/<name>-<key>/``,
and every later run opens it in milliseconds.

* **Where**: ``$VGRAPH_CACHE_DIR``, else ``$XDG_CACHE_HOME/vgraph``, else
  ``~/.cache/vgraph``.  Delete it at any time; it is rebuilt when needed.
* **Key**: everything the prepared corpus depends on: for the embedded one
  the Python version and implementation, the standard library's path, the
  corpus size cap and the vocabulary; for `--data` text the content hash of
  its files and the vocabulary; for both the format and tokenizers versions.
* **Atomic and concurrent**: an entry is built in a temporary directory and
  renamed into place, under an exclusive lock per key, so concurrent
  processes build it once (the others wait, then read it) and nobody ever
  sees half an entry.
* **Never trusted**: every use checks the entry against its manifest,
  hashes included (a few MB); a damaged entry is moved aside and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from vgraph.base.diagnostics import printable

from vgraph.data.prepare import PrepareOptions, exclusive, prepare_corpus
from vgraph.data.shards import FORMAT_VERSION, DataError, PreparedCorpus, open_prepared
from vgraph.data.sources import Source, find_sources
from vgraph.data.stdlib_corpus import default_corpus_documents, stdlib_dir

__all__ = ["cache_root", "CorpusRecipe", "embedded_recipe", "files_recipe", "default_corpus", "cached"]

Say = Callable[[str], None]


def cache_root(given: str | os.PathLike | None = None) -> Path:
    """The user cache directory of vgraph: `given` (a library caller's), else see the module docstring."""
    if given is not None:
        return Path(given)
    if os.environ.get("VGRAPH_CACHE_DIR"):
        return Path(os.environ["VGRAPH_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "vgraph"


def _versions() -> dict:
    import tokenizers

    return {"format": FORMAT_VERSION, "tokenizers": tokenizers.__version__}


@dataclass(frozen=True)
class CorpusRecipe:
    """One cache entry as a value: what it is built from and its key, everything the prepared corpus depends
    on.  The text given to `--data` is found once (`sources`), so the files keyed are the files prepared;
    the embedded corpus is read only when its entry is built (seconds of parsing)."""

    name: str  # the entry's prefix: "stdlib" | "files"
    key: dict
    what: str  # how the status lines name it
    vocab: int
    corpus_bytes: int = 0  # the embedded corpus's cap
    inputs: tuple[str, ...] = ()  # the text given to `--data`, as given ...
    sources: tuple[Source, ...] = ()  # ... and the files found for it
    skipped: tuple[str, ...] = ()  # what find_sources said it skipped: said when the entry is built, as prepare says it

    @property
    def entry_name(self) -> str:
        """The entry's directory under the cache's corpora/: its prefix and a digest of its key (an entry per
        key; its lock file is `.NAME.lock` beside it)."""
        return f"{self.name}-{hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]}"


def embedded_recipe(corpus_bytes: int, vocab: int) -> CorpusRecipe:
    """The embedded corpus capped at `corpus_bytes`, prepared with a `vocab`-token tokenizer."""
    key = {"corpus": "stdlib-docstrings", "python": f"{platform.python_implementation()} {platform.python_version()}",
           "stdlib": str(stdlib_dir()), "corpus_bytes": corpus_bytes, "vocab": vocab, **_versions()}
    what = f"the embedded corpus (standard library docstrings, at most {corpus_bytes:,} bytes, vocabulary {vocab})"
    return CorpusRecipe("stdlib", key, what, vocab, corpus_bytes=corpus_bytes)


def files_recipe(inputs: Sequence[str], vocab: int) -> CorpusRecipe:
    """Text, JSONL, Parquet or dataset files given to `--data` (not a prepared directory), prepared with a
    `vocab`-token tokenizer trained on them, keyed by their content."""
    skipped: list[str] = []
    sources = find_sources(inputs, report=skipped.append)
    digest = hashlib.sha256()
    for source in sources:
        digest.update(f"{source.kind} {source.size}\n".encode())
        with open(source.path, "rb") as fh:
            while block := fh.read(8 * 2**20):
                digest.update(block)
    key = {"corpus": "files", "content": digest.hexdigest(), "vocab": vocab, **_versions()}
    what = f"{', '.join(printable(i) for i in inputs)} (vocabulary {vocab})"
    return CorpusRecipe("files", key, what, vocab, inputs=tuple(inputs), sources=tuple(sources),
                        skipped=tuple(skipped))


def default_corpus(corpus_bytes: int, vocab: int, say: Say, root: str | os.PathLike | None = None) -> PreparedCorpus:
    """The embedded corpus capped at `corpus_bytes`, prepared with a `vocab`-token tokenizer."""
    return cached(embedded_recipe(corpus_bytes, vocab), say, root)


def cached(recipe: CorpusRecipe, say: Say, root: str | os.PathLike | None = None) -> PreparedCorpus:
    """The cache entry of `recipe` (under `root`, default `cache_root()`), built when missing or damaged."""
    corpora = cache_root(root) / "corpora"
    what = recipe.what
    entry = corpora / recipe.entry_name
    t0 = time.perf_counter()
    corpus = _open_entry(entry)
    if isinstance(corpus, PreparedCorpus):
        say(f"data: {what} from the cache {entry} ({time.perf_counter() - t0:.2f} s)")
        return corpus
    try:
        corpora.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{printable(str(corpora))}: cannot create the cache directory ({exc.strerror}); set "
                        f"VGRAPH_CACHE_DIR to a writable directory") from None
    with exclusive(corpora / f".{entry.name}.lock",
                   lambda: say(f"data: another process is building the cache of {what}; waiting for it")):
        corpus = _open_entry(entry)  # another process may have built it while this one waited
        if isinstance(corpus, PreparedCorpus):
            say(f"data: {what} from the cache {entry} ({time.perf_counter() - t0:.2f} s)")
            return corpus
        if corpus is not None:
            say(f"data: the cache entry {entry} is damaged ({corpus}); rebuilding it")
            trash = corpora / f".trash-{entry.name}-{os.getpid()}"
            os.rename(entry, trash)
            shutil.rmtree(trash, ignore_errors=True)
        say(f"data: building the cache of {what} in {entry} (once; later runs read it) ...")
        tmp = corpora / f".tmp-{entry.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _build(recipe, tmp, say)
            (tmp / "cache-key.json").write_text(json.dumps(recipe.key, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.rename(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        corpus = open_prepared(entry)
    say(f"data: built the cache of {what} in {time.perf_counter() - t0:.1f} s")
    return corpus


def _build(recipe: CorpusRecipe, tmp: Path, say: Say) -> None:
    """Prepare `recipe`'s corpus into `tmp` (prepare.py, as `vgraph data prepare` would)."""
    options = PrepareOptions(vocab=recipe.vocab)
    if recipe.name == "stdlib":
        t0 = time.perf_counter()
        documents = default_corpus_documents(recipe.corpus_bytes)
        say(f"data: read {len(documents):,} docstrings ({sum(map(len, documents)) / 1e6:.1f} MB) from "
            f"{stdlib_dir()} ({time.perf_counter() - t0:.1f} s)")
        prepare_corpus(tmp, options, documents=documents, description="stdlib docstrings", say=say, progress=False)
        return
    for line in recipe.skipped:
        say(line)
    prepare_corpus(tmp, options, sources=recipe.sources, inputs=recipe.inputs, say=say, progress=False)


def _open_entry(entry: Path) -> PreparedCorpus | str | None:
    """The entry, opened and fully verified; why it cannot be used (a damaged one); None when absent."""
    if not entry.exists():
        return None
    try:
        return open_prepared(entry, verify="full")
    except DataError as exc:
        return str(exc)
