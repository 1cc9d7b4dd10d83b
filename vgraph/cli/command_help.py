"""One-line summaries of the commands that plugins add, for `vgraph --help`, without importing them.

Why: a backend's command module imports its package, and the torch backend's package imports torch
(seconds), so `vgraph --help` and every other command build the parser without importing the commands
they do not run (vgraph/cli/main.py).  The summary is the `help=` the command's own module gives
`add_parser(NAME, help=...)`: its source is found through the import system's finders (no module
executed, the parent packages included) and read with `ast`.  A module that cannot be found or read, or
that builds the help at run time, gets the old pointer to `vgraph NAME -h`.
"""
from __future__ import annotations

import ast
import sys
from importlib.machinery import ModuleSpec
from typing import Any

__all__ = ["summary"]

_MAX_SOURCE_BYTES = 4 * 2**20  # a command module; a larger file is not one to parse for help


def summary(name: str, value: str) -> str | None:
    """The `help=` text of `add_parser(name, ...)` in entry point `value`'s module ("module:attr"), or None."""
    try:
        source = _module_source(value.partition(":")[0].strip())
        if source is None:
            return None
        return _help_in(ast.parse(source), name)
    except (OSError, SyntaxError, ValueError, ImportError, RecursionError, MemoryError):
        return None


def _module_source(module: str) -> str | None:
    """The source text of `module`, found level by level through `sys.meta_path`'s finders; nothing imported."""
    spec: ModuleSpec | None = None
    path: Any = None
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        full = ".".join(parts[:depth])
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else _find(full, path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return None
    with open(origin, "rb") as f:
        raw = f.read(_MAX_SOURCE_BYTES + 1)
    return None if len(raw) > _MAX_SOURCE_BYTES else raw.decode("utf-8")


def _find(full: str, path: Any) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(full, path)
        if spec is not None:
            return spec
    return None


def _help_in(tree: ast.AST, name: str) -> str | None:
    """The constant `help=` (else the first sentence of `description=`) of `add_parser(name, ...)`."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_parser" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == name):
            continue
        words = {k.arg: k.value.value for k in node.keywords
                 if isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)}
        text = words.get("help") or words.get("description", "").split(". ")[0]
        return " ".join(text.split()) or None
    return None
