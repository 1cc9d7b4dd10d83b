"""Declarative replacement (vgraph.transform.replace): use-def links stay consistent, nothing read from outside is
orphaned."""
from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from vgraph.ir.graph import Endpoint, Graph, VNode
from vgraph.transform.replace import NewNode, Reject, ReplaceError, fused, reads, rebuilt, replace


# -- random DAGs ------------------------------------------------------------------------------

@st.composite
def dags(draw):
    """A DAG of relu (1 input) and add (2 inputs) nodes; some inputs unconnected; a few endpoints."""
    g = Graph("random")
    n = draw(st.integers(2, 10))
    for i in range(n):
        kind = draw(st.sampled_from(["relu", "add"]))
        g.add_node(VNode(f"n{i}", kind))
        for slot in range(1 if kind == "relu" else 2):
            if i and draw(st.booleans()):
                g.add_edge(f"n{draw(st.integers(0, i - 1))}", 0, f"n{i}", slot)
    for k in range(draw(st.integers(0, 3))):
        g.add_endpoint("outputs", Endpoint(f"out{k}", f"n{draw(st.integers(0, n - 1))}", 0))
    old = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n).map(sorted))
    mapped = draw(st.booleans())  # map every outside reader, or a random subset
    keep = draw(st.sets(st.sampled_from([f"n{i}" for i in old])))
    return g, [f"n{i}" for i in old], mapped, keep, draw(st.booleans())


def outside_readers(g: Graph, gone: set[str]) -> dict[str, list]:
    """Old node -> the edges and endpoints outside `gone` that read it."""
    out: dict[str, list] = {o: [] for o in gone}
    for o in gone:
        out[o] += [(e.dst, e.dst_slot) for e in g.out_edges(o) if e.dst not in gone]
        out[o] += [ep.name for ep in g.iter_endpoints() if ep.node == o]
    return out


def assert_use_def_consistent(g: Graph) -> None:
    ids = set(g.node_ids())
    edges = g.edges
    assert {(e.src, e.src_slot, e.dst, e.dst_slot) for e in edges} == {
        (e.src, e.src_slot, e.dst, e.dst_slot) for n in ids for e in g.in_edges(n)}
    for e in edges:
        assert e.src in ids and e.dst in ids
        assert g.input_edge(e.dst, e.dst_slot) == e and e in g.out_edges(e.src)
    assert all(ep.node in ids for ep in g.iter_endpoints())
    assert set(g.nx.nodes) == ids  # the networkx view is kept in step
    assert {(u, v, k) for u, v, k in g.nx.edges(keys=True)} == {
        (e.src, e.dst, (e.src_slot, e.dst_slot)) for e in edges}


def is_convex(g: Graph, gone: set[str]) -> bool:
    """No node outside `gone` lies on a path between two nodes of it."""
    between = set().union(*(nx.descendants(g.nx, o) for o in gone)) & \
        set().union(*(nx.ancestors(g.nx, o) for o in gone))
    return between <= gone


@settings(max_examples=200, deadline=None)
@given(dags())
def test_replacing_random_subgraphs(case):
    g, old, mapped, keep, chained = case
    g.nx  # build the networkx view first: it must be kept in step
    gone = set(old)
    readers = outside_readers(g, gone)
    convex = is_convex(g, gone)
    before = g.copy()
    order = list(g.node_ids())
    feeds = [(o, s) for o in old for s in range(g.num_inputs(o))
             if (e := g.input_edge(o, s)) is None or e.src not in gone]
    new = NewNode("stack", "fused", {}, [reads(o, s) for o, s in feeds])
    last = NewNode("relu", "fused_out", {}, [new[0]]) if chained else new  # new nodes may read each other
    wanted = [o for o in old if mapped or o in keep]
    result = replace(g, old, [new, last] if chained else [new], {o: last[0] for o in wanted})
    orphaned = [o for o in old if readers[o] and o not in wanted]
    if orphaned:
        assert isinstance(result, Reject)
        assert any(f"'{o}'" in result.reason for o in orphaned)
        assert g == before and list(g.node_ids()) == order  # refused: nothing changed
        return
    assert not isinstance(result, Reject), result
    assert result == {"removed": len(old), "created": 2 if chained else 1}
    assert_use_def_consistent(g)
    created = ["fused", "fused_out"] if chained else ["fused"]
    assert not gone & set(g.node_ids()) and list(g.node_ids())[-len(created):] == created
    assert [n for n in g.node_ids() if n not in created] == [n for n in order if n not in gone]
    if chained:
        assert g.input_edge("fused_out", 0).src == "fused"
    for slot, (o, s) in enumerate(feeds):  # the new node reads what the old nodes read
        was = before.input_edge(o, s)
        now = g.input_edge("fused", slot)
        assert (now.src, now.src_slot) == (was.src, was.src_slot) if was else now is None
    for o in old:  # every outside reader now reads the new node
        for r in readers[o]:
            if isinstance(r, tuple):
                assert g.input_edge(*r).src == created[-1]
            else:
                assert next(ep for ep in g.iter_endpoints() if ep.name == r).node == created[-1]
    if convex:
        assert g.is_acyclic()


@settings(max_examples=100, deadline=None)
@given(dags())
def test_rebuilding_a_node_keeps_its_place_and_its_readers(case):
    g, old, *_ = case
    target = old[0]
    order = list(g.node_ids())
    readers = outside_readers(g, {target})[target]
    node = g.node(target)
    new = rebuilt(node, [reads(target, s) for s in range(g.num_inputs(target))], note="x")
    assert replace(g, [target], [new], {target: new[0]}) == {"removed": 1, "created": 1}
    assert list(g.node_ids()) == order and g.node(target).config == {"note": "x"}
    assert_use_def_consistent(g)
    assert len(outside_readers(g, {target})[target]) == len(readers)


