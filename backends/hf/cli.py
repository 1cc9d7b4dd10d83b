"""`vgraph import hf` and `vgraph export hf` (entry points of group `vgraph.commands`).

    vgraph import hf SRC -o RUN [--per-head | --fused-attention] [--seq-len N]
    vgraph export hf RUN -o DIR [--check]

Also runnable without the entry points: `python -m vgraph.backends.hf.cli import hf ...`.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from vgraph.base import options

__all__ = ["register_import", "register_export", "main"]


def register_import(subparsers: argparse._SubParsersAction) -> None:
    """Add `import` (with its format `hf`) to a `vgraph` subparser set."""
    top = subparsers.add_parser("import", help="a model from another framework as a vgraph run (hf: Hugging Face)",
                                description="Import a model as a run directory every vgraph command takes.")
    sub = top.add_subparsers(dest="import_format", metavar="FORMAT", required=True)
    p = sub.add_parser("hf", help="a local Hugging Face causal LM directory (GPT-2, Llama, Qwen2)",
                       description="Read SRC (config.json, *.safetensors, optional tokenizer.json; nothing is "
                                   "downloaded) and write the run directory RUN: network.yml, the weights as "
                                   "checkpoint step-00000000, tokenizer.json. Continue training with "
                                   "`vgraph train RUN/network.yml --out RUN --resume`.")
    p.add_argument("src", metavar="SRC", type=options.path, help="the model directory")
    p.add_argument("-o", "--out", required=True, metavar="RUN", type=options.path,
                   help="the run directory to create (must not exist, or be empty)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--per-head", dest="fused", action="store_false", default=False,
                      help="every attention head its own VNode, as the production networks (default)")
    form.add_argument("--fused-attention", dest="fused", action="store_true",
                      help="one attention VNode per block")
    p.add_argument("--seq-len", type=options.positive_int, metavar="N",
                   help="the network's sequence length (default: the model's maximum positions)")
    p.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    from .importer import import_hf

    run = import_hf(args.src, args.out, fused=args.fused, seq_len=args.seq_len)
    print(f"{run}: imported {args.src} (checkpoint step-00000000)")
    print(f"train on: vgraph train {shlex.quote(str(run / 'network.yml'))} --out {shlex.quote(str(run))} --resume "
          f"--data DIR")
    return 0


def register_export(subparsers: argparse._SubParsersAction) -> None:
    """Add `export` (with its format `hf`) to a `vgraph` subparser set."""
    top = subparsers.add_parser("export", help="a run's model for another framework (hf: Hugging Face)",
                                description="Export a run's weights in another framework's format.")
    sub = top.add_subparsers(dest="export_format", metavar="FORMAT", required=True)
    p = sub.add_parser("hf", help="a Hugging Face model directory (config.json, model.safetensors)",
                       description="Write DIR with config.json, model.safetensors and tokenizer.json that "
                                   "transformers.AutoModelForCausalLM.from_pretrained(DIR) loads. The run's "
                                   "network must be one a supported family (GPT-2, Llama, Qwen2) expresses.")
    p.add_argument("run", metavar="RUN", type=options.path, help="a run directory (its latest checkpoint) or a "
                   "checkpoint")
    p.add_argument("-o", "--out", required=True, metavar="DIR", type=options.path, help="the model directory")
    p.add_argument("--check", action="store_true", help="load DIR with transformers (pip install 'vgraph[hf]') "
                   "and compare its logits with the run's")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from .exporter import check_export, export_hf

    out = export_hf(args.run, args.out)
    print(f"{out}: config.json and model.safetensors of {args.run}")
    if args.check:
        print(f"check: transformers' logits within {check_export(args.run, out):.2g} of the run's")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.hf.cli import|export hf ...`."""
    from vgraph.cli.main import run_commands

    return run_commands([register_import, register_export], argv, prog="python -m vgraph.backends.hf.cli")


if __name__ == "__main__":
    sys.exit(main())
