"""The ONNX lowering as a whole: validity, shapes, names, weights, fused graphs, production networks."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, shape_inference

import vgraph
from vgraph import Graph, OpDef, VGraphError, VNode, register_op
from vgraph.backends.onnx import (LOWERINGS, expected_param_shapes, lower_network, onnx_dims,
                                  register_lowering)
from vgraph.backends.onnx.check import onnx_outputs, random_feeds, random_weights
from vgraph.ir.builder import NetBuilder

from tests.conftest import NET6, NET8, TINY, TINY_FP32

ELEM = {"float16": TensorProto.FLOAT, "bfloat16": TensorProto.FLOAT, "float32": TensorProto.FLOAT,
        "int64": TensorProto.INT64}


# ---------------------------------------------------------------------------
# Hand-made fused graphs (what fuse-heads / fuse-lm-head-ce produce)
# ---------------------------------------------------------------------------


def fuse_by_hand(graph: Graph, weights: dict[str, np.ndarray] | None = None
                 ) -> tuple[Graph, dict[str, np.ndarray] | None]:
    """broadcast -> heads -> stack becomes one `attention`; tied linear + ce_logits cost becomes
    `tied_lm_head_ce`.  Weights map as qkv = cat(wq..., wk..., wv...)."""
    g = graph.copy()
    w = dict(weights) if weights is not None else None
    for stack in [n for n in g.nodes if n.type == "stack"]:
        heads = [g.node(e.src) for e in g.in_edges(stack.id)]
        if not heads or any(h.type != "attention_head" for h in heads):
            continue
        fan = g.producer(heads[0].id, 0)
        source = g.input_edge(fan.id, 0)
        h0 = heads[0].cfg
        fused_id = stack.id.replace("_stack", "_attention")
        g.add_node(VNode(fused_id, "attention", {
            "num_heads": len(heads), "head_dim": h0["head_dim"], "dim": h0["input_dim"],
            "seq_len": h0["seq_len"], "causal": h0["causal"], "position_encoding": h0["position_encoding"],
            "rope_theta": h0["rope_theta"], "fused_from": ",".join(h.id for h in heads),
            "colocate_group": stack.group}))
        g.add_edge(source.src, source.src_slot, fused_id, 0)
        g.replace_uses((stack.id, 0), (fused_id, 0))
        for node_id in [stack.id, *[h.id for h in heads], fan.id]:
            for e in g.in_edges(node_id):
                g.remove_edge(e)
        for node_id in [stack.id, *[h.id for h in heads], fan.id]:
            g.remove_node(node_id)
        if w is not None:
            w[f"{fused_id}.qkv_weight"] = np.concatenate(
                [w.pop(f"{h.id}.{p}") for p in ("wq", "wk", "wv") for h in heads], axis=0)
            w[f"{fused_id}.qkv_bias"] = np.concatenate(
                [w.pop(f"{h.id}.{p}") for p in ("bq", "bk", "bv") for h in heads], axis=0)
    for cost in [n for n in g.nodes if n.type == "cost" and n.cfg["cost_function"] == "ce_logits"]:
        head = g.producer(cost.id, 0)
        if head.type != "linear" or not head.cfg.get("tie_weight_alias"):
            continue
        hidden = g.input_edge(head.id, 0)
        fused_id = f"{head.id}_ce"
        g.add_node(VNode(fused_id, "tied_lm_head_ce", {
            "in_dim": head.cfg["in_dim"], "out_dim": head.cfg["out_dim"],
            "tie_weight_alias": head.cfg["tie_weight_alias"], "cost_precision": "float32",
            "fused_from": f"{head.id},{cost.id}", "colocate_group": head.group}))
        g.add_edge(hidden.src, hidden.src_slot, fused_id, 0)
        g.replace_uses((cost.id, 0), (fused_id, 0))
        g.replace_uses((head.id, 0), (fused_id, 1))
        for node_id in (cost.id, head.id):
            for e in g.in_edges(node_id):
                g.remove_edge(e)
        g.remove_node(cost.id)
        g.remove_node(head.id)
    return vgraph.verify(g), w


def fused_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {("lm_head_ce:in1" if k == "loss:in1" else k): v for k, v in feeds.items()}


# ---------------------------------------------------------------------------
# Validity and shapes
# ---------------------------------------------------------------------------


def _graph(which: str) -> Graph:
    path = {"tiny": TINY, "tiny_fp32": TINY_FP32, "net6": NET6, "net8": NET8}[which.split("-")[0]]
    g = vgraph.load(path)
    return fuse_by_hand(g)[0] if which.endswith("-fused") else g


NETWORKS = ["tiny", "tiny_fp32", "tiny-fused", "net6", "net6-fused", "net8", "net8-fused"]


@pytest.mark.parametrize("which", NETWORKS)
def test_checker_passes_and_onnx_shape_inference_agrees_with_vgraph(which: str) -> None:
    graph = _graph(which)
    # Production networks: parameters as graph inputs (no 180 MB of data); tiny ones with weights.
    weights = random_weights(graph) if which.startswith("tiny") else None
    model = lower_network(graph, weights)
    onnx.checker.check_model(model, full_check=True)
    assert not model.graph.value_info  # everything below comes from ONNX's own inference
    inferred = shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    types = {v.name: v.type.tensor_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    checked = 0
    for node in graph.nodes:
        if node.type == "broadcast":  # fan-out reuses its input's value
            continue
        for slot, t in enumerate(node.outputs):
            name = f"{node.id}:{slot}"
            if node.type == "tied_lm_head_ce" and slot == 1 and name not in types:
                continue  # logits are only computed when read
            assert name in types, f"no ONNX value for {name}"
            dims = [d.dim_param or d.dim_value for d in types[name].shape.dim]
            assert dims == onnx_dims(graph, node.id, slot), name
            assert types[name].elem_type == ELEM[t.dtype], name
            checked += 1
    assert checked >= len(graph) - len(graph.nodes_of_type("broadcast"))


def test_names_follow_vnode_ids() -> None:
    graph = vgraph.load(TINY)
    model = lower_network(graph, random_weights(graph))
    ids = {n.id for n in graph.nodes}
    assert [i.name for i in model.graph.input] == ["embedder:in0", "loss:in1"]
    assert [o.name for o in model.graph.output] == ["lm_head:0", "loss:0"]
    assert json.loads({p.key: p.value for p in model.metadata_props}["vgraph.endpoints"]) == {
        "ce_loss": "loss:0", "logits": "lm_head:0"}
    for vi in model.graph.input:
        assert vi.type.tensor_type.shape.dim[0].dim_param == "batch"
    named = {n.name.split("/")[0] for n in model.graph.node}
    assert named <= ids
    assert named == {n.id for n in graph.nodes if n.type != "broadcast"}
    assert len({n.name for n in model.graph.node}) == len(model.graph.node)
    produced = {o for n in model.graph.node for o in n.output}
    for n in graph.nodes:
        if n.type != "broadcast":
            assert f"{n.id}:0" in produced
            assert any(node.name == n.id for node in model.graph.node)
    params = {t.name for t in model.graph.initializer if "." in t.name and "/" not in t.name}
    assert params == set(expected_param_shapes(graph))


def test_without_weights_parameters_are_named_graph_inputs() -> None:
    graph = vgraph.load(TINY_FP32)
    model = lower_network(graph, None)
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    for key, shape in expected_param_shapes(graph).items():
        assert inputs[key] == list(shape)
    assert "lm_head.weight" not in inputs  # the tied head reads embedder.weight
    # ...and feeding them gives the result of initializers (up to onnxruntime's constant folding).
    weights = random_weights(graph)
    feeds = random_feeds(graph, 2)
    a, _ = onnx_outputs(model, {**feeds, **weights})
    b, _ = onnx_outputs(lower_network(graph, weights), feeds)
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)


def test_batch_dimension_is_dynamic() -> None:
    graph = vgraph.load(TINY)
    model = lower_network(graph, random_weights(graph))
    feeds5 = random_feeds(graph, 5, seed=1)
    out5, _ = onnx_outputs(model, feeds5)
    out1, _ = onnx_outputs(model, {k: v[2:3] for k, v in feeds5.items()})
    assert out5["lm_head:0"].shape == (5, 16, 96)
    np.testing.assert_allclose(out1["lm_head:0"][0], out5["lm_head:0"][2], rtol=1e-5, atol=1e-6)


def test_weight_mismatches_name_the_node() -> None:
    graph = vgraph.load(TINY_FP32)
    weights = random_weights(graph)
    del weights["block0_head1.wk"]
    with pytest.raises(VGraphError, match=r"tiny_1l_fp32.yml:\d+: node 'block0_head1'.*block0_head1.wk"):
        lower_network(graph, weights)
    weights = random_weights(graph)
    weights["embedder.weight"] = weights["embedder.weight"][:10]
    with pytest.raises(VGraphError, match=r"'embedder'.*shape \[10, 32\].*\[64, 32\]"):
        lower_network(graph, weights)


def test_plugin_op_registers_its_own_lowering() -> None:
    name = "test_onnx_scale_by_two"
    register_op(OpDef(name, "activation", "multiplies by two", origin="test"), replace=True)
    b = NetBuilder("plugin")
    b.node("x2", name)
    b.graph.node("x2").input_shapes = ((4, 3),)
    b.output("y", "x2")
    graph = b.build()
    LOWERINGS.pop(name, None)
    with pytest.raises(VGraphError, match=r"'x2'.*'test_onnx_scale_by_two' \(defined by plugin test\) has no "
                                          r"onnx lowering.*vgraph\.lowerings\.onnx"):
        lower_network(graph, {})

    @register_lowering(name)
    def _double(n):
        return [n.op("Mul", [n.inputs[0], n.float_const("two", 2.0)], out=n.out(0))]

    try:
        feeds = random_feeds(graph, 2)
        got, _ = onnx_outputs(lower_network(graph, {}), feeds)
        np.testing.assert_allclose(got["x2:0"], 2 * feeds["x2:in0"])
    finally:
        LOWERINGS.pop(name, None)


# ---------------------------------------------------------------------------
# Fused graphs compute what the unfused ones do
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", [TINY, TINY_FP32], ids=["tiny", "tiny_fp32"])
def test_fused_network_equals_unfused(fixture) -> None:
    graph = vgraph.load(fixture)
    weights = random_weights(graph, seed=4)
    fused, fused_weights = fuse_by_hand(graph, weights)
    assert fused.nodes_of_type("attention") and not fused.nodes_of_type("attention_head")
    assert len(fused.nodes_of_type("tied_lm_head_ce")) == 1
    feeds = random_feeds(graph, 2, seed=4)
    want, _ = onnx_outputs(lower_network(graph, weights), feeds)
    got, _ = onnx_outputs(lower_network(fused, fused_weights), fused_feeds(feeds))
    np.testing.assert_allclose(got["lm_head_ce:1"], want["lm_head:0"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["lm_head_ce:0"], want["loss:0"], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# check-onnx and export-onnx (the torch backend against onnxruntime)
# ---------------------------------------------------------------------------

FUSE = "fuse-heads,fuse-lm-head-ce"


@pytest.mark.parametrize("path,passes", [
    (NET6, None), (NET6, FUSE),
    pytest.param(NET8, None, marks=pytest.mark.slow), pytest.param(NET8, FUSE, marks=pytest.mark.slow),
], ids=["net6", "net6-fused", "net8", "net8-fused"])
def test_check_onnx_passes_on_production_networks(path, passes) -> None:
    """check-onnx's comparisons (one input scale here; the CLI runs three) on the production networks; on the
    fused 6-layer network also the inference export at three sequence lengths and its KV-cache decoder (the
    fused attention's cache; the per-head one is checked on the tiny fixtures, and both by the 6-layer
    generate check in TESTING.md)."""
    from vgraph.backends.onnx.check import check_network
    from vgraph.backends.onnx.inference_check import check_network_and_export
    from vgraph.transform.pipeline import run_pipeline

    graph = vgraph.load(path)
    if passes:
        run_pipeline(graph, passes)
    inference = path == NET6 and passes is not None
    report = (check_network_and_export if inference else check_network)(graph, batch=1, scales=(1.0,))
    assert report.ok, report.format()
    head, loss = ("lm_head_ce:1", "lm_head_ce:0") if passes else ("lm_head:0", "loss:0")
    cases = [(o.case, o.name, o.value) for o in report.outputs]
    seq = 128
    assert cases == [("training graph, x1", "logits", head), ("training graph, x1", "ce_loss", loss)] + (
        [*((f"inference, sequence {n}", "logits", head) for n in (1, seq // 2 + 1, seq)),
         (f"KV cache, {seq // 2}+1x{seq // 2}", "logits", head)] if inference else [])


def test_check_onnx_cli_prints_every_case_and_passes(capsys) -> None:
    from vgraph.backends.onnx.cli import main

    assert main(["check-onnx", str(TINY_FP32), "--batch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [f"training graph, x{s} " for s in ("0.1", "0.1", "1", "1", "10", "10")] + [
        f"inference, sequence {n} " for n in (1, 5, 8)] + ["KV cache, 4+1x4 "]
    rows = lines[3:-1]
    assert len(rows) == len(expected) and all(r.startswith(e) for r, e in zip(rows, expected)), lines
    assert all(r.endswith(" ok") for r in rows) and lines[-1] == "PASS"


def test_check_onnx_on_hand_fused_graph_agrees() -> None:
    from vgraph.backends.onnx.check import check_network

    graph, _ = fuse_by_hand(vgraph.load(TINY))
    report = check_network(graph, weights=None, batch=2)
    assert report.ok, report.format()


def test_check_onnx_fails_with_exit_1_when_a_lowering_is_wrong(capsys) -> None:
    from vgraph.backends.onnx.cli import main

    good = LOWERINGS["gelu"]
    LOWERINGS["gelu"] = lambda n: [n.op("Relu", [n.inputs[0]], out=n.out(0))]
    try:
        assert main(["check-onnx", str(TINY_FP32)]) == 1
    finally:
        LOWERINGS["gelu"] = good
    out = capsys.readouterr().out
    assert "FAIL" in out.splitlines()[-1]


def test_export_onnx_from_checkpoint_reproduces_the_torch_module(tmp_path, capsys) -> None:
    import torch

    from vgraph.backends.onnx.cli import main
    from vgraph.backends.torch import compile_network
    from vgraph.backends.torch.training.checkpoint import save_checkpoint

    graph = vgraph.load(TINY_FP32)
    module = compile_network(graph, train=False, seed=7)
    with torch.no_grad():
        for p in module.parameters():  # move away from the default init so the test sees the checkpoint
            p.add_(0.05 * torch.randn_like(p))
    save_checkpoint(tmp_path / "run" / "step-1", model_state=module.state_dict(), optimizer_states={},
                    rng_state={}, step=1)
    out = tmp_path / "tiny.onnx"
    assert main(["export-onnx", str(TINY_FP32), "--checkpoint", str(tmp_path / "run"), "-o", str(out),
                 "--with-loss"]) == 0
    assert "embedder:in0[batch, sequence], loss:in1[batch, sequence]" in capsys.readouterr().out
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    feeds = random_feeds(graph, 2, seed=7)
    got, _ = onnx_outputs(model, feeds)
    with torch.no_grad():
        want = module({k: torch.from_numpy(v) for k, v in feeds.items()})
    np.testing.assert_allclose(got["lm_head:0"], want["logits"].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["loss:0"], want["ce_loss"].numpy(), rtol=1e-4, atol=1e-5)

    # The default export: logits only, no targets input.
    assert main(["export-onnx", str(TINY_FP32), "--checkpoint", str(tmp_path / "run"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "inputs:  embedder:in0[batch, sequence]\n" in printed and "outputs: lm_head:0[batch, sequence, 64]" in printed
    got, _ = onnx_outputs(onnx.load(str(out)), feeds)
    assert set(got) == {"lm_head:0"}
    np.testing.assert_allclose(got["lm_head:0"], want["logits"].numpy(), rtol=1e-4, atol=1e-5)

    # The same (unfused-layout) checkpoint exported through the fusion passes: same function.
    fused_out = tmp_path / "tiny_fused.onnx"
    assert main(["export-onnx", str(TINY_FP32), "--checkpoint", str(tmp_path / "run" / "step-1"),
                 "--passes", FUSE, "-o", str(fused_out), "--with-loss"]) == 0
    fused, _ = onnx_outputs(onnx.load(str(fused_out)), fused_feeds(feeds))
    assert not any(n.name.startswith("block0_head") for n in onnx.load(str(fused_out)).graph.node)
    np.testing.assert_allclose(fused["lm_head_ce:1"], want["logits"].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fused["lm_head_ce:0"], want["ce_loss"].numpy(), rtol=1e-4, atol=1e-5)
    assert main(["check-onnx", str(TINY_FP32), "--checkpoint", str(tmp_path / "run"), "--passes", FUSE]) == 0


def test_export_onnx_without_weights_and_user_errors(tmp_path, capsys) -> None:
    from vgraph.backends.onnx.cli import main

    out = tmp_path / "shapes.onnx"
    assert main(["export-onnx", str(NET8), "--no-weights", "-o", str(out)]) == 0
    assert out.stat().st_size < 2_000_000  # structure only: no 180 MB of weights
    assert main(["export-onnx", str(TINY), "--checkpoint", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "missing" in capsys.readouterr().err
