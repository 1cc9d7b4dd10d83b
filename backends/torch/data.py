"""Training text, tokenizer and token batches for the PyTorch backend.

The backend must be able to train a language model out of the box, on any
machine, without network access.  The default corpus is therefore built
from something every Python installation ships: the English docstrings of
the standard library, extracted with :mod:`ast` (modules are parsed, never
imported, so nothing executes and no optional dependency is needed).

User corpora come from plain text files (:func:`load_text_documents`).  The
tokenizer is a byte-level BPE trained on the corpus and cached on disk, and
:class:`TokenDataset` turns documents into deterministic, resumable batches.
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import json
import logging
import math
import os
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vgraph.base.safeio import atomic_write

__all__ = [
    "DataError",
    "EOT_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "DEFAULT_CORPUS_MAX_BYTES",
    "default_corpus_documents",
    "load_text_documents",
    "train_bpe_tokenizer",
    "TokenDataset",
]

logger = logging.getLogger(__name__)

EOT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOT_TOKEN, PAD_TOKEN)
DEFAULT_CORPUS_MAX_BYTES = 4_000_000

#: Byte-level BPE always contains the 256 byte symbols plus the specials, so
#: smaller vocabularies cannot represent arbitrary text.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Directory names under the stdlib that hold tests, test data, GUI code or
# vendored third-party packages rather than documented library code.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "pydoc_data",
    }
)
_MIN_DOCSTRING_CHARS = 40


class DataError(Exception):
    """Raised when training text cannot be found, read or is too small."""


# --------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------


def default_corpus_documents(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> list[str]:
    """English text available offline on any Python install: stdlib docstrings.

    Walks ``sysconfig.get_paths()["stdlib"]`` in sorted order (skipping
    site-packages, test directories, idlelib, lib2to3, tkinter, ...), parses
    every ``.py`` file with :mod:`ast` and yields module, class and function
    docstrings in source order.  Docstrings shorter than a sentence are
    dropped.  The total UTF-8 size is capped at ``max_bytes``; the last
    document is truncated to fit exactly, so the result is deterministic for
    a given Python version.  (CPython 3.11 yields about 1.5 MB in total, so
    the default cap only bites on larger standard libraries.)

    The walk takes a few seconds, so results are memoised per ``max_bytes``
    within the process; each call returns a fresh list.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive; got {max_bytes}")
    return list(_default_corpus_cached(int(max_bytes)))


