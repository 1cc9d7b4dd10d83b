"""Per-op parity of the ONNX lowering: onnxruntime vs the torch backend, for every catalog op.

Each op with an inference meaning is lowered alone, on each of the examples
its OpDef declares (``vgraph.ir.builder.example_graph``: float inputs are network
inputs with declared shapes), and run in onnxruntime.  It is compared with
the torch backend through ``check_network`` (what ``vgraph check-onnx`` does)
and with a small node-by-node interpreter over
``vgraph.backends.torch.lowering.kernels``, the functions that define the ops'
semantics.  Weights are random O(1) values (not the torch init, whose zero
biases and unit norm scales would leave parts of each op untested).  All
float32; tolerance rtol 1e-4, atol 1e-5 element-wise against the kernels.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vgraph import REGISTRY, Graph, VGraphError
from vgraph.backends.onnx import lower_network, value_name
from vgraph.backends.onnx.check import check_network, onnx_outputs, random_feeds, random_weights
from vgraph.backends.torch.lowering import kernels as K
from vgraph.backends.torch.lowering.wire_formats import Codec
from vgraph.ir.builder import NetBuilder, example_graph

RTOL, ATOL = 1e-4, 1e-5
S, D, HD, V = 8, 16, 8, 24


# ---------------------------------------------------------------------------
# Reference interpreter over the torch kernels
# ---------------------------------------------------------------------------


def _p(w: Mapping[str, torch.Tensor], node_id: str, name: str) -> torch.Tensor:
    return w[f"{node_id}.{name}"]


def _rope(cfg) -> float | None:
    return cfg["rope_theta"] if cfg["position_encoding"] == "rope" else None


def _ref_node(graph: Graph, n, xs: list[torch.Tensor], w: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    cfg, t = n.cfg, n.type
    if t == "compress":  # the activation's wire round trip (backends/torch/lowering/wire_formats.py defines it)
        return [Codec(cfg["activations"], cfg["scale"]).round_trip(xs[0])]
    if t == "linear":
        if cfg.get("tie_weight_alias"):
            pub = graph.publishers()[cfg["tie_weight_alias"]]
            return [F.linear(xs[0], _p(w, pub.id, "weight"))]
        return [F.linear(xs[0], _p(w, n.id, "weight"), _p(w, n.id, "bias") if cfg["bias"] else None)]
    if t == "embedder":
        y = F.embedding(xs[0], _p(w, n.id, "weight"))
        return [y + _p(w, n.id, "position") if cfg["position_encoding"] == "learned" else y]
    if t == "layernorm":
        return [F.layer_norm(xs[0], (cfg["dim"],), _p(w, n.id, "weight"), _p(w, n.id, "bias"), cfg["eps"])]
    if t == "rmsnorm":
        return [F.rms_norm(xs[0], (cfg["dim"],), _p(w, n.id, "weight"), cfg["eps"])]
    if t == "attention_head" and not cfg["kv_input"]:
        return [K.attention_head(xs[0], *(w.get(f"{n.id}.{k}") for k in ("wq", "bq", "wk", "bk", "wv", "bv")),
                                 causal=cfg["causal"], rope_theta=_rope(cfg))]
    if t in ("attention_head", "kv_head"):
        return [_gqa_head_ref(t, cfg, xs, {k.split(".", 1)[1]: v for k, v in w.items() if k.startswith(f"{n.id}.")})]
    if t == "attention":
        proj = cfg["output_projection"]
        if cfg.get("num_kv_heads") not in (None, cfg["num_heads"]):
            return [_gqa_attention_ref(cfg, xs[0], {k.split(".", 1)[1]: v for k, v in w.items()
                                                    if k.startswith(f"{n.id}.")})]
        return [K.multihead_attention(
            xs[0], _p(w, n.id, "qkv_weight"), w.get(f"{n.id}.qkv_bias"),
            _p(w, n.id, "out_weight") if proj else None, _p(w, n.id, "out_bias") if proj else None,
            num_heads=cfg["num_heads"], head_dim=cfg["head_dim"], causal=cfg["causal"], rope_theta=_rope(cfg))]
    if t == "tied_lm_head_ce":
        weight = _p(w, graph.publishers()[cfg["tie_weight_alias"]].id, "weight")
        loss = K.tied_lm_head_ce(xs[0], weight, xs[1], chunk_size=5, ignore_index=cfg["ignore_index"])
        return [loss, K.logits_chunk(xs[0], weight)]
    if t == "cost":
        if cfg["cost_function"] == "mse":
            return [F.mse_loss(xs[0], xs[1])]
        rows = xs[0].reshape(-1, xs[0].shape[-1])
        if cfg["cost_function"] == "ce":
            log_p = torch.log(rows.clamp_min(torch.finfo(rows.dtype).tiny))  # p = 0 stays finite
            return [F.nll_loss(log_p, xs[1].reshape(-1), ignore_index=cfg["ignore_index"])]
        return [F.cross_entropy(rows, xs[1].reshape(-1), ignore_index=cfg["ignore_index"])]
    simple: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
        "relu": lambda a: F.relu(a[0]), "gelu": lambda a: F.gelu(a[0], approximate=cfg["approximate"]),
        "silu": lambda a: F.silu(a[0]),
        "swiglu": lambda a: K.swiglu(a[0]), "dropout": lambda a: a[0], "add": lambda a: a[0] + a[1],
        "stack": lambda a: K.stack(a, cfg.get("axis", -1)),
        "reshape": lambda a: K.reshape(a[0], cfg["target_shape"]),
        "mask": lambda a: K.apply_mask(a[0], causal=cfg["causal"], mask_val=cfg["mask_val"]),
    }
    if t == "broadcast":
        return [xs[0]] * cfg["num_outputs"]
    if t in ("weight_replica", "send", "receive"):  # a publisher owns its weight; boundaries pass tensors on
        return list(xs)
    return [simple[t](xs)]


def _rotated(x: torch.Tensor, cfg) -> torch.Tensor:
    if _rope(cfg) is None:
        return x
    cos, sin = K.rope_cos_sin(x.shape[-2], x.shape[-1], _rope(cfg), dtype=x.dtype)
    return K.apply_rope(x, cos, sin)


def _gqa_head_ref(t: str, cfg, xs: list[torch.Tensor], p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A kv_head (K rotated, then V) or a query head reading one, on SDPA."""
    if t == "kv_head":
        return torch.cat([_rotated(F.linear(xs[0], p["wk"], p.get("bk")), cfg), F.linear(xs[0], p["wv"], p.get("bv"))],
                         dim=-1)
    q = _rotated(F.linear(xs[0], p["wq"], p.get("bq")), cfg)
    k, v = xs[1].split(cfg["head_dim"], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=cfg["causal"])


