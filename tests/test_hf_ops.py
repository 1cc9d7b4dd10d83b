"""The ops the Hugging Face families need (issue 37, item 1): rmsnorm, gelu tanh, linear without bias, Q/K/V
biases off, grouped-query attention as one `attention` (num_kv_heads) and per head (kv_head + query heads
with kv_input).

Each op's torch lowering is checked against an independent reference written here with torch's own
functions (F.rms_norm, the tanh formula of GPT-2's gelu_new, F.scaled_dot_product_attention with
Hugging Face's repeat_kv), in float32 at float32 tolerance; the per-head GQA network against the fused
fixture with the weights mapped by hand; fuse-heads against the unfused network; the ONNX export (the
KV-cache decoder included) through check-onnx's own comparison; training through `vgraph train`.
"""
from __future__ import annotations

import json
import math
from math import prod
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vgraph
from vgraph import VGraphError
from vgraph.backends.onnx import lower_inference
from vgraph.backends.onnx.inference_check import check_network_and_export
from vgraph.backends.torch import cli, compile_network, init_state
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.ir.builder import NetBuilder, example_graph
from vgraph.ops.registry import get_op
from vgraph.run.layout import to_graph_layout, to_unfused_layout
from vgraph.transform.pipeline import run_pipeline
from vgraph.types import TensorType

FIXTURES = Path(__file__).parent / "fixtures"
GQA, GQA_FUSED = FIXTURES / "tiny_gqa.yml", FIXTURES / "tiny_gqa_fused.yml"
HEADS, KV, HD, DIM, SEQ, VOCAB, LAYERS = 4, 2, 8, 32, 8, 64, 2
F32 = dict(rtol=1.3e-6, atol=1e-5)  # torch's float32 defaults: a few roundings of O(1) values


def _run_one(op: str, config: dict, *inputs: torch.Tensor, params: dict[str, torch.Tensor] | None = None):
    """One VNode of `op` compiled by the torch backend on `inputs`, with `params` (default: seeded)."""
    g = example_graph(op, config, tuple(tuple(x.shape[1:]) for x in inputs))
    state = init_state(g, seed=1) if params is None else {f"op.{k}": v for k, v in params.items()}
    module = compile_network(g, train=False, unfused_state=state)
    feeds = {"op:in0": inputs[0], **({"input1:in0": inputs[1]} if len(inputs) > 1 else {})}
    return module(feeds)["out0"], {k.split(".", 1)[1]: v for k, v in state.items()}


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Hugging Face's rotate_half RoPE (modeling_llama.apply_rotary_pos_emb), positions 0..S-1."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
    return x * emb.cos().to(x.dtype) + rotated * emb.sin().to(x.dtype)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers.models.llama.modeling_llama.repeat_kv: [B, KV, S, hd] -> [B, KV*groups, S, hd]."""
    b, kv, s, hd = t.shape
    return t[:, :, None].expand(b, kv, groups, s, hd).reshape(b, kv * groups, s, hd)


# ---------------------------------------------------------------------------
# Torch lowerings against independent references
# ---------------------------------------------------------------------------


def test_rmsnorm_is_torchs_rms_norm_in_float32() -> None:
    x = _randn(3, SEQ, DIM, seed=1, scale=3.0)
    weight = 1.0 + _randn(DIM, seed=2, scale=0.1)
    got, _ = _run_one("rmsnorm", {"dim": DIM, "eps": 1e-5}, x, params={"weight": weight})
    torch.testing.assert_close(got, F.rms_norm(x, (DIM,), weight, 1e-5), **F32)
    # The premise: eps matters here (a wrong eps or a mean over the wrong axis would show).
    assert not torch.allclose(F.rms_norm(x, (DIM,), weight, 1.0), got, atol=1e-3)


def test_rmsnorm_normalises_half_precision_in_float32() -> None:
    """Values around 300: their squares overflow float16 (max 65504), so a float16 mean square is inf and the
    output 0; computed in float32 and cast back (Llama's LlamaRMSNorm) it is the float32 result rounded."""
    from vgraph.backends.torch.lowering import kernels as K

    x = (300.0 + _randn(2, SEQ, DIM, seed=3)).half()
    weight = torch.ones(DIM, dtype=torch.float16)
    assert torch.isinf((x * x).mean(-1)).all()  # the premise
    got = K.rms_norm(x, weight, eps=1e-6)
    want = F.rms_norm(x.float(), (DIM,), weight.float(), 1e-6).half()
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # float16's rounding of O(1) values


def test_gelu_tanh_is_gpt2_gelu_new() -> None:
    x = _randn(2, SEQ, DIM, seed=4, scale=3.0)
    got, _ = _run_one("gelu", {"approximate": "tanh"}, x)
    want = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    torch.testing.assert_close(got, want, **F32)
    exact, _ = _run_one("gelu", {}, x)
    assert (exact - got).abs().max() > 1e-4  # the premise: the two forms differ visibly at this scale


def test_linear_without_bias_owns_no_bias() -> None:
    x = _randn(2, SEQ, DIM, seed=5)
    w = _randn(12, DIM, seed=6)
    got, params = _run_one("linear", {"in_dim": DIM, "out_dim": 12, "bias": False}, x, params={"weight": w})
    assert set(params) == {"weight"}
    torch.testing.assert_close(got, x @ w.T, **F32)


@pytest.mark.parametrize("rope", [True, False])
def test_head_without_qkv_bias_is_sdpa(rope: bool) -> None:
    x = _randn(2, SEQ, DIM, seed=7)
    cfg = {"head_dim": HD, "input_dim": DIM, "seq_len": SEQ, "qkv_bias": False,
           "position_encoding": "rope" if rope else "none"}
    w = {k: _randn(HD, DIM, seed=i, scale=DIM ** -0.5) for i, k in enumerate(("wq", "wk", "wv"))}
    got, params = _run_one("attention_head", cfg, x, params=w)
    assert set(params) == {"wq", "wk", "wv"}
    q, k = x @ w["wq"].T, x @ w["wk"].T
    if rope:
        q, k = _rope(q), _rope(k)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, x @ w["wv"].T, is_causal=True), **F32)


