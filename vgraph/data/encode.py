"""One unit of `vgraph data prepare`: its documents tokenized and written as train / val shards.

Runs in a worker process (spawned: it imports only this package, tokenizers
and numpy, never torch) or in the preparing process itself for small
corpora.  The tokenizer is the `tokenizers` library's batch encoder
(`encode_batch_fast`: no offsets, the fastest call it has); each worker runs
it single-threaded, so N workers use N cores, as the benchmark's baseline
does.

The validation split is by documents and decided here, locally: a document
goes to validation when the first 8 bytes of its BLAKE2b digest, read as a
fraction of 2**64, fall below `val_fraction`.  That is a pure function of the
document's text: independent of the order, the unit and the worker, and two
copies of a document never straddle the split.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import signal
from typing import Any, Sequence

import numpy as np

from vgraph.base.diagnostics import printable
from vgraph.base.jsonio import loads
from vgraph.base.safeio import atomic_write

from vgraph.data.shards import DataError, encode_index
from vgraph.data.sources import Source, Unit, read_unit

__all__ = ["init_worker", "encode_unit", "doc_hash", "shard_names", "pieces", "PIECE_CHARS"]

_ENCODE_BATCH_BYTES = 1 << 20  # documents per encode call: the progress counter moves at this grain
PIECE_CHARS = 1 << 20  # a longer document is encoded in pieces of about this size (see `_in_pieces`)
_CUT = re.compile(r"(?<=\S) (?=\S)")  # a single space between two non-spaces: where a piece may start
# pre-tokenizers after which no token spans such a space and a piece starting with " word" tokenizes as in
# the whole text (no lookbehind, nothing added at a piece's start); anything else is encoded whole
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Whitespace", "WhitespaceSplit", "Split", "Punctuation", "Digits"}
_worker: dict[str, Any] = {}


def init_worker(tokenizer_json: str, counter) -> None:
    """Process initializer: one single-threaded tokenizer per worker, and the shared progress counter."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _worker["tokenizer"] = Tokenizer.from_str(tokenizer_json)
    _worker["counter"] = counter


def doc_hash(doc: str) -> int:
    """The document's split key: BLAKE2b's first 8 bytes as an unsigned integer."""
    return int.from_bytes(hashlib.blake2b(doc.encode("utf-8"), digest_size=8).digest(), "little")


def shard_names(split: str, unit: int) -> tuple[str, str]:
    return f"{split}-{unit:05d}.bin", f"{split}-{unit:05d}.idx"


def encode_unit(task: dict[str, Any], tokenizer=None, counter=None, documents: Sequence[str] | None = None) -> dict:
    """Tokenize one unit into `task["out"]`; its record (counts, hashes, the extreme document keys).

    `task`: unit (its number), source and span, field/column, dtype, eot_id,
    val_fraction, and the fallbacks the finishing step may ask for: `force`
    (document number -> split) and `tail` (split the unit's only document by
    position).  `documents` replaces reading the source (the embedded corpus).
    """
    tokenizer = tokenizer or _worker["tokenizer"]
    counter = counter if counter is not None else _worker.get("counter")
    unit = Unit(**task["span"])
    docs = list(documents[unit.start:unit.end] if documents is not None else
                read_unit(Source(**task["source"]), unit, field=task["field"], column=task["column"]))
    keys = [doc_hash(d) for d in docs]
    limit = task["val_fraction"] * 2.0**64
    splits = ["val" if k < limit else "train" for k in keys]
    for number, split in (task.get("force") or {}).items():
        splits[int(number)] = split
    where = task["source"]["path"]
    ids = _in_pieces(tokenizer, docs, lambda texts: _encode(tokenizer, texts, counter, where))
    eot = int(task["eot_id"])
    record: dict[str, Any] = {"unit": task["unit"], "documents": len(docs), "bytes": task["bytes"],
                              "min_key": min(zip(keys, range(len(keys))), default=None),
                              "max_key": max(zip(keys, range(len(keys))), default=None)}
    if task.get("tail"):
        parts = _tail_split(ids[0], eot, task["val_fraction"])
    else:
        parts = {name: _join([i for i, s in zip(ids, splits) if s == name], eot) for name in ("train", "val")}
    for name, (tokens, lengths) in parts.items():
        record[name] = _write_shard(task["out"], name, task["unit"], tokens, lengths, task["dtype"]) \
            if len(lengths) else None
    return record


def _encode(tokenizer, docs: list[str], counter, where: str) -> list[list[int]]:
    ids: list[list[int]] = []
    batch: list[str] = []
    size = 0
    for doc in docs + [None]:  # None flushes the last batch
        if doc is not None:
            batch.append(doc)
            size += len(doc)
        if batch and (doc is None or size >= _ENCODE_BATCH_BYTES):
            try:
                ids += [e.ids for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False)]
            except Exception as exc:  # the library's own errors are plain Exceptions (no unknown token, ...)
                raise DataError(f"{printable(where)}: the tokenizer cannot encode this text ({printable(exc, 200)}); "
                                f"give a tokenizer that covers it (one with an unknown token, or byte-level)") from None
            if counter is not None:
                with counter.get_lock():
                    counter.value += size
            batch, size = [], 0
    return ids


