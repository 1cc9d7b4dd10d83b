"""The plain files of a run directory: its default name, and text written so that a kill never tears it.

Shared by `vgraph train` (network.yml, tokenizer.json, run.json, metrics)
and `vgraph launch` (the same, plus job files and placement.json).
"""
from __future__ import annotations

from pathlib import Path

from vgraph.base.safeio import atomic_write

__all__ = ["atomic_write_text", "run_slug"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` all or nothing: the core's one atomic writer (temporary, fsync, rename; the
    temporary removed on failure; the umask respected, a replaced file's mode kept)."""
    atomic_write(path, text)


_SLUG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
MAX_SLUG_CHARS = 100


def run_slug(name: str) -> str:
    """A network name made safe as one directory name (the default run directory is runs/<slug>).

    The network's name comes from a file that may be someone else's: the slug
    keeps ASCII letters, digits, '-', '_' and '.', never starts with a dot or
    a dash (so it is never '.', '..' or hidden) and is at most 100 characters,
    so `runs/<slug>` is always a new directory inside `runs/`.
    """
    slug = "".join(c if c in _SLUG_CHARS else "-" for c in str(name)[:MAX_SLUG_CHARS])
    return slug.lstrip(".-").rstrip("-") or "network"
