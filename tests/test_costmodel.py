"""The training-step cost model: bytes by kind at the effective precision, FLOPs, edge traffic."""
from __future__ import annotations

import json

import pytest

from conftest import NET8, ROOT, TINY_FP32
from vgraph import load
from vgraph.cli.main import main
from vgraph.cost.analyze import analyze
from vgraph.cost.costmodel import cost_model
from vgraph.ir.builder import NetBuilder
from vgraph.transform.pipeline import run_pipeline


def test_production_network_bytes_by_kind(net8):
    cm = cost_model(net8, batch=8)
    a = analyze(net8)
    t = cm.totals()
    params = a.params
    assert params == 45_147_648 == t["params"]
    assert t["param_bytes"] == 2 * params  # declared fp16
    assert t["grad_bytes"] == 2 * params
    assert t["optimizer_bytes"] == (4 + 8) * params  # fp32 master + two fp32 Adam moments
    assert t["flops_per_step"] == 3 * a.flops_per_sample * 8
    emb = cm.nodes["embedder"]
    assert emb.param_dtype == "float16" and emb.master_bytes == 4 * 32768 * 512
    assert cm.nodes["lm_head"].params == 0  # tied: its weight is counted at the embedder
    assert cm.nodes["block0_in"].activation_bytes == 0  # broadcast copies are free
    assert cm.nodes["block0_ffn_up"].activation_bytes == 512 * 2048 * 2


def test_edges_and_tied_weight_sync(net8):
    cm = cost_model(net8, batch=8)
    edge = next(e for e in cm.edges if (e.src, e.dst) == ("embedder", "block0_in"))
    assert edge.bytes_per_sample == 512 * 512 * 2 and edge.gradient
    assert cm.edge_bytes(edge) == 2 * 512 * 512 * 2 * 8  # activation + gradient, batch 8
    assert len(cm.edges) == len(net8.edges)
    [tie] = cm.ties
    assert (tie.alias, tie.publisher, tie.user) == ("token_embedding", "embedder", "lm_head")
    assert tie.weight_bytes == 32768 * 512 * 2 and tie.sync_bytes_per_step == 2 * tie.weight_bytes


def test_bytes_sent_are_what_each_side_of_a_cut_sends(net8):
    """By hand: across a cut the producer's PNode sends the activation and the reader's the gradient (an
    integer edge: no gradient); a separated tie: the publisher sends the weight, the user its gradient."""
    cm = cost_model(net8, batch=8)
    assign = {n.id: ("A" if n.id == "embedder" else "B") for n in net8.nodes}
    act = 512 * 512 * 2  # [512, 512] fp16 activation per sample
    weight = 32768 * 512 * 2  # the tied embedding, fp16
    cut = [e for e in cm.edges if (assign[e.src], assign[e.dst]) == ("A", "B")]
    assert [(e.src, e.dst) for e in cut] == [("embedder", "block0_in")]
    assert cm.bytes_sent(assign) == {"A": (act, weight), "B": (act, weight)}
    assert cm.bytes_sent({n.id: "A" for n in net8.nodes}) == {}
    b = NetBuilder("ids")
    b.node("tok", "tokenizer", pad_length=8, vocab_size=50)
    b.node("emb", "embedder", vocab_size=50, dim=16, seq_len=8)
    b.chain("tok", "emb")
    b.output("y", "emb")
    small = cost_model(b.build(), batch=10)
    assert small.bytes_sent({"tok": "A", "emb": "B"}) == {"A": (8 * 8, 0)}  # int64 ids: nothing flows back


def test_effective_precision_follows_the_precision_pass(net8):
    g = net8.copy()
    run_pipeline(g, "precision{target=cpu}")  # cpu runs declared fp16 as float32
    cm = cost_model(g, batch=4)
    n = cm.nodes["block0_ffn_up"]
    assert n.param_dtype == "float32" and n.param_bytes == 4 * n.params and n.master_bytes == 0
    assert n.activation_bytes == 512 * 2048 * 4
    assert cm.nodes["loss"].activation_bytes == 4  # the loss stays fp32 either way
    g2 = net8.copy()
    run_pipeline(g2, "precision{target=cuda-sm90}")
    assert cost_model(g2).nodes["block0_ffn_up"].param_dtype == "bfloat16"


def test_fp32_network_has_no_master_copy():
    cm = cost_model(load(TINY_FP32), batch=2)
    assert all(c.master_bytes == 0 for c in cm.nodes.values())
    assert all(c.param_bytes == 4 * c.params for c in cm.nodes.values())


def test_optimizers_integer_edges_and_micro_batches():
    b = NetBuilder("opt")
    b.node("tok", "tokenizer", pad_length=8, vocab_size=50)
    b.node("emb", "embedder", vocab_size=50, dim=16, seq_len=8, optimizer="sgd")
    b.node("a", "linear", in_dim=16, out_dim=16, optimizer="none")
    b.node("b", "linear", in_dim=16, out_dim=16)
    b.chain("tok", "emb", "a", "b")
    b.output("y", "b")
    g = b.build()
    cm = cost_model(g, batch=10, micro_batches=4)
    assert cm.nodes["emb"].adam_bytes == 4 * 50 * 16  # sgd: one momentum buffer
    assert cm.nodes["a"].grad_bytes == cm.nodes["a"].adam_bytes == 0  # frozen
    assert cm.nodes["b"].adam_bytes == 8 * (16 * 16 + 16)  # no optimizer key: Adam
    ids = next(e for e in cm.edges if e.src == "tok")
    assert not ids.gradient and cm.edge_bytes(ids) == 8 * 8 * 10  # int64 ids, no gradient
    assert cm.micro_batch == 3
    assert cm.resident_samples(stages=2) == 6 and cm.resident_samples(stages=16) == 12
    with pytest.raises(ValueError):
        cost_model(g, batch=0)


def test_analyze_fleet_cli(capsys):
    fleet = ROOT / "networks" / "fleets" / "t4x4.yml"
    assert main(["analyze", str(NET8), "--fleet", str(fleet), "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "batch 16" in out and "optim B" in out and "act B/ubatch" in out
    assert "transformer_block_7" in out and "token_embedding" in out
    assert "fleet 't4x4'" in out and "t4-3" in out and "yes" in out
    assert "tied weight 'token_embedding'" in out
    assert main(["analyze", str(NET8), "--batch", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["batch"] == 2 and doc["totals"]["params"] == 45_147_648
    assert {"param_bytes", "grad_bytes", "master_bytes", "adam_bytes", "activation_bytes_per_sample",
            "activation_bytes_per_micro_batch", "flops_per_step"} <= set(doc["nodes"][0])
