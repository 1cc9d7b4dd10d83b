"""The `vgraph` command line: builds the parser and dispatches.

Core commands are registered in `vgraph.cli.commands` with `@command`;
backends and tools add theirs through the `vgraph.commands` entry point
group, so the core never imports them.  A user's mistake is a VGraphError:
its diagnostics are printed and the exit status is 2, without a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from vgraph.base import options
from vgraph.base.diagnostics import VGraphError, printable, quote
from vgraph.cli import commands as _commands  # noqa: F401  (registers the core commands)
from vgraph.cli.common import CORE_COMMANDS, EXIT_INVALID, add_plugin_option, load_network  # noqa: F401
from vgraph.run import files as _run_files  # noqa: F401  (registers the run's ownership rule with safeio)
from vgraph.plugins import PluginError, discover, guarded


def load_plugins(args: argparse.Namespace) -> None:
    """Installed op types and the command's `--plugin` files (`run_parser` calls this for every command)."""
    from vgraph.plugins import load_plugins as load

    load(getattr(args, "plugin", None) or [])


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """Core commands, plus the plugin command `wanted` (only that one is imported)."""
    from vgraph import __version__

    parser = argparse.ArgumentParser(prog="vgraph", description="Graph IR and passes for network YAML.")
    parser.add_argument("--version", action="version", version=f"vgraph {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for build in CORE_COMMANDS.values():
        build(sub)
    for plugin in discover("vgraph.commands"):
        if plugin.name in CORE_COMMANDS:
            continue
        if plugin.name == wanted:
            register = plugin.load()
            guarded(plugin.who, "while adding its command", lambda: register(sub))
        else:
            # Listed without importing it (backends import torch): its summary read from its module's source.
            from vgraph.cli.command_help import summary

            text = summary(plugin.name, plugin.value) or f"see 'vgraph {plugin.name} -h'"
            sub.add_parser(plugin.name, help=text if plugin.builtin else f"[{plugin.distribution}] {text}",
                           add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    return run_parser(lambda: build_parser(wanted), argv)


def run_commands(registrars: Sequence[Callable[[argparse._SubParsersAction], None]],
                 argv: Sequence[str] | None = None, prog: str = "vgraph") -> int:
    """Run a plugin's own commands (`python -m <module> ...`) exactly as `vgraph` runs them."""
    def build() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog)
        sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
        for register in registrars:
            register(sub)
        return parser

    return run_parser(build, list(sys.argv[1:] if argv is None else argv))


def run_parser(build: Callable[[], argparse.ArgumentParser], argv: list[str]) -> int:
    """Parse and dispatch; a user's mistake prints its diagnostics and exits 2, no traceback."""
    from vgraph.base.terminal import escaped_output

    with escaped_output():  # nothing a command prints can drive the terminal (vgraph/base/terminal.py)
        return _dispatch(build, argv)


def _dispatch(build: Callable[[], argparse.ArgumentParser], argv: list[str]) -> int:
    try:
        parser = build()
        args, extras = parser.parse_known_args(argv)
        if extras:
            unrecognized(parser, args, extras)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0 if not argv else EXIT_INVALID
        refuse_undecodable(parser, args)  # before anything runs: text that is not UTF-8 is a diagnostic
        load_plugins(args)  # the one loading point: every command sees the same plugins
        return int(args.func(args) or 0)
    except (VGraphError, PluginError) as exc:
        for d in exc.diagnostics:
            print(d, file=sys.stderr)
        return getattr(exc, "exit_status", EXIT_INVALID)  # an interrupted run: 128 + the signal
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:
        # The environment refused a file operation (permissions, a full or read-only disk, a directory
        # where a file belongs): a user's problem to fix, named by its path, not a traceback.
        where = f"{printable(exc.filename)}: " if exc.filename is not None else ""
        print(f"{where}{printable(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_INVALID


def refuse_undecodable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A VGraphError naming every option whose text is not UTF-8, except file and directory names.

    Why one rule here: on Linux an argument is bytes, and Python hands the ones that are not UTF-8 over as
    lone surrogates ('\\udcff'), which fail only when the text is finally encoded, deep inside a command
    (a prompt in the tokenizer, an address in the socket library): a traceback.  A file name may be any
    bytes and works as given, so options of type `options.path` (or marked `names_path`) are left alone; every other value of the
    chosen command (and its subcommand) is checked once, before anything runs."""
    bad = []
    for action in _chosen_actions(parser, args):
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        is_path = action.type is options.path or getattr(action, "names_path", False)
        if is_path or not any(isinstance(v, str) and not _utf8(v) for v in values):
            continue
        name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
        shown = next(v for v in values if isinstance(v, str) and not _utf8(v))
        bad.append(f"{name}: not UTF-8 text ({quote(shown)}); give text in UTF-8")
    if bad:
        raise VGraphError(bad[0] if len(bad) == 1 else "; ".join(bad))


#: What users of nanoGPT, Hugging Face's Trainer and torchrun type for vgraph's options (spelling aside).
KNOWN_AS = {"--learning-rate": "--lr", "--batch-size": "--batch", "--max-steps": "--steps", "--max-iters": "--steps",
            "--warmup-steps": "--warmup", "--warmup-iters": "--warmup", "--eval-interval": "--val-every",
            "--eval-steps": "--val-every", "--eval-iters": "--val-batches", "--output-dir": "--out",
            "--out-dir": "--out", "--max-grad-norm": "--grad-clip", "--resume-from-checkpoint": "--resume",
            "--gradient-accumulation-steps": "--grad-accum"}


def unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """argparse's usage error for arguments nobody takes, from the chosen command's parser (its usage, not the
    top level's) and with the likeliest meant option of each mistyped one: `--batch-size` -> `--batch`."""
    import difflib

    chosen = _chosen_parser(parser, args)
    known = [o for a in chosen._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extras:
        name = word.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        plain = "--" + name[2:].replace("_", "-").lower()
        close = [o for o in (plain, KNOWN_AS.get(plain)) if o in known][:1] or difflib.get_close_matches(
            plain, known, n=1, cutoff=0.6) or [o for o in known if plain.startswith(o + "-")][:1]
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    chosen.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser `args` chose."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(args, action.dest, None) or "")
            if sub is not None:
                return _chosen_parser(sub, args)
    return parser


def _chosen_actions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.Action]:
    """The actions of `parser` and of each subcommand `args` chose under it."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(args, action.dest, None) or "")
            if sub is not None:
                actions += _chosen_actions(sub, args)
    return actions


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
