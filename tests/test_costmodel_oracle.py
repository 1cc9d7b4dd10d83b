"""Cost-model numbers a user reads (`vgraph analyze --fleet`, the partitioner) against counts by hand.

Mutation testing (TESTING.md) found rules the existing tests never read: a node's memory at a given
number of resident samples, a separated tied weight's replica, the activation of an output nobody reads,
and the seconds of compute per PNode in the fleet table.  Byte counts: fp16 2 bytes, fp32 4; a trained
fp16 parameter costs itself (2) + its gradient (2) + an fp32 master copy (4) + two fp32 Adam moments (8).
"""
from __future__ import annotations

from conftest import NET8, ROOT
from vgraph import load
from vgraph.cost.analyze import analyze
from vgraph.cost.costmodel import cost_model, format_costs
from vgraph.cost.fleet import load_fleet
from vgraph.transform.pipeline import run_pipeline

UP_PARAMS = 512 * 2048 + 2048          # block0_ffn_up: 512 -> 2048 with bias
UP_ACTIVATION = 512 * 2048 * 2         # its fp16 [512, 2048] output, per sample


def test_node_memory_by_hand(net8) -> None:
    cm = cost_model(net8, batch=8, micro_batches=2)  # 1F1B: a stage keeps at most depth micro-batches of 4
    up = cm.nodes["block0_ffn_up"]
    assert up.static_bytes == (2 + 2 + 4 + 8) * UP_PARAMS
    assert up.memory_bytes(3) == 16 * UP_PARAMS + 3 * UP_ACTIVATION
    assert cm.node_memory("block0_ffn_up", stages=1) == 16 * UP_PARAMS + 4 * UP_ACTIVATION
    assert cm.node_memory("block0_ffn_up", stages=2) == 16 * UP_PARAMS + 8 * UP_ACTIVATION
    t = cm.totals(["block0_ffn_up"], stages=2)
    assert t["memory_bytes"] == 16 * UP_PARAMS + 8 * UP_ACTIVATION
    assert t["transient_bytes"] == 0 and cm.transient_bytes() == 0  # nothing rematerialised without remat


def test_a_separated_tied_weight_holds_a_copy_and_its_gradient(net8) -> None:
    [tie] = cost_model(net8).ties
    assert tie.replica_bytes == 2 * (32768 * 512 * 2)  # the fp16 [32768, 512] embedding, twice


def test_unread_outputs_keep_no_activation() -> None:
    g = load(NET8)
    run_pipeline(g, "fuse-lm-head-ce")
    [ce] = g.nodes_of_type("tied_lm_head_ce")
    read = cost_model(g).nodes[ce.id].activation_bytes
    assert read == 4 + 512 * 32768 * 2  # the fp32 loss and the fp16 logits (the network outputs them)
    for ep in [ep for ep in g.outputs if ep.node == ce.id]:
        g.remove_endpoint("outputs", ep.name)
    for ep in [ep for ep in g.metrics if ep.node == ce.id]:  # (the learning-rate metric names slot 1 too)
        g.remove_endpoint("metrics", ep.name)
    assert cost_model(g).nodes[ce.id].activation_bytes == 4  # logits formed only when read


def test_fleet_table_compute_seconds_by_hand(net8) -> None:
    fleet = load_fleet(ROOT / "networks" / "fleets" / "t4x4.yml")
    cm = cost_model(net8, batch=16)
    text = format_costs(cm, net8, fleet)
    flops_per_step = 3 * analyze(net8).flops_per_sample * 16  # forward + backward (2x), batch 16
    seconds = flops_per_step / 25e12                            # a T4 of the fleet: 25 TFLOP/s
    assert f"{seconds:.4g} s" in text
    assert text.count(f"{seconds:.4g} s") == 4  # four equal PNodes


def test_analyze_cli_reports_the_same_memory(capsys) -> None:
    from vgraph.cli.main import main

    assert main(["analyze", str(NET8), "--batch", "8", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    up = next(n for n in doc["nodes"] if n["id"] == "block0_ffn_up")
    assert (up["param_bytes"], up["grad_bytes"], up["master_bytes"], up["adam_bytes"]) == \
        (2 * UP_PARAMS, 2 * UP_PARAMS, 4 * UP_PARAMS, 8 * UP_PARAMS)
