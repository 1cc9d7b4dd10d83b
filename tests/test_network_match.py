"""vgraph.run.network_match: when trained weights fit a network, and the message when they do not."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

import vgraph
from conftest import TINY, TINY_FP32
from vgraph.run.network_match import NON_FUNCTIONAL, difference, fingerprint
from vgraph.transform.pipeline import run_pipeline

BASE = vgraph.load(TINY)


def fused(graph):
    g = graph.copy()
    run_pipeline(g, "dead-nodes,precision,fuse-heads,fuse-lm-head-ce")
    return g


def test_a_network_matches_itself_and_its_fused_forms():
    assert difference(BASE, BASE.copy()) is None
    assert difference(BASE, fused(BASE)) is None and difference(fused(BASE), BASE) is None
    assert fingerprint(BASE) == fingerprint(fused(BASE))
    assert fingerprint(BASE) != fingerprint(vgraph.load(TINY_FP32))


def test_placement_training_and_precision_keys_do_not_count():
    g = BASE.copy()
    for node in g.nodes:
        node.set_config(colocate_group="elsewhere", optimizer="sgd", precision="float32")
    assert difference(BASE, g) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_functional_change_is_named(data):
    g = BASE.copy()
    candidates = [(n.id, k) for n in g.nodes for k, v in n.config.items()
                  if k not in NON_FUNCTIONAL and k != "fused_from" and isinstance(v, (int, float, str))
                  and not isinstance(v, bool)]
    node_id, key = data.draw(st.sampled_from(candidates))
    old = g.node(node_id).config[key]
    new = old + 1 if isinstance(old, (int, float)) else old + "_x"
    g.node(node_id).config[key] = new
    why = difference(BASE, g)
    if why is None:  # only when the change does not matter once fused (an unread broadcast slot)
        assert fingerprint(g) == fingerprint(BASE)
    else:
        assert why == f"node '{node_id}': config {key!r} is {old!r} in the checkpoint's network, {new!r} in this one"


def test_a_removed_node_and_a_rewired_edge_are_named():
    g = BASE.copy()
    g.node("block0_ffn_gelu").type = "relu"
    g.node("block0_ffn_gelu").__dict__.pop("op", None)
    assert difference(BASE, g) == ("node 'block0_ffn_gelu' is a gelu in the checkpoint's network, a relu in "
                                   "this one")
    h = BASE.copy()  # the residual's two inputs swapped: every node still there, two edges differ
    first, second = h.input_edge("block0_ffn_residual", 0), h.input_edge("block0_ffn_residual", 1)
    h.remove_edge(first)
    h.remove_edge(second)
    h.add_edge(first.src, first.src_slot, "block0_ffn_residual", 1)
    h.add_edge(second.src, second.src_slot, "block0_ffn_residual", 0)
    why = difference(BASE, h)
    assert why.startswith("only ") and "has the edge" in why and "'block0_ffn_residual':" in why
