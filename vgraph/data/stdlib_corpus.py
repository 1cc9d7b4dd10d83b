"""The embedded corpus: English text every Python installation has, the standard library's docstrings.

Training must work out of the box, on any machine, without network access.
Modules are parsed with :mod:`ast`, never imported, so nothing executes and
no optional dependency is needed.  The walk takes seconds (about 16 s for
the default 4 MB cap on a loaded 2-core machine), which is why its prepared
form is cached on disk (cache.py) rather than rebuilt by every run, and the walk itself is kept for the
process as far as it went (a later, smaller or larger, request reads it again from memory).
"""
from __future__ import annotations

import ast
import itertools
import os
import sysconfig
import threading
from pathlib import Path
from typing import Iterator

from vgraph.data.shards import DataError

__all__ = ["DEFAULT_CORPUS_MAX_BYTES", "default_corpus_documents", "stdlib_dir"]

DEFAULT_CORPUS_MAX_BYTES = 4_000_000
_MIN_DOCSTRING_CHARS = 40
# Directory names under the stdlib that hold tests, test data, GUI code or
# vendored third-party packages rather than documented library code.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib",
                        "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_documents(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> list[str]:
    """Module, class and function docstrings of the standard library, at most `max_bytes` of UTF-8.

    Files are walked in sorted order (skipping site-packages, tests, idlelib,
    lib2to3, tkinter, ...), docstrings shorter than a sentence are dropped,
    and the last document is truncated to fit exactly, so the result is a
    function of the Python installation and `max_bytes`.  (CPython 3.11
    yields about 1.5 MB in all.)
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive; got {max_bytes}")
    stdlib = stdlib_dir()
    if not stdlib.is_dir():
        raise DataError(f"standard library source directory not found: {stdlib}")
    documents: list[str] = []
    remaining = max_bytes
    for doc, encoded in _walked(stdlib):
        if len(encoded) >= remaining:
            documents.append(encoded[:remaining].decode("utf-8", errors="ignore"))
            return documents
        documents.append(doc)
        remaining -= len(encoded)
    if not documents:
        raise DataError(f"no docstrings found in the standard library sources under {stdlib}")
    return documents


class _Walk:
    """The docstrings of one stdlib directory as far as a caller has needed them, kept for the process: a test
    session or a benchmark asks for the corpus again and again (4 CPU-s a megabyte of parsing each time), and the
    answer is a prefix of the same walk."""

    def __init__(self, root: Path) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, bytes]] = []
        self.rest = ((doc, doc.encode("utf-8")) for path in _stdlib_sources(root) for doc in _docstrings(path))


_WALKS: dict[Path, _Walk] = {}
_WALKS_LOCK = threading.Lock()


def _walked(root: Path) -> Iterator[tuple[str, bytes]]:
    """(docstring, its UTF-8) in walk order: those seen before, then the walk continued (and kept) on demand."""
    with _WALKS_LOCK:
        walk = _WALKS.get(root) or _WALKS.setdefault(root, _Walk(root))
    for i in itertools.count():
        with walk.lock:
            if i == len(walk.seen):
                item = next(walk.rest, None)
                if item is None:
                    return
                walk.seen.append(item)
            item = walk.seen[i]
        yield item


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """``.py`` files under ``root`` in a deterministic, sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("test", ".")))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test"):
                yield Path(dirpath, name)


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return  # a stray file this interpreter cannot parse is not worth failing the corpus over
    for node in _in_source_order(tree):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            yield doc


def _in_source_order(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _in_source_order(child)
