"""Built-in passes: structure, idempotency, what each promises to preserve."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import NET6, NET8, TINY
from tools.gen_networks import TransformerSpec, transformer
from vgraph import dumps, load, loads
from vgraph.base.diagnostics import VGraphError
from vgraph.run.layout import param_sources, to_graph_layout, to_unfused_layout
from vgraph.transform.pipeline import DEFAULT_PIPELINE, run_pipeline

BUILTIN = ["dead-nodes", "precision", "fuse-heads", "fuse-lm-head-ce"]


def types(graph) -> Counter:
    return Counter(n.type for n in graph.nodes)


def endpoint_view(graph):
    """What a client can read: endpoint names with their shapes."""
    out = {}
    for kind, eps in graph.endpoints.items():
        for ep in eps:
            node = graph.node(ep.node)
            out[(kind, ep.name)] = node.outputs[ep.slot].shape if node.outputs else None
    return out


def test_production_8_layer_acceptance(net8):
    g = net8.copy()
    run_pipeline(g, "fuse-heads,fuse-lm-head-ce")
    t = types(g)
    assert t["attention"] == 8 and t["attention_head"] == 0
    assert t["tied_lm_head_ce"] == 1 and t["cost"] == 0
    again = loads(dumps(g))  # the optimized YAML validates (annotations are not part of the YAML)
    assert dumps(again) == dumps(g)


@pytest.mark.parametrize("path", [NET6, NET8, TINY])
@pytest.mark.parametrize("name", BUILTIN)
def test_each_pass_is_idempotent_and_keeps_endpoints(path, name):
    g = load(path)
    before = endpoint_view(g)
    run_pipeline(g, name)
    once = g.copy()
    pm = run_pipeline(g, name)
    assert not pm.records[0].changed, pm.report()
    assert g == once
    assert endpoint_view(g) == before


def test_default_pipeline_keeps_every_output_cost_and_metric(net6):
    g = net6.copy()
    pm = run_pipeline(g)
    assert [r.name for r in pm.records] == DEFAULT_PIPELINE.names
    assert endpoint_view(g) == endpoint_view(net6)
    logits = next(ep for ep in g.outputs if ep.name == "logits")
    assert (g.node(logits.node).type, logits.slot) == ("tied_lm_head_ce", 1)


def four_head_network(**kw):
    return transformer(TransformerSpec("four-heads", layers=1, vocab=64, seq_len=8, dim=32, heads=4,
                                       ffn=64, head_up=64, **kw))


def place(graph, pnodes):
    for h, p in zip(sorted(n.id for n in graph.nodes_of_type("attention_head")), pnodes):
        graph.node(h).meta["pnode"] = p


def test_partial_fusion_per_pnode_keeps_head_order():
    g = four_head_network()
    place(g, ["A", "A", "B", "B"])
    run_pipeline(g, "fuse-heads")
    attn = sorted(g.nodes_of_type("attention"), key=lambda n: n.id)
    assert [a.config["fused_from"] for a in attn] == ["block0_head0,block0_head1", "block0_head2,block0_head3"]
    assert [a.meta["pnode"] for a in attn] == ["A", "B"]
    stack = g.node("block0_stack")
    assert [e.src for e in g.in_edges(stack.id)] == [a.id for a in attn]
    assert g.node("block0_heads").cfg["num_outputs"] == 2


def test_heads_never_fused_across_pnodes_and_explain_says_why():
    g = four_head_network()
    place(g, ["A", "B", "A", "B"])
    pm = run_pipeline(g, "fuse-heads", explain=True)
    assert not pm.records[0].changed
    assert any("no two neighbouring heads are on the same PNode" in x for x in pm.ctx.explanations)


def test_heads_in_different_groups_are_left_alone():
    g = four_head_network()
    g.node("block0_head3").set_config(colocate_group="elsewhere")
    pm = run_pipeline(g, "fuse-heads", explain=True)
    assert types(g)["attention_head"] == 4
    assert any("differs from 'block0_head0' in colocate_group" in x for x in pm.ctx.explanations)


def test_lm_head_fusion_refuses_when_logits_feed_another_node():
    g = load(TINY)
    g.add_node(type(g.nodes[0])("probe", "relu"))
    g.add_edge("lm_head", 0, "probe", 0)
    g.add_endpoint("outputs", type(g.outputs[0])("probe_out", "probe", 0))
    pm = run_pipeline(g, "fuse-lm-head-ce", explain=True)
    assert types(g)["cost"] == 1
    assert any("also feed 'probe'" in x for x in pm.ctx.explanations)


@pytest.mark.parametrize("target,compute,scaling", [
    ("cpu", "float32", False), ("cuda-sm75", "float16", True), ("cuda-sm80", "bfloat16", False),
    ("cuda-sm90", "bfloat16", False)])
def test_precision_policy(net8, target, compute, scaling):
    g = net8.copy()
    run_pipeline(g, f"precision{{target={target}}}")
    assert g.meta["precision"]["compute_dtype"] == compute
    assert g.meta["precision"]["loss_scaling"] is scaling
    lin = g.node("block0_ffn_up").meta["precision"]
    assert lin["activation"] == compute and lin["param"] == compute
    assert lin["master"] == ("float32" if compute != "float32" else None)
    assert g.node("loss").meta["precision"]["loss"] == "float32"
    assert g.attrs["precision"] == "fp16"  # the declared precision stays
    assert "precision: fp16" in dumps(g)


def test_precision_on_cpu_says_so(net6):
    pm = run_pipeline(net6.copy(), "precision")
    assert any("float32" in n and "cpu" in n for n in pm.ctx.notes)


def test_precision_rejects_unknown_target(tiny):
    with pytest.raises(VGraphError, match="unknown target 'gpu'"):
        run_pipeline(tiny, "precision{target=gpu}")


def test_dead_nodes_removes_unreachable_but_keeps_tied_publisher(tiny):
    g = tiny
    Node = type(g.nodes[0])
    g.add_node(Node("orphan_relu", "relu"))
    g.add_edge("final_norm", 0, "orphan_relu", 0)
    g.add_node(Node("orphan_gelu", "gelu"))
    g.add_edge("orphan_relu", 0, "orphan_gelu", 0)
    pm = run_pipeline(g, "dead-nodes")
    assert pm.records[0].changes == {"removed": 2}
    assert "orphan_relu" not in g and "embedder" in g


def test_checkpoint_layout_round_trip_is_exact(net6):
    rng = np.random.default_rng(0)
    unfused = {k: rng.standard_normal((rows,) + ((4,) if "w" in k.split(".")[1] else ())).astype(np.float32)
               for k, [(_, rows)] in param_sources(net6).items()}
    fused = net6.copy()
    run_pipeline(fused)
    state = to_graph_layout(unfused, fused, lambda xs: np.concatenate(xs, axis=0))
    heads = [f"block0_head{h}" for h in range(8)]
    expect = np.concatenate([unfused[f"{h}.w{x}"] for x in "qkv" for h in heads])
    assert np.array_equal(state["block0_attention.qkv_weight"], expect)
    back = to_unfused_layout(state, fused, lambda a, rows: np.split(a, np.cumsum(rows)[:-1]))
    assert back.keys() == unfused.keys()
    assert all(np.array_equal(back[k], unfused[k]) for k in unfused)


def test_fused_layout_covers_every_unfused_parameter_once(net8):
    fused = net8.copy()
    run_pipeline(fused)
    pieces = [k for srcs in param_sources(fused).values() for k, _ in srcs]
    assert sorted(pieces) == sorted(param_sources(net8))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       placement=st.lists(st.sampled_from(["A", "B", None]), min_size=12, max_size=12),
       precision=st.sampled_from(["fp16", "bf16", None]),
       target=st.sampled_from(["cpu", "cuda-sm75", "cuda-sm86"]))
def test_default_pipeline_property(layers, heads, placement, precision, target):
    g = transformer(TransformerSpec("p", layers=layers, vocab=64, seq_len=8, dim=32, heads=heads, ffn=64,
                                    head_up=64, precision=precision))
    for node, pnode in zip(g.nodes_of_type("attention_head"), placement):
        if pnode:
            node.meta["pnode"] = pnode
    original = g.copy()
    run_pipeline(g, DEFAULT_PIPELINE, target=target)
    assert loads(dumps(g)) is not None  # valid again as YAML
    assert endpoint_view(g) == endpoint_view(original)
    pieces = sorted(k for srcs in param_sources(g).values() for k, _ in srcs)
    assert pieces == sorted(param_sources(original))
    again = g.copy()
    assert not any(r.changed for r in run_pipeline(g, DEFAULT_PIPELINE, target=target).records)
    assert g == again
