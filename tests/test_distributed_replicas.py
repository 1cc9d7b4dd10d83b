"""`vgraph launch` with data-parallel replicas: 2 stages x 2 replicas on four equal PNodes train like one
process at the same global batch (losses, and the final weights and optimizer state, weights_util.py), the
workers' bytes (the all-reduce's by the ring formula included) equal placement.json's prediction, a lost worker costs only its replica (--on-failure shrink), and two launchers on one host
(--nnodes 2) run the replicas together.  Tiny network, few steps: these run real worker processes."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from ports import launch_port
import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch, main as launch_main
from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import cost_model
from vgraph.cost.remat import RECOMPUTE, candidates, closed

from test_distributed import run_and_kill  # SIGKILLs a held worker from here: one helper for both
from ranks_util import run_ranks
from weights_util import assert_replicas_identical, assert_same_weights, replicas_recorded

STEPS, BATCH, MICRO, LR, SEED = 6, 8, 8, 1e-3, 5


def tiny():
    return transformer(TransformerSpec("tiny-replicas", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                       head_up=64, precision=None))  # fp32, dropout 0.1 on


def recomputing(g):
    """`g` with every remat candidate marked `remat: recompute` (the blocks' interiors, dropout included)."""
    cm = cost_model(g, batch=2)
    for node_id in closed(g, [c for cs in candidates(g, cm, list(g.node_ids()), {}).values() for c in cs]):
        g.node(node_id).set_config(remat=RECOMPUTE)
    return g


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    g = tiny()
    vgraph.save(g, d / "net.yml")
    vgraph.save(recomputing(tiny()), d / "net_remat.yml")
    # Four equal PNodes that each hold 80% of the network (with one sample's activations): a pipeline of 2
    # stages, 2 replicas of it; with M = 8 a stage keeps 2 samples however large its share.
    need = cost_model(g, batch=BATCH, micro_batches=MICRO).totals()["memory_bytes"]
    (d / "fleet4.yml").write_text("name: four\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: {int(0.8 * need)}, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n"
        for i in range(4)))
    (d / "wide2.yml").write_text("name: wide\npnodes:\n" + "".join(  # each holds the network: 2 replicas of it
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return d


def common(files: Path) -> dict:
    return dict(network=str(files / "net.yml"), data=str(files / "corpus.txt"), steps=STEPS, batch=BATCH, lr=LR,
                seed=SEED, val_every=3, checkpoint_every=2, threads=1, progress=False)


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    return train(TrainConfig(**common(files), out=tmp_path_factory.mktemp("ref") / "run"))


def same_training(rows, reference, run_dir: Path | None = None) -> None:
    """Same losses and validation as `vgraph train` (rtol 1e-5), and, given the run directory, the same
    final weights and optimizer state (weights_util.py: within what Adam's rounding justifies)."""
    ref = reference.history
    if run_dir is not None:
        assert_same_weights(run_dir / f"step-{STEPS:08d}", reference.run_dir / f"step-{STEPS:08d}", steps=STEPS,
                            lr=LR)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step logged exactly once
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in ref], dtype=torch.float64), rtol=1e-5, atol=0)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    torch.testing.assert_close(torch.tensor(val), torch.tensor([r["val_loss"] for r in ref if "val_loss" in r]),
                               rtol=1e-5, atol=0)


def test_two_stages_by_two_replicas_train_like_one_process(files, reference, tmp_path):
    with replicas_recorded(tmp_path / "replicas"):
        result = launch(LaunchConfig(**common(files), out=tmp_path / "run", fleet=str(files / "fleet4.yml"),
                                     micro_batches=MICRO, replicas=2))
    assert assert_replicas_identical(tmp_path / "replicas", 2) == 3  # checkpoints 2, 4, 6: every replica alike
    pl = result.placement
    assert pl["replicas"] == 2 and len(pl["replica_pnodes"][0]) == 2 and sorted(pl["batch_shares"]) == [4, 4]
    assert sorted(result.attempts[0]["ranks"]) == ["w0", "w1", "w2", "w3"]
    same_training(result.history, reference, tmp_path / "run")
    # Bytes the workers counted (boundary tensors both ways, ring all-reduce) == the prediction, every step.
    assert pl["allreduce_bytes_per_step"] > 0
    assert {r["boundary_bytes"] for r in result.history} == {pl["bytes_per_step"]}
    # ... and per PNode, on the same basis: what it sent, its share of the ring included (the ring's chunks
    # differ by at most an element between members, so a member's count may differ by a few bytes).
    for row in result.history:
        for pnode, figures in row["pnodes"].items():
            assert figures["bytes_sent"] == pytest.approx(pl["pnodes"][pnode]["bytes_sent_per_step"], abs=64)
    saved = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert saved["replica_pnodes"] == pl["replica_pnodes"] and saved["step_seconds"] == pl["step_seconds"]


