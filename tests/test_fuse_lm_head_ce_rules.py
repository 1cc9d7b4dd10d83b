"""fuse-lm-head-ce's refusals and what a run reports, from its surviving mutants (TESTING.md).

Only a `ce_logits` cost may become `tied_lm_head_ce` (which computes cross-entropy from raw logits):
fusing a `ce` cost (cross-entropy of probabilities) or an `mse` cost would silently change the loss.
The `cost_function` choices sort as `ce` < `ce_logits` < `mse`, so both neighbours are checked.  The
fusion keeps what the network computes (no "changed what the network computes" note, no semantic change
recorded, so weights trained before it still fit) and reports one fused head (`vgraph optimize` prints it).
"""
from __future__ import annotations

import pytest

from conftest import TINY
from vgraph import load
from vgraph.transform.pipeline import run_pipeline, semantic_changes


@pytest.mark.parametrize("cost_function", ["ce", "mse"])
def test_only_a_ce_logits_cost_is_fused(cost_function: str) -> None:
    g = load(TINY)
    g.node("loss").set_config(cost_function=cost_function)
    pm = run_pipeline(g, "fuse-lm-head-ce", explain=True, verify=False)
    assert not pm.records[0].changed and not g.nodes_of_type("tied_lm_head_ce")
    assert g.node("loss").cfg["cost_function"] == cost_function and g.node("lm_head").type == "linear"
    assert any(f"cost_function is {cost_function}" in x for x in pm.ctx.explanations)


def test_the_fusion_keeps_semantics_and_reports_one_fused_head() -> None:
    g = load(TINY)
    pm = run_pipeline(g, "fuse-lm-head-ce")
    [ce] = g.nodes_of_type("tied_lm_head_ce")
    assert ce.id == "lm_head_ce"
    [record] = pm.records
    assert record.changed and record.changes == {"lm_head_ce_fused": 1} and record.preserves_semantics
    assert semantic_changes(g) == []
    assert not any("changed what the network computes" in note for note in pm.ctx.notes)


@pytest.mark.parametrize("reader", ["a_probe", "z_probe"])  # ids sorting before and after the cost's ('loss')
def test_logits_read_by_another_node_block_the_fusion_whatever_its_id(reader: str) -> None:
    g = load(TINY)
    g.add_node(type(g.nodes[0])(reader, "relu"))
    g.add_edge("lm_head", 0, reader, 0)
    g.add_endpoint("outputs", type(g.outputs[0])(f"{reader}_out", reader, 0))
    pm = run_pipeline(g, "fuse-lm-head-ce", explain=True)
    assert not pm.records[0].changed and not g.nodes_of_type("tied_lm_head_ce")
    assert sorted(e.dst for e in g.out_edges("lm_head")) == sorted(["loss", reader])
    assert any(f"also feed '{reader}'" in x for x in pm.ctx.explanations)


def test_targets_fed_by_a_node_stay_fed_by_it() -> None:
    """A cost's targets may come from a VNode (here a tokenizer) instead of the training data."""
    g = load(TINY)
    g.add_node(type(g.nodes[0])("targets_tok", "tokenizer", {"vocab_size": 64, "pad_length": 16}))
    g.add_edge("targets_tok", 0, "loss", 1)
    run_pipeline(g, "fuse-lm-head-ce")
    [ce] = g.nodes_of_type("tied_lm_head_ce")
    logits_in, targets_in = g.input_edge(ce.id, 0), g.input_edge(ce.id, 1)
    assert (logits_in.src, logits_in.src_slot) == ("head_down", 0)
    assert (targets_in.src, targets_in.src_slot) == ("targets_tok", 0)
