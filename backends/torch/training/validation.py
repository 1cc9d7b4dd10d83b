"""Validation: the mean loss over the first `--val-batches` held-out batches, in eval mode.

Eval mode switches dropout off; the held-out batches are always the same
ones (data.py: `val_batches` is deterministic), so validation losses
of different steps and of resumed runs compare.
"""
from __future__ import annotations

import contextlib

import torch

from .batches import TokenShards
from ..lowering.lower import VGraphModule

__all__ = ["validation_loss"]


@torch.no_grad()
def validation_loss(module: VGraphModule, dataset: TokenShards, *, batch: int, max_batches: int,
                    device: torch.device, amp: contextlib.AbstractContextManager, costs: tuple[str, ...],
                    token_feeds: list[str], target_feeds: list[str]) -> float:
    """Sum of the `costs`, averaged over the samples of up to `max_batches` validation batches."""
    module.eval()
    total = 0.0
    count = 0
    try:
        for i, (inputs, targets) in enumerate(dataset.val_batches(batch)):
            if i >= max_batches:
                break
            feeds = {name: inputs.to(device) for name in token_feeds}
            feeds.update({name: targets.to(device) for name in target_feeds})
            with amp:
                out = module(feeds, want=costs)
            total += float(sum(out[c] for c in costs)) * inputs.shape[0]
            count += inputs.shape[0]
    finally:
        module.train()
    return total / max(count, 1)
