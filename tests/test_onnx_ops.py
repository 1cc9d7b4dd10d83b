"""Per-op parity of the ONNX lowering: onnxruntime vs the torch backend, for every catalog op.

Each op with an inference meaning is lowered alone (its float inputs are
network inputs with declared shapes) and run in onnxruntime.  It is compared
with the torch backend through ``check_network`` (what ``vgraph check-onnx``
does) and with a small node-by-node interpreter over
``vgraph.backends.torch.kernels``, the functions that define the ops'
semantics.  Weights are random O(1) values (not the torch init, whose zero
biases and unit norm scales would leave parts of each op untested).  All
float32; tolerance rtol 1e-4, atol 1e-5.
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
from vgraph.backends.torch import kernels as K
from vgraph.backends.torch.compression import Codec
from vgraph.ir.builder import NetBuilder

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
    if t == "compress":  # the activation's wire round trip (backends/torch/compression.py defines it)
        return [Codec(cfg["activations"], cfg["scale"]).round_trip(xs[0])]
    if t == "linear":
        if cfg.get("tie_weight_alias"):
            pub = graph.publishers()[cfg["tie_weight_alias"]]
            return [F.linear(xs[0], _p(w, pub.id, "weight"))]
        return [F.linear(xs[0], _p(w, n.id, "weight"), _p(w, n.id, "bias"))]
    if t == "embedder":
        y = F.embedding(xs[0], _p(w, n.id, "weight"))
        return [y + _p(w, n.id, "position") if cfg["position_encoding"] == "learned" else y]
    if t == "layernorm":
        return [F.layer_norm(xs[0], (cfg["dim"],), _p(w, n.id, "weight"), _p(w, n.id, "bias"), cfg["eps"])]
    if t == "attention_head":
        return [K.attention_head(xs[0], *(_p(w, n.id, k) for k in ("wq", "bq", "wk", "bk", "wv", "bv")),
                                 causal=cfg["causal"], rope_theta=_rope(cfg))]
    if t == "attention":
        proj = cfg["output_projection"]
        return [K.multihead_attention(
            xs[0], _p(w, n.id, "qkv_weight"), _p(w, n.id, "qkv_bias"),
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
        "relu": lambda a: F.relu(a[0]), "gelu": lambda a: F.gelu(a[0]), "silu": lambda a: F.silu(a[0]),
        "swiglu": lambda a: K.swiglu(a[0]), "dropout": lambda a: a[0], "add": lambda a: a[0] + a[1],
        "stack": lambda a: K.stack(a, cfg.get("axis", -1)),
        "reshape": lambda a: K.reshape(a[0], cfg["target_shape"]),
        "mask": lambda a: K.apply_mask(a[0], causal=cfg["causal"], mask_val=cfg["mask_val"]),
    }
    if t == "broadcast":
        return [xs[0]] * cfg["num_outputs"]
    return [simple[t](xs)]


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
    report = check_network(graph, weights=weights, batch=batch, seed=seed)
    assert report.ok, report.format()
    assert len(report.outputs) == len(graph.outputs) + len(graph.costs)
    feeds = random_feeds(graph, batch, seed)
    got, provider = onnx_outputs(lower_network(graph, weights), feeds)
    want = reference_run(graph, weights, feeds)
    assert got, "the model has no outputs"
    for name, value in got.items():
        assert value.shape == want[name].shape, name
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=f"{name} ({provider})")
    return got


# ---------------------------------------------------------------------------
# One-op networks
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


ATTN = dict(seq_len=S, position_encoding="rope", rope_theta=10000.0)

SINGLE_OP_CASES = {
    "linear": lambda: _single("linear", [(S, D)], in_dim=D, out_dim=12),
    "layernorm": lambda: _single("layernorm", [(S, D)], dim=D, eps=1e-5),
    "attention_head-rope-causal": lambda: _single("attention_head", [(S, D)], head_dim=HD, input_dim=D,
                                                  causal=True, **ATTN),
    "attention_head-plain": lambda: _single("attention_head", [(S, D)], head_dim=HD, input_dim=D,
                                            seq_len=S, causal=False, position_encoding="none"),
    "attention-rope-causal": lambda: _single("attention", [(S, D)], num_heads=2, head_dim=HD, dim=D,
                                             causal=True, **ATTN),
    "attention-projection": lambda: _single("attention", [(S, 12)], num_heads=3, head_dim=6, dim=12,
                                            causal=True, output_projection=True, **ATTN),
    "attention-narrow": lambda: _single("attention", [(S, D)], num_heads=2, head_dim=4, dim=D, causal=True,
                                        **ATTN),
    "attention-plain": lambda: _single("attention", [(S, D)], num_heads=2, head_dim=HD, dim=D, seq_len=S,
                                       causal=False, position_encoding="none"),
    "relu": lambda: _single("relu", [(S, D)]),
    "gelu": lambda: _single("gelu", [(S, D)]),
    "silu": lambda: _single("silu", [(S, D)]),
    "swiglu": lambda: _single("swiglu", [(S, D)]),
    "dropout": lambda: _single("dropout", [(S, D)], rate=0.5),
    "broadcast": lambda: _single("broadcast", [(S, D)], num_outputs=3),
    "stack-last": lambda: _single("stack", [(S, 4), (S, 6), (S, 2)], axis=-1),
    "stack-first": lambda: _single("stack", [(3, D), (S, D)], axis=0),
    "add": lambda: _single("add", [(S, D), (S, D)]),
    "reshape": lambda: _single("reshape", [(S, D)], target_shape=[2, -1, 4]),
    "mask-causal": lambda: _single("mask", [(3, S, S)], causal=True, mask_val=-1e4),
    "mask-off": lambda: _single("mask", [(S, S)], causal=False, random_prob=0.5),
    "cost-mse": lambda: _single("cost", [(S, D), (S, D)], cost=True, cost_function="mse"),
    "cost-ce_logits": lambda: _single("cost", [(S, V)], cost=True, cost_function="ce_logits", vocab_size=V),
    "compress-int8-token": lambda: _single("compress", [(S, D)], activations="int8", scale="token"),
    "compress-int8-channel": lambda: _single("compress", [(3, S, D)], activations="int8", scale="channel"),
    "compress-int8-vector": lambda: _single("compress", [(D,)], activations="int8"),
    "compress-fp16": lambda: _single("compress", [(S, D)], activations="fp16"),
    "compress-bf16": lambda: _single("compress", [(S, D)], activations="bf16"),
    "compress-none": lambda: _single("compress", [(S, D)], activations="none", gradients="int8"),
}


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
    assert_parity(SINGLE_OP_CASES[case]())


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


def test_every_catalog_op_has_a_lowering_and_a_parity_case() -> None:
    from vgraph.backends.onnx import LOWERINGS

    covered = {case.split("-")[0] for case in SINGLE_OP_CASES} | {
        "cost", "embedder", "tied_lm_head_ce", "send", "receive", "weight_replica"}  # boundary: below
    text_io = {"tokenizer", "detokenizer"}
    for op in REGISTRY:
        if op.origin != "vgraph":
            continue
        assert op.name in LOWERINGS, op.name
        assert op.name in covered | text_io, f"no parity case for {op.name}"


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
