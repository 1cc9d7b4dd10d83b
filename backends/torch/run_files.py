"""The plain files of a run directory: its default name, and text written so that a kill never tears it.

Shared by `vgraph train` (network.yml, tokenizer.json, run.json, metrics)
and `vgraph launch` (the same, plus job files and placement.json).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write_text", "run_slug"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary beside `path`, then rename it over `path` (all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def run_slug(name: str) -> str:
    """A network name made safe as a directory name (the default run directory is runs/<slug>)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-") or "network"