def _gqa_attention_ref(cfg, x: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Grouped-query attention as Hugging Face's Llama computes it: K/V heads repeated by repeat_kv."""
    heads, kv, hd = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    b, s, _ = x.shape
    q, k, v = F.linear(x, p["qkv_weight"], p.get("qkv_bias")).split([heads * hd, kv * hd, kv * hd], dim=-1)
    q = _rotated(q.view(b, s, heads, hd).transpose(1, 2), cfg)
    k = _rotated(k.view(b, s, kv, hd).transpose(1, 2), cfg)
    v = v.view(b, s, kv, hd).transpose(1, 2)

    def repeat_kv(t: torch.Tensor) -> torch.Tensor:  # transformers.models.llama.modeling_llama.repeat_kv
        return t[:, :, None].expand(b, kv, heads // kv, s, hd).reshape(b, heads, s, hd)

    out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), is_causal=cfg["causal"])
    out = out.transpose(1, 2).reshape(b, s, heads * hd)
    return F.linear(out, p["out_weight"], p["out_bias"]) if cfg["output_projection"] else out


def reference_run(graph: Graph, weights: Mapping[str, np.ndarray],
                  feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Value name ("node:slot") -> array for every output slot, by the torch kernels."""
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    values: dict[tuple[str, int], torch.Tensor] = {}
    with torch.no_grad():
        for n in graph.topo_order():
            xs = []
            for slot in range(graph.num_inputs(n.id)):
                e = graph.input_edge(n.id, slot)
                xs.append(torch.from_numpy(feeds[f"{n.id}:in{slot}"]) if e is None else values[(e.src, e.src_slot)])
            for slot, y in enumerate(_ref_node(graph, n, xs, w)):
                values[(n.id, slot)] = y
    return {value_name(*k): v.numpy() for k, v in values.items()}


def assert_parity(graph: Graph, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """onnxruntime == the torch backend (check-onnx's comparison) == the kernels reference."""
    weights = random_weights(graph, seed)
    report = check_network(graph, weights=weights, batch=batch, seed=seed, scales=(1.0, 10.0))
    assert report.ok, report.format()
    float_inputs = any(v.dtype == np.float32 for v in random_feeds(graph, 1).values())
    assert len(report.outputs) == (2 if float_inputs else 1) * (len(graph.outputs) + len(graph.costs))
    feeds = random_feeds(graph, batch, seed)
    got, provider = onnx_outputs(lower_network(graph, weights), feeds)
    want = reference_run(graph, weights, feeds)
    assert got, "the model has no outputs"
    for name, value in got.items():
        assert value.shape == want[name].shape, name
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=f"{name} ({provider})")
    return got


# ---------------------------------------------------------------------------
# One-op networks: the examples every catalog op declares (what `check-onnx --ops` runs)
# ---------------------------------------------------------------------------


def _single(type_name: str, shapes: list[tuple[int, ...]], cost: bool = False, **config) -> Graph:
    """One node whose float inputs are network inputs of the given per-sample shapes."""
    b = NetBuilder(f"one-{type_name}")
    b.node("op", type_name, **config)
    b.graph.node("op").input_shapes = tuple(shapes)
    g = b.graph
    for slot in range(g.node("op").op.outputs_for(g.node("op").cfg)):
        (b.cost if cost and slot == 0 else b.output)(f"out{slot}", "op", slot)
    return b.build()


SINGLE_OP_CASES = {f"{op.name}-{ex.label or i}": (op.name, ex) for op in REGISTRY if op.origin == "vgraph"
                   for i, ex in enumerate(op.examples)}


@pytest.mark.parametrize("scale", ["token", "channel"])
def test_compress_int8_is_bit_for_bit_torchs_with_zero_and_non_finite_groups(scale: str) -> None:
    graph = _single("compress", [(3, S, D)], activations="int8", scale=scale)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, S, D)) * 10.0 ** rng.integers(-6, 6, (2, 3, S, 1))).astype(np.float32)
    x[0, 0, 1] = 0.0
    x[0, 1, 2, 3], x[1, 2, 0, 0], x[1, 0, 4, 5] = np.nan, np.inf, -np.inf
    got, _ = onnx_outputs(lower_network(graph, {}), {"op:in0": x})
    want = Codec("int8", scale).round_trip(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got["op:0"], want)  # equal NaN positions too
    assert np.isnan(want).any() and (want == 0).any()


