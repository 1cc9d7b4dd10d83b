"""The Graph API: invariants, orders, the networkx view, copies and re-verification.

The storage behind `Graph` is plain dicts kept for speed; these tests pin
the behaviour callers rely on, including that edge and topological orders
are exactly the ones networkx gives for the same sequence of changes.
"""
from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph import Edge, Endpoint, Graph, GraphError, TensorType, VGraphError, VNode, dumps, load, loads, verify
from vgraph.builder import NetBuilder


def small() -> Graph:
    """x -> split -(0)-> a -> join(0); split -(1)-> join(1)."""
    b = NetBuilder("small")
    b.node("x", "reshape", target_shape=(4, 8))
    b.node("split", "broadcast", num_outputs=2)
    b.node("a", "relu")
    b.node("join", "add")
    b.edge("x", "split")
    b.edge("split", "a", 0)
    b.edge("a", "join")
    b.edge("split", "join", 1, 1)
    g = b.graph
    g.node("x").input_shapes = ((32,),)
    b.output("y", "join")
    return verify(g)


def test_small_graph_infers_types() -> None:
    g = small()
    assert g.node("split").outputs == (TensorType((4, 8)), TensorType((4, 8)))
    assert g.node("join").outputs == (TensorType((4, 8)),)


def test_duplicate_node_id_is_refused_even_for_the_same_object() -> None:
    g = small()
    with pytest.raises(GraphError, match="duplicate node id"):
        g.add_node(VNode("a", "relu"))
    with pytest.raises(GraphError):
        g.add_node(g.node("a"))
    assert len(g) == 4


def test_add_edge_checks_ends_and_busy_inputs() -> None:
    g = small()
    with pytest.raises(GraphError, match="unknown node 'nope'"):
        g.add_edge("nope", 0, "a", 0)
    with pytest.raises(GraphError, match="input slot 0 already receives split:0 -> a:0"):
        g.add_edge("x", 0, "a", 0)
    assert [str(e) for e in g.in_edges("join")] == ["a:0 -> join:0", "split:1 -> join:1"]


def test_adjacency_queries() -> None:
    g = small()
    assert g.input_edge("join", 1) == Edge("split", 1, "join", 1)
    assert g.input_edge("join", 5) is None
    assert g.producer("join", 0) is g.node("a")
    assert g.producer("x", 0) is None
    assert [str(e) for e in g.out_edges("split")] == ["split:0 -> a:0", "split:1 -> join:1"]
    assert [str(e) for e in g.users("split", 1)] == ["split:1 -> join:1"]
    assert g.num_inputs("join") == 2 and g.num_inputs("x") == 1
    assert g.network_inputs() == [("x", 0)]
    with pytest.raises(KeyError):
        g.in_edges("nope")
    assert "a" in g and "nope" not in g and ["unhashable"] not in g


def test_stack_counts_inputs_from_its_edges() -> None:
    b = NetBuilder("s")
    b.node("src", "broadcast", num_outputs=3)
    b.node("st", "stack", axis=-1)
    for i in range(3):
        b.edge("src", "st", i, i)
    b.graph.node("src").input_shapes = ((2, 5),)
    g = verify(b.graph)
    assert g.num_inputs("st") == 3
    assert g.node("st").outputs == (TensorType((2, 15)),)


def test_remove_edge_and_node() -> None:
    g = small()
    e = g.input_edge("join", 1)
    g.remove_edge(e)
    assert g.input_edge("join", 1) is None
    with pytest.raises(nx.NetworkXError):
        g.remove_edge(e)
    with pytest.raises(GraphError, match="still used by a:0 -> join:0"):
        g.remove_node("a")
    with pytest.raises(GraphError, match="still used by y"):
        g.remove_node("join")
    g.outputs.clear()
    g.remove_node("join")  # its own input edges go with it
    assert [str(e) for e in g.out_edges("a")] == []
    assert "join" not in g and len(g.edges) == 2


def test_replace_uses_moves_edges_and_endpoints() -> None:
    g = small()
    g.add_node(VNode("b", "relu"))
    g.add_edge("split", 0, "b", 0)
    assert g.replace_uses(("a", 0), ("b", 0)) == 1  # the edge into join
    assert g.input_edge("join", 0) == Edge("b", 0, "join", 0)
    assert g.out_edges("a") == []
    assert g.replace_uses(("join", 0), ("a", 0)) == 1  # output 'y'
    assert g.outputs[0] == Endpoint("y", "a", 0)


def test_copy_is_equal_and_independent() -> None:
    g = small()
    c = g.copy()
    assert c == g and c.diff(g) == []
    c.node("a").set_config(precision="fp16")
    c.remove_edge(c.input_edge("join", 1))
    assert c != g
    assert sorted(c.diff(g)) == ["+ edge split:1 -> join:1", "~ node a"]
    assert g.input_edge("join", 1) is not None and g.node("a").config == {}


def test_cfg_is_cached_and_set_config_drops_it() -> None:
    g = small()
    n = g.node("split")
    assert n.cfg["num_outputs"] == 2 and n.cfg["precision"] is None
    n.set_config(num_outputs=3)
    assert n.cfg["num_outputs"] == 3
    verify(g)
    assert len(n.outputs) == 3


def test_verify_re_infers_after_a_change_and_reports_problems() -> None:
    g = small()
    g.node("x").set_config(target_shape=(2, 16))
    verify(g)
    assert g.node("join").outputs == (TensorType((2, 16)),)
    g.node("x").set_config(target_shape=(5, 7))
    with pytest.raises(VGraphError, match=r"cannot reshape \[32\]"):
        verify(g)


