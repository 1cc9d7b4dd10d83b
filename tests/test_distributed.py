"""`vgraph launch`: a partitioned network trained by one torch.distributed worker per PNode.

The numerics are checked against the single-process trainer on a tiny network
(dim 32, 2 heads, vocabulary 64, fp32) with dropout on: keyed dropout and
token-weighted micro-batch losses make the pipelined run the same training.
Two layouts of it: the production one (embedder and LM head in one required
group: the PNode holding it runs before *and* after the blocks) and one whose
LM head has a group of its own (the tied embedding is split over two PNodes
and synced every step).  Failures are real: a worker is SIGKILLed from here.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import TrainConfig, TrainingError, train
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch, main as launch_main, place, split_pipeline
from vgraph.run.step_plan import (Message, make_plan, message_order, micro_batch_sizes, rank_ops,
                                                    schedule_ops, sends_of, weight_ops)
from vgraph.backends.torch.lowering.dropout import dropout_key, keyed_dropout
from vgraph.base.diagnostics import VGraphError
from vgraph.ir.depth import graph_depths
from vgraph.cost.fleet import loads_fleet
from vgraph.placement.export import placement_report
from vgraph.run.files import WORKERS_JSON
from weights_util import assert_same_weights

STEPS, BATCH, MICRO, LR, SEED = 20, 8, 4, 1e-3, 3
HEAD = ("final_norm", "head_up", "head_swiglu", "head_down", "lm_head", "loss")


def tiny(split_head: bool):
    g = transformer(TransformerSpec("tiny-dist", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                    head_up=64, precision=None))  # dropout 0.1 stays on
    if split_head:
        for node_id in HEAD:
            g.node(node_id).set_config(colocate_group="lm_head")
    return g


def fleet_text(k: int) -> str:
    return "name: test\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(k))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    vgraph.save(tiny(False), d / "joint.yml")
    vgraph.save(tiny(True), d / "split.yml")
    for k in (2, 3):
        (d / f"fleet{k}.yml").write_text(fleet_text(k))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=30_000)), encoding="utf-8")
    return d


def common(files: Path, net: str) -> dict:
    return dict(network=str(files / f"{net}.yml"), data=str(files / "corpus.txt"), steps=STEPS, batch=BATCH, lr=LR,
                seed=SEED, val_every=10, checkpoint_every=5, threads=1, progress=False)


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    """Single-process `vgraph train` runs of both layouts (the oracle): their histories, and their run
    directories under "<net>_dir" (the final checkpoint's weights and optimizer state)."""
    out = {}
    for net in ("joint", "split"):
        run = train(TrainConfig(**common(files, net), out=tmp_path_factory.mktemp("ref") / net))
        out[net] = run.history
        out[f"{net}_dir"] = run.run_dir
    return out


def assert_same_model(run_dir: Path, reference: dict, net: str) -> None:
    """The final weights and optimizer state are `vgraph train`'s, within Adam's rounding (weights_util.py)."""
    last = f"step-{STEPS:08d}"
    assert_same_weights(run_dir / last, reference[f"{net}_dir"] / last, steps=STEPS, lr=LR)


def losses(rows) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in rows], dtype=torch.float64)


def assert_same_training(rows, ref_rows) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step exactly once
    torch.testing.assert_close(losses(rows), losses(ref_rows), rtol=1e-5, atol=0)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    ref_val = [r["val_loss"] for r in ref_rows if "val_loss" in r]
    torch.testing.assert_close(torch.tensor(val), torch.tensor(ref_val), rtol=1e-5, atol=0)


# -- equivalence -------------------------------------------------------------------------------------

