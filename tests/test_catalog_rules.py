"""Catalog FLOP and parameter rules on the configurations the production networks do not use.

The production networks (tests/test_flop_oracle.py) never have a learned position table, an `attention`
VNode without `dim`, or a layer applied to a rank-3 per-sample input; mutation testing (TESTING.md) showed
the rules for those cases could change without any test noticing.  The expected numbers are counted by
hand, as in test_flop_oracle.py: a multiply-add is 2 FLOPs, forward, per sample.
"""
from __future__ import annotations

from math import prod

import pytest

from vgraph.ops.registry import get_op
from vgraph.types import TensorType as T


def _count(op_name: str, config: dict, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]):
    op = get_op(op_name)
    cfg = op.schema.resolve(config)
    flops = op.flop_count(cfg, [T(s) for s in ins], [T(s) for s in outs])
    params = sum(prod(shape) for shape in op.param_shapes(cfg).values())
    return flops, params


@pytest.mark.parametrize("encoding, flops, params", [
    ("learned", 16 * 8, 50 * 8 + 16 * 8),  # adds a [seq, dim] position table: one add per element
    ("rope", 0, 50 * 8),                   # rotations happen in the heads; the embedder only looks up
    ("none", 0, 50 * 8),
])
def test_embedder_position_encodings(encoding: str, flops: int, params: int) -> None:
    config = {"vocab_size": 50, "dim": 8, "seq_len": 16, "position_encoding": encoding}
    assert _count("embedder", config, [(16,)], [(16, 8)]) == (flops, params)


def test_attention_without_dim_uses_heads_times_head_dim() -> None:
    S, n, h = 16, 3, 8
    D = n * h  # no `dim`: the model width is num_heads * head_dim
    head = 3 * (2 * S * D * h) + 2 * S * S * h + 2 * S * S * h
    flops, params = _count("attention", {"num_heads": n, "head_dim": h, "seq_len": S}, [(S, D)], [(S, D)])
    assert flops == n * head
    assert params == 3 * (n * h) * D + 3 * (n * h)


def test_linear_counts_every_leading_dimension() -> None:
    # A per-sample [4, 5, 6] input: 4 * 5 rows of a 6 -> 7 matmul.
    assert _count("linear", {"in_dim": 6, "out_dim": 7}, [(4, 5, 6)], [(4, 5, 7)]) == (2 * 4 * 5 * 6 * 7, 6 * 7 + 7)
    assert _count("linear", {"in_dim": 6, "out_dim": 7}, [(6,)], [(7,)]) == (2 * 6 * 7, 6 * 7 + 7)


def test_tied_linear_owns_no_parameters_but_costs_its_matmul() -> None:
    cfg = {"in_dim": 8, "out_dim": 50, "tie_weight_alias": "emb"}
    assert _count("linear", cfg, [(16, 8)], [(16, 50)]) == (2 * 16 * 8 * 50, 0)
    assert get_op("linear").tied(get_op("linear").schema.resolve(cfg)) == {"weight": ("emb", (50, 8))}


@pytest.mark.parametrize("op_name, per_element, shape", [
    ("layernorm", 8, (4, 6)), ("gelu", 8, (4, 6)), ("silu", 4, (4, 6)), ("relu", 1, (4, 6)),
    ("dropout", 1, (4, 6)), ("mask", 1, (6, 6)),
])
def test_elementwise_conventions(op_name: str, per_element: int, shape: tuple[int, ...]) -> None:
    config = {"dim": shape[-1]} if op_name == "layernorm" else {}
    flops, _ = _count(op_name, config, [shape], [shape])
    assert flops == per_element * prod(shape)


def test_swiglu_and_cost_conventions() -> None:
    assert _count("swiglu", {}, [(4, 12)], [(4, 6)])[0] == 5 * 4 * 6        # per output element
    assert _count("cost", {"cost_function": "ce_logits"}, [(4, 50), (4,)], [()])[0] == 5 * 4 * 50  # per logit
    fused = _count("tied_lm_head_ce", {"in_dim": 8, "out_dim": 50, "tie_weight_alias": "emb"},
                   [(4, 8), (4,)], [(), (4, 50)])
    assert fused == (2 * 4 * 8 * 50 + 5 * 4 * 50, 0)