@pytest.mark.parametrize("kv,bias,out", [(2, False, False), (1, True, True), (4, False, False)],
                         ids=["gqa", "mqa-bias-projection", "kv-equals-heads"])
def test_fused_gqa_attention_is_sdpa_with_repeat_kv(kv: int, bias: bool, out: bool) -> None:
    x = _randn(2, SEQ, DIM, seed=8)
    cfg = {"num_heads": HEADS, "num_kv_heads": kv, "head_dim": HD, "dim": DIM, "seq_len": SEQ,
           "position_encoding": "rope", "rope_theta": 500.0, "qkv_bias": bias, "output_projection": out}
    rows = (HEADS + 2 * kv) * HD
    p = {"qkv_weight": _randn(rows, DIM, seed=9, scale=DIM ** -0.5)}
    if bias:
        p["qkv_bias"] = _randn(rows, seed=10, scale=0.1)
    if out:
        p["out_weight"], p["out_bias"] = _randn(DIM, HEADS * HD, seed=11, scale=0.2), _randn(DIM, seed=12)
    got, params = _run_one("attention", cfg, x, params=p)
    assert set(params) == set(p)
    q, k, v = F.linear(x, p["qkv_weight"], p.get("qkv_bias")).split([HEADS * HD, kv * HD, kv * HD], dim=-1)
    q = _rope(q.view(2, SEQ, HEADS, HD).transpose(1, 2), 500.0)
    k = _rope(k.view(2, SEQ, kv, HD).transpose(1, 2), 500.0)
    v = v.view(2, SEQ, kv, HD).transpose(1, 2)
    want = F.scaled_dot_product_attention(q, _repeat_kv(k, HEADS // kv), _repeat_kv(v, HEADS // kv), is_causal=True)
    want = want.transpose(1, 2).reshape(2, SEQ, HEADS * HD)
    if out:
        want = F.linear(want, p["out_weight"], p["out_bias"])
    torch.testing.assert_close(got, want, **F32)


def test_kv_head_and_a_query_head_are_one_head_of_attention() -> None:
    """kv_head -> [K rotated, V]; a query head with kv_input reading it is an ordinary head's output."""
    x = _randn(2, SEQ, DIM, seed=13)
    w = {k: _randn(HD, DIM, seed=20 + i, scale=DIM ** -0.5) for i, k in enumerate(("wq", "wk", "wv"))}
    b = {k: _randn(HD, seed=30 + i, scale=0.1) for i, k in enumerate(("bq", "bk", "bv"))}
    common = {"head_dim": HD, "input_dim": DIM, "seq_len": SEQ, "position_encoding": "rope"}
    kv, _ = _run_one("kv_head", common, x, params={"wk": w["wk"], "bk": b["bk"], "wv": w["wv"], "bv": b["bv"]})
    torch.testing.assert_close(kv, torch.cat([_rope(F.linear(x, w["wk"], b["bk"])), F.linear(x, w["wv"], b["bv"])],
                                             dim=-1), **F32)
    got, params = _run_one("attention_head", {**common, "kv_input": True}, x, kv, params={"wq": w["wq"], "bq": b["bq"]})
    assert set(params) == {"wq", "bq"}
    whole, _ = _run_one("attention_head", common, x, params={**w, **b})
    torch.testing.assert_close(got, whole, **F32)


# ---------------------------------------------------------------------------
# The GQA fixtures: per head, fused, fuse-heads, ONNX, training
# ---------------------------------------------------------------------------


def _perturbed_state(graph: vgraph.Graph) -> dict[str, torch.Tensor]:
    """The seeded init moved off its ones and zeros, so every weight matters."""
    state = init_state(graph, seed=2)
    return {k: v + _randn(*v.shape, seed=i, scale=0.05) for i, (k, v) in enumerate(sorted(state.items()))}


def _logits(graph: vgraph.Graph, unfused_state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    module = compile_network(graph, train=False, unfused_state=unfused_state)
    return module({"embedder:in0": ids}, want="logits")["logits"].detach()


IDS = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))


def test_per_head_gqa_network_equals_the_fused_fixture_with_weights_mapped_by_hand() -> None:
    heads, fused = vgraph.load(GQA), vgraph.load(GQA_FUSED)
    state = _perturbed_state(heads)
    mapped = {k: v for k, v in state.items() if "_head" not in k.split(".")[0] and "_kv" not in k}
    for i in range(LAYERS):
        q = [state[f"block{i}_head{h}.wq"] for h in range(HEADS)]
        kv = [state[f"block{i}_kv{g}.w{x}"] for x in "kv" for g in range(KV)]
        mapped[f"block{i}_attention.qkv_weight"] = torch.cat(q + kv)
    assert set(mapped) == set(init_state(fused))
    torch.testing.assert_close(_logits(fused, mapped, IDS), _logits(heads, state, IDS), **F32)


@pytest.fixture(scope="module")
def fused_gqa() -> vgraph.Graph:
    g = vgraph.load(GQA)
    record = run_pipeline(g, "fuse-heads").records[0]
    assert record.changes == {"heads_fused": LAYERS * HEADS, "attention_created": LAYERS}
    return g


def test_fuse_heads_fuses_query_heads_and_kv_heads_with_the_same_logits(fused_gqa) -> None:
    heads = vgraph.load(GQA)
    (attn, _) = fused_gqa.nodes_of_type("attention")
    assert attn.cfg["num_kv_heads"] == KV and attn.cfg["qkv_bias"] is False and attn.cfg["num_heads"] == HEADS
    assert attn.config["fused_from"] == "block0_head0,block0_head1,block0_head2,block0_head3,block0_kv0,block0_kv1"
    assert not fused_gqa.nodes_of_type("kv_head") and not fused_gqa.nodes_of_type("attention_head")
    state = _perturbed_state(heads)
    torch.testing.assert_close(_logits(fused_gqa, state, IDS), _logits(heads, state, IDS), **F32)
    # the checkpoint layout both ways, exactly
    fused_state = to_graph_layout(state, fused_gqa, lambda xs: torch.cat(xs))
    assert fused_state["block0_attention.qkv_weight"].shape == ((HEADS + 2 * KV) * HD, DIM)
    back = to_unfused_layout(fused_state, fused_gqa, lambda t, rows: torch.split(t, list(rows)))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_fused_and_per_head_gradients_agree(fused_gqa) -> None:
    heads = vgraph.load(GQA)
    state = _perturbed_state(heads)
    targets = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(6))
    grads = []
    for g in (heads, fused_gqa):
        module = compile_network(g, train=False, unfused_state=state)
        module({"embedder:in0": IDS, "loss:in1": targets}, want="ce_loss")["ce_loss"].backward()
        own = {k: p.grad for k, p in module.named_parameters()}
        grads.append(to_unfused_layout(own, g, lambda t, rows: torch.split(t, list(rows))))
    assert set(grads[0]) == set(grads[1])
    for key in grads[0]:
        torch.testing.assert_close(grads[1][key], grads[0][key], rtol=1e-4, atol=1e-6)


