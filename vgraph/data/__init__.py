"""Training text as token shards: prepare a corpus once, read a window at a time (no torch here).

Why a package of its own: a corpus of tens of gigabytes cannot be read into
memory and tokenized again by every run and every worker.  `vgraph data
prepare` (command.py, prepare.py) tokenizes it once, in parallel processes,
into raw little-endian token shards with an index of document boundaries and
a manifest (shards.py: the format, its writer and its checked reader);
training reads windows of the shards (`shards.ShardFile`, no memory map: see why there) and draws its samples as a
pure function of (seed, step) (sampler.py).  The embedded corpus (the
standard library's docstrings, stdlib_corpus.py) and text given to `--data`
go through the same prepare, into an on-disk cache (cache.py).

Nothing here imports torch (the backends convert windows to tensors), so the
command starts fast and its worker processes stay small.
"""
from __future__ import annotations

from vgraph.data.shards import DataError

__all__ = ["DataError"]
