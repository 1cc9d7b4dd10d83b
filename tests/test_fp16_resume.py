"""Resuming a loss-scaled fp16 run continues it exactly: scale, skipped steps and weights.

The SIGKILL tests of :mod:`test_torch_resume` train in float32, where the GradScaler is disabled and
its state is never saved: a resume that forgot the scaler passed them all.  Here the tiny network runs
its fp16 policy (the `precision` pass for a Turing GPU: fp16 compute with dynamic loss scaling) under CPU
autocast, with an initial loss scale of 2^24 that forces overflows: the scaler skips steps 1, 2, 5 and 10
and halves its scale each time (the overflows on both sides of the resume point are what make the
scaler's state matter).  The oracle is the same run uninterrupted; a run stopped at step 6 and resumed
must agree with it bit for bit (deterministic kernels, one thread).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import TINY
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.train import TrainConfig, train

STEPS, STOP_AT = 12, 6
FP16_POLICY = "precision{target=cuda-sm75},fuse-heads,fuse-lm-head-ce"
FORCED_SCALE = 2.0**24  # far above what fp16 gradients of this network bear: overflows until it halves


def _config(corpus: Path, out: Path, cache: Path, steps: int, resume: bool = False) -> TrainConfig:
    return TrainConfig(network=TINY, data=str(corpus), steps=steps, batch=2, lr=3e-3, seed=3, out=out,
                       passes=FP16_POLICY, checkpoint_every=4, val_every=0, deterministic=True, threads=1,
                       progress=False, initial_loss_scale=FORCED_SCALE, cache_dir=cache, resume=resume)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def _halvings(rows: list[dict]) -> int:
    """Skipped steps read off the logged scale: each skip halves it (growth needs 2000 clean steps)."""
    scales = [FORCED_SCALE] + [r["loss_scale"] for r in rows]
    return sum(round(math.log2(a / b)) for a, b in zip(scales, scales[1:]) if b < a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp16")
    corpus = base / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    cache = base / "cache"
    whole = train(_config(corpus, base / "whole", cache, STEPS))
    first = train(_config(corpus, base / "split", cache, STOP_AT))
    second = train(_config(corpus, base / "split", cache, STEPS, resume=True))
    return whole, first, second


def test_the_forced_overflow_really_skips_steps_on_both_sides_of_the_resume(runs) -> None:
    whole, first, second = runs
    scales = [r["loss_scale"] for r in whole.history]
    assert len(scales) == STEPS and all(isinstance(s, float) for s in scales)  # loss scaling is on
    skipped = [r["step"] for r, before in zip(whole.history, [FORCED_SCALE, *scales]) if r["loss_scale"] < before]
    assert any(s <= STOP_AT for s in skipped) and any(s > STOP_AT for s in skipped), skipped
    assert whole.skipped_steps == len(skipped) == _halvings(whole.history)
    assert scales[-1] == FORCED_SCALE / 2**whole.skipped_steps


def test_fp16_resume_continues_scale_skips_and_weights_exactly(runs) -> None:
    whole, first, second = runs
    assert first.step == STOP_AT and second.step == STEPS
    # the premise: the second run resumed rather than training again from step 0 (its first rows, wall times
    # included, are the first run's)
    assert [(r["step"], r["elapsed_s"]) for r in second.history[:STOP_AT]] == \
        [(r["step"], r["elapsed_s"]) for r in first.history]
    # The scale after every step, and the losses, are those of the uninterrupted run.
    assert [(r["step"], r["loss"], r["loss_scale"]) for r in second.history] == \
        [(r["step"], r["loss"], r["loss_scale"]) for r in whole.history]
    assert first.skipped_steps + second.skipped_steps == whole.skipped_steps
    mine, theirs = _weights(second.checkpoint), _weights(whole.checkpoint)
    assert mine.keys() == theirs.keys() and mine
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def test_fp16_checkpoint_carries_the_scaler_state(runs) -> None:
    from vgraph.backends.torch.training import checkpoint as ckpt

    whole, first, _ = runs
    state = ckpt.load_checkpoint(first.checkpoint, map_location="cpu")
    saved = state.extra["grad_scaler"]
    assert saved["scale"] == first.history[-1]["loss_scale"] < FORCED_SCALE