def _explained(g: vgraph.Graph) -> list[str]:
    pm = run_pipeline(g, "fuse-heads", explain=True)
    return pm.ctx.explanations


@pytest.mark.parametrize("change, reason", [
    (lambda g: g.node("block0_kv1").set_config(learning_rate=0.5), "kv_head 'block0_kv1' differs from 'block0_kv0' "
                                                                     "in learning_rate"),
    (lambda g: [g.node(f"block0_kv{k}").set_config(qkv_bias=True) for k in range(KV)],
     "kv_head 'block0_kv0' differs from head 'block0_head0' in qkv_bias"),
    (lambda g: (g.node("block0_kv1").meta.update(pnode="B"), [g.node(f"block0_head{h}").meta.update(pnode="B")
                                                              for h in (2,)]),
     "kv_head 'block0_kv1' and its query heads are on different PNodes"),
])
def test_fuse_heads_leaves_gqa_heads_it_cannot_fuse_and_says_why(change, reason) -> None:
    g = vgraph.load(GQA)
    change(g)
    explanations = _explained(g)
    assert any(reason in x for x in explanations), explanations
    assert len(g.nodes_of_type("attention")) == 1 and len(g.nodes_of_type("kv_head")) == KV  # block1 fused


def test_heads_out_of_kv_head_order_are_not_fused() -> None:
    """Head 1 reading kv_head 1 and head 2 kv_head 0: the fused layout (consecutive groups) would differ."""
    text = GQA.read_text()
    g = vgraph.loads(text, file="gqa.yml")
    for head, kv in (("block0_head1", "block0_kv1"), ("block0_head2", "block0_kv0")):
        g.remove_edge(g.input_edge(head, 1))
        g.add_edge(kv, 0, head, 1)
    vgraph.verify(g)
    assert any("not in groups of equal size in kv_head order: head 'block0_head1' reads kv_head 'block0_kv1'" in x
               for x in _explained(g))


