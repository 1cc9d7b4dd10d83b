"""The `vgraph data` command (`prepare`), registered through the `vgraph.commands` entry point like `ops`.

    vgraph data prepare INPUT... -o DIR (--vocab N | --tokenizer FILE) [--field F] [--column C]
                        [--val-fraction X] [--sample-bytes SIZE] [--workers N] [--quiet]

A core command: preparing needs tokenizers and numpy, never torch (prepare.py).
"""
from __future__ import annotations

import argparse
import math
import sys

from vgraph.base import options
from vgraph.base.diagnostics import quote

__all__ = ["register_data", "fraction"]


def fraction(text: str) -> float:
    """A fraction strictly between 0 and 1 (--val-fraction)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {quote(text)}") from None
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 (exclusive), got {quote(text)}")
    return value


def name(text: str) -> str:
    """A JSONL field or a column name: any non-empty text."""
    if not text:
        raise argparse.ArgumentTypeError("expected a field or column name, got ''")
    return text


def pattern(text: str) -> str:
    """An --include file name pattern: non-empty printable text without a directory part."""
    if not text or not text.isprintable() or "/" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a file name pattern such as '*.py', got {quote(text)}")
    return text


def register_data(subparsers: argparse._SubParsersAction) -> None:
    """Add `data` (with its subcommand `prepare`) to a `vgraph` subparser set."""
    data = subparsers.add_parser("data", help="prepare a text corpus as token shards for training",
                                 description="Corpora for `vgraph train --data DIR` and `vgraph launch --data DIR`.")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser(
        "prepare", help="tokenize text, JSONL, Parquet or a saved dataset into token shards",
        description="Tokenize a corpus once, in parallel processes, into DIR: token shards (uint16 or uint32, "
                    "raw little-endian), document indexes, a validation split by documents, tokenizer.json and "
                    "manifest.json (counts, SHA-256 hashes). A killed prepare resumes when run again.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", type=options.path,
                   help="text files (.txt, .md; documents separated by lines '<|endoftext|>'), .jsonl, .parquet, "
                        "a directory (also a `datasets` save_to_disk directory) or a glob")
    p.add_argument("-o", "--output", required=True, metavar="DIR", type=options.path, help="the prepared directory")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--vocab", type=options.positive_int, metavar="N",
                     help="train a tokenizer of N tokens on a sample (byte-level BPE; characters below 258; at "
                          "most 16,777,216: larger vocabularies come as --tokenizer)")
    tok.add_argument("--tokenizer", metavar="FILE", type=options.path, help="a `tokenizers` JSON file to use")
    p.add_argument("--field", default="text", type=name, help="JSONL: the field holding the text (default text)")
    p.add_argument("--column", default="text", type=name,
                   help="Parquet, saved datasets: the column holding the text (default text)")
    p.add_argument("--val-fraction", type=fraction, default=0.05, metavar="X",
                   help="share of documents held out for validation, chosen by content hash (default 0.05)")
    p.add_argument("--sample-bytes", type=options.byte_size, default="64M", metavar="SIZE",
                   help="text the tokenizer is trained on, spread over the corpus (default 64M)")
    p.add_argument("--include", action="append", default=[], type=pattern, metavar="PATTERN",
                   help="also read files in directories and globs whose names match PATTERN (e.g. '*.py') as "
                        "text; others of unknown kinds are counted in a message (repeatable)")
    p.add_argument("--allow-small-vocab", action="store_true",
                   help="accept a trained tokenizer under half of --vocab (the text has too few byte pairs)")
    p.add_argument("--workers", type=options.positive_int, metavar="N",
                   help="tokenizing processes (default: the CPUs available)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    p.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from vgraph.data.prepare import PrepareOptions, prepare
    from vgraph.data.shards import DataError
    from vgraph.data.tokenizer import MAX_TRAINED_VOCAB, MIN_BPE_VOCAB

    if args.vocab is not None and not 4 <= args.vocab <= MAX_TRAINED_VOCAB:
        raise DataError(f"--vocab must be from 4 to {MAX_TRAINED_VOCAB:,} tokens (byte-level BPE from "
                        f"{MIN_BPE_VOCAB}; the trainer's memory grows with the size asked; a larger vocabulary "
                        f"comes as --tokenizer FILE), not {args.vocab:,}")
    opts = PrepareOptions(vocab=args.vocab, tokenizer=args.tokenizer, field=args.field, column=args.column,
                          val_fraction=args.val_fraction, sample_bytes=args.sample_bytes, workers=args.workers or 0,
                          include=tuple(args.include), small_vocab=args.allow_small_vocab)
    warn = (lambda m: print(m, file=sys.stderr, flush=True))  # even with --quiet: what was skipped or came out small
    say = (lambda m: None) if args.quiet else warn
    corpus = prepare(args.inputs, args.output, opts, say=say, progress=not args.quiet, warn=warn)
    m = corpus.manifest
    print(f"{args.output}: {m['splits']['train']['tokens']:,} train / {m['splits']['val']['tokens']:,} val tokens "
          f"({m['dtype']}, vocabulary {m['vocab_size']}); train with --data {args.output}")
    return 0