def test_replicas_clip_the_norm_of_the_summed_gradient_like_one_process(files, tmp_path):
    """--grad-clip with 2 replicas: the norm is the summed gradient's, counted once (not once per replica, which
    would clip sqrt(2) too hard), so the run is `vgraph train --grad-clip` (weights and Adam's moments within
    weights_util's bound; a clip sqrt(2) off scales the first moments by 0.7).  The premise, that the clip bites
    every step (this network's gradient norm is about 0.03): then every step's gradient has norm
    clip x total / (total + 1e-6) with total >= clip, and Adam's second moments sum to
    (1 - b2) (b2^2 + b2 + 1) clip^2 within a factor (1 - 1e-6 / clip)^2; a step the clip spared would add
    its own smaller square instead."""
    clip, steps, beta2 = 1e-3, 3, 0.999
    settings = {**common(files), "steps": steps, "val_every": 0, "checkpoint_every": steps}
    ref = train(TrainConfig(**settings, grad_clip=clip, out=tmp_path / "ref"))
    run = launch(LaunchConfig(**settings, grad_clip=clip, out=tmp_path / "run", fleet=str(files / "wide2.yml"),
                              micro_batches=2, replicas=2))
    assert run.placement["replicas"] == 2 and sorted(run.attempts[0]["ranks"]) == ["w0", "w1"]
    last = f"step-{steps:08d}"
    squares = sum(float(s["exp_avg_sq"].double().sum())
                  for s in load_checkpoint(tmp_path / "ref" / last).optimizer_states.values())
    assert squares == pytest.approx((1 - beta2) * (beta2 ** 2 + beta2 + 1) * clip ** 2, rel=2 * 1e-6 / clip)
    assert_same_weights(tmp_path / "run" / last, tmp_path / "ref" / last, steps=steps, lr=LR)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in run.history], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in ref.history], dtype=torch.float64), rtol=1e-5, atol=0)


def test_a_lost_worker_costs_its_replica_not_the_run(files, reference, tmp_path):
    probe = launch(LaunchConfig(**{**common(files), "steps": 0}, out=tmp_path / "probe",
                                fleet=str(files / "fleet4.yml"), micro_batches=MICRO, replicas=2))
    rows = probe.placement["replica_pnodes"]
    victim = rows[1][-1]
    config = LaunchConfig(**common(files), out=tmp_path / "run", fleet=str(files / "fleet4.yml"),
                          micro_batches=MICRO, replicas=2, hold=(victim, 3), on_failure="shrink")
    result = run_and_kill(config, victim)
    first, second = result.attempts
    assert first["lost"] == [victim] and not first["ok"] and second["ok"]
    assert sorted(second["ranks"]) == sorted(rows[0])  # the survivors: replica 0's PNodes
    assert result.placement["replicas"] == 1 and result.placement["batch_shares"] == [BATCH]
    same_training(result.history, reference, tmp_path / "run")  # from the step-2 checkpoint, nothing twice