# -- refusals: the reason, and an untouched graph ------------------------------------------------

def chain() -> Graph:
    """a -> b -> c, with output 'y' reading c and 'mid' reading b."""
    g = Graph("chain")
    for name in "abc":
        g.add_node(VNode(name, "relu"))
    g.add_edge("a", 0, "b", 0)
    g.add_edge("b", 0, "c", 0)
    g.add_endpoint("outputs", Endpoint("y", "c", 0))
    return g


def test_an_outside_reader_of_a_removed_node_is_refused():
    g = chain()
    g.add_node(VNode("probe", "relu"))
    g.add_edge("b", 0, "probe", 0)
    before = g.copy()
    new = NewNode("relu", "bc", {}, [reads("b", 0)])
    result = replace(g, ["b", "c"], [new], {"c": new[0]})
    assert result == Reject("'b' also feeds 'probe'")
    assert g == before


def test_an_endpoint_reading_a_removed_node_is_refused():
    g = chain()
    g.add_endpoint("outputs", Endpoint("mid", "b", 0))
    new = NewNode("relu", "bc", {}, [reads("b", 0)])
    assert replace(g, ["b", "c"], [new], {"c": new[0]}) == Reject("'b' is read by 'mid'")
    assert [ep.node for ep in g.outputs] == ["c", "b"]


def test_a_published_weight_must_keep_its_owner(tiny):
    emb = next(n for n in tiny.nodes if n.config.get("shared_weight_alias"))
    alias = emb.config["shared_weight_alias"]
    plain = rebuilt(emb, [reads(emb, 0)], shared_weight_alias=None)
    result = replace(tiny, [emb], [plain], {emb.id: plain[0]})
    assert isinstance(result, Reject) and f"publishes weight {alias!r}" in result.reason
    assert "ties to" in result.reason and tiny.node(emb.id).config["shared_weight_alias"] == alias
    keeps = rebuilt(emb, [reads(emb, 0)])  # publishing it again is fine
    assert replace(tiny, [emb], [keeps], {emb.id: keeps[0]}) == {"removed": 1, "created": 1}


def test_declared_shapes_are_not_silently_lost():
    g = chain()
    g.node("b").input_shapes = ((4, 8),)
    new = NewNode("relu", "bc", {}, [reads("b", 0)])
    result = replace(g, ["b", "c"], [new], {"c": new[0]})
    assert result == Reject("'b' declares input/output shapes, which the replacement would lose")


# -- mistakes in a rewrite are errors, raised before anything changes ----------------------------

@pytest.mark.parametrize("build,message", [
    (lambda n: ([n], {"a": n[0]}), "'a' is not replaced"),
    (lambda n: ([x := NewNode("relu", "x", {}, [reads("c", 0)])], {"c": x[0]}), "which the replacement removes"),
    (lambda n: ([x := NewNode("relu", "x", {}, [("b", 0)])], {"c": x[0]}), "an output the replacement removes"),
    (lambda n: ([x := NewNode("relu", "x", {}, [n[0]])], {"c": x[0]}), "not among the new nodes"),
    (lambda n: ([n], {"c": None}), "would read nothing"),
])
def test_wrong_replacements_raise_and_change_nothing(build, message):
    g = chain()
    before = g.copy()
    new, outputs = build(NewNode("relu", "bc", {}, [reads("b", 0)]))
    with pytest.raises(ReplaceError, match=message):
        replace(g, ["b", "c"], new, outputs)
    assert g == before


def test_fused_records_sources_and_inherits_placement():
    g = chain()
    g.node("b").set_config(colocate_group="g1", precision="bf16")
    g.node("b").meta["pnode"] = "A"
    new = fused("relu", "bc", {}, [g.node("b"), g.node("c")], inputs=[reads("b", 0)])
    assert replace(g, ["b", "c"], [new], {"c": new[0]}, counts={"fused": 1}) == {"fused": 1}
    bc = g.node("bc")
    assert bc.config == {"colocate_group": "g1", "precision": "bf16", "fused_from": "b,c"}
    assert bc.meta == {"pnode": "A"} and g.outputs[0].node == "bc"
    assert [(e.src, e.dst) for e in g.edges] == [("a", "bc")]


def test_a_taken_id_gets_a_fresh_one_and_an_old_id_is_reused_in_place():
    g = chain()
    clash = NewNode("relu", "a", {}, [reads("b", 0)])  # 'a' is kept: the new node becomes 'a_2'
    assert replace(g, ["b"], [clash], {"b": clash[0]}) == {"removed": 1, "created": 1}
    assert list(g.node_ids()) == ["a", "c", "a_2"] and g.input_edge("c", 0).src == "a_2"
    again = NewNode("relu", "c", {"x": 1}, [("a_2", 0)])  # 'c' is replaced: rebuilt in its place
    replace(g, ["c"], [again], {"c": again[0]})
    assert list(g.node_ids()) == ["a", "c", "a_2"] and g.node("c").config == {"x": 1}


def test_a_removed_pass_through_node_maps_its_output_to_its_input():
    g = chain()
    assert replace(g, ["b"], [], {"b": reads("b", 0)}) == {"removed": 1, "created": 0}
    assert [(e.src, e.dst) for e in g.edges] == [("a", "c")]
