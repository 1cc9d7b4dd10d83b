"""Plugin discovery and loading: the one place every command gets its plugins from.

Entry points are listed from package metadata without importing anything
(after flake8's finder); a plugin is imported only when it is used, in a
deterministic order (by name, then distribution), and the built-ins register
through the same groups.  `load_plugins` is the single loading point: the
CLI calls it for every command (installed op types always, `--plugin FILE.py`
files when given), and `vgraph launch` hands the files to its workers, which
call it too.  Whatever a plugin does wrong while loading (raises, calls
`sys.exit`, registers a clashing name) is a `PluginError` naming the plugin:
a plugin's bug must never look like vgraph's, nor end vgraph silently.

Groups:
- `vgraph.passes`: name -> a Pass class
- `vgraph.ops`: name -> a callable that registers op types (called once)
- `vgraph.lowerings.<backend>` (`torch`, `onnx`): op type -> a callable that
  registers that backend's lowering of it (or a module that does so when
  imported).  Loaded only when that backend meets the op, so `vgraph
  validate` never imports torch or onnx for a plugin's sake; `vgraph ops`
  reads which backends lower an op from these names alone.
- `vgraph.commands`: name -> a callable `(subparsers) -> None` adding a CLI command
- `vgraph.exporters`: name -> `fn(graph, node_ids, name=...)` serialising one part of a partition
- `vgraph.decoders`: backend -> a class sampling a trained network's next-token logits through that
  backend (`for_network(graph, weights, kv_cache=, logits_output=, threads=)`, `last_logits(ids)`):
  how `generate --backend onnx` reaches the ONNX backend without the torch backend importing it

A plugin *file* declares its lazy lowerings with `@lowering("torch", "my_op")`.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, TypeVar

from vgraph.base.diagnostics import Diagnostic, VGraphError

BUILTIN = "vgraph"  # the distribution whose entry points are the built-ins
BACKENDS = ("torch", "onnx")
LOWERINGS_PREFIX = "vgraph.lowerings."
GROUPS = ("vgraph.passes", "vgraph.ops", "vgraph.commands", "vgraph.exporters", "vgraph.decoders",
          *(LOWERINGS_PREFIX + b for b in BACKENDS))

R = TypeVar("R")


class PluginError(VGraphError):
    pass


def lowering_group(backend: str) -> str:
    return LOWERINGS_PREFIX + backend


def shown(text: object) -> str:
    """`text` as it may be echoed to a terminal: repr'd when it holds control characters."""
    s = str(text)
    return s if s.isprintable() else repr(s)