def test_two_launchers_on_one_host_run_the_replicas_together(files, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", "replicas-test-secret")  # several machines share a secret
    port = launch_port()
    results: dict = {}

    def node(rank: int) -> None:
        try:
            results[rank] = launch(LaunchConfig(
                **common(files), out=tmp_path / f"node{rank}", fleet=str(files / "fleet4.yml"), micro_batches=MICRO,
                replicas=2, nnodes=2, node_rank=rank, master_port=port))
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    lead = results[0]
    assert lead.placement["replicas"] == 2
    same_training(lead.history, reference)
    assert {r["boundary_bytes"] for r in lead.history} == {lead.placement["bytes_per_step"]}


def test_replica_options_are_checked(files, tmp_path, capsys):
    for bad in ("0", "-1", "two", "", "1e3"):
        with pytest.raises(SystemExit) as exc:
            launch_main(["launch", str(files / "net.yml"), "--fleet", str(files / "fleet4.yml"), "--replicas", bad,
                         "--out", str(tmp_path / "x")])
        assert exc.value.code == 2 and "--replicas" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "inf", "1e30", "", "abc", "25X", "0.5"):
        with pytest.raises(SystemExit) as exc:
            launch_main(["launch", str(files / "net.yml"), "--fleet", str(files / "fleet4.yml"), "--bucket-size", bad,
                         "--out", str(tmp_path / "x")])
        assert exc.value.code == 2 and "--bucket-size" in capsys.readouterr().err
    for bad in (0, -1, True, 1.5, "25M", 2**63):
        with pytest.raises(VGraphError, match="bucket-size must be"):
            launch(LaunchConfig(**common(files), out=tmp_path / "y", fleet=str(files / "fleet4.yml"), bucket_bytes=bad))
    with pytest.raises(VGraphError, match="replicas must be"):
        launch(LaunchConfig(**common(files), out=tmp_path / "y", fleet=str(files / "fleet4.yml"), replicas=0))
    with pytest.raises(VGraphError, match="repartition needs all workers on one machine"):
        launch(LaunchConfig(**common(files), out=tmp_path / "z", fleet=str(files / "fleet4.yml"), nnodes=2,
                            on_failure="repartition"))
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_a_placement_file_with_replicas_is_read_or_refused(tmp_path):
    from vgraph.backends.torch.distributed.launcher.launch import read_placement_layout

    good = {"assignment": {"a": "w0", "b": "w1"}, "replica_pnodes": [["w0", "w1"], ["w2", "w3"]],
            "batch_shares": [5, 3]}
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(good))
    assert read_placement_layout(path) == (good["assignment"], (good["replica_pnodes"], [5, 3]))
    path.write_text(json.dumps({**good, "replica_pnodes": [["w0", "w1"]], "batch_shares": [8]}))
    assert read_placement_layout(path) == (good["assignment"], None)  # one replica: the assignment says it all
    for bad in ({"batch_shares": [5]}, {"batch_shares": [5, "3"]}, {"replica_pnodes": [["w0"], [3]]},
                {"batch_shares": None}):
        path.write_text(json.dumps({**good, **bad}))
        with pytest.raises(VGraphError, match="not a placement"):
            read_placement_layout(path)


def test_unequal_replicas_train_on_unequal_shares_like_one_process(files, reference, tmp_path):
    """One PNode four times slower than the others: its replica takes less of the global batch.  Buckets of
    16 KiB: the stages' gradients go out in many buckets, launched from the backward hooks in one order.
    The blocks recompute their interiors (remat marks, dropout inside): replica 1's micro-batches start at
    sample offsets up to 7, and a recompute must draw those samples' masks again."""
    text = (files / "fleet4.yml").read_text().replace("flops: 1G", "flops: 2G", 3).replace("flops: 1G", "flops: 500M")
    (tmp_path / "mixed.yml").write_text(text.replace("name: four", "name: mixed"))
    with replicas_recorded(tmp_path / "replicas"):
        result = launch(LaunchConfig(**{**common(files), "network": str(files / "net_remat.yml")},
                                     out=tmp_path / "run", fleet=str(tmp_path / "mixed.yml"), micro_batches=MICRO,
                                     replicas=2, bucket_bytes=16_384))
    assert assert_replicas_identical(tmp_path / "replicas", 2) == 3
    shares = result.placement["batch_shares"]
    assert sum(shares) == BATCH and len(set(shares)) == 2
    same_training(result.history, reference, tmp_path / "run")
    assert {r["boundary_bytes"] for r in result.history} == {result.placement["bytes_per_step"]}


def test_a_restart_resumes_every_replica_from_the_checkpoint(files, reference, tmp_path):
    """--on-failure restart with replicas: rank 0 hands each world rank its plan rank's share."""
    config = LaunchConfig(**common(files), out=tmp_path / "run", fleet=str(files / "fleet4.yml"),
                          micro_batches=MICRO, replicas=2, hold=("w0", 3))
    result = run_and_kill(config, "w0")
    first, second = result.attempts
    assert first["lost"] == ["w0"] and second["ok"] and sorted(second["ranks"]) == ["w0", "w1", "w2", "w3"]
    assert result.placement["replicas"] == 2
    same_training(result.history, reference, tmp_path / "run")


