"""IR -> torch.fx lowering: parameters, feeds/outputs, every catalog op, init, plugins, memory."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import vgraph
from vgraph import OpDef, register_op
from vgraph.ir.builder import NetBuilder
from vgraph.ops import REGISTRY

from conftest import TINY_FP32
from vgraph.backends.torch import (LOWERINGS, check_memory, compile_network, estimate_training_memory,
                                   init_state, interpret, register_lowering, to_unfused_layout)
from vgraph.backends.torch.training.memory import MemoryRefused
from vgraph.backends.torch.lowering.ops import cost_loss
from vgraph.backends.torch.training.train import prepare_graph
from vgraph.data.tokenizer import char_tokenizer

VOCAB, SEQ, DIM = 50, 8, 16


def _ids(shape, high, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def zoo() -> vgraph.Graph:
    """A small network using every non-text op of the catalog, several in non-default settings."""
    b = NetBuilder("zoo")
    b.node("emb", "embedder", vocab_size=VOCAB, dim=DIM, seq_len=SEQ, position_encoding="learned",
           shared_weight_alias="tok")
    b.node("fan", "broadcast", num_outputs=6)
    b.edge("emb", "fan")
    for slot, act in enumerate(("relu", "gelu", "silu")):
        b.node(act, act)
        b.edge("fan", act, slot)
    b.node("cat3", "stack", axis=-1)
    for slot, act in enumerate(("relu", "gelu", "silu")):
        b.edge(act, "cat3", 0, slot)
    b.node("mix", "linear", in_dim=3 * DIM, out_dim=DIM)
    b.node("up", "linear", in_dim=DIM, out_dim=DIM)
    b.node("sw", "swiglu")
    b.chain("cat3", "mix", "up", "sw")
    b.node("scores", "linear", in_dim=DIM, out_dim=SEQ)
    b.edge("fan", "scores", 3)
    b.node("msk", "mask", causal=True, mask_val=-1e4)
    b.node("flat", "reshape", target_shape=(SEQ * SEQ,))
    b.node("unflat", "reshape", target_shape=(SEQ, -1))
    b.chain("scores", "msk", "flat", "unflat")
    b.node("mha", "attention", num_heads=2, head_dim=4, dim=DIM, seq_len=SEQ, causal=False,
           position_encoding="none", output_projection=True)
    b.edge("fan", "mha", 4)
    b.node("hd", "attention_head", head_dim=8, input_dim=DIM, seq_len=SEQ, causal=False,
           position_encoding="none")
    b.edge("fan", "hd", 5)
    b.node("a1", "add")
    b.edge("sw", "a1")
    b.edge("unflat", "a1", 0, 1)
    b.node("a2", "add")
    b.edge("a1", "a2")
    b.edge("hd", "a2", 0, 1)
    b.node("cat2", "stack", axis=1)
    b.edge("a2", "cat2")
    b.edge("mha", "cat2", 0, 1)
    b.node("proj", "linear", in_dim=24, out_dim=DIM)
    b.node("ln", "layernorm", dim=DIM)
    b.node("dp", "dropout", rate=0.5)
    b.node("head", "linear", in_dim=DIM, out_dim=VOCAB, tie_weight_alias="tok")
    b.node("loss", "cost", cost_function="ce_logits", vocab_size=VOCAB)
    b.chain("cat2", "proj", "ln", "dp", "head", "loss")
    b.node("mse", "cost", cost_function="mse")
    b.edge("mha", "mse")
    b.output("logits", "head")
    b.output("hidden", "ln")
    b.cost("ce", "loss")
    b.cost("mse_cost", "mse")
    return b.build()


def zoo_feeds(batch: int = 3) -> dict[str, torch.Tensor]:
    return {"emb:in0": _ids((batch, SEQ), VOCAB, 0), "loss:in1": _ids((batch, SEQ), VOCAB, 1),
            "mse:in1": torch.randn(batch, SEQ, DIM, generator=torch.Generator().manual_seed(2))}


def _grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    return out


def test_every_catalog_op_has_a_lowering() -> None:
    builtin = {op.name for op in REGISTRY if op.origin == "vgraph"}  # other tests register plugin ops
    assert builtin - set(LOWERINGS) == set()


def test_state_dict_has_one_namespace_per_vnode_and_tied_weight_once(tiny) -> None:
    module = compile_network(tiny, seed=0)
    expected = {f"{n.id}.{p}" for n in tiny.nodes for p in n.op.param_shapes(n.cfg)}
    assert set(module.state_dict()) == expected
    assert "block0_head1.wq" in expected and "embedder.weight" in expected
    assert not any(k.startswith("lm_head.") for k in module.state_dict())
    for key, tensor in module.state_dict().items():
        node_id, pname = key.split(".")
        node = tiny.node(node_id)
        assert tuple(tensor.shape) == tuple(node.op.param_shapes(node.cfg)[pname])
        assert tensor.dtype == torch.float32  # master weights even though the YAML says fp16
    # The tied LM head reads the embedder's Parameter itself: with token ids from a few rows only, the
    # embedding's gradient still reaches every row (through the LM head).
    ids = torch.zeros(2, 16, dtype=torch.int64)
    out = module({"embedder:in0": ids, "loss:in1": _ids((2, 16), 96, 3)}, want=("ce_loss",))
    out["ce_loss"].backward()
    grad = module.namespace("embedder").weight.grad
    assert grad is not None and bool((grad.abs().sum(dim=1) > 0).all())


def test_generated_code_is_readable_and_named_after_vnodes(tiny) -> None:
    module = compile_network(tiny, seed=0)
    code = module.code()
    assert "def forward(self, embedder_in0, loss_in1)" in code
    assert "block0_head1 = " in code and "self.block0_head1.wq" in code
    assert "lm_head = torch._C._nn.linear(head_down, embedder_weight)" in code
    assert "return {'logits': lm_head, 'ce_loss': loss}" in code
    module.eval()
    assert "dropout" not in module.code()  # identity in eval: not even emitted


def test_want_restricts_the_computation(tiny) -> None:
    fused = prepare_graph(tiny, passes="fuse-heads,fuse-lm-head-ce")
    module = compile_network(fused, seed=0, train=False)
    assert module.feeds_needed(("ce_loss",)) == ("embedder:in0", "lm_head_ce:in1")
    assert "logits_chunk" not in module.code(("ce_loss",))  # the fused loss never forms logits
    assert module.feeds_needed(("logits",)) == ("embedder:in0",)  # no targets needed for logits
    ids = _ids((2, 16), 96, 0)
    logits = module({"embedder:in0": ids}, want=("logits",))["logits"]
    assert logits.shape == (2, 16, 96)
    with pytest.raises(vgraph.VGraphError, match="missing feed.*lm_head_ce:in1"):
        module({"embedder:in0": ids}, want=["ce_loss"])
    with pytest.raises(vgraph.VGraphError, match="no output or cost named 'nope'"):
        module({"embedder:in0": ids}, want=("nope",))
    # Any value can be read as "<node>:<slot>".
    hidden = module({"embedder:in0": ids}, want=("final_norm:0",))["final_norm:0"]
    assert hidden.shape == (2, 16, 32)


def test_init_is_deterministic_per_vnode_and_documented_scheme() -> None:
    g = vgraph.load(TINY_FP32)
    a, b, c = init_state(g, seed=1), init_state(g, seed=1), init_state(g, seed=2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["block0_head0.wq"], c["block0_head0.wq"])
    assert torch.equal(a["block0_ln1.weight"], torch.ones(32)) and torch.equal(a["block0_ln1.bias"], torch.zeros(32))
    assert torch.equal(a["block0_head0.bq"], torch.zeros(16))
    assert abs(float(a["embedder.weight"].std()) - 0.02) < 0.002
    # Per VNode id, not per position: heads with the same shape still differ.
    assert not torch.equal(a["block0_head0.wq"], a["block0_head1.wq"])


def test_fused_init_equals_the_heads_it_came_from(tiny) -> None:
    fused = prepare_graph(tiny, passes="fuse-heads,fuse-lm-head-ce")
    assert fused.nodes_of_type("attention")
    unfused_init = init_state(tiny, seed=5)
    fused_init = to_unfused_layout(init_state(fused, seed=5), fused)
    assert set(fused_init) == set(unfused_init)
    assert all(torch.equal(fused_init[k], unfused_init[k]) for k in unfused_init)


def test_zoo_matches_the_reference_interpreter_outputs_and_gradients() -> None:
    g = zoo()
    module = compile_network(g, seed=3, train=False)
    params = dict(module.named_parameters())
    feeds = zoo_feeds()
    out = module(feeds)
    assert set(out) == {"logits", "hidden", "ce", "mse_cost"}
    (out["ce"] + out["mse_cost"]).backward()
    compiled_grads = _grads(params)
    ref = interpret(g, params, feeds)
    (ref["ce"] + ref["mse_cost"]).backward()
    ref_grads = _grads(params)
    for name in out:
        torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-5)
    assert out["ce"].dtype == torch.float32
    assert set(compiled_grads) == set(ref_grads) == set(params)
    for key in params:
        torch.testing.assert_close(compiled_grads[key], ref_grads[key], rtol=1e-4, atol=1e-6)


def test_dropout_is_random_in_training_and_identity_in_eval() -> None:
    g = zoo()
    module = compile_network(g, seed=0, train=True)
    feeds = zoo_feeds()
    with torch.no_grad():
        a, b = module(feeds, want="dp:0")["dp:0"], module(feeds, want="dp:0")["dp:0"]
        assert not torch.equal(a, b)
        assert 0.3 < float((a == 0).float().mean()) < 0.7  # rate 0.5
        module.eval()
        c, d = module(feeds, want="dp:0")["dp:0"], module(feeds, want="dp:0")["dp:0"]
    assert torch.equal(c, d)
    torch.testing.assert_close(c, interpret(g, module.state_dict(), feeds, want="hidden")["hidden"])


def test_cross_entropy_from_probabilities_and_mse() -> None:
    probs = torch.softmax(torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    targets = _ids((2, 5), 7, 1)
    expected = -torch.log(probs.gather(-1, targets[..., None])).mean()
    torch.testing.assert_close(cost_loss(probs, targets, function="ce", ignore_index=-100), expected)
    logits = torch.log(probs)
    torch.testing.assert_close(cost_loss(logits, targets, function="ce_logits", ignore_index=-100), expected)
    half = cost_loss(probs.half(), targets, function="ce", ignore_index=-100)
    assert half.dtype == torch.float32
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(cost_loss(x, y, function="mse", ignore_index=-100), F.mse_loss(x, y))


def test_text_nodes_round_trip_through_the_tokenizer() -> None:
    tokenizer = char_tokenizer(["hello world, the quick brown fox"], 40)
    b = NetBuilder("text")
    b.node("tok", "tokenizer", vocab_size=40, pad_length=12)
    b.node("detok", "detokenizer", vocab_size=40)
    b.chain("tok", "detok")
    b.output("ids", "tok")
    b.output("text", "detok")
    g = b.build()
    module = compile_network(g, tokenizer=tokenizer, train=False)
    assert module.state_dict() == {}
    out = module({"tok:in0": ["hello fox", "the world, quick brown"]})
    assert out["ids"].shape == (2, 12) and out["ids"].dtype == torch.int64
    assert out["text"] == ["hello fox", "the world, q"]  # truncated to pad_length
    ref = interpret(g, {}, {"tok:in0": ["hello fox", "the world, quick brown"]}, tokenizer=tokenizer)
    assert torch.equal(ref["ids"], out["ids"]) and ref["text"] == out["text"]
    with pytest.raises(vgraph.VGraphError, match="vocab_path"):
        compile_network(g)


def test_plugin_op_lowers_through_the_registry() -> None:
    name = "scaled_tanh_test_op"
    if name not in REGISTRY:
        register_op(OpDef(name, "activation", "2 * tanh(x)", origin="test"))

        @register_lowering(name, origin="test")
        def _emit(ctx):
            return [ctx.call(operator.mul, ctx.call(torch.tanh, ctx.inputs[0]), 2.0)]

    b = NetBuilder("plugin")
    b.node("emb", "embedder", vocab_size=VOCAB, dim=DIM, seq_len=SEQ)
    b.node("act", name)
    b.chain("emb", "act")
    b.output("y", "act")
    g = b.build()
    module = compile_network(g, seed=0, train=False)
    ids = _ids((2, SEQ), VOCAB, 0)
    out = module({"emb:in0": ids})["y"]
    torch.testing.assert_close(out, 2 * torch.tanh(module.namespace("emb").weight[ids]))
    torch.testing.assert_close(interpret(g, module.state_dict(), {"emb:in0": ids})["y"], out)


def test_a_lowering_is_required_and_named() -> None:
    name = "no_lowering_test_op"
    if name not in REGISTRY:
        register_op(OpDef(name, "activation", "identity without a torch lowering", origin="test"))
    b = NetBuilder("nolower")
    b.node("emb", "embedder", vocab_size=VOCAB, dim=DIM, seq_len=SEQ)
    b.node("mystery", name)
    b.chain("emb", "mystery")
    b.output("y", "mystery")
    with pytest.raises(vgraph.VGraphError,
                       match=r"node 'mystery'.*'no_lowering_test_op' \(defined by plugin test\) has no torch lowering"):
        compile_network(b.build())


def test_vnode_ids_that_shadow_module_attributes_keep_their_keys() -> None:
    b = NetBuilder("shadow")
    b.node("eval", "embedder", vocab_size=VOCAB, dim=DIM, seq_len=SEQ)
    b.node("forward", "linear", in_dim=DIM, out_dim=DIM)
    b.chain("eval", "forward")
    b.output("y", "forward")
    module = compile_network(b.build(), seed=0)
    assert set(module.state_dict()) == {"eval.weight", "forward.weight", "forward.bias"}
    module.eval()  # still the nn.Module method
    assert module({"eval:in0": _ids((1, SEQ), VOCAB, 0)})["y"].shape == (1, SEQ, DIM)


def test_reduced_precision_autocast_on_tiny_tensors() -> None:
    g = vgraph.load(TINY_FP32)
    module = compile_network(g, seed=0, train=False)
    ids, tg = _ids((2, 8), 64, 0), _ids((2, 8), 64, 1)
    feeds = {"embedder:in0": ids, "loss:in1": tg}
    full = module(feeds)["ce_loss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = module(feeds)
    assert half["ce_loss"].dtype == torch.float32  # the loss stays float32
    assert half["logits"].dtype == torch.bfloat16
    torch.testing.assert_close(half["ce_loss"], full, rtol=3e-2, atol=3e-2)


def test_memory_estimate_counts_adam_and_refuses_before_allocating(net8) -> None:
    small = estimate_training_memory(vgraph.load(TINY_FP32), 4)
    params = sum(p.numel() for p in init_state(vgraph.load(TINY_FP32)).values())
    assert small.parameters == 4 * params and small.gradients == 4 * params and small.optimizer == 8 * params
    fused = prepare_graph(net8, target="cpu")
    unfused = prepare_graph(net8, fuse=False, target="cpu")
    e_fused, e_unfused = (estimate_training_memory(g, 4) for g in (fused, unfused))
    logits_bytes = 4 * 512 * 32768 * 4  # batch 4 x [512, 32768] float32
    # the unfused step keeps the float32 log-softmax and forms the logits; the fused one does neither
    assert (e_unfused.activations + e_unfused.workspace) - (e_fused.activations + e_fused.workspace) >= logits_bytes
    assert estimate_training_memory(unfused, 8).activations == 2 * e_unfused.activations
    with pytest.raises(MemoryRefused, match=r"needs an estimated .* GiB = parameters .*batch 4.*lower --batch"):
        check_memory(fused, 4, "cpu", limit=e_fused.fixed + 1.5 * (e_fused.total - e_fused.fixed) // 4)
    assert check_memory(fused, 4, "cpu", limit=e_fused.total).total == e_fused.total


def test_a_float32_vnode_inside_a_reduced_precision_network() -> None:
    g = vgraph.load(TINY_FP32)
    g.meta["precision"] = {"target": "cuda-sm90", "compute_dtype": "bfloat16", "loss_scaling": False,
                           "reason": "test"}
    g.node("head_up").meta["precision"] = {"param": "float32", "activation": "float32", "master": None}
    module = compile_network(g, seed=0, train=False)
    assert "head_up = vgraph_backends_torch_lowering_lower_linear_float32(" in module.code()
    feeds = {"embedder:in0": _ids((2, 8), 64, 0)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(feeds, want=("head_up:0", "block0_ffn_up:0"))
    assert out["head_up:0"].dtype == torch.float32 and out["block0_ffn_up:0"].dtype == torch.bfloat16


def test_reading_loss_and_logits_forms_the_logits_once(tiny) -> None:
    """Both outputs of a fused LM head: one logits matmul, the loss taken from it, not a second pass."""
    fused = prepare_graph(tiny, passes="fuse-heads,fuse-lm-head-ce")
    module = compile_network(fused, seed=0, train=False)
    code = module.code(("ce_loss", "logits"))
    assert code.count("logits_chunk(") == 1
    assert "tied_lm_head_ce(" not in code
    ids = _ids((2, 16), 96, 0)
    both = module({"embedder:in0": ids, "lm_head_ce:in1": ids}, want=("ce_loss", "logits"))
    alone = module({"embedder:in0": ids, "lm_head_ce:in1": ids}, want=("ce_loss",))
    torch.testing.assert_close(both["ce_loss"], alone["ce_loss"], rtol=1e-5, atol=1e-6)
