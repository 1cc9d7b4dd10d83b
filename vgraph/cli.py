"""The `vgraph` command line.

Core commands live here; backends and tools add theirs through the
`vgraph.commands` entry point group, so the core never imports them.  A
user's mistake is a VGraphError: its diagnostics are printed and the exit
status is 2, without a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from .diagnostics import VGraphError
from .plugins import PluginError, discover

EXIT_INVALID = 2
CORE_COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def command(name: str):
    """Register a core subcommand's parser builder."""
    def deco(fn):
        CORE_COMMANDS[name] = fn
        return fn
    return deco


def add_plugin_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="load a local plugin file (passes, op types); may repeat")


def load_plugins(args: argparse.Namespace) -> None:
    from .plugins import load_file, load_op_plugins

    load_op_plugins()
    for path in getattr(args, "plugin", []) or []:
        load_file(path)


@command("validate")
def _validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check network YAML files; exit 2 listing every problem")
    p.add_argument("files", nargs="+", metavar="FILE")
    add_plugin_option(p)
    p.set_defaults(func=_validate)


def _validate(args: argparse.Namespace) -> int:
    from .yamlio import load

    load_plugins(args)
    failed = False
    for path in args.files:
        warnings: list = []
        try:
            g = load(path, warnings=warnings)
        except VGraphError as exc:
            failed = True
            for d in exc.diagnostics:
                print(d, file=sys.stderr)
            print(f"{path}: invalid ({len(exc.errors)} error{'s' * (len(exc.errors) != 1)})", file=sys.stderr)
            continue
        for w in warnings:
            print(w, file=sys.stderr)
        print(f"{path}: ok ({len(g)} VNodes, {g.nx.number_of_edges()} edges)")
    return EXIT_INVALID if failed else 0


@command("analyze")
def _analyze_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="shapes, parameters, FLOPs and memory per node and group")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    add_plugin_option(p)
    p.set_defaults(func=_analyze)


def _analyze(args: argparse.Namespace) -> int:
    from .analyze import analyze, format_table
    from .yamlio import load

    load_plugins(args)
    a = analyze(load(args.file))
    print(json.dumps(a.to_json(), indent=2) if args.json else format_table(a))
    return 0


@command("optimize")
def _optimize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="run a pass pipeline and write the rewritten network")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-o", "--output", required=True, metavar="OUT.yml")
    p.add_argument("--passes", metavar="SPEC", default=None,
                   help="pipeline, e.g. 'fuse-heads,precision{target=cuda-sm80}' "
                        "(default: the production pipeline)")
    p.add_argument("--target", default=None, help="compile target for target-aware passes (cpu, cuda-smXY)")
    p.add_argument("--dump-dir", metavar="DIR", help="write the graph after each pass as NN_pass.yml")
    p.add_argument("--explain", action="store_true", help="say why rewrites did not match")
    p.add_argument("--no-verify", action="store_true", help="skip IR verification between passes")
    add_plugin_option(p)
    p.set_defaults(func=_optimize)


def _optimize(args: argparse.Namespace) -> int:
    from .pipeline import DEFAULT_PIPELINE, run_pipeline
    from .yamlio import load, save

    load_plugins(args)
    graph = load(args.file)
    pm = run_pipeline(graph, args.passes, target=args.target, explain=args.explain,
                      dump_dir=args.dump_dir, verify=not args.no_verify)
    save(graph, args.output)
    print(f"pipeline: {args.passes or DEFAULT_PIPELINE}")
    print(pm.report())
    for note in pm.ctx.notes:
        print(f"note: {note}")
    if args.explain:
        print("explain:" if pm.ctx.explanations else "explain: every candidate was rewritten")
        for line in pm.ctx.explanations:
            print(f"  {line}")
    print(f"wrote {args.output} ({len(graph)} VNodes)")
    return 0


@command("passes")
def _passes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("passes", help="list every available pass with its doc and origin")
    add_plugin_option(p)
    p.set_defaults(func=_passes)


def _passes(args: argparse.Namespace) -> int:
    from .pipeline import available_passes

    load_plugins(args)
    for name, info in available_passes().items():
        cls = info.load()
        print(f"{name}  [{info.origin}]")
        print(f"    {cls.doc()}")
        for key, opt in cls.options.items():
            print(f"    option {key} (default {opt.default!r}): {opt.doc}")
        deps = [f"{label} {', '.join(v)}" for label, v in
                (("requires", cls.requires), ("after", cls.after), ("invalidates", cls.invalidates)) if v]
        if deps:
            print(f"    {'; '.join(deps)}")
    return 0


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """Core commands, plus the plugin command `wanted` (only that one is imported)."""
    parser = argparse.ArgumentParser(prog="vgraph", description="Graph IR and passes for network YAML.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for build in CORE_COMMANDS.values():
        build(sub)
    for plugin in discover("vgraph.commands"):
        if plugin.name in CORE_COMMANDS:
            continue
        if plugin.name == wanted:
            plugin.load()(sub)
        else:
            # Listed without importing it (backends import torch): its own -h has the details.
            sub.add_parser(plugin.name, help=f"[{plugin.distribution}] see 'vgraph {plugin.name} -h'",
                           add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(wanted)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0 if not argv else EXIT_INVALID
        return int(args.func(args) or 0)
    except (VGraphError, PluginError) as exc:
        for d in exc.diagnostics:
            print(d, file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