@pytest.mark.parametrize("case", sorted(SINGLE_OP_CASES))
def test_single_op_parity(case: str) -> None:
    op, ex = SINGLE_OP_CASES[case]
    assert_parity(example_graph(op, dict(ex.config), ex.inputs))


def test_variadic_examples_really_join_every_input() -> None:
    """A stack's inputs past the first are fed by identity VNodes (an unconnected slot past the minimum
    would not exist): the example joins all three."""
    ex = next(e for e in REGISTRY.get("stack").examples if e.label == "features")
    g = example_graph("stack", dict(ex.config), ex.inputs)
    assert g.node("op").outputs[0].shape == (S, 12) and g.num_inputs("op") == 3


def test_cost_ce_from_probabilities() -> None:
    g = _single("cost", [(S, V)], cost=True, cost_function="ce")
    weights: dict[str, np.ndarray] = {}
    feeds = random_feeds(g, 2, seed=3)
    logits = feeds["op:in0"]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    probs[0, 0, feeds["op:in1"][0, 0]] = 0.0  # a zero probability on a target: large but finite
    feeds["op:in0"] = probs.astype(np.float32)
    got, _ = onnx_outputs(lower_network(g, weights), feeds)
    want = reference_run(g, weights, feeds)
    assert np.isfinite(got["op:0"])
    np.testing.assert_allclose(got["op:0"], want["op:0"], rtol=RTOL, atol=ATOL)