def test_whole_groups_on_two_pnodes_fuse_into_two_attentions_with_the_same_logits() -> None:
    heads = vgraph.load(GQA)
    g = heads.copy()
    for node_id in ("block0_kv1", "block0_head2", "block0_head3"):
        g.node(node_id).meta["pnode"] = "B"
    run_pipeline(g, "fuse-heads")
    parts = sorted(n.id for n in g.nodes_of_type("attention"))
    assert parts == ["block0_attention0", "block0_attention1", "block1_attention"]
    assert {g.node(p).cfg["num_kv_heads"] for p in parts[:2]} == {1}
    state = _perturbed_state(heads)
    torch.testing.assert_close(_logits(g, state, IDS), _logits(heads, state, IDS), **F32)


@pytest.mark.parametrize("path, passes, cached", [
    (GQA, None, {"kv_head": [["past_sequence", HD]]}),
    (GQA, "fuse-heads,fuse-lm-head-ce", {"attention": [[KV, "past_sequence", HD]]}),
    (GQA_FUSED, None, {"attention": [[KV, "past_sequence", HD]]}),
], ids=["per-head", "fuse-heads", "fused-fixture"])
def test_onnx_export_and_kv_cache_decoder_match_torch(path, passes, cached) -> None:
    g = vgraph.load(path)
    if passes:
        run_pipeline(g, passes)
    report = check_network_and_export(g, batch=2, seed=3, scales=(1.0,))
    assert report.ok, report.format()
    assert any("KV cache" in o.case for o in report.outputs)  # the decoder was compared, not skipped
    model = lower_inference(g, kv_cache=True)
    caches = json.loads({p.key: p.value for p in model.metadata_props}["vgraph.kv_cache"])
    kinds: dict[str, list] = {}
    for c in caches:
        kinds.setdefault(g.node(c["node"]).type, []).append(c["shape"])
    assert {k: v[:1] for k, v in kinds.items()} == cached
    assert sum(map(len, kinds.values())) == LAYERS * (KV if path == GQA and not passes else 1)


