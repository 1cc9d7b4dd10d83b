"""Partial head fusion under any PNode placement computes the same function as the unfused graph.

`fuse-heads` fuses each contiguous run of heads that share a PNode and leaves the stack reading the
runs in the heads' original order.  A structural test can check the order it expects; this one checks
what the order is for: for random placements (hypothesis), the fused graph's logits, loss and every
parameter gradient equal the unfused graph's with the same weights (torch backend, tiny network).
Grouping heads across PNodes (a run per PNode rather than per contiguous stretch) permutes the stacked
columns, which the output projection turns into different logits: that bug fails here.
"""
from __future__ import annotations

import functools

import torch
from hypothesis import given, settings, strategies as st

from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import compile_network, to_unfused_layout
from vgraph.transform.pipeline import run_pipeline

LAYERS, HEADS, VOCAB, SEQ = 2, 4, 64, 8


def _network():
    return transformer(TransformerSpec("placed", layers=LAYERS, vocab=VOCAB, seq_len=SEQ, dim=32, heads=HEADS,
                                       ffn=64, head_up=64, precision=None))


def _forward_backward(module, ids, targets):
    feeds = {name: ids if name.startswith("embedder:") else targets for name in module.feeds_needed()}
    module.zero_grad(set_to_none=True)
    out = module(feeds, want=("logits", "ce_loss"))
    out["ce_loss"].backward()
    grads = {k: p.grad.detach().clone() for k, p in module.named_parameters() if p.grad is not None}
    return out["logits"].detach(), out["ce_loss"].detach(), grads


UNFUSED = _network()


@functools.lru_cache(maxsize=1)
def reference():
    """Perturbed weights (non-zero biases, so a misplaced bias shows too), a batch, and the unfused results."""
    module = compile_network(UNFUSED, seed=0, train=False)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    return module.state_dict(), ids, targets, _forward_backward(module, ids, targets)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(placement=st.lists(st.sampled_from(["A", "B", "C", None]), min_size=LAYERS * HEADS,
                          max_size=LAYERS * HEADS))
def test_partial_head_fusion_matches_unfused_numerically(placement) -> None:
    g = UNFUSED.copy()
    heads = sorted(g.nodes_of_type("attention_head"), key=lambda n: n.id)
    for node, pnode in zip(heads, placement):
        if pnode:
            node.meta["pnode"] = pnode
    run_pipeline(g, "fuse-heads")
    fused_heads = sum(a.cfg["num_heads"] for a in g.nodes_of_type("attention"))
    assert fused_heads + len(g.nodes_of_type("attention_head")) == LAYERS * HEADS
    assert all(a.cfg["num_heads"] >= 2 for a in g.nodes_of_type("attention"))  # a lone head stays a head

    weights, ids, targets, (ref_logits, ref_loss, ref_grads) = reference()
    module = compile_network(g, train=False, unfused_state=weights)
    logits, loss, grads = _forward_backward(module, ids, targets)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    grads = to_unfused_layout(grads, g)
    assert set(grads) == set(ref_grads)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-7, msg=key)


def test_two_runs_per_block_match_unfused() -> None:
    """The placement the property must not miss: A,A,B,B in every block fuses two runs per block."""
    g = UNFUSED.copy()
    for node in g.nodes_of_type("attention_head"):
        node.meta["pnode"] = "A" if node.id[-1] in "01" else "B"
    run_pipeline(g, "fuse-heads")
    assert len(g.nodes_of_type("attention")) == 2 * LAYERS
    weights, ids, targets, (ref_logits, ref_loss, _) = reference()
    module = compile_network(g, train=False, unfused_state=weights)
    logits, loss, _ = _forward_backward(module, ids, targets)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