def _layout_member(rank: int, port: int, sizes: list[int], out) -> None:
    import torch.distributed as dist

    from vgraph.backends.torch.distributed.runtime.replica_groups import (ReplicaLayoutError, check_same_layout,
                                                                  stage_groups)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        groups = stage_groups(replicas=2, plan_ranks=2)  # world rank r*2+s: stage s of replica r
        params = [torch.nn.Parameter(torch.zeros(sizes[rank]))]
        try:
            check_same_layout(groups[rank % 2], params)
            out.put((rank, "ok"))
        except ReplicaLayoutError as exc:
            out.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes, bad", [([3, 5, 3, 5], set()), ([3, 5, 3, 6], {1, 3})])
def test_stage_groups_check_that_replicas_hold_the_same_parameters(sizes, bad):
    results = run_ranks(_layout_member, 4, sizes)
    assert {r for r, msg in results.items() if msg != "ok"} == bad
    assert all("hold different parameters" in results[r] for r in bad)


def _agree_member(rank: int, port: int, values: list[list[float]], out) -> None:
    import torch.distributed as dist

    from vgraph.backends.torch.distributed.runtime.replica_groups import ReplicaLayoutError, check_replicas_agree

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        named = [("same.weight", torch.arange(6.0)), ("x.weight:exp_avg", torch.tensor(values[rank])),
                 ("same.bias", torch.ones(2))]
        try:
            check_replicas_agree(dist.group.WORLD, named)
            out.put((rank, "ok"))
        except ReplicaLayoutError as exc:
            out.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


NAN = float("nan")


@pytest.mark.parametrize("values, ok", [
    ([[0.5, 0.5, 0.5]] * 2, True),
    ([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5 + 2**-20]], False),  # one element off by 2^-20
    ([[1.0, 3.0, 0.0], [2.0, 2.0, 0.0]], False),  # the same sum, other values
    ([[NAN, 1.0, 0.0]] * 2, True),  # NaN alike on both (a diverged step is the loss check's to stop)
    ([[NAN, 1.0, 0.0], [0.0, 1.0, 0.0]], False),  # NaN on one replica only (gloo's MIN and MAX: both NaN)
    ([[0.0, 1.0, 0.0], [NAN, 1.0, 0.0]], False)])  # ... on the other (MIN and MAX: both 0)
def test_replicas_that_drifted_apart_are_named_before_a_checkpoint(values, ok):
    """The check every checkpoint runs: replicas that no longer hold the same values are found, and named."""
    results = run_ranks(_agree_member, 2, values)
    if ok:
        assert results == {0: "ok", 1: "ok"}
    else:
        assert all("no longer hold the same values (1 tensor(s), e.g. x.weight:exp_avg)" in m for m in results.values())


def test_an_ignored_real_token_is_counted_over_the_global_batch(files, tmp_path):
    """A cross-entropy cost that ignores a real token id: each replica weighs its loss by the non-ignored
    tokens of the *global* batch (it reads the other replicas' targets only then), so unequal shares still
    sum to `vgraph train`'s loss.  Counting every token instead (right when the ignored id is outside the
    vocabulary) makes the losses differ by the ignored share."""
    from collections import Counter

    from tokenizers import Tokenizer

    ref_dir = tmp_path / "probe"
    train(TrainConfig(**{**common(files), "steps": 1, "val_every": 0}, out=ref_dir))
    tok = Tokenizer.from_file(str(ref_dir / "tokenizer.json"))
    frequent = Counter(tok.encode((files / "corpus.txt").read_text(encoding="utf-8")[:20_000]).ids).most_common(1)[0][0]
    g = tiny()
    [cost] = [n for n in g.nodes if n.type == "cost"]
    cost.set_config(ignore_index=frequent)
    vgraph.save(g, tmp_path / "net_ignore.yml")
    cfg = {**common(files), "network": str(tmp_path / "net_ignore.yml"), "steps": 3, "val_every": 0}
    ref = train(TrainConfig(**cfg, out=tmp_path / "ref"))
    two = (files / "fleet4.yml").read_text().replace("flops: 1G", "flops: 3G", 1)
    (tmp_path / "two.yml").write_text(two.replace("name: four", "name: uneven"))
    run = launch(LaunchConfig(**cfg, out=tmp_path / "run", fleet=str(tmp_path / "two.yml"), micro_batches=1,
                              replicas=2))
    assert run.placement["replicas"] == 2 and len(set(run.placement["batch_shares"])) == 2
    torch.testing.assert_close(torch.tensor([r["loss"] for r in run.history], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in ref.history], dtype=torch.float64), rtol=1e-5, atol=0)
