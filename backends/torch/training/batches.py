"""Token batches for the PyTorch backend, read from a prepared corpus (vgraph.data) a window at a time.

`TokenShards` is what a run trains on: the training batch of step s (or a
replica's share of it) is the samples `vgraph.data.sampler.step_samples`
names for (seed, s), read from the train shards (`ShardFile.read`) into int64
tensors; validation batches are consecutive windows of the val split, the
same on every run.  Nothing here holds the corpus in memory and nothing is
state: a resumed run reads exactly what an uninterrupted one would.

The corpus itself (prepare, cache, the embedded standard-library corpus) is
torch-free and lives in the core (vgraph/data/); its names are re-exported
here for the backend's callers.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from vgraph.data.sampler import sample_count, step_samples
from vgraph.data.shards import DataError, PreparedCorpus
from vgraph.data.stdlib_corpus import DEFAULT_CORPUS_MAX_BYTES, default_corpus_documents
from vgraph.data.tokenizer import EOT_TOKEN, MIN_BPE_VOCAB, PAD_TOKEN, SPECIAL_TOKENS

__all__ = ["DataError", "EOT_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "MIN_BPE_VOCAB", "DEFAULT_CORPUS_MAX_BYTES",
           "default_corpus_documents", "TokenShards"]


class TokenShards:
    """Training and validation batches of `seq_len` tokens from `corpus`, for a network of `vocab` tokens.

    Refuses, before the first step, a corpus whose tokenizer is larger than
    the network's vocabulary or whose splits are shorter than one window; a
    token id outside the vocabulary met in a batch (a shard edited after its
    manifest was hashed) is a DataError naming the shard.
    """

    def __init__(self, corpus: PreparedCorpus, *, seq_len: int, vocab: int, seed: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive; got {seq_len}")
        self.corpus, self.seq_len, self.vocab, self.seed = corpus, seq_len, vocab, seed
        where = corpus.root
        if corpus.vocab_size > vocab:
            raise DataError(f"{where}: prepared with a tokenizer of {corpus.vocab_size} tokens, but the network's "
                            f"vocabulary is {vocab}: prepare it with --vocab {vocab} or a tokenizer of at most "
                            f"{vocab} tokens")
        for name, split in (("train", corpus.train), ("val", corpus.val)):
            if split.tokens < seq_len + 1:
                raise DataError(f"{where}: the {name} split has {split.tokens} tokens, fewer than one window of "
                                f"seq_len + 1 = {seq_len + 1}")
        self.samples = sample_count(corpus.train.tokens, seq_len)

    @property
    def train_tokens(self) -> int:
        return self.corpus.train.tokens

    @property
    def val_tokens(self) -> int:
        return self.corpus.val.tokens

    def sample_ids(self, step: int, batch: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The train samples of positions lo..hi-1 of step `step`'s global batch of `batch`."""
        return step_samples(self.seed, step, batch, self.samples, lo, hi)

    def batch(self, step: int, batch: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [hi - lo, seq_len] int64: positions lo..hi-1 of step `step`'s batch."""
        ids = self.sample_ids(step, batch, lo, hi)
        return self._windows(self.corpus.train, ids * self.seq_len)

    def val_batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Consecutive, non-overlapping validation windows, `batch` at a time (the last batch may be short):
        every validation token is scored once, in the same order on every run."""
        if batch <= 0:
            raise ValueError(f"batch must be positive; got {batch}")
        count = sample_count(self.corpus.val.tokens, self.seq_len)
        for first in range(0, count, batch):
            starts = np.arange(first, min(first + batch, count), dtype=np.int64) * self.seq_len
            yield self._windows(self.corpus.val, starts)

    def _windows(self, split, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([split.window(int(s), self.seq_len + 1) for s in starts]) if len(starts) else \
            np.zeros((0, self.seq_len + 1), dtype=np.int64)
        if rows.size and int(rows.max()) >= self.vocab:
            bad = int(starts[int(np.argmax(rows.max(axis=1)))])
            raise DataError(f"{self.corpus.root / split.shard_of(bad)}: token id {int(rows.max())} is outside the "
                            f"network's vocabulary of {self.vocab} (the shard changed after it was prepared?)")
        windows = torch.from_numpy(rows)
        return windows[:, :-1], windows[:, 1:]

    def __repr__(self) -> str:
        return (f"TokenShards({self.corpus.root}, train={self.train_tokens}, val={self.val_tokens}, "
                f"samples={self.samples}, seq_len={self.seq_len})")