def _in_pieces(tokenizer, docs: list[str], encode) -> list[list[int]]:
    """`encode(docs)`, with each document longer than PIECE_CHARS encoded as pieces cut before a space
    between two non-spaces, and their ids joined back.

    Why: the tokenizer holds a whole document's encoding (ids, tokens, offsets, alignments: ~140 bytes a
    character) at once, so one 32 MB JSONL line peaked at 6.5 GB where the same text as separate lines took
    0.8 GB.  The ids are the same: with no normalizer and a pre-tokenizer that splits before such a space
    (GPT-2's byte-level regex, whitespace, the character tokenizer), no token crosses the cut.  A tokenizer
    of another kind, or a document with no such space, is encoded whole, as before."""
    if not any(len(d) > PIECE_CHARS for d in docs) or not _cuttable(tokenizer):
        return encode(docs)
    texts: list[str] = []
    owner: list[int] = []
    for number, doc in enumerate(docs):
        for piece in pieces(doc):
            texts.append(piece)
            owner.append(number)
    ids: list[list[int]] = [[] for _ in docs]
    for number, piece_ids in zip(owner, encode(texts)):
        ids[number] += piece_ids
    return ids


def pieces(doc: str) -> list[str]:
    """`doc` cut before spaces between non-spaces, each piece of PIECE_CHARS / 2 to PIECE_CHARS characters
    where the text allows (a longer stretch with no such space stays whole).  Also what the tokenizer is
    trained on (prepare.py): the trainer too holds a whole document's pre-tokenization at once, and the
    words it counts are the same."""
    out, start = [], 0
    while len(doc) - start > PIECE_CHARS:
        cut = _CUT.search(doc, start + PIECE_CHARS // 2, start + PIECE_CHARS) or _CUT.search(doc, start + PIECE_CHARS)
        if cut is None:
            break
        out.append(doc[start:cut.start()])
        start = cut.start()
    out.append(doc[start:])
    return out


def _cuttable(tokenizer) -> bool:
    """Whether the tokenizer splits text so that `pieces`' cuts change no id (see `_in_pieces`)."""
    try:
        config = loads(tokenizer.to_str(), "the tokenizer")
    except Exception:  # a tokenizer we cannot describe: encode whole, as before
        return False
    if not isinstance(config, dict) or config.get("normalizer") is not None:
        return False
    pre = config.get("pre_tokenizer")
    parts = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    cut_at_spaces = False  # some part must split before such a space (or at every character); a Split into
    for part in parts:  # runs of N characters is safe only after one that does (it then cuts within words)
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _SAFE_PRE_TOKENIZERS or not part.get("use_regex", True):
            return False
        if kind == "Split":
            pattern = part.get("pattern")
            runs = re.fullmatch(r"\[\\s\\S\](\{1,\d+\})?", str(pattern.get("Regex") if isinstance(pattern, dict) else ""))
            if runs is None or (runs.group(1) and not cut_at_spaces):
                return False
            cut_at_spaces = cut_at_spaces or not runs.group(1)
        elif kind not in ("Punctuation", "Digits"):
            cut_at_spaces = True
    return cut_at_spaces


def _join(docs: list[list[int]], eot: int) -> tuple[np.ndarray, np.ndarray]:
    """Every document's ids followed by the end-of-text id, and the documents' lengths (eot included)."""
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    tokens = np.empty(int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)
    for doc, end in zip(docs, ends):
        tokens[end - 1 - len(doc):end - 1] = doc
    tokens[ends - 1] = eot
    return tokens, lengths


def _tail_split(doc: list[int], eot: int, val_fraction: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A corpus of one document: its last `val_fraction` of tokens (at least one) is validation."""
    tokens, _ = _join([doc], eot)
    n_val = max(1, math.ceil(len(tokens) * val_fraction))
    cut = len(tokens) - n_val
    if cut < 1:
        return {"train": (tokens[:0], np.zeros(0, np.int64)), "val": (tokens, np.array([len(tokens)]))}
    return {"train": (tokens[:cut], np.array([cut])), "val": (tokens[cut:], np.array([n_val]))}


def _write_shard(out: str, split: str, unit: int, tokens: np.ndarray, lengths: np.ndarray, dtype: str) -> dict:
    if len(tokens) and int(tokens.max()) > np.iinfo(dtype).max:  # never wrap an id (the dtype comes from the
        raise DataError(f"{split} shard of unit {unit}: token id {int(tokens.max())} does not fit {dtype}; the "
                        f"tokenizer produced an id outside its own vocabulary")  # vocabulary: a last guard)
    data = tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    index = encode_index(lengths)
    bin_name, idx_name = shard_names(split, unit)
    atomic_write(os.path.join(out, bin_name), data)
    atomic_write(os.path.join(out, idx_name), index)
    return {"bin": bin_name, "idx": idx_name, "tokens": int(len(tokens)), "documents": int(len(lengths)),
            "bin_sha256": hashlib.sha256(data).hexdigest(), "idx_sha256": hashlib.sha256(index).hexdigest()}
