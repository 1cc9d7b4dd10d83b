"""Equivalence: compiled == reference interpreter, and fused == unfused (loss, gradients, checkpoints)."""
from __future__ import annotations

import pytest
import torch

import vgraph
from conftest import NET6, TINY, TINY_FP32
from vgraph.backends.torch import (TrainConfig, compile_network, interpret, prepare_graph, to_graph_layout,
                                   to_unfused_layout, train)
from vgraph.backends.torch.training.checkpoint import load_checkpoint

FUSE_ALL = "fuse-heads,fuse-lm-head-ce"


def _batch(vocab: int, seq: int, batch: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen)


def _feeds(module, ids: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token ids to the embedder, targets to whatever node computes the loss (it differs after fusion)."""
    feeds = {}
    for name in module.feeds_needed():
        feeds[name] = ids if name.startswith("embedder:") else targets
    return feeds


def _loss_and_grads(module, feeds) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module(feeds, want=("ce_loss",))["ce_loss"]
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in module.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("path", [TINY, TINY_FP32], ids=["tiny_2l", "tiny_1l_fp32"])
def test_compiled_equals_reference_interpreter(path) -> None:
    g = vgraph.load(path)
    for graph in (g, prepare_graph(g, passes=FUSE_ALL)):
        module = compile_network(graph, seed=1, train=False)
        vocab, seq = graph.node("embedder").cfg["vocab_size"], graph.node("embedder").cfg["seq_len"]
        feeds = _feeds(module, *_batch(vocab, seq))
        params = dict(module.named_parameters())
        out = module(feeds)
        ref = interpret(graph, params, feeds)
        assert set(out) == set(ref) == {"logits", "ce_loss"}
        for name in out:
            torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-5)
        out["ce_loss"].backward()
        compiled = {k: p.grad.clone() for k, p in params.items()}
        module.zero_grad(set_to_none=True)
        ref["ce_loss"].backward()
        for key, p in params.items():
            torch.testing.assert_close(compiled[key], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", [TINY, TINY_FP32], ids=["tiny_2l", "tiny_1l_fp32"])
def test_fused_and_unfused_give_the_same_loss_and_gradients(path) -> None:
    unfused_graph = vgraph.load(path)
    fused_graph = prepare_graph(unfused_graph, passes=FUSE_ALL)
    assert len(fused_graph.nodes_of_type("attention")) >= 1 and len(fused_graph.nodes_of_type("tied_lm_head_ce")) == 1
    unfused = compile_network(unfused_graph, seed=0, train=False)
    # Same weights: perturb the unfused init (so biases are not all zero), then load it into the fused graph.
    with torch.no_grad():
        for p in unfused.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fused = compile_network(fused_graph, train=False, unfused_state=unfused.state_dict())
    vocab, seq = unfused_graph.node("embedder").cfg["vocab_size"], unfused_graph.node("embedder").cfg["seq_len"]
    ids, targets = _batch(vocab, seq, batch=4)
    loss_u, grads_u = _loss_and_grads(unfused, _feeds(unfused, ids, targets))
    loss_f, grads_f = _loss_and_grads(fused, _feeds(fused, ids, targets))
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=0)
    grads_f = to_unfused_layout(grads_f, fused_graph)
    assert set(grads_f) == set(grads_u)
    for key in grads_u:
        torch.testing.assert_close(grads_f[key], grads_u[key], rtol=1e-5, atol=1e-7)
    # The logits output survives fusion (computed on request only).
    torch.testing.assert_close(fused({"embedder:in0": ids}, want="logits")["logits"],
                               unfused(_feeds(unfused, ids, targets), want="logits")["logits"], rtol=1e-5, atol=1e-5)


def test_layout_round_trip_is_exact(tiny) -> None:
    fused_graph = prepare_graph(tiny, passes=FUSE_ALL)
    unfused = compile_network(tiny, seed=3).state_dict()
    there = to_graph_layout(unfused, fused_graph)
    assert "block0_attention.qkv_weight" in there and there["block0_attention.qkv_weight"].shape == (96, 32)
    # Rows: all heads' q, then all k, then all v.
    assert torch.equal(there["block0_attention.qkv_weight"][16:32], unfused["block0_head1.wq"])
    assert torch.equal(there["block0_attention.qkv_bias"][32:48], unfused["block0_head0.bk"])
    back = to_unfused_layout(there, fused_graph)
    assert set(back) == set(unfused) and all(torch.equal(back[k], unfused[k]) for k in unfused)


def _text_file(tmp_path) -> str:
    from vgraph.backends.torch.training.batches import default_corpus_documents

    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=12_000)), encoding="utf-8")
    return str(path)


def test_a_checkpoint_of_one_layout_trains_on_in_the_other(tmp_path) -> None:
    """Unfused steps 1-3, then fused steps 4-6 == unfused steps 1-6 (same data, dropout and Adam state)."""
    data = _text_file(tmp_path)
    common = dict(network=str(TINY), data=data, batch=4, lr=3e-3, seed=7, val_every=0, progress=False,
                  checkpoint_every=3, deterministic=True)
    reference = train(TrainConfig(**common, steps=6, fuse=False, out=tmp_path / "ref"))
    train(TrainConfig(**common, steps=3, fuse=False, out=tmp_path / "switch"))
    switched = train(TrainConfig(**common, steps=6, fuse=True, resume=True, out=tmp_path / "switch"))
    a = load_checkpoint(reference.checkpoint)
    b = load_checkpoint(switched.checkpoint)
    assert a.step == b.step == 6
    assert set(a.model_state) == set(b.model_state)  # checkpoints are in the unfused layout either way
    for key in a.model_state:
        torch.testing.assert_close(b.model_state[key], a.model_state[key], rtol=1e-4, atol=1e-6)
    assert set(a.optimizer_states) == set(b.optimizer_states)
    losses_ref = [r["loss"] for r in reference.history]
    losses_switch = [r["loss"] for r in switched.history]
    assert losses_switch[:3] == losses_ref[:3]  # the same rows, kept from the unfused part
    torch.testing.assert_close(torch.tensor(losses_switch), torch.tensor(losses_ref), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_six_layer_network_fused_equals_unfused() -> None:
    unfused_graph = prepare_graph(vgraph.load(NET6), fuse=False, target="cpu")
    fused_graph = prepare_graph(vgraph.load(NET6), target="cpu")
    unfused = compile_network(unfused_graph, seed=0, train=False)
    fused = compile_network(fused_graph, train=False, unfused_state=unfused.state_dict())
    ids, targets = _batch(10000, 128, batch=1)
    loss_u, grads_u = _loss_and_grads(unfused, _feeds(unfused, ids, targets))
    loss_f, grads_f = _loss_and_grads(fused, _feeds(fused, ids, targets))
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=0)
    grads_f = to_unfused_layout(grads_f, fused_graph)
    for key in grads_u:
        torch.testing.assert_close(grads_f[key], grads_u[key], rtol=1e-5, atol=1e-7)