def test_two_workers_with_a_split_tied_weight_train_like_one_process(files, reference, tmp_path) -> None:
    lines: list[str] = []
    result = launch(LaunchConfig(**{**common(files, "split"), "progress": True}, out=tmp_path / "run",
                                 fleet=str(files / "fleet2.yml"), micro_batches=MICRO, pipeline="gpipe",
                                 log=lines.append))
    assert result.restarts == 0 and result.attempts[0]["ranks"] == ["w0", "w1"]
    assert_same_training(result.history, reference["split"])
    assert_same_model(tmp_path / "run", reference, "split")  # the tie synced by reduce and broadcast, exactly
    # The tied embedding lives on w0 and is read by the LM head on w1: synced, 2 x the weight a step.
    assert result.placement["weight_sync"] and result.placement["weight_sync"][0]["to_pnode"] == "w1"
    # Bytes counted by the workers == the partition's prediction, every step.
    predicted = result.placement["cut_bytes_per_step"]
    assert {r["boundary_bytes"] for r in result.history} == {predicted}
    # Two PNodes, one machine: every row says 1 (Job.machines), and no fleet section in the report.
    assert [r["machines"] for r in result.history] == [1] * STEPS
    from vgraph.report.page import build_report, read_run

    assert "Fleet over time" not in build_report(read_run(tmp_path / "run"))
    # Per PNode too, on one basis: what each sent (w0: activations and the tied weight; w1: their gradients).
    sent = {p: info["bytes_sent_per_step"] for p, info in result.placement["pnodes"].items()}
    assert [{p: f["bytes_sent"] for p, f in r["pnodes"].items()} for r in result.history] == [sent] * STEPS
    # Rows are gathered at sync points by rank 0's clock (worker.py), yet every row keeps its own step's time
    # (rank 0's clock at the step's end) and the network's metric (measured on w1, which holds the LM head).
    elapsed = [r["elapsed_s"] for r in result.history]
    assert all(b > a for a, b in zip(elapsed, elapsed[1:]))
    assert [r.get("learning_rate") for r in result.history] == [pytest.approx(LR)] * STEPS
    # The run directory of `vgraph train`, and worker lines prefixed with their PNode.
    run = tmp_path / "run"
    for name in ("network.yml", "tokenizer.json", "run.json", "metrics.jsonl", "metrics.csv", "loss_curve.png",
                 "placement.json", "latest", "step-00000020"):
        assert (run / name).exists(), name
    assert any(line.startswith("[w0] step 20/20") and "machines 1" in line for line in lines)
    assert any(line.startswith("[w1] task w1#") for line in lines)
    ckpt = load_checkpoint(run / "step-00000020")
    assert ckpt.extra["layout"] == "unfused" and "embedder.weight" in ckpt.model_state
    assert not any(k.startswith("replica__") for k in ckpt.model_state)
    assert set(ckpt.optimizer_states) == set(ckpt.model_state)  # every trained parameter, gathered once

    # A distributed checkpoint resumes on one process: steps 11..20 there == the reference.
    single = tmp_path / "single"
    shutil.copytree(run, single)
    (single / "latest").write_text("step-00000010\n")
    for late in ("step-00000015", "step-00000020"):
        shutil.rmtree(single / late)
    resumed = train(TrainConfig(**common(files, "split"), out=single, resume=True))
    assert_same_training(resumed.history, reference["split"])