class _PluginExited(BaseException):
    """os._exit called by plugin code while it loads (see `guarded`)."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


def guarded(who: str, doing: str, fn: Callable[[], R], *, loading: bool = False) -> R:
    """Run plugin code; anything it raises, and `sys.exit`, becomes a PluginError naming `who`.

    Ctrl-C while plugin code runs (a plugin that hangs) is a PluginError naming it too, with the exit
    status of an interrupt (130).  While a plugin `loading` (its module imported, its file executed),
    `os._exit` is refused as well: it ended vgraph at once, silently, with the status the plugin chose
    (0: as if the command had worked).  Only while loading, because code that forks (multiprocessing)
    calls os._exit in its children when a pass runs."""
    real_exit = os._exit
    if loading:
        def refuse_exit(code: int = 0) -> None:
            raise _PluginExited(code)
        os._exit = refuse_exit  # type: ignore[assignment]
    try:
        return fn()
    except PluginError:
        raise
    except VGraphError as exc:
        raise PluginError([Diagnostic(f"{who}: {doing}:")] + exc.diagnostics) from None
    except SystemExit as exc:
        raise PluginError(f"{who} called sys.exit({exc.code!r}) {doing}; a plugin may not end vgraph "
                          f"(raise an exception with a message instead)") from None
    except _PluginExited as exc:
        raise PluginError(f"{who} called os._exit({exc.code!r}) {doing}; a plugin may not end vgraph "
                          f"(raise an exception with a message instead)") from None
    except KeyboardInterrupt:
        error = PluginError(f"{who}: interrupted {doing} (Ctrl-C while its code ran: does it hang?)")
        error.exit_status = 130  # type: ignore[attr-defined]
        raise error from None
    except BaseException as exc:  # noqa: BLE001  (GeneratorExit and friends from a plugin are its bugs too)
        raise PluginError(f"{who} failed {doing}: {type(exc).__name__}: {shown(exc)}") from exc
    finally:
        os._exit = real_exit


@dataclass(frozen=True)
class Plugin:
    """A discovered, not yet imported, entry point."""

    group: str
    name: str
    value: str  # "module:attr" or "module"
    distribution: str
    version: str

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}".strip()

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN

    @property
    def who(self) -> str:
        return f"plugin {self.name!r} ({self.group}) from distribution {self.origin!r}"

    def load(self) -> Any:
        module_name, _, attr = self.value.partition(":")

        def load() -> Any:
            obj: Any = importlib.import_module(module_name.strip())
            for part in filter(None, attr.strip().split(".")):
                obj = getattr(obj, part)
            return obj

        return guarded(self.who, f"to load {self.value!r}", load, loading=True)


@functools.lru_cache(maxsize=8)
def _entry_points(search_path: tuple[str, ...]) -> dict[str, list[Plugin]]:
    """Every vgraph entry point on `search_path` by group, each sorted by (name, distribution).

    A distribution's METADATA (an email message, README included) is parsed only where its entry_points.txt
    names a vgraph group, and once: reading `Name` of all ~80 installed distributions and `version` once per
    entry point (vgraph's 138) cost 0.33 CPU-s in every process that loads plugins (each launch worker, each
    CLI command), 0.014 this way."""
    found: dict[str, dict[tuple[str, str], Plugin]] = {}
    for dist in metadata.distributions(path=list(search_path)):
        ours = [ep for ep in dist.entry_points if ep.group.startswith("vgraph.")]
        if not ours:
            continue
        meta = dist.metadata
        dist_name, version = meta["Name"] or "?", meta["Version"] or ""
        for ep in ours:
            found.setdefault(ep.group, {}).setdefault(
                (ep.name, dist_name), Plugin(ep.group, ep.name, ep.value, dist_name, version))
    return {group: [plugins[k] for k in sorted(plugins)] for group, plugins in found.items()}


def discover(group: str) -> list[Plugin]:
    """Every entry point of `group`, sorted by (name, distribution), none imported."""
    return list(_entry_points(tuple(sys.path)).get(group, ()))


def find_plugin(group: str, name: str) -> Plugin | None:
    """The entry point `name` of `group` (the first by distribution), not imported; None if none is installed."""
    return next((plugin for plugin in discover(group) if plugin.name == name), None)


def discover_groups(prefix: str) -> dict[str, list[Plugin]]:
    """Entry points of every group starting with `prefix` (e.g. all backends' lowerings)."""
    return {g: list(p) for g, p in _entry_points(tuple(sys.path)).items() if g.startswith(prefix)}


# -- op types ------------------------------------------------------------------------------------

def _defining_ops(who: str, doing: str, origin: str, fn: Callable[[], R], *, loading: bool = False) -> R:
    """Run `fn` (plugin code); every op type it registers is recorded as defined by `origin`."""
    from vgraph.ops import REGISTRY

    before = {op.name for op in REGISTRY}
    result = guarded(who, doing, fn, loading=loading)
    for op in list(REGISTRY):
        if op.name not in before:
            REGISTRY.set_origin(op.name, origin)
    return result


_ops_loaded = False


def load_op_plugins() -> None:
    """Let installed distributions register their op types (once per process)."""
    global _ops_loaded
    if _ops_loaded:
        return
    _ops_loaded = True
    for plugin in discover("vgraph.ops"):
        register = plugin.load()
        if not callable(register) or isinstance(register, ModuleType):
            raise PluginError(f"{plugin.who}: {plugin.value!r} is not a callable that registers op types")
        _defining_ops(plugin.who, "while registering its op types", plugin.origin, register)


# -- plugin files --------------------------------------------------------------------------------

_FILES: dict[str, ModuleType] = {}  # resolved path -> module, in load order
_loading_file: list[str] = []  # the file being executed (for `@lowering`)


def load_file(path: str | Path) -> ModuleType:
    """Import a local plugin file (`--plugin path.py`) once; it registers what it defines."""
    if not str(path).strip():
        raise PluginError("--plugin needs the path of a Python file, got an empty one")
    given = Path(path)
    label = f"plugin file {shown(given)}"
    try:
        resolved = given.resolve(strict=True)
    except (OSError, RuntimeError):
        raise PluginError(f"{shown(given)}: plugin file not found") from None
    if not resolved.is_file():
        raise PluginError(f"{shown(given)}: a plugin must be a Python file, not a "
                          f"{'directory' if resolved.is_dir() else 'special file'}")
    key = str(resolved)
    if key in _FILES:
        return _FILES[key]
    name = "vgraph_plugin_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None or resolved.suffix != ".py":
        raise PluginError(f"{shown(given)}: a plugin must be a Python file ending in .py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    _loading_file.append(key)
    try:
        _defining_ops(label, "while loading", key, lambda: spec.loader.exec_module(module),  # type: ignore
                      loading=True)
    except PluginError:
        sys.modules.pop(name, None)
        raise
    finally:
        _loading_file.pop()
    _FILES[key] = module
    return module


def loaded_files() -> list[str]:
    """Absolute paths of the plugin files loaded so far, in order (what `launch` forwards)."""
    return list(_FILES)


def load_plugins(files: Iterable[str | Path] = ()) -> None:
    """The one loading point: installed op types (once), then each plugin file (once)."""
    load_op_plugins()
    for path in files:
        load_file(path)


# -- backend lowerings ---------------------------------------------------------------------------

_FILE_LOWERINGS: dict[str, dict[str, list[tuple[str, Callable[[], Any]]]]] = {}
_lowerings_run: set[tuple[str, str]] = set()

F = TypeVar("F", bound=Callable[[], Any])


def lowering(backend: str, *ops: str) -> Callable[[F], F]:
    """Decorator for a plugin file: `fn()` registers `backend`'s lowering of `ops`.

    It runs only when that backend meets one of the ops, so the file can
    import torch (or onnx) inside `fn` and `vgraph validate` never pays for it.
    """
    if not ops:
        raise ValueError("lowering(backend, *ops) needs at least one op type")

    def deco(fn: F) -> F:
        origin = _loading_file[-1] if _loading_file else getattr(fn, "__module__", "?")
        for op in ops:
            _FILE_LOWERINGS.setdefault(backend, {}).setdefault(op, []).append((origin, fn))
        return fn

    return deco


def _canonical(op: str) -> str:
    from vgraph.ops import REGISTRY

    return REGISTRY.canonical(op) or op


def load_lowering(backend: str, op: str) -> list[str]:
    """Run (once) every plugin declaring `backend`'s lowering of op type `op`; their origins."""
    op = _canonical(op)
    if (backend, op) in _lowerings_run:
        return []
    _lowerings_run.add((backend, op))
    origins: list[str] = []
    for plugin in discover(lowering_group(backend)):
        if _canonical(plugin.name) != op:
            continue
        obj = plugin.load()
        if callable(obj) and not isinstance(obj, ModuleType):
            guarded(plugin.who, f"while registering its {backend} lowering of {op!r}", obj)
        origins.append(plugin.origin)
    for name, entries in _FILE_LOWERINGS.get(backend, {}).items():
        if _canonical(name) == op:
            for origin, fn in entries:
                guarded(f"plugin file {shown(origin)}", f"while registering its {backend} lowering of {op!r}", fn)
                origins.append(origin)
    return origins


def require_lowering(backend: str, node: Any, table: Mapping[str, R]) -> R:
    """`table[node.type]`, loading the plugins that declare it first; else an error naming op, node, plugin."""
    rule = table.get(node.type)
    if rule is not None:
        return rule
    declared = load_lowering(backend, node.type)
    rule = table.get(node.type)
    if rule is not None:
        return rule
    origin = node.op.origin
    defined = "a built-in op type" if origin == BUILTIN else f"defined by plugin {shown(origin)}"
    if declared:
        how = (f"{', '.join(map(shown, declared))} declares one but did not register it "
               f"(its callable must call vgraph.backends.{backend}.register_lowering({node.type!r}, ...))")
    else:
        how = (f"the plugin must declare one: an entry point named {node.type!r} in group "
               f"{lowering_group(backend)!r}, or @vgraph.plugins.lowering({backend!r}, {node.type!r}) in a "
               f"plugin file (see docs/plugins.md)")
    raise VGraphError([Diagnostic(f"op type {node.type!r} ({defined}) has no {backend} lowering; {how}",
                                  node.loc, node.id)])


def declared_lowerings() -> dict[str, dict[str, str]]:
    """op type -> {backend: origin} for every lowering declared by entry points or plugin files.

    Read from metadata and decorators only: nothing is imported, so `vgraph ops`
    can say which backends lower an op without importing torch or onnx.
    """
    out: dict[str, dict[str, str]] = {}
    for group, plugins in discover_groups(LOWERINGS_PREFIX).items():
        backend = group[len(LOWERINGS_PREFIX):]
        for plugin in plugins:
            out.setdefault(_canonical(plugin.name), {}).setdefault(backend, plugin.origin)
    for backend, table in _FILE_LOWERINGS.items():
        for name, entries in table.items():
            out.setdefault(_canonical(name), {}).setdefault(backend, entries[0][0])
    return out


# -- which distributions a run used ----------------------------------------------------------------

def _distribution_of_origin() -> dict[str, tuple[str, str]]:
    """An origin string as op types, passes and lowerings carry it ("<distribution> <version>") ->
    (distribution, version), for every installed distribution with vgraph entry points."""
    return {p.origin: (p.distribution, p.version)
            for plugins in _entry_points(tuple(sys.path)).values() for p in plugins}


def distributions_used(op_types: Iterable[str] = (), origins: Iterable[str] = ()) -> list[dict[str, str]]:
    """`{"name", "version"}` of each installed distribution, vgraph itself aside, that defines one of
    `op_types` or lowers one of them, or is one of `origins` (as passes carry them: "<distribution>
    <version>") - what a run records in run.json so that a later command lacking one can name the
    package to install.  Plugin files (`--plugin`) are not distributions; a run records them by path."""
    from vgraph.ops import REGISTRY

    found_origins: set[str] = set(origins)
    lowerings = declared_lowerings()
    for op_type in set(op_types):
        if op_type in REGISTRY:
            found_origins.add(REGISTRY.get(op_type).origin)
            found_origins.update(lowerings.get(_canonical(op_type), {}).values())
    known = _distribution_of_origin()
    found = {known[o] for o in found_origins if o in known and known[o][0] != BUILTIN}
    return [{"name": name, "version": version} for name, version in sorted(found)]


def missing_plugins(run: Mapping[str, Any]) -> list[Diagnostic]:
    """What a command needs to hear when a run's network or passes fail to load here: each distribution
    the run recorded (run.json's "plugin_distributions") that is not installed, or installed in another
    version, with the command that installs it; and the --plugin files it was trained with."""
    installed = {dist: version for dist, version in _distribution_of_origin().values()}
    notes: list[Diagnostic] = []
    for rec in run.get("plugin_distributions") or ():
        if not isinstance(rec, Mapping) or not isinstance(rec.get("name"), str):
            continue
        name, version = shown(rec["name"]), shown(rec.get("version") or "")
        pin = f"{name}=={version}" if version else name
        if rec["name"] not in installed:
            notes.append(Diagnostic(f"the run used plugin distribution {name} {version} (an op type or pass of "
                                    f"it), which is not installed here: pip install '{pin}'", severity="warning"))
        elif version and installed[rec["name"]] != rec.get("version"):
            notes.append(Diagnostic(f"the run used plugin distribution {name} {version}; {installed[rec['name']]} "
                                    f"is installed (pip install '{pin}' for the one it trained with)",
                                    severity="warning"))
    files = [f for f in run.get("plugins") or () if isinstance(f, str)]
    if files:
        notes.append(Diagnostic(f"the run was trained with --plugin {' --plugin '.join(map(shown, files))}: give "
                                f"the same plugin files to this command", severity="warning"))
    return notes


def naming_missing_plugins(run: Mapping[str, Any] | None, fn: Callable[[], R]) -> R:
    """`fn()` (loading a run's network, replaying its passes); a VGraphError it raises gains the plugins the
    run used that this process lacks (`missing_plugins`), so the message says what to install."""
    try:
        return fn()
    except VGraphError as exc:
        hints = missing_plugins(run or {})
        if not hints:
            raise
        raise type(exc)(exc.diagnostics + hints) from None
