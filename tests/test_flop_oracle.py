"""FLOPs and parameters against a hand count, and conserved by every fusion.

FLOPs feed `vgraph analyze` and the partitioner's cost model, so a wrong rule is a silently wrong
placement.  The oracle here is arithmetic written out from what each op computes (a multiply-add is 2
FLOPs, forward, per sample), not from the catalog's code:

* a linear layer ``[S, i] -> [S, o]``: ``2 S i o``;
* an attention head (head_dim h, input D): Q, K and V projections ``3 * 2 S D h``, the scores
  ``Q K^T`` ``2 S S h`` and the weighted sum ``A V`` ``2 S S h`` (the full square: the causal mask
  is not subtracted), biases and softmax not counted;
* multi-head attention of n heads: n such heads, plus ``2 S (n h) D`` for an output projection;
* the elementwise ops by the catalog's documented per-element conventions (layernorm 8, gelu 8,
  swiglu 5 per output element, dropout and add 1, a cross-entropy 5 per logit), which are choices, so
  they are stated here once and checked;
* the fused tied LM head + cross-entropy: the LM head's matmul plus the cross-entropy, nothing more.

Parameters likewise: weights and biases of each layer, a tied LM head owning nothing.
"""
from __future__ import annotations

from collections import Counter

import pytest

from conftest import NET6, NET8, NET12
from vgraph import load
from vgraph.cost.analyze import analyze
from vgraph.transform.pipeline import DEFAULT_PIPELINE, available_passes, run_pipeline
from vgraph.transform.rewrite import RewritePass

# Per-element conventions (documented in vgraph/ops/catalog.py; see the module docstring).
LAYERNORM, GELU, SWIGLU, DROPOUT, ADD, CE_PER_LOGIT = 8, 8, 5, 1, 1, 5

# (file, layers, seq S, dim D, heads n, head_dim h, ffn F, head_up U, vocab V) from networks/README.md.
SHAPES = {
    NET6: (6, 128, 512, 8, 64, 2048, 4096, 10_000),
    NET8: (8, 512, 512, 8, 64, 2048, 4096, 32_768),
    NET12: (12, 2048, 768, 12, 64, 3072, 6144, 32_768),
}


def head_flops(S: int, D: int, h: int) -> int:
    return 3 * (2 * S * D * h) + 2 * S * S * h + 2 * S * S * h


def linear_flops(S: int, i: int, o: int) -> int:
    return 2 * S * i * o


def hand_block_flops(S: int, D: int, n: int, h: int, F: int) -> int:
    """One pre-norm block: ln, n heads, projection, dropout, residual, ln, FFN up, gelu, down, dropout, residual."""
    return (LAYERNORM * S * D + n * head_flops(S, D, h) + linear_flops(S, n * h, D) + DROPOUT * S * D
            + ADD * S * D + LAYERNORM * S * D + linear_flops(S, D, F) + GELU * S * F + linear_flops(S, F, D)
            + DROPOUT * S * D + ADD * S * D)


