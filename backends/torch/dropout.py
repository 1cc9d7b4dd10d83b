"""Keyed dropout: masks that depend on (seed, step, VNode, sample), never on how a batch is cut.

Why: a partitioned run (`vgraph launch`) computes a step as several
micro-batches on several processes, in an order the pipeline schedule picks.
Dropout drawn from the global RNG would then see a different stream than the
single-process trainer, and the two runs would stop being the same training.
With a key set, the mask of sample `i` of a step is drawn from a generator
seeded by hash(seed, step, VNode id, i) alone, so

* a micro-batch holding samples `offset .. offset+b-1` draws exactly the rows
  the whole batch would have drawn for them (the trainers say which samples
  a call holds with `offset`);
* nothing depends on the global RNG, so a resumed run replays the same masks
  without restoring any RNG state.

The key is per thread (`set_dropout_key` / `clear_dropout_key` or the
`dropout_key` context manager).  Without a key, dropout falls back to
`torch.nn.functional.dropout` on the global RNG, which is what a module called
outside a trainer does.

Cost: one `manual_seed` and one in-place `uniform_` per sample, the same
random numbers in all as `F.dropout` draws; the keep mask is stored for
backward as a scaled multiplier (x * mask / (1 - p)).
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["DropoutKey", "set_dropout_key", "clear_dropout_key", "current_dropout_key", "dropout_key",
           "keyed_dropout", "sample_seed"]


@dataclass(frozen=True)
class DropoutKey:
    """What a dropout mask is a function of, besides the VNode id and the sample's place."""

    seed: int
    step: int
    offset: int = 0  # global index of the first sample of the batch being computed


_STATE = threading.local()
_GENERATORS: dict[torch.device, torch.Generator] = {}


def set_dropout_key(seed: int, step: int, offset: int = 0) -> None:
    _STATE.key = DropoutKey(int(seed), int(step), int(offset))


def clear_dropout_key() -> None:
    _STATE.key = None


def current_dropout_key() -> DropoutKey | None:
    return getattr(_STATE, "key", None)


@contextmanager
def dropout_key(seed: int, step: int, offset: int = 0) -> Iterator[DropoutKey]:
    """Dropout inside the block is keyed; the previous key (or none) comes back afterwards."""
    previous = current_dropout_key()
    set_dropout_key(seed, step, offset)
    try:
        yield current_dropout_key()  # type: ignore[misc]
    finally:
        _STATE.key = previous


def sample_seed(seed: int, step: int, node: str, sample: int) -> int:
    """The generator seed of one sample's mask at one dropout VNode in one step."""
    digest = hashlib.blake2b(f"{seed}:{step}:{node}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(device: torch.device) -> torch.Generator:
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device)
    return gen


def keyed_dropout(x: torch.Tensor, p: float, node: str) -> torch.Tensor:
    """Training-mode dropout of `x` ([batch, ...]) at VNode `node`, keyed if a key is set."""
    key = current_dropout_key()
    if key is None:
        return F.dropout(x, p=p, training=True)
    if p >= 1.0:
        return x * 0.0
    noise = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    gen = _generator(noise.device)
    for j in range(x.shape[0]):
        gen.manual_seed(sample_seed(key.seed, key.step, node, key.offset + j))
        noise[j].uniform_(0.0, 1.0, generator=gen)
    # noise >= p keeps with probability 1 - p; the survivors are scaled like F.dropout does.
    scale = noise.ge_(p).mul_(1.0 / (1.0 - p))
    return x * scale.to(x.dtype)
