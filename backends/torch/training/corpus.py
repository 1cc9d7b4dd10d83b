"""What a run trains on: a prepared corpus (`--data DIR`), text given to `--data`, or the embedded corpus.

One place for `vgraph train` and `vgraph launch`, so both see exactly the
same data, and one path for all three: text and the embedded corpus are
prepared by the same `vgraph data prepare` machinery into the on-disk cache
(vgraph/data/cache.py), and every run reads token shards through memory
maps (data.py).  A prepared directory is checked against its manifest,
hashes included, before the first step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from vgraph.data.cache import cached, embedded_recipe, files_recipe
from vgraph.data.shards import DataError, PreparedCorpus, is_prepared, open_prepared
from vgraph.data.tokenizer import tokenizer_from_json

from .batches import TokenShards
from .config import TrainConfig, TrainingError

__all__ = ["PreparedData", "prepare_data", "open_corpus"]


@dataclass
class PreparedData:
    dataset: TokenShards
    tokenizer: Any
    tokenizer_kind: str  # "bpe" | "char" | "given"
    description: str  # where the text came from, for the run info and the log
    digest: str  # SHA-256 of the corpus's manifest: which exact corpus a run read
    content_digest: str  # SHA-256 of its tokens and tokenizer, whatever built them (PreparedCorpus.content_digest)

    def run_fields(self) -> dict[str, str]:
        """What run.json and every checkpoint record of the data (`vgraph train` and `vgraph launch` alike); a
        resume compares them (run_checkpoints.changed_identity)."""
        return {"data": self.description, "data_digest": self.digest, "data_content": self.content_digest,
                "tokenizer": self.tokenizer_kind}


def open_corpus(config: TrainConfig, vocab: int, say: Callable[[str], None]) -> tuple[PreparedCorpus, str]:
    """(the prepared corpus, its description) for `config.data`: see the module docstring.  Every way opens
    it verified in full, so it carries its tokenizer's text as checked (`PreparedCorpus.tokenizer_json`)."""
    t0 = time.perf_counter()
    if config.data and is_prepared(config.data):
        corpus = open_prepared(config.data, verify="full")
        say(f"data: prepared corpus {config.data} checked against its manifest ({time.perf_counter() - t0:.2f} s)")
        return corpus, str(config.data)
    recipe = files_recipe([str(config.data)], vocab) if config.data else embedded_recipe(config.corpus_bytes, vocab)
    return (cached(recipe, say, config.cache_dir),
            str(config.data) if config.data else f"default corpus ({config.corpus_bytes} bytes)")


def prepare_data(config: TrainConfig, vocab: int, seq_len: int, say: Callable[[str], None] = lambda m: None
                 ) -> PreparedData:
    """The tokenizer and token shards a run trains on; a DataError becomes the run's TrainingError."""
    try:
        corpus, description = open_corpus(config, vocab, say)
        dataset = TokenShards(corpus, seq_len=seq_len, vocab=vocab, seed=config.seed)
        tokenizer = tokenizer_from_json(corpus.tokenizer_json, str(corpus.tokenizer_path))  # read once, checked
    except DataError as exc:
        raise TrainingError(f"training data: {exc}") from None
    if corpus.vocab_size < vocab:
        say(f"note: the tokenizer has {corpus.vocab_size} tokens, the network's vocabulary {vocab}: ids "
            f"{corpus.vocab_size}..{vocab - 1} are never fed")
    kind = str(corpus.manifest["tokenizer"].get("kind", "given"))
    return PreparedData(dataset, tokenizer, kind, description, corpus.digest, corpus.content_digest)
