"""Plugin discovery through entry points, after flake8's finder.

Entry points are listed from package metadata without importing anything;
a plugin is imported only when it is used, and an import failure is reported
with the plugin's name and distribution.  Order is deterministic (by name,
then distribution), and the built-ins register through the same groups.

Groups:
- `vgraph.passes`: name -> a Pass class (or an object with the Pass protocol)
- `vgraph.ops`: name -> a callable that registers op types (called once)
- `vgraph.commands`: name -> a callable `(subparsers) -> None` adding a CLI command
- `vgraph.exporters`: name -> `fn(graph, node_ids, name=...)` serialising one part of a partition
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .diagnostics import VGraphError

GROUPS = ("vgraph.passes", "vgraph.ops", "vgraph.commands", "vgraph.exporters")


class PluginError(VGraphError):
    pass


@dataclass(frozen=True)
class Plugin:
    """A discovered, not yet imported, entry point."""

    group: str
    name: str
    value: str  # "module:attr"
    distribution: str
    version: str

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}".strip()

    def load(self) -> Any:
        module_name, _, attr = self.value.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
            return obj
        except Exception as exc:  # a plugin's bug must not look like ours
            raise PluginError(f"plugin {self.name!r} ({self.group}) from distribution "
                              f"{self.origin!r} failed to load {self.value!r}: "
                              f"{type(exc).__name__}: {exc}") from exc


def discover(group: str) -> list[Plugin]:
    """Every entry point of `group`, sorted by (name, distribution), none imported."""
    found: dict[tuple[str, str], Plugin] = {}
    for dist in metadata.distributions():
        dist_name = dist.metadata["Name"] or "?"
        for ep in dist.entry_points:
            if ep.group == group:
                found[(ep.name, dist_name)] = Plugin(group, ep.name, ep.value, dist_name, dist.version or "")
    return [found[k] for k in sorted(found)]


_ops_loaded = False


def load_op_plugins() -> None:
    """Let installed distributions register their op types (once per process)."""
    global _ops_loaded
    if _ops_loaded:
        return
    _ops_loaded = True
    for plugin in discover("vgraph.ops"):
        register = plugin.load()
        try:
            register()
        except Exception as exc:
            raise PluginError(f"op plugin {plugin.name!r} from {plugin.origin!r} failed while "
                              f"registering: {type(exc).__name__}: {exc}") from exc


def load_file(path: str | Path) -> Any:
    """Import a local plugin file (`--plugin path.py`); it registers what it defines."""
    path = Path(path)
    if not path.is_file():
        raise PluginError(f"{path}: plugin file not found")
    name = f"vgraph_local_plugin_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise PluginError(f"{path}: plugin failed to load: {type(exc).__name__}: {exc}") from exc
    return module