def hand_network_flops(layers: int, S: int, D: int, n: int, h: int, F: int, U: int, V: int) -> int:
    head = (LAYERNORM * S * D + linear_flops(S, D, U) + SWIGLU * S * (U // 2) + linear_flops(S, U // 2, D)
            + linear_flops(S, D, V) + CE_PER_LOGIT * S * V)
    return layers * hand_block_flops(S, D, n, h, F) + head  # the embedder (no position table) costs 0


def hand_network_params(layers: int, S: int, D: int, n: int, h: int, F: int, U: int, V: int) -> int:
    def linear(i: int, o: int) -> int:
        return i * o + o

    block = 2 * (2 * D) + n * 3 * (h * D + h) + linear(n * h, D) + linear(D, F) + linear(F, D)
    return V * D + layers * block + 2 * D + linear(D, U) + linear(U // 2, D)  # lm_head is tied: 0


@pytest.fixture(scope="module")
def net6_stats():
    return {n.id: n for n in analyze(load(NET6)).nodes}


def test_one_node_of_each_kind_against_the_hand_count(net6_stats) -> None:
    S, D, h, F, U, V = 128, 512, 64, 2048, 4096, 10_000
    expected = {
        "embedder": (0, V * D),
        "block0_ln1": (8 * S * D, 2 * D),
        "block0_head0": (29_360_128, 98_496),  # 3*2*128*512*64 + 2*2*128*128*64; 3*(64*512 + 64)
        "block0_attn_proj": (2 * S * D * D, D * D + D),
        "block0_attn_dropout": (S * D, 0),
        "block0_attn_residual": (S * D, 0),
        "block0_ffn_up": (268_435_456, D * F + F),
        "block0_ffn_gelu": (8 * S * F, 0),
        "block0_ffn_down": (2 * S * F * D, F * D + D),
        "head_up": (2 * S * D * U, D * U + U),
        "head_swiglu": (5 * S * U // 2, 0),
        "lm_head": (1_310_720_000, 0),  # 2*128*512*10000; tied to the embedding: no parameters of its own
        "loss": (5 * S * V, 0),
    }
    assert head_flops(S, D, h) == 29_360_128
    got = {k: (net6_stats[k].flops, net6_stats[k].params) for k in expected}
    assert got == expected


@pytest.mark.parametrize("path", [NET6, NET8, NET12], ids=["net6", "net8", "net12"])
def test_whole_network_flops_and_params_against_the_hand_count(path) -> None:
    a = analyze(load(path))
    assert a.flops_per_sample == hand_network_flops(*SHAPES[path])
    assert a.params == hand_network_params(*SHAPES[path])


def test_fused_nodes_against_the_hand_count() -> None:
    g = load(NET6)
    run_pipeline(g, "fuse-heads,fuse-lm-head-ce")
    stats = {n.id: n for n in analyze(g).nodes}
    S, D, n, h, V = 128, 512, 8, 64, 10_000
    attn = stats["block0_attention"]
    assert attn.type == "attention"
    assert attn.flops == n * head_flops(S, D, h) == 234_881_024  # all eight heads, not one
    assert attn.params == n * 3 * (h * D + h)
    ce = next(s for s in stats.values() if s.type == "tied_lm_head_ce")
    assert ce.flops == 2 * S * D * V + 5 * S * V and ce.params == 0


def test_fused_attention_is_named_after_its_block() -> None:
    """`analyze` and `render` show the fused node by name; blocks 10 and 11 must not borrow block 1's."""
    g = load(NET12)
    run_pipeline(g, "fuse-heads")
    assert {n.id for n in g.nodes_of_type("attention")} == {f"block{i}_attention" for i in range(12)}


def test_attention_with_output_projection_against_the_hand_count() -> None:
    from vgraph.ops.registry import get_op
    from vgraph.types import TensorType

    op = get_op("attention")
    S, D, n, h = 16, 48, 3, 8  # n*h != D: the projection is [D, n*h]
    for proj in (False, True):
        cfg = op.schema.resolve({"num_heads": n, "head_dim": h, "dim": D, "seq_len": S,
                                 "output_projection": proj})
        flops = op.flop_count(cfg, [TensorType((S, D))], [TensorType((S, D if proj else n * h))])
        assert flops == n * head_flops(S, D, h) + (2 * S * (n * h) * D if proj else 0)
        params = sum(a * b for a, b in (s if len(s) == 2 else (*s, 1) for s in op.param_shapes(cfg).values()))
        assert params == 3 * n * h * D + 3 * n * h + ((D * n * h + D) if proj else 0)


def fusion_passes() -> list[str]:
    """Every available pass that is a rule set (a fusion), built-in or plugin."""
    return [name for name, info in available_passes().items()
            if name != "partition" and issubclass(info.load(), RewritePass)]


def test_the_fusion_passes_are_found() -> None:
    assert {"fuse-heads", "fuse-lm-head-ce"} <= set(fusion_passes())


@pytest.mark.parametrize("path", [NET6, NET8, NET12], ids=["net6", "net8", "net12"])
def test_every_fusion_conserves_flops_and_params(path) -> None:
    original = load(path)
    before = analyze(original)
    for spec in [*fusion_passes(), DEFAULT_PIPELINE]:
        g = original.copy()
        pm = run_pipeline(g, spec)
        assert any(r.changed for r in pm.records), spec  # the pass really rewrote something
        after = analyze(g)
        assert (after.flops_per_sample, after.params) == (before.flops_per_sample, before.params), spec
        # Per colocation group too: the partitioner places groups by these numbers.
        assert {k: (s.flops_per_sample, s.params) for k, s in after.groups.items()} == \
            {k: (s.flops_per_sample, s.params) for k, s in before.groups.items()}, spec
        assert Counter(n.type for n in g.nodes) != Counter(n.type for n in original.nodes)
