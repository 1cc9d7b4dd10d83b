"""fuse-heads' refusals, counts and explanations, from its surviving mutants (TESTING.md).

Every head must equal the first in config, not just some; the counts a run reports (`vgraph optimize`
prints them) are those of the heads really fused; an explanation names every key that differs,
whichever head has the larger value.
"""
from __future__ import annotations

import pytest

from tools.gen_networks import TransformerSpec, transformer
from vgraph.transform.pipeline import run_pipeline


def four_heads():
    return transformer(TransformerSpec("four-heads", layers=1, vocab=64, seq_len=8, dim=32, heads=4, ffn=64,
                                       head_up=64, precision=None))


@pytest.mark.parametrize("odd", ["block0_head1", "block0_head2", "block0_head3"])
def test_any_head_that_differs_blocks_the_fusion(odd: str) -> None:
    g = four_heads()
    g.node(odd).set_config(rope_theta=500.0)
    pm = run_pipeline(g, "fuse-heads", explain=True)
    assert not pm.records[0].changed and not g.nodes_of_type("attention")
    assert any(f"head '{odd}' differs from 'block0_head0' in rope_theta" in x for x in pm.ctx.explanations)


@pytest.mark.parametrize("first, other", [(500.0, 10000.0), (10000.0, 500.0)])
def test_the_explanation_names_the_key_whichever_value_is_larger(first: float, other: float) -> None:
    g = four_heads()
    g.node("block0_head0").set_config(rope_theta=first)
    for i in (1, 2, 3):
        g.node(f"block0_head{i}").set_config(rope_theta=other)
    pm = run_pipeline(g, "fuse-heads", explain=True)
    assert any("head 'block0_head1' differs from 'block0_head0' in rope_theta" in x for x in pm.ctx.explanations)


@pytest.mark.parametrize("placement, fused, created", [
    (["A", "A", "A", "A"], 4, 1),
    (["A", "A", "B", "B"], 4, 2),
    (["A", "A", "B", "C"], 2, 1),
    (["A", "B", "B", "B"], 3, 1),
])
def test_counts_are_the_heads_really_fused(placement, fused: int, created: int) -> None:
    g = four_heads()
    for i, pnode in enumerate(placement):
        g.node(f"block0_head{i}").meta["pnode"] = pnode
    record = run_pipeline(g, "fuse-heads").records[0]
    assert record.changes == {"heads_fused": fused, "attention_created": created}
    assert sum(a.cfg["num_heads"] for a in g.nodes_of_type("attention")) == fused
    assert len(g.nodes_of_type("attention")) == created


def test_two_heads_are_enough_to_fuse() -> None:
    g = transformer(TransformerSpec("two-heads", layers=1, vocab=64, seq_len=8, dim=32, heads=2, ffn=64,
                                    head_up=64, precision=None))
    run_pipeline(g, "fuse-heads")
    [attn] = g.nodes_of_type("attention")
    assert attn.cfg["num_heads"] == 2 and not g.nodes_of_type("attention_head")


@pytest.mark.parametrize("axis", [-1, 1])
def test_the_stack_may_name_the_head_axis_either_way(axis: int) -> None:
    """Per-sample [seq, head_dim] heads: axis 1 is the last axis too, and fuses like -1."""
    g = four_heads()
    g.node("block0_stack").set_config(axis=axis)
    run_pipeline(g, "fuse-heads")
    [attn] = g.nodes_of_type("attention")
    assert attn.cfg["num_heads"] == 4