def test_a_kv_head_read_by_anything_but_query_heads_cannot_be_cached() -> None:
    b = NetBuilder("odd-reader")
    b.node("kv", "kv_head", head_dim=HD, input_dim=DIM, seq_len=SEQ)
    b.graph.node("kv").input_shapes = ((SEQ, DIM),)
    b.node("proj", "linear", in_dim=2 * HD, out_dim=DIM)
    b.edge("kv", "proj")
    b.output("out", "proj")
    g = b.build()
    with pytest.raises(VGraphError) as err:
        lower_inference(g, kv_cache=True)
    assert "read by linear 'proj'" in str(err.value) and "'kv'" in str(err.value)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return str(path)


def test_vgraph_train_trains_the_gqa_network_fused_as_per_head(tmp_path, corpus, capsys) -> None:
    """Two steps fused (the default pipeline) and two per head (--no-fuse): the same losses and weights, and
    the kv_heads' weights moved (they get gradients through their query heads)."""
    runs = {}
    for name, extra in (("fused", []), ("heads", ["--no-fuse"])):
        out = tmp_path / name
        assert cli.main(["train", str(GQA), "--data", corpus, "--steps", "2", "--batch", "2", "--lr", "1e-2",
                         "--out", str(out), "--val-every", "0", "--quiet", *extra]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((out / "run.json").read_text())["fuse"] is (name == "fused")  # the premise
        runs[name] = ([r["loss"] for r in rows], load_checkpoint(out / "step-00000002").model_state)
    capsys.readouterr()
    (fused_loss, fused_w), (heads_loss, heads_w) = runs["fused"], runs["heads"]
    assert len(fused_loss) == 2 and all(math.isfinite(x) for x in fused_loss)
    np.testing.assert_allclose(fused_loss, heads_loss, rtol=1e-5)
    assert set(fused_w) == set(heads_w) and "block0_kv0.wk" in fused_w  # the checkpoint is per head either way
    for key in heads_w:
        torch.testing.assert_close(fused_w[key], heads_w[key], rtol=1e-4, atol=1e-5)
    start = init_state(vgraph.load(GQA), seed=0)
    assert not torch.equal(heads_w["block0_kv0.wk"], start["block0_kv0.wk"])


# ---------------------------------------------------------------------------
# Schema, shapes and counts
# ---------------------------------------------------------------------------


def _problems(text: str) -> str:
    with pytest.raises(VGraphError) as err:
        vgraph.loads(text, file="bad.yml")
    return str(err.value)


def _with(path: Path, old: str, new: str, count: int = 1) -> str:
    text = path.read_text()
    assert old in text, old  # the premise: the fixture has what the case changes
    return text.replace(old, new, count)


@pytest.mark.parametrize("path, old, new, node, message", [
    (GQA_FUSED, 'num_kv_heads: "2"', 'num_kv_heads: "3"', "block0_attention",
     "num_heads=4 is not a multiple of num_kv_heads=3"),
    (GQA_FUSED, 'num_kv_heads: "2"', 'num_kv_heads: "0"', "block0_attention", "must be >= 1"),
    (GQA, "  - {from: block0_kv0, to: block0_head0, to_slot: 1}\n", "", "block0_head0",
     "kv_input is true but input 1 (the keys and values of a kv_head) is not connected"),
    (GQA, 'kv_input: "true"', 'kv_input: "false"', "block0_head0", "input 1 is connected but kv_input is false"),
    (GQA, 'kv_input: "true"', 'kv_input: "maybe"', "block0_head0", 'expected "true" or "false"'),
    (FIXTURES / "tiny_1l_fp32.yml", 'type: gelu\n', 'type: gelu\n    config:\n      approximate: "sigmoid"\n',
     "block0_ffn_gelu", "must be one of none, tanh"),
    (GQA, 'type: rmsnorm\n    config:\n      dim: "32"', 'type: rmsnorm\n    config:\n      dim: "32"\n      eps: "nan"',
     "block0_ln1", "expected a number"),
    (GQA, 'type: rmsnorm\n    config:\n      dim: "32"', 'type: rmsnorm\n    config:\n      dim: "32"\n      eps: "-1"',
     "block0_ln1", "must be >= 0"),
])
def test_schema_mistakes_are_diagnostics_naming_the_node(path, old, new, node, message) -> None:
    text = _with(path, old, new)
    problems = _problems(text)
    assert message in problems and f"'{node}'" in problems, problems


def test_odd_head_dim_with_rope_a_kv_width_mismatch_and_a_different_rotation_are_named() -> None:
    text = GQA.read_text()
    block = text[text.index("  - id: block0_kv0"):text.index("  - id: block0_kv1")]
    odd = _problems(text.replace(block, block.replace('head_dim: "8"', 'head_dim: "7"')))
    assert "position_encoding=rope needs an even head_dim, got 7" in odd and "'block0_kv0'" in odd
    wide = _problems(text.replace(block, block.replace('head_dim: "8"', 'head_dim: "6"')))
    assert "input 1 has shape [8, 12] but seq_len=8 and head_dim=8" in wide and "'block0_head0'" in wide
    turned = _problems(text.replace(block, block.replace('rope_theta: "10000.0"', 'rope_theta: "500.0"')))
    assert "its kv_head 'block0_kv0' rotates the keys differently (rope_theta=500.0 there, 10000.0 here)" in turned
    assert "'block0_head1'" in turned and "'block0_head2'" not in turned  # the heads of that kv_head only
    plain = _problems(text.replace(block, block.replace('position_encoding: "rope"', 'position_encoding: "none"')))
    assert "position_encoding='none' there, 'rope' here" in plain


def test_fused_from_must_name_the_heads_then_the_kv_heads() -> None:
    g = vgraph.load(GQA)
    run_pipeline(g, "fuse-heads")
    text = vgraph.dumps(g).replace("block0_head3,block0_kv0,block0_kv1", "block0_head3,block0_kv0")
    problems = _problems(text)
    assert "fused_from names 5 nodes but num_heads=4, num_kv_heads=2 need 4 query heads followed by 2 kv_heads" \
        in problems and "'block0_attention'" in problems


def _count(op: str, config: dict, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> tuple[int, int]:
    o = get_op(op)
    cfg = o.schema.resolve(config)
    flops = o.flop_count(cfg, [TensorType(s) for s in ins], [TensorType(s) for s in outs])
    return flops, sum(prod(s) for s in o.param_shapes(cfg).values())


def test_params_and_flops_counted_by_hand() -> None:
    S, D, H, K, hd = 16, 32, 4, 2, 8
    assert _count("rmsnorm", {"dim": D}, [(S, D)], [(S, D)]) == (4 * S * D, D)
    assert _count("linear", {"in_dim": D, "out_dim": 12, "bias": False}, [(S, D)], [(S, 12)]) == (2 * S * D * 12,
                                                                                                    D * 12)
    head = {"head_dim": hd, "input_dim": D, "seq_len": S}
    # kv_head: two projections; a query head: its projection, the scores and the weighted sum.
    assert _count("kv_head", head, [(S, D)], [(S, 2 * hd)]) == (2 * 2 * S * D * hd, 2 * (hd * D + hd))
    assert _count("kv_head", {**head, "qkv_bias": False}, [(S, D)], [(S, 2 * hd)])[1] == 2 * hd * D
    assert _count("attention_head", {**head, "kv_input": True}, [(S, D), (S, 2 * hd)], [(S, hd)]) == (
        2 * S * D * hd + 2 * 2 * S * S * hd, hd * D + hd)
    assert _count("attention_head", {**head, "qkv_bias": False}, [(S, D)], [(S, hd)])[1] == 3 * hd * D
    gqa = {"num_heads": H, "num_kv_heads": K, "head_dim": hd, "dim": D, "seq_len": S, "qkv_bias": False}
    flops, params = _count("attention", gqa, [(S, D)], [(S, H * hd)])
    assert params == (H + 2 * K) * hd * D
    assert flops == 2 * S * D * (H + 2 * K) * hd + 2 * 2 * S * S * H * hd
    # A per-head GQA block costs what the fused one does: H query heads plus K kv_heads.
    per_head = H * _count("attention_head", {**head, "kv_input": True}, [(S, D), (S, 2 * hd)], [(S, hd)])[0] + \
        K * _count("kv_head", head, [(S, D)], [(S, 2 * hd)])[0]
    assert per_head == flops


def test_partition_places_a_kv_head_and_its_query_heads_as_one_unit() -> None:
    """When a block's preferred group is split into VNodes (more PNodes than blocks), each GQA group stays one
    unit: split, its keys and values would cross a cut and fuse-heads could not fuse it."""
    from vgraph.cost.fleet import Fleet, PNode
    from vgraph.passes.partition_problem import build_problem

    text = _with(GQA, 'colocate_policy: "required"', 'colocate_policy: "preferred"', -1)
    g = vgraph.loads(text, file="gqa.yml")
    fleet = Fleet.of("many", *(PNode(f"p{i}", 2 ** 34, 1e12, 1e9) for i in range(8)))
    problem = build_problem(g, fleet, batch=2, view="vnodes")
    for block in range(LAYERS):
        for k in range(KV):
            unit = problem.units[problem.unit_of[f"block{block}_kv{k}"]]
            members = {f"block{block}_kv{k}", *(f"block{block}_head{h}" for h in (2 * k, 2 * k + 1))}
            assert unit.kind == "kv_group" and set(unit.members) == members
    assert problem.units[problem.unit_of["block0_ln1"]].kind == "vnode"  # the premise: the block was split


@pytest.mark.parametrize("passes", ["dead-nodes,precision,fuse-heads,fuse-lm-head-ce", "dead-nodes,precision"],
                         ids=["fused", "per-head"])
def test_remat_of_the_gqa_network_gives_the_same_step(passes) -> None:
    """Every remat candidate recomputed (kv_heads and query heads inside the regions): the same loss and
    gradients as the step that keeps everything."""
    from tests.test_torch_remat import assert_same_step, mark_all, step, token_batch
    from vgraph.backends.torch import prepare_graph

    plain = prepare_graph(vgraph.load(GQA), passes=passes, target="cpu")
    marked = mark_all(plain.copy())
    ids, targets = token_batch(plain, 3, seed=0)
    loss0, grads0, _ = step(plain, ids, targets)
    loss1, grads1, gm = step(marked, ids, targets)
    bodies = "\n".join(m.body.code for name, m in gm.named_children() if name.startswith("remat_"))
    assert ("multihead_attention" if "fuse-heads" in passes else "kv_head_projection") in bodies  # the premise
    assert "rms_norm" in bodies
    assert_same_step(loss1, grads1, loss0, grads0)


def test_the_reference_interpreter_agrees_on_the_gqa_network_outputs_and_gradients() -> None:
    """backends/torch/lowering/interpreter.py writes every op out again (query heads, kv_heads, rmsnorm, GQA attention
    split back into its heads); the compiled module must agree with it, per head and fused."""
    from vgraph.backends.torch.lowering.interpreter import interpret

    targets = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(8))
    for path in (GQA, GQA_FUSED):
        g = vgraph.load(path)
        module = compile_network(g, train=False, unfused_state=_perturbed_state(g))
        params = dict(module.named_parameters())
        feeds = {"embedder:in0": IDS, "loss:in1": targets}
        out = module(feeds)
        out["ce_loss"].backward()
        compiled = {k: p.grad.clone() for k, p in params.items()}
        for p in params.values():
            p.grad = None
        ref = interpret(g, params, feeds)
        ref["ce_loss"].backward()
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        for key, grad in compiled.items():
            torch.testing.assert_close(grad, params[key].grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("codec, mantissa", [("fp16", 11), ("bf16", 8)])
def test_a_kv_head_cut_from_its_query_heads_is_compressed_like_any_activation(codec: str, mantissa: int) -> None:
    """Query heads 0 and 1 placed away from their kv_head: compress-boundary puts a compress VNode on each cut
    edge, the [seq, 2 x head_dim] keys and values included; the loss stays within twice the codec's unit
    roundoff (2^-mantissa bits) of the uncut one, and the kv_head still gets its gradient through the cut."""
    text = _with(GQA, 'colocate_policy: "required"', 'colocate_policy: "preferred"', -1)
    g = vgraph.loads(text, file="gqa.yml")
    state = _perturbed_state(g)
    for n in g.nodes:
        n.meta["pnode"] = "b" if n.id in ("block0_head0", "block0_head1") else "a"
    targets = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))
    feeds = {"embedder:in0": IDS, "loss:in1": targets}
    plain = compile_network(g, unfused_state=state)
    want = plain(feeds)["ce_loss"]
    run_pipeline(g, f"compress-boundary{{activations={codec},gradients={codec}}}")
    kv_edges = {e.dst for c in g.nodes_of_type("compress") for e in g.in_edges(c.id) if e.src == "block0_kv0"}
    assert len(kv_edges) == 2  # both query heads read the kv_head across the cut
    module = compile_network(g, unfused_state=state)
    loss = module(feeds)["ce_loss"]
    loss.backward()
    assert not torch.equal(loss, want)  # the premise: the wire format rounded something
    torch.testing.assert_close(loss, want, rtol=2.0 ** (1 - mantissa), atol=0)
    grad = dict(module.named_parameters())["block0_kv0.wk"].grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0


def test_a_query_head_reading_keys_from_anything_but_a_kv_head_cannot_be_cached() -> None:
    b = NetBuilder("odd-source")
    b.node("x", "dropout", rate=0.0)
    b.graph.node("x").input_shapes = ((SEQ, DIM),)
    b.node("fan", "broadcast", num_outputs=2)
    b.node("kv", "linear", in_dim=DIM, out_dim=2 * HD)
    b.node("head", "attention_head", head_dim=HD, input_dim=DIM, seq_len=SEQ, kv_input=True)
    b.edge("x", "fan")
    b.edge("fan", "head", 0, 0)
    b.edge("fan", "kv", 1, 0)
    b.edge("kv", "head", 0, 1)
    b.output("out", "head")
    g = b.build()
    lower_inference(g)  # without a cache it is an ordinary computation
    with pytest.raises(VGraphError) as err:
        lower_inference(g, kv_cache=True)
    assert "its keys and values come from linear 'kv', not a kv_head" in str(err.value) and "'head'" in str(err.value)
