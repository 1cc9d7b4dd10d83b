"""What every `vgraph` command shares: the registry of core commands (`@command`), the `--plugin` option, and
loading a network with its warnings on stderr.  Kept apart from the dispatcher (`main`) and the commands
(`commands`) so that both import it and neither imports the other's module at load time."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

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