def test_three_workers_pipeline_through_a_pnode_twice_via_the_cli(files, reference, tmp_path, capsys) -> None:
    """Production layout: w0 holds embedder and LM head, so it runs before and after w1 and w2."""
    out = tmp_path / "run"
    rc = launch_main(["launch", str(files / "joint.yml"), "--fleet", str(files / "fleet3.yml"), "--data",
                      str(files / "corpus.txt"), "--steps", str(STEPS), "--batch", str(BATCH), "--micro-batches",
                      str(MICRO), "--lr", str(LR), "--seed", str(SEED), "--val-every", "10", "--checkpoint-every",
                      "10", "--threads", "1", "--replicas", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    assert f"step {STEPS}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_same_training(rows, reference["joint"])
    assert_same_model(out, reference, "joint")
    placement = json.loads((out / "placement.json").read_text())
    assert sorted({p for p in placement["assignment"].values()}) == ["w0", "w1", "w2"]
    assert placement["assignment"]["embedder"] == placement["assignment"]["final_norm"] == "w0"
    assert {r["boundary_bytes"] for r in rows} == {placement["cut_bytes_per_step"]}


# -- failure -----------------------------------------------------------------------------------------

def run_and_kill(config: LaunchConfig, victim: str) -> object:
    """Launch in a thread; when `victim`'s worker holds after its step, SIGKILL it from here."""
    box: dict = {}

    def target():
        try:
            box["result"] = launch(config)
        except BaseException as exc:  # re-raised below, in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    launch_dir = Path(config.out) / "launch"
    deadline = time.monotonic() + 120
    while not (launch_dir / f"held-{victim}").exists():
        assert thread.is_alive() and time.monotonic() < deadline, box.get("error")
        time.sleep(0.02)
    pid = json.loads((launch_dir / WORKERS_JSON).read_text())["pids"][victim]
    time.sleep(0.2)  # the other workers move on into the next step and block on the victim
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=180)
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_a_killed_worker_restarts_from_the_last_checkpoint(files, reference, tmp_path) -> None:
    config = LaunchConfig(**common(files, "split"), out=tmp_path / "run", fleet=str(files / "fleet2.yml"),
                          micro_batches=MICRO, hold=("w1", 12))
    result = run_and_kill(config, "w1")
    assert result.restarts == 1
    first, second = result.attempts
    assert first["lost"] == ["w1"] and first["exit_codes"]["w1"] == -signal.SIGKILL and not first["ok"]
    assert second["ranks"] == ["w0", "w1"] and second["ok"]
    assert_same_training(result.history, reference["split"])  # steps 11, 12 redone once, none lost
    assert_same_model(tmp_path / "run", reference, "split")


def test_a_killed_worker_can_be_repartitioned_away(files, reference, tmp_path) -> None:
    config = LaunchConfig(**common(files, "joint"), out=tmp_path / "run", fleet=str(files / "fleet3.yml"),
                          micro_batches=MICRO, hold=("w1", 12), on_failure="repartition")
    result = run_and_kill(config, "w1")
    assert [a["ranks"] for a in result.attempts] == [["w0", "w1", "w2"], ["w0", "w2"]]
    assert "w1" not in result.placement["assignment"].values()
    assert_same_training(result.history, reference["joint"])


# -- the plan and its schedule ---------------------------------------------------------------------

def placed(graph, k: int):
    fleet = loads_fleet(fleet_text(k))
    before, partition, after = split_pipeline(None, True, {"batch": "8", "micro_batches": "4"})
    return place(graph, fleet, before=before, partition=partition, after=after, target="cpu", batch=8,
                 micro_batches=4)


def simulate(plan, micro: int, pipeline: str = "1f1b") -> None:
    """Run every rank's ops with blocking receives and non-blocking sends; fail on a deadlock.
    1F1B must also keep at most min(micro, ranks) micro-batches of activations on a rank.  A tie op
    starts an asynchronous collective waited for at the end of the round (tie_sync.py): it needs nothing
    before it, and every rank reaching its end means both members started it."""
    ops = schedule_ops(plan, micro, train=True, pipeline=pipeline)
    assert ops == {r: rank_ops(plan, r, micro, train=True, pipeline=pipeline) for r in ops}
    for rank, seq in ops.items():
        kinds = [(op.kind, op.task, op.micro) for op in seq if op.kind in ("fwd", "bwd")]
        assert sorted(kinds) == sorted([(k, t.id, m) for t in plan.tasks_of(rank) for m in range(micro)
                                        for k in ("fwd", "bwd")])  # each op exactly once
        if pipeline == "1f1b":
            live: dict[int, int] = {}
            for kind, _, m in kinds:
                live[m] = live.get(m, 0) + (1 if kind == "fwd" else -1)
                assert sum(1 for v in live.values() if v) <= min(micro, plan.world_size)
    order = message_order(plan, ops)
    sent: set[tuple[int, int, Message]] = set()
    done_local: set[tuple[str, int, int]] = set()
    pos = {r: 0 for r in ops}

    def needs(rank, op):
        if op.kind == "fwd":
            for i in plan.tasks[op.task].receives:
                tr = plan.transfers[i]
                yield (tr.src_rank, "a", i, op.micro) if tr.remote else ("local", "a", i, op.micro)
        elif op.kind == "bwd":
            for i in plan.tasks[op.task].sends:
                tr = plan.transfers[i]
                if tr.grad:
                    yield (tr.dst_rank, "g", i, op.micro) if tr.remote else ("local", "g", i, op.micro)

    def ready(rank, need):
        src, kind, index, micro_ = need
        if src == "local":
            return (kind, index, micro_) in done_local
        return (src, rank, Message(kind, index, micro_)) in sent

    progress = True
    while progress:
        progress = False
        for rank in ops:
            while pos[rank] < len(ops[rank]) and all(ready(rank, n) for n in needs(rank, ops[rank][pos[rank]])):
                op = ops[rank][pos[rank]]
                for dst, msg in sends_of(plan, rank, op):
                    sent.add((rank, dst, msg))
                if op.kind == "fwd":
                    done_local.update(("a", i, op.micro) for i in plan.tasks[op.task].sends)
                if op.kind == "bwd":
                    done_local.update(("g", i, op.micro) for i in plan.tasks[op.task].receives)
                pos[rank] += 1
                progress = True
    stuck = {r: ops[r][pos[r]] for r in ops if pos[r] < len(ops[r])}
    assert not stuck, f"deadlock: {stuck}"
    assert sent == {(s, d, m) for (s, d), msgs in order.items() for m in msgs}


def test_depths_make_the_task_graph_acyclic_when_the_pnode_graph_is_not() -> None:
    p = placed(tiny(False), 3)
    plan = make_plan(p.graph, p.final, p.ranks)
    w0 = [t.depth for t in plan.tasks_of(0)]
    assert len(w0) == 2 and w0[0] < w0[1]  # embedder first, LM head after the blocks
    for tr in plan.transfers:
        assert plan.tasks[tr.src_task].depth < plan.tasks[tr.dst_task].depth
    assert not any(t.remote for t in plan.ties)  # the replica shares the publisher's Parameter
    simulate(plan, 4, "1f1b")
    simulate(plan, 4, "gpipe")


def test_any_placement_gets_a_deadlock_free_schedule_and_the_predicted_bytes() -> None:
    """Random, even non-contiguous assignments of the tiny network to 3 PNodes."""
    graph = placed(tiny(True), 3).graph
    fleet = loads_fleet(fleet_text(3))
    rng = random.Random(0)
    for trial in range(25):
        assignment = {n.id: f"w{rng.randrange(3)}" for n in graph.nodes}
        for n in graph.nodes:
            n.meta["pnode"] = assignment[n.id]
        plan = make_plan(graph, assignment)
        simulate(plan, rng.randint(1, 6), rng.choice(["1f1b", "gpipe"]))
        report = placement_report(graph, fleet, batch=8)
        assert plan.cut_bytes_per_step(8) == report["cut_bytes_per_step"], trial
        order = graph_depths(graph, assignment)
        assert all(order[e.dst] >= order[e.src] for e in graph.edges)
        assert {r for tie in plan.ties for r in (tie.owner_rank, tie.replica_rank)} <= set(range(plan.world_size))
        for r in range(plan.world_size):
            assert all(op.kind == "tie_weight" for op in weight_ops(plan, r))


def test_micro_batches_and_pipeline_splitting() -> None:
    assert micro_batch_sizes(8, 3) == [3, 3, 2] and sum(micro_batch_sizes(7, 7)) == 7
    with pytest.raises(VGraphError, match="micro-batches"):
        micro_batch_sizes(4, 5)
    opts = {"batch": "8", "micro_batches": "2"}
    one = "partition{batch=8,micro_batches=2,replicas=1}"  # one pipeline unless the options ask for replicas

    def split(*args) -> tuple[str, ...]:
        return tuple(map(str, split_pipeline(*args)))

    assert split(None, True, opts) == ("dead-nodes,precision", one, "fuse-heads,fuse-lm-head-ce")
    assert split(None, False, opts) == ("dead-nodes,precision", one, "")
    assert split("", True, opts) == ("", one, "")
    assert split("fuse-heads,partition{fleet=x.yml},precision", True, opts) == (
        "fuse-heads", "partition{fleet=x.yml,batch=8,micro_batches=2,replicas=1}", "precision")
    assert split("fuse-heads,precision", True, opts) == ("fuse-heads,precision", one, "")
    assert split("fuse-heads", True, opts) == ("", one, "fuse-heads")
    assert split(None, False, {**opts, "replicas": "auto"})[1] == "partition{batch=8,micro_batches=2,replicas=auto}"


def test_fusion_after_the_partition_respects_it() -> None:
    p = placed(tiny(False), 3)
    fused = p.graph.nodes_of_type("attention")
    assert len(fused) == 2
    for node in fused:  # the heads it replaced were placed on the PNode it runs on
        heads = [h.strip() for h in node.cfg["fused_from"].split(",")]
        assert heads and {p.assignment[h] for h in heads} == {p.final[node.id]}


# -- keyed dropout ---------------------------------------------------------------------------------

def test_keyed_dropout_rows_do_not_depend_on_how_the_batch_is_cut() -> None:
    x = torch.ones(6, 5, 7)
    with dropout_key(seed=1, step=4):
        whole = keyed_dropout(x, 0.5, "drop")
    with dropout_key(seed=1, step=4, offset=2):
        part = keyed_dropout(x[2:5], 0.5, "drop")
    assert torch.equal(part, whole[2:5])
    assert 0.3 < float((whole == 0).float().mean()) < 0.7 and set(whole.unique().tolist()) == {0.0, 2.0}
    with dropout_key(seed=1, step=5):
        assert not torch.equal(keyed_dropout(x, 0.5, "drop"), whole)  # another step, other masks
    with dropout_key(seed=1, step=4):
        assert not torch.equal(keyed_dropout(x, 0.5, "other"), whole)  # another VNode, other masks
    a, b = keyed_dropout(x, 0.5, "drop"), keyed_dropout(x, 0.5, "drop")  # no key: the global RNG
    assert not torch.equal(a, b)


# -- mistakes --------------------------------------------------------------------------------------

def test_user_mistakes_are_reported_not_raised(files, tmp_path, capsys) -> None:
    args = ["launch", str(files / "joint.yml"), "--fleet", str(files / "fleet2.yml"), "--data",
            str(files / "corpus.txt"), "--batch", "2", "--micro-batches", "4", "--out", str(tmp_path / "x")]
    assert launch_main(args) == 2
    assert "--micro-batches must be between 1 and --batch 2" in capsys.readouterr().err
    (tmp_path / "bad.yml").write_text("name: f\npnodes:\n  - {id: a, memory: lots, flops: 1G, bandwidth: 1GB/s}\n")
    assert launch_main(["launch", str(files / "joint.yml"), "--fleet", str(tmp_path / "bad.yml")]) == 2
    assert "bad.yml:3" in capsys.readouterr().err


def test_a_worker_error_stops_the_run_instead_of_restarting_it(files, tmp_path) -> None:
    """Resuming with another seed is refused by rank 0; every worker exits with the message, no restart."""
    base = {**common(files, "split"), "steps": 2, "checkpoint_every": 2, "val_every": 0}
    fleet = str(files / "fleet2.yml")
    launch(LaunchConfig(**base, out=tmp_path / "run", fleet=fleet, micro_batches=2))
    with pytest.raises(TrainingError, match="it was trained with seed=3, this run has seed=4"):
        launch(LaunchConfig(**{**base, "seed": 4, "steps": 4}, out=tmp_path / "run", fleet=fleet, micro_batches=2,
                            resume=True))
    assert not (tmp_path / "run" / "launch" / "job-1.json").exists()  # never restarted
    with pytest.raises(TrainingError, match="already holds a training run"):
        launch(LaunchConfig(**base, out=tmp_path / "run", fleet=fleet))


def test_an_arbitrary_placement_trains_the_same(files, reference, tmp_path) -> None:
    """Scattered VNodes: several tasks per rank, in-memory hand-overs between them, split heads, a
    tied weight read away from its owner; still the single-process training."""
    graph = vgraph.load(files / "split.yml")
    rng = random.Random(0)  # 25 tasks, 3 in-memory hand-overs, the tie remote, one block's heads fused
    assignment = {n.id: f"w{rng.randrange(3)}" for n in graph.nodes}
    steps = 6
    base = {**common(files, "split"), "steps": steps, "checkpoint_every": 0, "val_every": 0}
    result = launch(LaunchConfig(**base, out=tmp_path / "run", fleet=str(files / "fleet3.yml"), micro_batches=3,
                                 placement=assignment))
    assert result.placement["assignment"]["embedder"] == assignment["embedder"]
    torch.testing.assert_close(losses(result.history), losses(reference["split"][:steps]), rtol=1e-5, atol=0)
    assert {r["boundary_bytes"] for r in result.history} == {result.placement["cut_bytes_per_step"]}
