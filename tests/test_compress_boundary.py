"""The compress-boundary pass on every network and fixture: the rewrite, its cost, drawing, export and training.

On each network, `partition` onto three PNodes that each hold 60% of it (so it must be cut), then the pass:
every cut edge carrying a float tensor leaves a `compress` VNode on the producer's PNode, nothing else
changes, a second run changes nothing; the cost model prices those edges in the wire format
(`wire_bytes`, written out here per format); the drawing names the formats; the per-PNode export keeps the
VNode in the producer's part and stitches back into the compressed network; the YAML round-trips.  On the
fixtures `vgraph train` trains through it and a run with error feedback resumes exactly (the residuals in the
checkpoint).  `vgraph launch` with it: tests/test_distributed_compression.py.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, NETWORKS, TINY
from vgraph import dumps, load, loads
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.cli.main import main
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import loads_fleet
from vgraph.ir.verify import verify
from vgraph.ops.boundary import wire_bytes
from vgraph.placement.export import export_partition, load_parts, split_network, stitch
from vgraph.report.render import to_dot
from vgraph.transform.pass_api import PassError
from vgraph.transform.pipeline import fingerprint, run_pipeline, semantic_changes
from vgraph.types import DTYPE_BYTES

ALL = sorted(NETWORKS.glob("*.yml")) + sorted(FIXTURES.glob("*.yml"))
BATCH = 8


def fleet_for(graph, pnodes: int = 3, share: float = 0.6, bandwidth: str = "2.5MB/s"):
    need = cost_model(graph, batch=BATCH).totals()["memory_bytes"]
    return loads_fleet("name: cut\npnodes:\n" + "".join(
        f"  - {{id: p{i}, memory: {int(share * need) + 1}, flops: 1T, bandwidth: {bandwidth}, accelerator: cpu}}\n"
        for i in range(pnodes)))


def placed(path: Path, spec: str = "compress-boundary"):
    graph = load(path)
    fleet = fleet_for(graph)
    before = graph.copy()
    run_pipeline(before, f"partition{{batch={BATCH},replicas=1}}", data={"fleet": fleet})
    after = before.copy()
    run_pipeline(after, spec)
    return before, after, fleet


def float_cuts(graph) -> list:
    where = {n.id: n.meta["pnode"] for n in graph.nodes}
    return [e for e in graph.edges if where[e.src] != where[e.dst]
            and graph.node(e.src).outputs[e.src_slot].kind == "float"]


@pytest.fixture(scope="module", params=ALL, ids=[p.stem[:40] for p in ALL])
def network(request):
    return (request.param, *placed(request.param, "compress-boundary{error_feedback=true}"))


def test_every_float_cut_edge_leaves_a_compress_vnode_on_the_producers_pnode(network):
    path, before, after, _ = network
    cuts = float_cuts(before)
    assert cuts, f"{path.name}: the fleet was meant to force a cut"
    compress = {n.id: n for n in after.nodes_of_type("compress")}
    assert len(compress) == len(cuts)
    for e in float_cuts(after):
        node = compress[e.src]  # every float cut edge now starts at a compress VNode ...
        (feed,) = after.in_edges(node.id)
        assert after.node(feed.src).meta["pnode"] == node.meta["pnode"]  # ... fed on its own PNode
        assert node.cfg["peer_pnode"] == after.node(e.dst).meta["pnode"] != node.meta["pnode"]
        assert node.cfg["activations"] == node.cfg["gradients"] == "int8" and node.cfg["error_feedback"]
    assert len(after) == len(before) + len(cuts)
    assert semantic_changes(after) == ["compress-boundary{error_feedback=True}"]
    again = after.copy()
    run_pipeline(again, "compress-boundary{error_feedback=true}")
    assert fingerprint(again) == fingerprint(after)  # idempotent


def test_the_cost_model_prices_the_cut_in_the_wire_format(network):
    _, before, after, _ = network
    cm = cost_model(after, batch=BATCH)
    for e in cm.edges:
        src = after.node(e.src)
        if src.type == "compress":
            t = src.outputs[0]
            int8 = t.numel + 4 * (t.numel // t.shape[-1] if t.shape else 1)  # a float32 scale per token
            assert e.bytes_per_sample == e.back_bytes_per_sample == int8 == wire_bytes(t.shape, t.dtype, "int8")
            assert cm.edge_bytes(e) == 2 * int8 * BATCH
    old, new = cost_model(before, batch=BATCH), cm
    where = {n.id: n.meta["pnode"] for n in after.nodes}

    def cut(model):  # float cut edges, both ways
        return sum(model.edge_bytes(e) for e in model.edges if where[e.src] != where[e.dst] and e.gradient)
    # int8 plus a float32 scale per token of D elements: (1 + 4 / D) bytes an element instead of 2 or 4
    ratio = max((1 + 4 / n.outputs[0].shape[-1]) / DTYPE_BYTES[n.outputs[0].dtype]
                for n in after.nodes_of_type("compress"))
    assert cut(new) <= ratio * cut(old) * (1 + 1e-9) and ratio < 0.6


def test_drawing_export_and_yaml_keep_the_compression(network, tmp_path):
    path, _, after, fleet = network
    dot = to_dot(after, group_by="pnode")
    assert dot.count("fwd int8/token, bwd int8/token + error feedback") == len(after.nodes_of_type("compress"))
    text = dumps(after)
    assert loads(text) == loads(dumps(loads(text)))  # the compressed network round-trips
    assert {n.id for n in loads(text).nodes_of_type("compress")} == {n.id for n in after.nodes_of_type("compress")}
    report = export_partition(after, fleet, tmp_path / "parts", batch=BATCH)
    parts, placement = load_parts(tmp_path / "parts")
    for node in after.nodes_of_type("compress"):  # in its producer's part, before the send
        part = parts[node.meta["pnode"]]
        (edge,) = part.out_edges(node.id)
        assert part.node(edge.dst).type == "send"
    assert stitch(parts, placement) == loads(dumps(after))
    cut_bytes = sum(c["bytes_per_step"] for c in report["cut_edges"])
    assert cut_bytes == sum(cost_model(after, batch=BATCH).edge_bytes(e) for e in cost_model(after, batch=BATCH).edges
                            if report["assignment"][e.src] != report["assignment"][e.dst])


@pytest.mark.parametrize("fmt, bytes_per_element", [("fp16", 2), ("bf16", 2)])
def test_half_formats_and_one_direction(fmt, bytes_per_element):
    before, after, _ = placed(TINY, f"compress-boundary{{activations={fmt},gradients=none}}")
    cm = cost_model(after, batch=BATCH)
    for e in cm.edges:
        if after.node(e.src).type == "compress":
            t = after.node(e.src).outputs[0]
            assert e.bytes_per_sample == bytes_per_element * t.numel
            assert e.back_bytes_per_sample == DTYPE_BYTES[t.dtype] * t.numel  # gradients=none: as it is
    _, nothing, _ = placed(TINY, "compress-boundary{activations=none,gradients=none}")
    assert not nothing.nodes_of_type("compress")


def test_channel_scales_per_sample_and_channel():
    _, after, _ = placed(TINY, "compress-boundary{scale=channel}")
    for node in after.nodes_of_type("compress"):
        t = node.outputs[0]
        assert node.cfg["scale"] == "channel" and len(t.shape) == 2
        (e,) = [c for c in cost_model(after, batch=BATCH).edges if c.src == node.id]
        assert e.bytes_per_sample == t.numel + 4 * t.shape[-1]


@pytest.mark.parametrize("spec, why", [
    ("compress-boundary{activations=int4}", "must be one of none, fp16, bf16, int8, auto"),
    ("compress-boundary{gradients=}", "is empty"),
    ("compress-boundary{scale=nan}", "must be one of token, channel"),
    ("compress-boundary{error_feedback=maybe}", "is not a valid bool"),
    ("compress-boundary{error_feedback=1e309}", "is not a valid bool"),
    ("compress-boundary{activations=\x1b[31m}", "control characters"),
    ("compress-boundary{bits=8}", "bits"),
])
def test_hostile_options_are_refused_naming_the_option(spec, why):
    graph = load(TINY)
    with pytest.raises(PassError, match="compress-boundary") as info:
        run_pipeline(graph, spec)
    assert why in str(info.value)


def test_without_a_placement_or_a_choice_it_says_what_to_run_first():
    with pytest.raises(PassError, match="run 'partition' before it"):
        run_pipeline(load(TINY), "compress-boundary")
    before, _, _ = placed(TINY, "compress-boundary{activations=none,gradients=none}")
    with pytest.raises(PassError, match=r"partition\{compress=auto\}"):
        run_pipeline(before.copy(), "compress-boundary{activations=auto,gradients=auto}")


def test_the_cli_renders_and_exports_it(tmp_path):
    graph = load(TINY)
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: cut\npnodes:\n" + "".join(
        f"  - {{id: p{i}, memory: {int(0.6 * cost_model(graph, batch=BATCH).totals()['memory_bytes'])}, "
        f"flops: 1T, bandwidth: 2.5MB/s, accelerator: cpu}}\n" for i in range(3)))
    spec = f"partition{{fleet={fleet},replicas=1}},compress-boundary"
    assert main(["optimize", str(TINY), "--passes", spec, "-o", str(tmp_path / "c.yml")]) == 0
    assert load(tmp_path / "c.yml").nodes_of_type("compress")
    assert main(["partition", str(tmp_path / "c.yml"), "--fleet", str(fleet), "--replicas", "1",
                 "-o", str(tmp_path / "parts"), "--onnx"]) == 0
    parts, placement = load_parts(tmp_path / "parts")
    import onnx  # each part exported with its compress VNodes lowered (the activation's round trip)

    lowered = [n.name for pid in placement["assignment"].values() for n in
               onnx.load(tmp_path / "parts" / f"{pid}.onnx").graph.node if n.name.startswith("compress__")]
    assert lowered
    assert sum(len(p.nodes_of_type("compress")) for p in parts.values()) == len(load(tmp_path / "c.yml")
                                                                                  .nodes_of_type("compress"))


@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.sampled_from(["none", "fp16", "bf16", "int8"]), st.sampled_from(["none", "fp16", "bf16", "int8"]),
       st.sampled_from(["token", "channel"]), st.booleans())
def test_any_options_give_a_valid_graph_whose_parts_stitch_back(act, grad, scale, ef):
    before, after, _ = placed(TINY, f"compress-boundary{{activations={act},gradients={grad},scale={scale},"
                                       f"error_feedback={ef}}}")
    verify(after)
    expected = 0 if (act, grad) == ("none", "none") else len(float_cuts(before))
    assert len(after.nodes_of_type("compress")) == expected
    parts = split_network(after)
    assert stitch(parts) == loads(dumps(after))


# -- training through it ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return path


def fleet_file(tmp_path: Path, graph) -> Path:
    need = cost_model(graph, batch=BATCH).totals()["memory_bytes"]
    path = tmp_path / "fleet.yml"
    path.write_text("name: cut\npnodes:\n" + "".join(
        f"  - {{id: p{i}, memory: {int(0.6 * need)}, flops: 1T, bandwidth: 2.5MB/s, accelerator: cpu}}\n"
        for i in range(3)))
    return path


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.yml")), ids=lambda p: p.stem)
def test_train_through_it_and_resume_exactly_with_error_feedback(fixture, corpus, tmp_path):
    fleet = fleet_file(tmp_path, load(fixture))
    passes = (f"dead-nodes,precision,partition{{fleet={fleet},batch={BATCH},replicas=1}},"
              f"compress-boundary{{error_feedback=true}}")
    common = dict(network=str(fixture), data=str(corpus), batch=BATCH, lr=1e-3, seed=1, val_every=0,
                  checkpoint_every=2, threads=1, progress=False, passes=passes, deterministic=True)
    whole = train(TrainConfig(**common, steps=4, out=tmp_path / "whole"))
    part = train(TrainConfig(**common, steps=2, out=tmp_path / "parts"))
    resumed = train(TrainConfig(**common, steps=4, out=tmp_path / "parts", resume=True))
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history]  # bit for bit
    # the premise: it resumed (steps 1-2 are the first run's rows, their wall times included; a run that started
    # over would have timed them again), so the equality above is the residuals' doing
    timed = lambda rows: [(r["step"], r["elapsed_s"]) for r in rows]  # noqa: E731
    assert timed(resumed.history[:2]) == timed(part.history) and len(part.history) == 2
    first = load_checkpoint(tmp_path / "parts" / "step-00000002")
    residuals = first.extra["compression"]["boundary"]
    stored = loads((tmp_path / "whole" / "network.yml").read_text())  # the network it trained
    assert set(residuals) == {n.id for n in stored.nodes_of_type("compress")} != set()
    assert all(r.shape[0] == BATCH and float(r.abs().max()) > 0 for r in residuals.values())
    last = load_checkpoint(tmp_path / "parts" / "step-00000004").extra["compression"]["boundary"]
    ref = load_checkpoint(tmp_path / "whole" / "step-00000004").extra["compression"]["boundary"]
    assert all(torch.equal(last[k], ref[k]) for k in ref)
    assert math.isfinite(resumed.history[-1]["loss"])
