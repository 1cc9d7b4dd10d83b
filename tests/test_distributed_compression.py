"""`vgraph launch` with compression: what crosses the cuts and what the replicas all-reduce, on real workers.

* A pipeline through compress-boundary (int8 both ways, error feedback) is the same training as
  `vgraph train` through the same passes, which computes the wire round trips in one process: losses and
  validation at rtol 1e-5, final weights and optimizer state as weights_util.py allows.  The workers put
  int8 codes and float32 scales on the wire, and the bytes they count equal the cost model's prediction.
* PowerSGD replicas (--grad-compress) send, after the plain first steps, exactly the bytes the step cost
  model predicts from the gradients' shapes (vgraph/cost/grad_compression.py), far fewer than a plain all-reduce.
* A compressed run killed mid-way resumes exactly: the error-feedback residuals of the boundary and every
  replica's PowerSGD state (error buffers, warm-start factors, step counter, generator) are in the checkpoint.
Tiny network (dim 32, fp32), few steps: these start real worker processes.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch, place, split_pipeline
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import load_fleet

from conftest import FIXTURES
from test_distributed import run_and_kill
from weights_util import assert_same_weights

pytestmark = pytest.mark.slow
STEPS, BATCH, MICRO, LR, SEED = 6, 8, 4, 1e-3, 7
COMPRESS = "compress-boundary{error_feedback=true}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("compressed")
    g = transformer(TransformerSpec("tiny-compressed", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                    head_up=64, precision=None))
    vgraph.save(g, d / "net.yml")
    need = cost_model(g, batch=BATCH, micro_batches=MICRO).totals()["memory_bytes"]
    for k in (2, 4):  # PNodes that hold 80% of the network each: two stages
        (d / f"fleet{k}.yml").write_text(f"name: f{k}\npnodes:\n" + "".join(
            f"  - {{id: w{i}, memory: {int(0.8 * need)}, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n"
            for i in range(k)))
    (d / "wide2.yml").write_text("name: wide\npnodes:\n" + "".join(  # each holds the network: replicas
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return d


def common(files: Path, **more) -> dict:
    return {**dict(network=str(files / "net.yml"), data=str(files / "corpus.txt"), steps=STEPS, batch=BATCH, lr=LR,
                   seed=SEED, val_every=3, checkpoint_every=2, threads=1, progress=False), **more}


def planned(files: Path, fleet: Path, replicas: int) -> dict:
    """placement.json of the uncompressed run of these settings, as `vgraph launch` would place it."""
    before, partition, after = split_pipeline(None, True, {"batch": str(BATCH), "micro_batches": str(MICRO),
                                                           "replicas": str(replicas)})
    return place(vgraph.load(files / "net.yml"), load_fleet(fleet), before=before, partition=partition, after=after,
                 target="cpu", batch=BATCH, micro_batches=MICRO).report


def losses(rows) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in rows], dtype=torch.float64)


# How far two runs of the same training through int8 cuts may drift apart, from the computation (issue 41).
# The launch runs micro-batches of 2 where `vgraph train` runs the batch of 8 at once: other matmul shapes,
# another summation order, so values differ in their last bits (weights_util's per-step rounding bound).
# Before the wire such a value is divided by its token's scale and rounded to an int8 code; one that lies
# within an ulp of a rounding boundary (x / scale = k + 0.5) may round the other way on one side, and its
# dequantized value then moves by a whole quantum, scale = max |x_token| / 127: at most 1/127 of its token's
# largest value.  (A 2-stage cut carries 8 x 16 x 32 values each way a step, each within ~1e-5 of a code of
# a boundary: about one flip a run; an AMD EPYC flipped one at step 6, the Intel Xeons' runs stayed within
# the rounding bound.)  The
# gradients crossing back are linear in what crossed, so a flip changes a weight's gradient by at most
# FLIP of its largest term, to first order; Adam's moments (means of gradients and their squares) move by
# FLIP (2 FLIP) of their largest value, and its normalised update lr m / sqrt(v), at most ADAM_MAX_STEP x lr
# an element, by 2 FLIP of that, every step after: weights_util's `flips`.  An unflipped run stays within
# the rounding bound (1e-6 of each tensor's scale at steps 2 and 4 here); a wrong boundary moves tensors by
# far more than 1/127 (a sign, a scale, a dropped residual).
FLIP = 1 / 127


def test_a_compressed_pipeline_trains_like_one_process_and_sends_the_predicted_bytes(files, tmp_path):
    fleet = files / "fleet2.yml"
    ref = train(TrainConfig(**common(files), out=tmp_path / "ref", passes=(
        f"dead-nodes,precision,partition{{fleet={fleet},batch={BATCH},micro_batches={MICRO},replicas=1}},"
        f"{COMPRESS},fuse-heads,fuse-lm-head-ce")))
    run = launch(LaunchConfig(**common(files), out=tmp_path / "run", fleet=str(fleet), micro_batches=MICRO,
                              passes=f"dead-nodes,precision,partition,{COMPRESS},fuse-heads,fuse-lm-head-ce"))
    assert run.attempts[0]["ranks"] == ["w0", "w1"]
    torch.testing.assert_close(losses(run.history), losses(ref.history), rtol=1e-5, atol=0)
    val = [r["val_loss"] for r in run.history if "val_loss" in r]
    torch.testing.assert_close(torch.tensor(val), torch.tensor([r["val_loss"] for r in ref.history
                                                                if "val_loss" in r]), rtol=1e-5, atol=0)
    last = f"step-{STEPS:08d}"
    assert_same_weights(tmp_path / "run" / last, tmp_path / "ref" / last, steps=STEPS, lr=LR, flips=FLIP)
    # The wire: every cut edge leaves a compress VNode; the bytes counted are the prediction, every step.
    cuts = run.placement["cut_edges"]
    assert cuts and all(c["from"].startswith("compress__") for c in cuts)
    predicted = run.placement["cut_bytes_per_step"]
    assert {r["boundary_bytes"] for r in run.history} == {predicted}
    assert predicted < 0.3 * planned(files, fleet, replicas=1)["cut_bytes_per_step"]  # int8 + a float32 a token
    # Both runs checkpoint the same error-feedback residuals (rows of the global batch), the network as given.
    saved = load_checkpoint(tmp_path / "run" / last).extra["compression"]["boundary"]
    ref_saved = load_checkpoint(tmp_path / "ref" / last).extra["compression"]["boundary"]
    assert set(saved) == set(ref_saved) == {c["from"] for c in cuts}
    for key in saved:
        torch.testing.assert_close(saved[key], ref_saved[key], rtol=0, atol=1e-5)
    assert (tmp_path / "run" / "network.yml").read_text() == (files / "net.yml").read_text()
    # One micro-batch: every stage runs train's ops on the same shapes in the same order, so no value can land
    # on the other side of a rounding boundary and the two trainings are the same bit for bit.
    same = launch(LaunchConfig(**common(files, steps=2, val_every=0), out=tmp_path / "same", fleet=str(fleet),
                               micro_batches=1,
                               passes=f"dead-nodes,precision,partition,{COMPRESS},fuse-heads,fuse-lm-head-ce"))
    assert same.placement["cut_edges"] == cuts  # the premise: the same cut
    assert [r["loss"] for r in same.history] == [r["loss"] for r in ref.history[:2]]
    assert_same_weights(tmp_path / "same" / "step-00000002", tmp_path / "ref" / "step-00000002", bitwise=True)
    first = load_checkpoint(tmp_path / "same" / "step-00000002").extra["compression"]["boundary"]
    ref_first = load_checkpoint(tmp_path / "ref" / "step-00000002").extra["compression"]["boundary"]
    assert first.keys() == ref_first.keys() and all(torch.equal(first[k], ref_first[k]) for k in first)


def test_powersgd_replicas_send_the_predicted_bytes(files, tmp_path):
    run = launch(LaunchConfig(**common(files, steps=4), out=tmp_path / "run", fleet=str(files / "wide2.yml"),
                              micro_batches=MICRO, replicas=2, grad_compress="powersgd:rank=2,start=2"))
    placement = run.placement
    assert placement["replicas"] == 2 and placement["grad_compress"] == "powersgd:rank=2;start=2"
    sent = [r["boundary_bytes"] for r in run.history]
    plain = planned(files, files / "wide2.yml", replicas=2)["bytes_per_step"]  # the same plan, all-reduced whole
    assert sent[:2] == [plain] * 2  # the first `start` steps all-reduce plainly (the workers' count)
    assert sent[2:] == [placement["bytes_per_step"]] * 2  # then the factors: as the cost model says
    assert placement["bytes_per_step"] < 0.5 * plain


def test_a_killed_compressed_run_resumes_exactly(files, tmp_path):
    """Boundary error feedback and PowerSGD (plain for 2 steps, then compressing) on 2 stages x 2 replicas;
    w0 is killed after step 5 (the checkpoint is step 4): the restart replays step 5 from the checkpoint's
    compression state."""
    config = dict(common(files, checkpoint_every=4, val_every=0), fleet=str(files / "fleet4.yml"),
                  micro_batches=MICRO, replicas=2, grad_compress="powersgd:rank=2",
                  passes=f"dead-nodes,precision,partition,{COMPRESS},fuse-heads,fuse-lm-head-ce")
    whole = launch(LaunchConfig(**config, out=tmp_path / "whole"))
    killed = run_and_kill(LaunchConfig(**config, out=tmp_path / "killed", hold=("w0", 5)), "w0")
    assert killed.restarts == 1 and whole.placement["replicas"] == 2 and whole.placement["cut_edges"]
    # the premise: the restart resumed from step 4 (its checkpoint was written before the victim held after
    # step 5 and never again), rather than training again from step 0
    held = tmp_path / "killed" / "launch" / "held-w0"
    assert (tmp_path / "killed" / "step-00000004").stat().st_mtime_ns <= held.stat().st_mtime_ns
    torch.testing.assert_close(losses(killed.history), losses(whole.history), rtol=1e-6, atol=0)
    last = f"step-{STEPS:08d}"
    assert_same_weights(tmp_path / "killed" / last, tmp_path / "whole" / last, steps=STEPS, lr=LR, bitwise=True)
    state = load_checkpoint(tmp_path / "killed" / "step-00000004").extra["compression"]
    assert state["boundary"] and all(float(r.abs().max()) > 0 for r in state["boundary"].values())
    assert sorted(state["powersgd"]) == [0, 1, 2, 3]  # every world rank's own error buffers
    assert all(s["error"] and s["p"] and s["iter"] == 4 for s in state["powersgd"].values())


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.yml")), ids=lambda p: p.stem)
def test_every_fixture_launches_compressed_like_it_trains(fixture, files, tmp_path):
    """The fixtures (tiny_2l in float16 autocast, tiny_1l_fp32) through int8 cuts on two workers."""
    need = cost_model(vgraph.load(fixture), batch=BATCH, micro_batches=2).totals()["memory_bytes"]
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: cut\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: {int(0.8 * need)}, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n"
        for i in range(2)))
    settings = dict(common(files, steps=3, val_every=0), network=str(fixture))
    ref = train(TrainConfig(**settings, out=tmp_path / "ref", passes=(
        f"dead-nodes,precision,partition{{fleet={fleet},batch={BATCH},micro_batches=2,replicas=1}},{COMPRESS}")))
    run = launch(LaunchConfig(**settings, out=tmp_path / "run", fleet=str(fleet), micro_batches=2,
                              passes=f"dead-nodes,precision,partition,{COMPRESS}"))
    assert len(run.attempts[0]["ranks"]) == 2 and run.placement["cut_edges"]
    torch.testing.assert_close(losses(run.history), losses(ref.history), rtol=1e-5, atol=0)
    assert {r["boundary_bytes"] for r in run.history} == {run.placement["cut_bytes_per_step"]}
