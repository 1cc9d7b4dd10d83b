"""`vgraph partition`: one valid network per PNode, placement.json, stitching back, running the parts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_partition import fleet, tiny
from conftest import NET8, ROOT, TINY
from vgraph import VGraphError, load
from vgraph.cli.main import main
from vgraph.cost.fleet import load_fleet
from vgraph.placement.export import (export_partition, find_exporter, load_parts, placement_report,
                                     split_network, stitch)
from vgraph.transform.pipeline import run_pipeline

FLEETS = ROOT / "networks" / "fleets"
BIG = 1 << 30


def partitioned(graph, fl, spec: str = "partition{batch=8,replicas=1}"):
    g = graph.copy()
    run_pipeline(g, spec, data={"fleet": fl})
    return g


def test_cli_writes_parts_and_placement(tmp_path: Path, capsys):
    out = tmp_path / "parts"
    fl = FLEETS / "t4x4.yml"
    assert main(["partition", str(NET8), "--fleet", str(fl), "--batch", "16", "--replicas", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bottleneck:" in printed and "idle PNodes: t4-0" in printed and "a larger --batch" in printed
    placement = json.loads((out / "placement.json").read_text())
    assert {"assignment", "cut_edges", "pnodes", "bottleneck_seconds", "cut_bytes_per_step"} <= set(placement)
    original = load(NET8)
    assert set(placement["assignment"]) == {n.id for n in original.nodes}
    for cut in placement["cut_edges"]:
        assert {"from", "from_slot", "to", "to_slot", "bytes_per_step"} <= set(cut)
        assert placement["assignment"][cut["from"]] != placement["assignment"][cut["to"]]
    assert placement["cut_bytes_per_step"] == sum(c["bytes_per_step"] for c in placement["cut_edges"])
    used = {pid for pid, p in placement["pnodes"].items() if p["vnodes"]}
    assert used == set(placement["assignment"].values())
    for pid, p in placement["pnodes"].items():
        assert {"vnodes", "memory_bytes", "flops_per_step"} <= set(p)
        assert (out / f"{pid}.yml").exists() == (pid in used)
    bottleneck = max(p["seconds"] for p in placement["pnodes"].values())
    assert placement["bottleneck_seconds"] == pytest.approx(bottleneck)
    for pid in used:  # every part is a valid network on its own
        part = load(out / f"{pid}.yml")
        sends = {(n.cfg["peer_pnode"], n.cfg["peer_node"], n.cfg["peer_slot"]) for n in part.nodes_of_type("send")}
        recvs = {(n.cfg["peer_pnode"], n.cfg["peer_node"], n.cfg["peer_slot"])
                 for n in part.nodes_of_type("receive")}
        for cut in placement["cut_edges"]:
            if cut["from_pnode"] == pid:
                assert (cut["to_pnode"], cut["to"], cut["to_slot"]) in sends
            if cut["to_pnode"] == pid:
                assert (cut["from_pnode"], cut["from"], cut["from_slot"]) in recvs
        assert {ep.node for ep in part.outputs} >= {n.id for n in part.nodes_of_type("send")}


def test_stitching_the_written_parts_gives_the_original(tmp_path: Path):
    g = partitioned(load(NET8), load_fleet(FLEETS / "mixed16.yml"))
    export_partition(g, load_fleet(FLEETS / "mixed16.yml"), tmp_path)
    parts, placement = load_parts(tmp_path)
    assert len(parts) >= 3
    whole = stitch(parts, placement)
    original = load(NET8)
    assert whole == original, whole.diff(original)


def test_tied_weight_across_pnodes_becomes_a_replica_and_stitches_back():
    g = tiny(1, groups="none")
    fl = fleet("x", (2.2e5, 1e9, 1e7), (2.2e5, 1e9, 1e7), (2.2e5, 1e9, 1e7))
    placed = partitioned(g, fl)
    emb, head = placed.node("embedder").meta["pnode"], placed.node("lm_head").meta["pnode"]
    assert emb != head  # memory forces the embedder and the tied LM head apart
    parts = split_network(placed)
    [replica] = parts[head].nodes_of_type("weight_replica")
    assert replica.cfg["shared_weight_alias"] == "token_embedding" and replica.cfg["peer_pnode"] == emb
    assert tuple(replica.cfg["shape"]) == (96, 32)
    report = placement_report(placed, fl)
    assert [s["user"] for s in report["weight_sync"]] == ["lm_head"]
    assert report["bottleneck_seconds"] == pytest.approx(placed.meta["placement"]["bottleneck_seconds"])
    whole = stitch(parts, report)
    assert whole == tiny(1, groups="none"), whole.diff(tiny(1, groups="none"))


def test_parts_after_head_fusion_stitch_to_the_fused_network():
    fl = load_fleet(FLEETS / "t4x4.yml")
    placed = partitioned(load(NET8), fl, "partition{batch=8,replicas=1},fuse-heads")
    whole = stitch(split_network(placed), placement_report(placed, fl))
    for n in placed.nodes:
        n.meta.clear()
    placed.meta.clear()
    assert whole == placed, whole.diff(placed)


def test_stitch_refuses_a_receive_without_its_send():
    fl = fleet("two", (BIG, 1e9, 1e12), (BIG, 1e9, 1e12))
    parts = split_network(partitioned(load(TINY), fl))
    assert len(parts) == 2
    pid, part = next((p, g) for p, g in parts.items() if g.nodes_of_type("send"))
    send = part.nodes_of_type("send")[0]
    for ep in [ep for ep in part.outputs if ep.node == send.id]:
        part.remove_endpoint("outputs", ep.name)
    part.remove_edge(part.input_edge(send.id, 0))
    part.remove_node(send.id)
    with pytest.raises(VGraphError, match="has no matching send"):
        stitch(parts)


# -- running the parts -----------------------------------------------------------------------------

def run_parts_in_turn(tb, parts, feeds, whole_module):
    """Run every part's computations as soon as their inputs exist (a part may run in several
    pieces: the embedding PNode runs before and after the blocks), handing sends to receives."""
    import torch

    modules = {pid: tb.compile_network(part, train=False) for pid, part in parts.items()}
    for pid, part in parts.items():  # a replica holds the publisher's weight, synced every step
        for r in part.nodes_of_type("weight_replica"):
            owner = whole_module.node_parameters(r.cfg["peer_node"])["weight"]
            with torch.no_grad():
                modules[pid].node_parameters(r.id)["weight"].copy_(owner)
    source = {}  # receive feed name -> (pnode, send name)
    for pid, part in parts.items():
        for r in part.nodes_of_type("receive"):
            (edge,) = part.out_edges(r.id)
            peer = parts[r.cfg["peer_pnode"]]
            send = next(s for s in peer.nodes_of_type("send")
                        if (s.cfg["peer_pnode"], s.cfg["peer_node"], s.cfg["peer_slot"]) == (pid, edge.dst, edge.dst_slot))
            source[f"{r.id}:in0"] = send.id
    values = dict(feeds)
    todo = {(pid, ep.name) for pid, part in parts.items() for ep in [*part.outputs, *part.costs]}
    runs = 0
    while todo:
        ready = []
        for pid, name in sorted(todo):
            need = modules[pid].feeds_needed(want=(name,))
            if all(n in values or source.get(n) in values for n in need):
                ready.append((pid, name, need))
        assert ready, f"no part can make progress; waiting for {sorted(todo)}"
        for pid, name, need in ready:
            args = {n: values[n] if n in values else values[source[n]] for n in need}
            values.update(modules[pid](args, want=(name,)))
            todo.discard((pid, name))
            runs += 1
    return values, runs


@pytest.mark.parametrize("case", ["ring", "tied-apart"])
def test_parts_run_one_after_the_other_give_the_whole_networks_output(case):
    import torch

    import vgraph.backends.torch as tb

    if case == "ring":  # production layout: the embedding group holds both ends of the chain
        graph = load(TINY)
        fl = fleet("three", (BIG, 1e9, 1e12), (BIG, 1e9, 1e12), (BIG, 1e9, 1e12))
    else:
        graph = tiny(1, groups="none")
        fl = fleet("x", (2.2e5, 1e9, 1e7), (2.2e5, 1e9, 1e7), (2.2e5, 1e9, 1e7))
    placed = partitioned(graph, fl)
    parts = split_network(placed)
    assert len(parts) >= 2
    whole = tb.compile_network(graph, train=False)
    gen = torch.Generator().manual_seed(0)
    seq = graph.node("embedder").cfg["seq_len"]
    vocab = graph.node("embedder").cfg["vocab_size"]
    feeds = {"embedder:in0": torch.randint(0, vocab, (3, seq), generator=gen),
             "loss:in1": torch.randint(0, vocab, (3, seq), generator=gen)}
    expected = whole(feeds)
    got, runs = run_parts_in_turn(tb, parts, feeds, whole)
    assert runs >= len(parts)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5)


# -- exporters ------------------------------------------------------------------------------------------

def test_onnx_parts_through_the_exporter_plugin(tmp_path: Path, capsys):
    import onnx

    from vgraph.backends.onnx.subgraph import export_subgraph

    assert find_exporter("onnx") is export_subgraph  # the installed entry point, nothing registered here
    fl = tmp_path / "two.yml"
    fl.write_text("pnodes:\n  - {id: a, memory: 1GiB, flops: 1G, bandwidth: 1TB/s}\n"
                  "  - {id: b, memory: 1GiB, flops: 1G, bandwidth: 1TB/s}\n")
    assert main(["partition", str(TINY), "--fleet", str(fl), "-o", str(tmp_path / "out"), "--onnx"]) == 0
    placement = json.loads((tmp_path / "out" / "placement.json").read_text())
    for pid, p in placement["pnodes"].items():
        model = onnx.load(tmp_path / "out" / f"{pid}.onnx")
        onnx.checker.check_model(model)
        outputs = {o.name for o in model.graph.output}
        for cut in placement["cut_edges"]:  # boundary tensors are named "<producer>:<slot>"
            if cut["from_pnode"] == pid:
                assert f"{cut['from']}:{cut['from_slot']}" in outputs


def test_missing_exporter_is_a_clear_error():
    with pytest.raises(VGraphError, match="no 'tflite' exporter is installed.*vgraph.exporters"):
        find_exporter("tflite")