def test_cross_entropy_respects_ignore_index() -> None:
    g = _single("cost", [(S, V)], cost=True, cost_function="ce_logits", ignore_index=-100)
    feeds = random_feeds(g, 2, seed=5)
    feeds["op:in1"][0, :3] = -100
    got, _ = onnx_outputs(lower_network(g, {}), feeds)
    want = reference_run(g, {}, feeds)
    np.testing.assert_allclose(got["op:0"], want["op:0"], rtol=RTOL, atol=ATOL)


def _embedder_net(position_encoding: str, head: str | None) -> Graph:
    """embedder -> [tied linear | tied_lm_head_ce]: tokens in, tied weight read twice."""
    b = NetBuilder(f"embed-{position_encoding}-{head}")
    b.node("emb", "embedder", vocab_size=V, dim=D, seq_len=S, position_encoding=position_encoding,
           shared_weight_alias="tok")
    if head is None:
        b.output("x", "emb")
        return b.build()
    if head == "linear":
        b.node("lm", "linear", in_dim=D, out_dim=V, tie_weight_alias="tok")
        b.edge("emb", "lm")
        b.output("logits", "lm")
        return b.build()
    b.node("lm", "tied_lm_head_ce", in_dim=D, out_dim=V, tie_weight_alias="tok")
    b.edge("emb", "lm")
    b.cost("loss", "lm")
    if head == "fused+logits":
        b.output("logits", "lm", 1)
    return b.build()


@pytest.mark.parametrize("pe", ["none", "learned", "rope"])
def test_embedder_parity(pe: str) -> None:
    assert_parity(_embedder_net(pe, None))


@pytest.mark.parametrize("head", ["linear", "fused", "fused+logits"])
def test_tied_heads_parity_and_share_one_initializer(head: str) -> None:
    g = _embedder_net("learned", head)
    got = assert_parity(g)
    model = lower_network(g, random_weights(g))
    inits = [t.name for t in model.graph.initializer]
    assert inits.count("emb.weight") == 1
    assert not any(name.startswith("lm.") for name in inits)
    readers = {n.name.split("/")[0] for n in model.graph.node if "emb.weight" in n.input}
    assert readers == {"emb", "lm"}
    assert ("lm:1" in got) == (head == "fused+logits")


def test_text_io_ops_are_refused_with_the_node_named() -> None:
    b = NetBuilder("text")
    b.node("tok", "tokenizer", pad_length=S, vocab_size=V)
    b.node("emb", "embedder", vocab_size=V, dim=D, seq_len=S)
    b.edge("tok", "emb")
    b.output("x", "emb")
    with pytest.raises(VGraphError, match="'tok'.*no ONNX lowering"):
        lower_network(b.build(), None)


def test_every_catalog_op_has_a_lowering_and_examples() -> None:
    from vgraph.backends.onnx import LOWERINGS

    text_io, no_computation = {"tokenizer", "detokenizer"}, {"weight_replica"}
    for op in REGISTRY:
        if op.origin != "vgraph":
            continue
        assert op.name in LOWERINGS, op.name
        assert op.examples or op.name in text_io | no_computation, f"no examples for {op.name}"


