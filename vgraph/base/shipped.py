"""The networks and fleets that ship with vgraph, and the one resolver from what a user typed to a file.

Why: a user who installed the wheel has no checkout, so the production
networks and example fleets the README talks about travel as package data
(`vgraph.networks`: networks/*.yml and networks/fleets/*.yml), and every
command that reads a network or a fleet takes their names as well as file
names (`vgraph train distributed_attention_example_6_swiglu_head`).

One rule, applied by the argument types of `vgraph.base.options`:

* text naming an existing file system entry is that entry, whatever its
  name (a local file `t4x4.yml` wins over the shipped fleet);
* otherwise a bare name (letters, digits, `_`, `-`, `.`; no `/`, no `..`, no
  control characters), with or without `.yml`, is a shipped one of the kind
  asked for, and one that is not is refused naming the choices;
* anything else is a path like any other, left to the reader, which says
  what is wrong with it: a name with `/` or `..` never reaches into the
  package's folder.
"""
from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

from vgraph.base.diagnostics import VGraphError, printable

__all__ = ["KINDS", "shipped", "resolve", "is_bare_name", "typed_name"]

PACKAGE = "vgraph.networks"
KINDS = {"network": ".", "fleet": "fleets"}  # kind -> folder inside the package
_BARE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}")
_SUFFIXES = (".yml", ".yaml")


def shipped(kind: str) -> dict[str, Path]:
    """Name -> file of every shipped `kind` ("network" or "fleet"), by name; {} when none is installed."""
    try:
        folder = resources.files(PACKAGE).joinpath(KINDS[kind])
    except ModuleNotFoundError:  # a build without the package data
        return {}
    if not folder.is_dir():
        return {}
    return {Path(entry.name).stem: Path(str(entry)) for entry in sorted(folder.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".yml") and entry.is_file()}


def is_bare_name(text: str) -> bool:
    """A name that can only mean a shipped file: no folder, no `..`, nothing but letters, digits, `_-.`."""
    return bool(_BARE.fullmatch(text)) and ".." not in text


def resolve(text: str, kind: str) -> str:
    """The file `text` names: itself when it exists or is a path, else the shipped `kind` of that name."""
    if text == "" or os.path.lexists(text) or not is_bare_name(text):
        return text
    name = next((text[:-len(s)] for s in _SUFFIXES if text.endswith(s)), text)
    found = shipped(kind)
    if name in found:
        return str(found[name])
    choices = ", ".join(found) or "none are installed"
    raise VGraphError(f"{printable(text)}: no such file, and no {kind} of that name ships with vgraph "
                      f"(shipped {kind}s: {choices}; `vgraph networks` lists them)")


def typed_name(path: str, kind: str) -> str:
    """What a user types for the file `resolve` gave: a shipped `kind`'s bare name, unless a local entry of
    that name would win over it (then the path itself); any other path unchanged."""
    for name, file in shipped(kind).items():
        if os.path.realpath(path) == os.path.realpath(file):
            return name if not any(os.path.lexists(name + s) for s in ("", *_SUFFIXES)) else path
    return path
