"""`vgraph launch`: rank 0 compares each PNode's measured busy time with the plan and reports a drift
(vgraph/placement/drift.py, runtime/pnode_figures.RunDrift)."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

import vgraph
from conftest import ROOT, TINY
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch, main as launch_main
from vgraph.backends.torch.distributed.runtime.pnode_figures import RunDrift
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.cost.fleet import load_fleet, loads_fleet
from vgraph.placement.drift import DEFAULT_WARMUP, DriftWatch, fleet_file_text
from vgraph.run.files import MEASURED_FLEET

LIE = 1000.0  # w1 claims this many times the FLOP/s of w0, which is the same kind of process on the same CPU


def test_a_fleet_that_lies_about_a_pnode_is_reported_and_the_measured_fleet_moves_to_the_truth(tmp_path) -> None:
    graph = transformer(TransformerSpec("tiny-drift", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                        head_up=64, precision=None))
    vgraph.save(graph, tmp_path / "net.yml")
    (tmp_path / "fleet.yml").write_text(
        "name: lying\npnodes:\n  - {id: w0, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}\n"
        f"  - {{id: w1, memory: 1GiB, flops: {LIE:g}G, bandwidth: 1GB/s, accelerator: cpu}}\n")
    (tmp_path / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    # A block on w1, the rest on w0: the partitioner would put everything on the PNode that claims to be fast.
    assignment = {n.id: "w1" if n.cfg.get("colocate_group") == "transformer_block_1" else "w0" for n in graph.nodes}
    lines: list[str] = []
    result = launch(LaunchConfig(network=str(tmp_path / "net.yml"), data=str(tmp_path / "corpus.txt"), steps=14,
                                 batch=4, lr=1e-3, seed=2, val_every=0, checkpoint_every=0, threads=1, progress=True,
                                 out=tmp_path / "run", fleet=str(tmp_path / "fleet.yml"), micro_batches=2,
                                 placement=assignment, drift_steps=3, log=lines.append))
    predicted = result.placement["pnodes"]["w1"]["compute_seconds"]
    drifts = [r["drift"] for r in result.history if "drift" in r]
    assert [d for d in drifts if "w1" in d["pnodes"]][:1], (drifts, [r.get("pnodes") for r in result.history])
    w1 = [d for d in drifts if "w1" in d["pnodes"]]
    assert len(w1) == 1  # once per episode: w1 never comes back within 25% of the lie
    assert w1[0]["pnodes"]["w1"]["predicted_s"] == pytest.approx(predicted) and w1[0]["pnodes"]["w1"]["ratio"] > 1.25
    said = [line for line in lines if "drift at step" in line]
    assert len(said) == len(drifts) and MEASURED_FLEET in said[0] and "--fleet" in said[0], said
    # The measured fleet: w1's FLOP/s moved down toward the truth, and the cost model's compute for w1 at the
    # measured figures (compute is FLOPs / flops for a PNode without a probe's efficiency) is within 25% of the
    # busy time measured over the run after the warm-up.
    measured = load_fleet(tmp_path / "run" / MEASURED_FLEET)
    assert measured.pnode("w1").flops < LIE * 1e9
    repriced = predicted * (LIE * 1e9) / measured.pnode("w1").flops
    busy = statistics.median(r["pnodes"]["w1"]["step_s"] - r["pnodes"]["w1"]["idle_s"]
                             for r in result.history[DEFAULT_WARMUP:])
    assert repriced == pytest.approx(busy, rel=0.25)
    assert (tmp_path / "fleet.yml").read_text().startswith("name: lying")  # the input is never written over


def test_the_measured_fleet_is_never_written_over_the_fleet_file_given(tmp_path) -> None:
    fleet = loads_fleet("pnodes: [{id: a, memory: 1GiB, flops: 1G, bandwidth: 1GB/s}]")
    given = tmp_path / MEASURED_FLEET  # a run resumed with --fleet RUN/fleet.measured.yml
    given.write_text(fleet_file_text(fleet))
    before = given.read_text()
    said: list[str] = []
    drift = RunDrift(DriftWatch({"a": 0.01}, steps=1, warmup=0, window=1), fleet, given, str(given), "vgraph launch x",
                     said.append)
    rows = [{"step": 1, "pnodes": {"a": {"step_s": 0.5, "idle_s": 0.1}}}]
    drift.rows(rows)
    assert rows[0]["drift"]["pnodes"]["a"]["ratio"] == pytest.approx(40.0)
    assert given.read_text() == before and "not written" in said[0], said
    # Hostile figures from a worker are skipped with a reason, never a traceback.
    drift.rows([{"step": 2, "pnodes": {"a": {"step_s": float("nan"), "idle_s": 0}}}, {"step": "x"}, {"step": 3}])
    assert drift.watch.skipped and "step_s nan" in drift.watch.skipped[0][2]
    other = tmp_path / "run"
    drift = RunDrift(DriftWatch({"a": 0.01}, steps=1, warmup=0, window=1), fleet, other / MEASURED_FLEET, str(given),
                     "vgraph launch x", said.append)
    other.mkdir()
    drift.rows([{"step": 1, "pnodes": {"a": {"step_s": 0.5, "idle_s": 0.1}}}])
    assert load_fleet(other / MEASURED_FLEET).pnode("a").flops == pytest.approx(1e9 / 40)


@pytest.mark.parametrize("bad", ["-1", "x", "1.5", "nan", "", "99999999999"])
def test_drift_steps_refuses_what_is_not_a_count(bad, tmp_path, capsys) -> None:
    try:
        code = launch_main(["launch", str(TINY), "--fleet", str(ROOT / "networks/fleets/cpu2.yml"), "--out",
                            str(tmp_path / "r"), "--steps", "1", "--drift-steps", bad])
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "drift-steps" in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()  # refused before anything was written