# ---------------------------------------------------------------------------
# Whole tiny networks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["TINY", "TINY_FP32"])
def test_tiny_network_parity(fixture: str) -> None:
    import vgraph
    from tests.conftest import TINY, TINY_FP32

    graph = vgraph.load({"TINY": TINY, "TINY_FP32": TINY_FP32}[fixture])
    got = assert_parity(graph, batch=3)
    assert set(got) == {"lm_head:0", "loss:0"}
    assert got["loss:0"].shape == ()


def test_boundary_ops_of_a_part_pass_tensors_through() -> None:
    """receive -> relu -> send: the part's graph input comes out of the send, relu'd."""
    b = NetBuilder("part")
    b.node("rx", "receive", peer_pnode="a", peer_node="x", peer_slot=0, shape=f"[{S}, {D}]", dtype="float32")
    b.node("act", "relu")
    b.node("tx", "send", peer_pnode="b", peer_node="y", peer_slot=0)
    b.chain("rx", "act", "tx")
    b.output("tx", "tx")
    model = lower_network(b.build(), {})
    x = np.random.default_rng(0).standard_normal((2, S, D)).astype(np.float32)
    got, _ = onnx_outputs(model, {"rx:in0": x})
    (out,) = got.values()
    np.testing.assert_array_equal(out, np.maximum(x, 0))


# ---------------------------------------------------------------------------
# vgraph check-onnx --ops
# ---------------------------------------------------------------------------


def _ops(argv, capsys) -> tuple[int, str, str]:
    from vgraph.backends.onnx.cli import main

    code = main(["check-onnx", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_onnx_ops_passes_the_catalog_and_fails_a_tanh_gelu(capsys, monkeypatch) -> None:
    code, out, _ = _ops(["--ops", "gelu", "linear", "attention"], capsys)
    assert code == 0 and out.rstrip().endswith("PASS")
    assert "gelu #1 x0.01" in out and "gelu #1 x100" in out and "linear tied x3" in out
    assert "attention projection x0.3" in out
    from vgraph.backends.onnx import LOWERINGS

    monkeypatch.setitem(LOWERINGS, "gelu", lambda n: [n.op("Gelu", [n.inputs[0]], out=n.out(0), approximate="tanh")])
    code, out, _ = _ops(["--ops", "gelu"], capsys)
    failed = [line.split()[2] for line in out.splitlines() if line.endswith(" FAIL")]
    assert code == 1 and {"x1", "x3"} <= set(failed) and "x0.01" not in failed


def test_check_onnx_ops_adds_the_configs_a_network_uses(capsys) -> None:
    from tests.conftest import TINY

    code, out, _ = _ops([str(TINY), "--ops", "stack", "swiglu"], capsys)
    assert code == 0
    assert "stack as 'block0_stack' x1 " in out and "stack as 'block1_stack'" not in out  # same config: once
    assert "swiglu as 'head_swiglu' x1 " in out and "swiglu #1 x1 " in out


@pytest.mark.parametrize("argv,message", [
    (["--ops", "no_such_op"], "unknown op type 'no_such_op'"),
    (["--ops", "gelu", "--checkpoint", "run"], "--checkpoint does not apply"),
    (["--ops", "gelu", "--passes", "fuse-heads"], "--passes does not apply"),
    ([], "needs a network FILE"),
])
def test_check_onnx_ops_refuses_what_does_not_apply(argv, message, capsys) -> None:
    code, _, err = _ops(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_an_op_without_examples_needs_a_network(capsys) -> None:
    from vgraph import OpDef, register_op
    from vgraph.backends.onnx import register_lowering as onnx_lowering
    from vgraph.backends.torch import register_lowering as torch_lowering

    register_op(OpDef("twice_noex", "activation", "2 x", origin="test"), replace=True)
    torch_lowering("twice_noex", replace=True)(lambda ctx: [ctx.call(torch.mul, ctx.inputs[0], 2.0)])
    onnx_lowering("twice_noex", lambda n: [n.op("Add", [n.inputs[0], n.inputs[0]], out=n.out(0))], replace=True)
    code, _, err = _ops(["--ops", "twice_noex"], capsys)
    assert code == 2 and "declares no examples" in err and "no network was given" in err
