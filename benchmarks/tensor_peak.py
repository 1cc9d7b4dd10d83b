"""The tensor peak of a block of torch code: what bench_memory.py and bench_remat.py measure.

A TorchDispatchMode sees every tensor any aten op allocates inside the
block (forward, backward, optimizer) and follows each storage until it is
freed (a weakref finalizer on the storage), so `peak` is the block's
allocation peak above what existed before it, independent of the C
allocator's caching.  Views and in-place ops allocate nothing and are
skipped.  It also records the largest tensor, overall and among those whose
last dimension is `vocab` (the proof that a fused loss never forms logits).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    def __init__(self, vocab: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self.largest: tuple[int, tuple[int, ...]] = (0, ())
        self.largest_vocab: tuple[int, tuple[int, ...]] = (0, ())

    def _freed(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out  # aliases of existing storage: nothing new is allocated
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape))
            if self.vocab and t.dim() and t.shape[-1] == self.vocab and t.numel() > self.largest_vocab[0]:
                self.largest_vocab = (t.numel(), tuple(t.shape))
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self.live:
                continue
            self.live[ptr] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, ptr)
        return out
