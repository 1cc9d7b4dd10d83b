"""What every `vgraph` command shares: the registry of core commands (`@command`), the `--plugin` option, and
loading a network with its warnings on stderr.  Kept apart from the dispatcher (`main`) and the commands
(`commands`) so that both import it and neither imports the other's module at load time."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Callable, Iterable, Mapping

EXIT_INVALID = 2
CORE_COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def command(name: str):
    """Register a core subcommand's parser builder."""
    def deco(fn):
        CORE_COMMANDS[name] = fn
        return fn
    return deco


def load_network(path: str):
    """Load a network for a command; its warnings (settings that do nothing) go to stderr."""
    from vgraph.yamlio import load

    warnings: list = []
    graph = load(path, warnings=warnings)
    for w in warnings:
        print(w, file=sys.stderr)
    return graph


def add_plugin_option(p: argparse.ArgumentParser) -> None:
    action = p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",  # checked by load_file
                   help="load a local plugin file (passes, op types); may repeat")
    action.names_path = True  # a file name: any bytes (main.refuse_undecodable leaves it alone)




def remember_parser(p: argparse.ArgumentParser) -> None:
    """Keep the command's parser in its namespace, for `command_line` (the resume hint of train and launch)."""
    p.set_defaults(command_parser=p)


def command_line(args: argparse.Namespace, *, override: Mapping[str, Any] = (), drop: Iterable[str] = ()) -> str:
    """The command `args` were parsed from, as a shell reads it: what the user set (options at their
    defaults left out), `override` values by dest (None leaves one out), `drop` dests left out.

    Why: a stopped run's "continue with" line must be the exact command to copy, with the network and
    fleet as typed (a shipped one by its name, not the package's file) and every option that decides what
    runs (--data, --batch, --steps ...), or the copy trains on other data and is refused.  Built from the
    parser's own actions, so an option added later is in it without anyone remembering to list it."""
    from vgraph.base import options
    from vgraph.base.shipped import typed_name

    parser: argparse.ArgumentParser = args.command_parser
    override, drop = dict(override), set(drop)
    prog, words, tail = parser.prog.split(), [], []
    for action in parser._actions:
        if action.dest in drop or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        value = override[action.dest] if action.dest in override else getattr(args, action.dest, None)
        if action.type is options.network_file:
            value = typed_name(value, "network") if isinstance(value, str) else value
        elif action.type is options.fleet_file:
            value = typed_name(value, "fleet") if isinstance(value, str) else value
        elif action.type is options.nnodes and isinstance(value, tuple):
            if action.dest not in override and value == tuple(action.default or ()):
                continue  # at its default, like any other option (compared before it becomes text)
            value = str(value[0]) if value[0] == value[1] else f"{value[0]}:{value[1]}"
        if not action.option_strings:
            tail += [str(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
            continue
        if value is None or (action.dest not in override and value == action.default):
            continue
        words += _option_words(action, value)
    return " ".join([*prog, *(shlex.quote(w) for w in [*tail, *words])])


def _option_words(action: argparse.Action, value: Any) -> list[str]:
    """One option's words: a flag, --x/--no-x, a value, or one value per repetition."""
    name = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    if isinstance(action, argparse.BooleanOptionalAction):
        return [name if value else "--no-" + name[2:]]
    if action.nargs == 0:  # store_true / store_const: the flag when set
        return [name] if value == action.const else []
    if isinstance(action, argparse._AppendAction):
        return [w for v in value for w in (name, str(v))]
    if isinstance(value, list):
        return [name, *map(str, value)]
    return [name, repr(value) if isinstance(value, float) else str(value)]
