"""`vgraph launch` with fp16 loss scaling: replicas, resume and the single-process trainer (issues 25, 27).

The tiny network runs its fp16 policy (the `precision` pass for a Turing GPU: fp16 compute with dynamic
loss scaling) under CPU autocast, on two replicas of one PNode each (batch 4, shares 2 + 2).

* With an initial loss scale of 2^24 the scaler overflows and skips some of the first steps (halving its
  scale; which ones depends on the data the steps draw, so the test reads them from the run and requires
  skipped and stepped steps both before the resume point).  Two replicas must then be *bit for bit* one
  worker fed the same micro-batches (2 samples each): fp16 rounds a batch's gradient sum differently when
  the batch is cut differently, so the same cut is the exact oracle, and it includes every skip decision,
  the scale, the growth tracker and Adam's state.  Every replica holds the same weights and optimizer
  state at every checkpoint (weights_util.replicas_recorded).
* A launch stopped after step 5 and resumed to step 7 is bit for bit the uninterrupted launch: the scale
  (halved before the resume; forgetting it would overflow again at 2^24) and the growth tracker (the good
  steps since the last skip, at least 1 at the resume; forgetting it would end 2 lower) come back from the
  checkpoint.
* Against `vgraph train` (one process, the whole batch at once) at a scale that never overflows: the
  same losses and validation losses (rtol 1e-5).  Weights are not compared there: fp16 rounds the
  gradient of 4 samples at once differently from two sums of 2, and Adam turns that into differences no
  tolerance separates from a bug; the same-cut comparison above is the one that can be exact.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from weights_util import assert_replicas_identical, assert_same_weights, replicas_recorded

STEPS, STOP_AT = 7, 5
FP16_POLICY = "precision{target=cuda-sm75},fuse-heads,fuse-lm-head-ce"
FORCED_SCALE = 2.0**24  # overflows until halved (skips steps 1 and 4 here)


def _fleet(k: int) -> str:
    return f"name: f{k}\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(k))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch_fp16")
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    for k in (1, 2):
        (d / f"fleet{k}.yml").write_text(_fleet(k))
    common = dict(network=str(TINY), data=str(d / "corpus.txt"), steps=STEPS, batch=4, lr=3e-3, seed=3,
                  passes=FP16_POLICY, checkpoint_every=STOP_AT, val_every=0, threads=1, progress=False,
                  initial_loss_scale=FORCED_SCALE, deterministic=True)
    return d, common


def _replicas(d: Path, common: dict, out: str, **over) -> object:
    return launch(LaunchConfig(**{**common, **over}, out=d / out, fleet=str(d / "fleet2.yml"), micro_batches=1,
                               replicas=2))


@pytest.fixture(scope="module")
def whole(setup):
    d, common = setup
    with replicas_recorded(d / "replicas"):
        run = _replicas(d, common, "whole")
    assert assert_replicas_identical(d / "replicas", 2) == 2  # checkpoints 5 and 7
    return run


def _skipped(history) -> list[int]:
    """Steps the scaler skipped: a step logs the scale after its update, halved on an overflow."""
    scales = [FORCED_SCALE] + [r["loss_scale"] for r in history]
    return [r["step"] for r, before in zip(history, scales) if r["loss_scale"] < before]


def _tracker(history, step: int) -> int:
    """GradScaler's growth tracker after `step`: the good steps since the last skip (no growth in 2000)."""
    return step - max([s for s in _skipped(history) if s <= step], default=0)


def _scaler(run: Path) -> dict:
    return load_checkpoint(run / f"step-{STEPS:08d}", map_location="cpu").extra["grad_scaler"]


def test_two_replicas_are_one_worker_fed_the_same_micro_batches(setup, whole) -> None:
    d, common = setup
    assert whole.placement["batch_shares"] == [2, 2] and whole.placement["replicas"] == 2
    scales = [r["loss_scale"] for r in whole.history]
    skipped = _skipped(whole.history)
    assert 1 in skipped and len(skipped) < STOP_AT  # both paths seen before the resume point
    assert scales == [FORCED_SCALE * 0.5 ** sum(s <= r["step"] for s in skipped) for r in whole.history]
    one = launch(LaunchConfig(**common, out=d / "one", fleet=str(d / "fleet1.yml"), micro_batches=2, replicas=1))
    assert [r["loss_scale"] for r in one.history] == scales
    torch.testing.assert_close(torch.tensor([r["loss"] for r in whole.history], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in one.history], dtype=torch.float64), rtol=1e-6, atol=0)
    assert_same_weights(d / "whole" / f"step-{STEPS:08d}", d / "one" / f"step-{STEPS:08d}", bitwise=True)
    assert _scaler(d / "whole") == _scaler(d / "one")


def test_a_resumed_fp16_launch_is_the_uninterrupted_one(setup, whole) -> None:
    d, common = setup
    first = _replicas(d, common, "split", steps=STOP_AT)
    saved = load_checkpoint(d / "split" / f"step-{STOP_AT:08d}", map_location="cpu").extra["grad_scaler"]
    assert saved["scale"] == whole.history[STOP_AT - 1]["loss_scale"] < FORCED_SCALE  # what a resume must restore
    assert saved["_growth_tracker"] == _tracker(whole.history, STOP_AT) >= 1
    second = _replicas(d, common, "split", resume=True)
    assert [r["step"] for r in second.history] == list(range(1, STEPS + 1)) and first.step == STOP_AT
    # the premise: the second run resumed (its first rows are the first run's, wall times included; a run that
    # started over would have timed them again), so the equalities below are the restored state's doing
    assert [(r["step"], r["elapsed_s"]) for r in second.history[:STOP_AT]] == \
        [(r["step"], r["elapsed_s"]) for r in first.history]
    assert [(r["step"], r["loss"], r["loss_scale"]) for r in second.history] == \
        [(r["step"], r["loss"], r["loss_scale"]) for r in whole.history]
    assert _scaler(d / "split") == _scaler(d / "whole")
    assert _scaler(d / "whole")["_growth_tracker"] == _tracker(whole.history, STEPS) >= 2
    assert_same_weights(d / "split" / f"step-{STEPS:08d}", d / "whole" / f"step-{STEPS:08d}", bitwise=True)


def test_fp16_replicas_have_the_losses_of_the_single_process_trainer(setup) -> None:
    d, common = setup
    calm = {**common, "initial_loss_scale": 256.0, "val_every": STEPS}  # no overflow on either side
    ref = train(TrainConfig(**calm, out=d / "train")).history
    run = _replicas(d, calm, "calm").history
    assert all(r["loss_scale"] == 256.0 for r in run)
    for key in ("loss", "val_loss"):
        got = [r[key] for r in run if key in r]
        want = [r[key] for r in ref if key in r]
        assert len(got) == len(want) > 0
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=0)
