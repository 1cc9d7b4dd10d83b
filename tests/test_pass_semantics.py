"""Passes declare whether they keep what the network computes; the pipeline records those that don't."""
from __future__ import annotations

import pytest

from vgraph.transform.pass_api import Pass, register_pass
from vgraph.transform.pipeline import SEMANTIC_CHANGES, available_passes, fingerprint, run_pipeline, semantic_changes

BUILTIN = ["dead-nodes", "precision", "fuse-heads", "fuse-lm-head-ce", "partition"]


pytestmark = pytest.mark.usefixtures("local_passes")  # passes a test registers are forgotten after it


class GeluToRelu(Pass):
    """Swap every gelu for relu (a different function)."""

    name = "test-gelu-to-relu"

    def run(self, graph, ctx):
        for node in graph.nodes_of_type("gelu"):
            node.type = "relu"
            node.__dict__.pop("cfg", None)


SWAP = GeluToRelu


def register_swap():
    register_pass(SWAP)  # the fixture unregisters it after the test


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_passes_preserve_semantics(name):
    assert available_passes()[name].load().preserves_semantics is True


def test_a_pass_that_does_not_declare_it_is_assumed_not_to():
    assert Pass.preserves_semantics is False and SWAP.preserves_semantics is False


def test_builtin_pipeline_records_no_semantic_change(tiny):
    pm = run_pipeline(tiny)
    assert semantic_changes(tiny) == [] and SEMANTIC_CHANGES not in tiny.meta
    assert all(r.preserves_semantics for r in pm.records)


def test_non_preserving_pass_is_recorded_with_spec_and_origin(tiny):
    register_swap()
    pm = run_pipeline(tiny, "fuse-heads,test-gelu-to-relu,dead-nodes")
    assert semantic_changes(tiny) == ["test-gelu-to-relu"]
    (change,) = tiny.meta[SEMANTIC_CHANGES]
    assert change["pass"] == "test-gelu-to-relu" and change["origin"].endswith("test_pass_semantics.py")
    swap = next(r for r in pm.records if r.name == "test-gelu-to-relu")
    assert swap.changed and not swap.preserves_semantics
    assert any("changed what the network computes" in n for n in pm.ctx.notes)
    # the bookkeeping itself is not a change: the pass after it is judged on its own
    assert not next(r for r in pm.records if r.name == "dead-nodes").changed


def test_non_preserving_pass_that_changed_nothing_is_not_recorded(tiny):
    register_swap()
    for node in tiny.nodes_of_type("gelu"):
        node.type = "relu"
        node.__dict__.pop("cfg", None)
    before = fingerprint(tiny)
    pm = run_pipeline(tiny, "test-gelu-to-relu")
    assert not pm.records[0].changed and semantic_changes(tiny) == []
    assert fingerprint(tiny) == before


def test_records_accumulate_across_pipelines_and_copies(tiny):
    register_swap()
    run_pipeline(tiny, "test-gelu-to-relu")
    copy = tiny.copy()
    run_pipeline(copy, "fuse-heads")
    assert semantic_changes(copy) == ["test-gelu-to-relu"]
