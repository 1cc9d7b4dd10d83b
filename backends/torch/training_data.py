"""What a run trains on: the tokenizer and the token streams, from `--data` or the embedded corpus.

One place for `vgraph train` and `vgraph launch`, so both see exactly the
same data.  A byte-level BPE of the network's vocabulary size is trained and
cached; networks with a vocabulary under 258 tokens (too small for
byte-level BPE) get a character-level tokenizer of their most frequent
characters instead (unknown characters map to `<|unk|>`).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import data as D
from .train_config import TrainConfig, TrainingError

__all__ = ["char_tokenizer", "build_tokenizer", "PreparedData", "prepare_data"]


def char_tokenizer(documents: list[str], vocab_size: int):
    """A character-level HF tokenizer of the `vocab_size - 3` most frequent characters.

    For networks whose vocabulary is too small for byte-level BPE (< 258):
    ids 0, 1, 2 are `<|endoftext|>`, `<|pad|>`, `<|unk|>`; every other
    character maps to `<|unk|>`.  Decoding concatenates characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [D.EOT_TOKEN, D.PAD_TOKEN, "<|unk|>"]
    if vocab_size < len(specials) + 1:
        raise TrainingError(f"vocab_size {vocab_size} is too small even for a character tokenizer")
    counts = Counter()
    for doc in documents:
        counts.update(doc)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch, _ in ranked:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return tokenizer


def build_tokenizer(documents: list[str], vocab_size: int, cache_dir: str | Path) -> tuple[Any, str]:
    """(tokenizer, kind): cached byte-level BPE when the vocabulary allows, else characters."""
    if vocab_size >= D.MIN_VOCAB_SIZE:
        return D.train_bpe_tokenizer(documents, vocab_size, cache_dir), "bpe"
    return char_tokenizer(documents, vocab_size), "char"


def _cache_dir(config: TrainConfig) -> Path:
    if config.cache_dir is not None:
        return Path(config.cache_dir)
    return Path(os.environ.get("VGRAPH_CACHE") or Path.home() / ".cache" / "vgraph")


@dataclass
class PreparedData:
    dataset: "D.TokenDataset"
    tokenizer: Any
    tokenizer_kind: str  # "bpe" | "char"
    description: str  # where the text came from, for the run info and the log


def prepare_data(config: TrainConfig, vocab: int, seq_len: int) -> PreparedData:
    """The tokenizer and token streams a run trains on: one place for `vgraph train` and `vgraph launch`,
    so both see exactly the same data."""
    documents, description = _documents(config)
    tokenizer, kind = build_tokenizer(documents, vocab, _cache_dir(config))
    if tokenizer.get_vocab_size() > vocab:
        raise TrainingError(f"tokenizer has {tokenizer.get_vocab_size()} tokens but the network's "
                            f"vocabulary is {vocab}")
    try:
        dataset = D.TokenDataset(documents, tokenizer, seq_len=seq_len)
    except D.DataError as exc:
        raise TrainingError(f"training data ({description}): {exc}") from None
    return PreparedData(dataset, tokenizer, kind, description)


def _documents(config: TrainConfig) -> tuple[list[str], str]:
    try:
        if config.data:
            return D.load_text_documents(config.data), str(config.data)
        return D.default_corpus_documents(config.corpus_bytes), f"default corpus ({config.corpus_bytes} bytes)"
    except D.DataError as exc:
        raise TrainingError(f"training data: {exc}") from None