@functools.lru_cache(maxsize=4)
def _default_corpus_cached(max_bytes: int) -> tuple[str, ...]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise DataError(f"standard library source directory not found: {stdlib}")
    documents: list[str] = []
    remaining = max_bytes
    for source_file in _stdlib_sources(stdlib):
        for doc in _docstrings(source_file):
            encoded = doc.encode("utf-8")
            if len(encoded) >= remaining:
                documents.append(encoded[:remaining].decode("utf-8", errors="ignore"))
                return tuple(documents)
            documents.append(doc)
            remaining -= len(encoded)
    if not documents:
        raise DataError(f"no docstrings found in the standard library sources under {stdlib}")
    return tuple(documents)


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """Yield ``.py`` files under ``root`` in a deterministic, sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("test", "."))
        )
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test"):
                yield Path(dirpath, name)


def _docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one file, in source order."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        # A stray file that is not valid Python for this interpreter is not
        # worth failing the corpus over.
        return
    yield from _docstrings_of(tree)


def _docstrings_of(node: ast.AST) -> Iterator[str]:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings_of(child)


def load_text_documents(path: str | os.PathLike[str]) -> list[str]:
    """Read training text: one document per file.

    ``path`` may be a text file, a directory (all ``*.txt`` and ``*.md``
    files below it, recursively, sorted by relative path) or a glob pattern
    (``**`` allowed; matches sorted).  Files must be UTF-8.  Raises
    :class:`DataError` naming ``path`` when nothing matches or a file cannot
    be read.
    """
    target = Path(path).expanduser()
    if target.is_file():
        files = [target]
    elif target.is_dir():
        files = sorted(
            (p for p in target.rglob("*") if p.is_file() and p.suffix.lower() in (".txt", ".md")),
            key=lambda p: p.relative_to(target).as_posix(),
        )
    else:
        files = sorted(Path(p) for p in glob.glob(os.fspath(target), recursive=True))
        files = [p for p in files if p.is_file()]
    if not files:
        hint = "no *.txt or *.md files in directory" if target.is_dir() else "no file matches"
        raise DataError(f"{hint}: {os.fspath(path)!r}")
    documents = []
    for file in files:
        try:
            documents.append(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(f"{file} is not valid UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except OSError as exc:
            raise DataError(f"cannot read {file}: {exc.strerror or exc}") from exc
    return documents


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _tokenizer_settings(vocab_size: int) -> dict[str, object]:
    """Everything that changes the trained tokenizer, hashed into the cache key."""
    return {
        "format": "vgraph-bpe",
        "version": 1,
        "model": "byte-level-bpe",
        "add_prefix_space": False,
        "special_tokens": list(SPECIAL_TOKENS),
        "min_frequency": 0,
        "vocab_size": vocab_size,
        "tokenizers_version": tokenizers.__version__,
    }


def _cache_key(documents: Sequence[str], vocab_size: int) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(_tokenizer_settings(vocab_size), sort_keys=True).encode())
    for doc in documents:
        encoded = doc.encode("utf-8")
        # Length prefix: ["ab", "c"] and ["a", "bc"] must hash differently.
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def _train_fresh(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE from scratch (no caching)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=list(SPECIAL_TOKENS),
        # Seed the full byte alphabet so any input text stays encodable,
        # even bytes the training corpus never contained.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def train_bpe_tokenizer(
    documents: Sequence[str], vocab_size: int, cache_dir: str | os.PathLike[str]
) -> Tokenizer:
    """Train (or load from cache) a byte-level BPE tokenizer with ``vocab_size`` tokens.

    ByteLevel pre-tokenizer and decoder (GPT-2 style, lossless on any UTF-8
    text), special tokens ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1).
    Training stops at exactly ``vocab_size`` tokens unless the corpus runs
    out of pairs to merge first; then a warning reports the real size, which
    ``tokenizer.get_vocab_size()`` also returns and which is what a model
    must be sized for.

    The result is cached as ``cache_dir/bpe-<sha256>.json``, the hash
    covering the documents, ``vocab_size`` and all tokenizer settings, so a
    second call with the same inputs loads instead of retraining.  The cache
    file is written atomically, so concurrent runs cannot read a torn file.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{MIN_VOCAB_SIZE} (256 byte symbols + {len(SPECIAL_TOKENS)} special tokens)"
        )
    if not documents:
        raise DataError("cannot train a tokenizer on an empty document list")
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    cache_file = cache / f"bpe-{_cache_key(documents, vocab_size)}.json"
    if cache_file.is_file():
        logger.debug("loading cached tokenizer %s", cache_file)
        return Tokenizer.from_file(os.fspath(cache_file))

    tokenizer = _train_fresh(documents, vocab_size)
    actual = tokenizer.get_vocab_size()
    if actual != vocab_size:
        warnings.warn(
            f"tokenizer trained to {actual} tokens instead of the requested {vocab_size}: "
            f"the corpus has too few distinct byte pairs; size the model for {actual}",
            stacklevel=2,
        )
    atomic_write(cache_file, tokenizer.to_str())  # the core's atomic writer (umask respected)
    return tokenizer


# --------------------------------------------------------------------------
# Token batches
# --------------------------------------------------------------------------