def test_nx_view_is_built_lazily_and_kept_in_step() -> None:
    g = small()
    view = g.nx
    assert set(view.nodes) == {"x", "split", "a", "join"}
    assert view.nodes["a"]["vnode"] is g.node("a")
    assert view.edges["split", "join", (1, 1)]["edge"] == Edge("split", 1, "join", 1)
    g.add_node(VNode("b", "relu"))
    g.add_edge("split", 0, "b", 0)
    g.remove_edge(g.input_edge("join", 1))
    assert g.nx is view
    assert view.has_edge("split", "b", (0, 0)) and not view.has_edge("split", "join", (1, 1))
    g.remove_node("b")
    assert "b" not in view
    assert [d["edge"] for *_, d in view.edges(data=True)] == g.edges


def test_cycles_are_named() -> None:
    g = Graph("loop")
    for name in ("a", "b", "c"):
        g.add_node(VNode(name, "relu"))
    g.add_edge("a", 0, "b", 0)
    g.add_edge("b", 0, "c", 0)
    g.add_edge("c", 0, "a", 0)
    assert not g.is_acyclic()
    with pytest.raises(GraphError, match="cycle: a -> b -> c -> a"):
        g.topo_order()
    with pytest.raises(VGraphError, match="cycle: a -> b -> c -> a"):
        verify(g)


def test_nodes_written_out_of_order_give_the_same_graph(net6) -> None:
    text = dumps(net6)
    head, rest = text.split("  - id: block0_in\n", 1)
    block0, tail = rest.split("  - id: block0_ln1\n", 1)
    swapped = head + "  - id: block0_ln1\n" + tail.replace("edges:\n", "  - id: block0_in\n" + block0 + "edges:\n", 1)
    g = loads(swapped)
    assert [n.id for n in g.nodes] != [n.id for n in net6.nodes]
    assert [n.id for n in g.topo_order()] == [n.id for n in net6.topo_order()]
    assert {n.id: n.outputs for n in g.nodes} == {n.id: n.outputs for n in net6.nodes}


def test_endpoint_defaults() -> None:
    ep = Endpoint("y", "join")
    assert (ep.slot, ep.type, ep.loc) == (0, None, None)


def test_production_graph_counts(net8) -> None:
    assert len(net8) == 183
    assert len(net8.edges) == net8.nx.number_of_edges() == 8 * 31 + 6  # 31 edges a block
    assert net8.network_inputs() == [("embedder", 0), ("loss", 1)]
    assert net8.publishers()["token_embedding"].id == "embedder"
    assert net8.activation_dtype(net8.node("loss")) == "float16"
    assert net8.node("loss").outputs[0].dtype == "float32"  # cost_precision


# -- orders agree with networkx for any sequence of changes ------------------------------

@st.composite
def edits(draw):
    """A random sequence of node/edge additions and removals, over 8 node ids."""
    return draw(st.lists(st.tuples(st.sampled_from(["add_node", "add_edge", "add_edge", "add_edge",
                                                    "remove_edge", "remove_node"]),
                                   st.integers(0, 7), st.integers(0, 7), st.integers(0, 2), st.integers(0, 2)),
                         max_size=40))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(edits())
def test_orders_match_networkx(ops) -> None:
    g, ref = Graph(), nx.MultiDiGraph()
    for op, a, b, sa, sb in ops:
        u, v = f"n{a}", f"n{b}"
        if op == "add_node" and u not in g:
            g.add_node(VNode(u, "relu"))
            ref.add_node(u)
        elif op == "add_edge" and u in g and v in g and g.input_edge(v, sb) is None:
            g.add_edge(u, sa, v, sb)
            ref.add_edge(u, v, key=(sa, sb))
        elif op == "remove_edge" and u in g and g.out_edges(u):
            e = g.out_edges(u)[sa % len(g.out_edges(u))]
            g.remove_edge(e)
            ref.remove_edge(e.src, e.dst, key=(e.src_slot, e.dst_slot))
        elif op == "remove_node" and u in g and not g.out_edges(u):
            g.remove_node(u)
            ref.remove_node(u)
    assert [n.id for n in g.nodes] == list(ref.nodes)
    assert [(e.src, e.dst, (e.src_slot, e.dst_slot)) for e in g.edges] == list(ref.edges(keys=True))
    index = {n: i for i, n in enumerate(ref.nodes)}
    if nx.is_directed_acyclic_graph(ref):
        assert [n.id for n in g.topo_order()] == list(nx.lexicographical_topological_sort(ref, key=index.get))
    else:
        assert not g.is_acyclic()
        with pytest.raises(GraphError, match="cycle"):
            g.topo_order()
    for n in g.nodes:
        assert [str(e) for e in g.in_edges(n.id)] == [
            f"{u}:{k[0]} -> {n.id}:{k[1]}" for u, _, k in sorted(ref.in_edges(n.id, keys=True), key=lambda t: t[2][1])]


def test_loaded_graph_keeps_file_lines(tmp_path) -> None:
    path = tmp_path / "t.yml"
    path.write_text(dumps(small()))
    g = load(path)
    text = path.read_text().split("\n")
    assert text[g.node("a").loc.line - 1] == "  - id: a"
    e = g.input_edge("join", 1)
    assert text[e.loc.line - 1] == "  - {from: split, to: join, from_slot: 1, to_slot: 1}"
    assert str(g.node("a").loc) == f"{path}:{g.node('a').loc.line}"