class TokenDataset:
    """One int64 token stream with a train / validation split and batch iterators.

    Every document is encoded and followed by the end-of-text token, so the
    model sees document boundaries and learns to end a text.  The last
    ``val_fraction`` of the stream (at least ``seq_len + 1`` tokens, i.e. one
    full input/target window) is validation; the split is a pure function of
    the documents and tokenizer, hence identical on every run and resume.

    ``seq_len`` is the longest sequence length that will be requested; it
    sizes the validation split and is checked against both splits up front
    so an undersized corpus fails here rather than mid-training.
    """

    SPLITS = ("train", "val")

    def __init__(
        self,
        documents: Sequence[str],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        val_fraction: float = 0.05,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive; got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
        eot_id = tokenizer.token_to_id(EOT_TOKEN)
        if eot_id is None:
            raise DataError(f"tokenizer has no {EOT_TOKEN!r} token")
        self.eot_id: int = eot_id
        self.vocab_size: int = tokenizer.get_vocab_size()
        self.seq_len = seq_len
        self.tokens = self._encode(documents, tokenizer, eot_id)

        total = self.tokens.numel()
        window = seq_len + 1
        val_len = max(math.ceil(total * val_fraction), window)
        if total - val_len < window:
            raise DataError(
                f"corpus too small: {total} tokens, but seq_len={seq_len} needs at least "
                f"{window} training and {val_len} validation tokens"
            )
        self.train_tokens = self.tokens[: total - val_len]
        self.val_tokens = self.tokens[total - val_len :]

    @staticmethod
    def _encode(documents: Sequence[str], tokenizer: Tokenizer, eot_id: int) -> torch.Tensor:
        if not documents:
            raise DataError("no documents to encode")
        encodings = tokenizer.encode_batch(list(documents), add_special_tokens=False)
        stream: list[int] = []
        for encoding in encodings:
            stream.extend(encoding.ids)
            stream.append(eot_id)
        return torch.tensor(stream, dtype=torch.int64)

    def split(self, name: str) -> torch.Tensor:
        """The token stream of split ``"train"`` or ``"val"`` (alias ``"validation"``)."""
        if name == "validation":
            name = "val"
        if name == "train":
            return self.train_tokens
        if name == "val":
            return self.val_tokens
        raise ValueError(f"unknown split {name!r}; expected one of {self.SPLITS}")

    def _check_seq_len(self, stream: torch.Tensor, seq_len: int, split: str) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive; got {seq_len}")
        if stream.numel() < seq_len + 1:
            raise DataError(
                f"{split} split has {stream.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}"
            )

    def batches(
        self, split: str, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless random ``(inputs, targets)`` batches, each ``[batch_size, seq_len]`` int64.

        ``targets`` is ``inputs`` shifted by one token (next-token
        prediction).  Window starts are drawn uniformly with ``generator``
        (a CPU :class:`torch.Generator`) and nothing else, one ``randint``
        per batch, drawn lazily when the batch is requested.  Saving
        ``generator.get_state()`` after ``k`` batches and restoring it into a
        new iterator therefore continues with exactly batch ``k + 1``.
        """
        stream = self.split(split)
        self._check_seq_len(stream, seq_len, split)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive; got {batch_size}")
        if generator.device.type != "cpu":
            raise ValueError(f"batches need a CPU generator; got one on {generator.device}")
        offsets = torch.arange(seq_len + 1)
        num_starts = stream.numel() - seq_len  # last start leaves room for the target
        return self._random_windows(stream, offsets, num_starts, batch_size, generator)

    @staticmethod
    def _random_windows(
        stream: torch.Tensor,
        offsets: torch.Tensor,
        num_starts: int,
        batch_size: int,
        generator: torch.Generator,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            starts = torch.randint(0, num_starts, (batch_size,), generator=generator)
            windows = stream[starts[:, None] + offsets]
            yield windows[:, :-1], windows[:, 1:]

    def val_batches(
        self, batch_size: int, seq_len: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic validation batches covering the split once.

        Windows are consecutive and non-overlapping in their inputs (window
        ``i`` reads tokens ``[i*seq_len, (i+1)*seq_len]``, the last one only
        as a target), so every validation token is scored exactly once.  The
        final batch may hold fewer than ``batch_size`` windows.
        """
        stream = self.val_tokens
        self._check_seq_len(stream, seq_len, "val")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive; got {batch_size}")
        num_windows = (stream.numel() - 1) // seq_len
        offsets = torch.arange(seq_len + 1)
        for first in range(0, num_windows, batch_size):
            starts = torch.arange(first, min(first + batch_size, num_windows)) * seq_len
            windows = stream[starts[:, None] + offsets]
            yield windows[:, :-1], windows[:, 1:]

    def __repr__(self) -> str:
        return (
            f"TokenDataset(tokens={self.tokens.numel()}, train={self.train_tokens.numel()}, "
            f"val={self.val_tokens.numel()}, vocab_size={self.vocab_size})"
        )
