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
from vgraph.ir.builder import NetBuilder


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
    for ep in g.outputs:
        g.remove_endpoint("outputs", ep.name)
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


# -- every change through Graph: endpoints, rebuilt nodes, the bulk loader, lint --------------------------

def test_endpoints_change_only_through_the_graph() -> None:
    g = small()
    with pytest.raises(TypeError):
        g.endpoints["outputs"] = ()  # type: ignore[index]
    with pytest.raises(AttributeError):
        g.outputs.append(Endpoint("z", "a", 0))  # type: ignore[attr-defined]
    g.add_endpoint("outputs", Endpoint("z", "a", 0))
    assert [ep.name for ep in g.outputs] == ["y", "z"]
    moved = g.set_endpoint("outputs", "z", "b", 0)
    assert (moved.node, moved.slot) == ("b", 0) and g.outputs[1] == moved
    assert g.remove_endpoint("outputs", "z") == moved and [ep.name for ep in g.outputs] == ["y"]
    with pytest.raises(KeyError, match="no output 'z'"):
        g.set_endpoint("outputs", "z", "a", 0)
    with pytest.raises(GraphError, match="unknown endpoint kind 'inputs'"):
        g.add_endpoint("inputs", Endpoint("q", "a", 0))
    with pytest.raises(TypeError, match="takes an Endpoint"):
        g.add_endpoint("outputs", ("q", "a", 0))  # type: ignore[arg-type]


def test_rebuild_node_keeps_id_and_order_and_drops_what_was_inferred() -> None:
    g = small()
    verify(g)
    for e in g.in_edges("join") + g.out_edges("join"):
        g.remove_edge(e)
    with pytest.raises(GraphError, match="still has edges"):
        g.rebuild_node("a", "relu")
    g.nx  # built: the rebuild must keep it in step
    order = [n.id for n in g.nodes]
    new = g.rebuild_node("join", "relu", {"colocate_group": "x"}, meta={"k": 1})
    assert [n.id for n in g.nodes] == order and g.node("join") is new
    assert (new.type, new.config, new.meta, new.outputs, new.output_shapes) == ("relu", {"colocate_group": "x"},
                                                                                 {"k": 1}, (), None)
    assert new.cfg["colocate_group"] == "x"
    g.lint()


def test_bulk_loader_keeps_the_invariants() -> None:
    g = Graph()
    load = g.loader()
    a = load.add_node(VNode("a", "relu"))
    b = load.add_node(VNode("b", "relu"))
    assert load.add_edge(Edge("a", 0, "b", 0), a, b) is None
    busy = load.add_edge(Edge("a", 0, "b", 0), a, b)
    assert busy == Edge("a", 0, "b", 0) and len(g.edges) == 1
    with pytest.raises(GraphError, match="duplicate node id"):
        load.add_node(VNode("a", "relu"))
    g.lint()
    assert g.input_edge("b", 0) == Edge("a", 0, "b", 0) and g.users("a") == [Edge("a", 0, "b", 0)]


def test_adjacency_is_the_whole_use_def_structure_read_only() -> None:
    g = small()
    seen = {n.id: (dict(ins), {d: list(es) for d, es in users.items()}) for n, ins, users in g.adjacency()}
    assert seen["join"][0] == {s: g.input_edge("join", s) for s in (0, 1)}
    assert set(seen["a"][1]) == {e.dst for e in g.out_edges("a")}
    _, ins, _ = next(g.adjacency())
    with pytest.raises(TypeError):
        ins[5] = None  # type: ignore[index]


@pytest.mark.parametrize("corrupt, message", [
    (lambda g: g._in["join"].pop(0), "in the users table only"),
    (lambda g: g._out["a"].clear(), "in the inputs table only"),
    (lambda g: g._vnodes.__setitem__("a", VNode("other", "relu")), "stored under 'a'"),
    (lambda g: g._endpoints.__setitem__("outputs", (Endpoint("y", "gone", 0),)), "reads unknown node 'gone'"),
    (lambda g: g._endpoints.__setitem__("outputs", (Endpoint("y", "a", 0),) * 2), "not unique"),
    (lambda g: g.nx.remove_edge("a", "join"), "networkx view's edges"),
    (lambda g: g._in["join"].__setitem__(7, g._in["join"][0]), "stored in slot 7"),
], ids=["input-without-user", "user-without-input", "wrong-id", "dangling-endpoint", "duplicate-endpoint",
        "nx-out-of-step", "wrong-slot"])
def test_lint_names_each_broken_invariant(corrupt, message) -> None:
    g = small()
    g.lint()
    corrupt(g)
    with pytest.raises(GraphError, match=message):
        g.lint()


def test_the_pass_manager_lints_after_every_pass_in_debug_mode(local_passes) -> None:
    from vgraph.transform.pass_api import Pass, register_pass
    from vgraph.transform.pipeline import PassManager

    @register_pass
    class Sneaky(Pass):
        name = "sneaky"

        def run(self, graph, ctx):
            graph._out["a"].clear()  # around Graph's methods: the users table loses its edges

    with pytest.raises(VGraphError, match="pass 'sneaky' broke the graph's use-def links"):
        PassManager("sneaky", verify=False, debug=True).run(small())
    PassManager("sneaky", verify=False, debug=False).run(small())  # not looked at outside debug mode


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["node", "edge", "unedge", "unnode", "endpoint", "move", "rebuild",
                                           "replace"]),
                          st.integers(0, 5), st.integers(0, 5), st.integers(0, 1)), max_size=40))
def test_any_sequence_of_graph_methods_keeps_the_invariants(ops) -> None:
    """Whatever a caller does through Graph's methods, refused or not, the storage stays consistent."""
    g = Graph()
    g.nx  # keep the networkx view in step from the start
    for op, i, j, slot in ops:
        a, b = f"n{i}", f"n{j}"
        try:
            if op == "node":
                g.add_node(VNode(a, "add"))
            elif op == "edge":
                g.add_edge(a, 0, b, slot)
            elif op == "unedge" and a in g and g.input_edge(a, slot):
                g.remove_edge(g.input_edge(a, slot))
            elif op == "unnode":
                g.remove_node(a)
            elif op == "endpoint" and a in g:
                g.add_endpoint("outputs", Endpoint(f"out_{a}_{len(g.outputs)}", a, 0))
            elif op == "move" and g.outputs and b in g:
                g.set_endpoint("outputs", g.outputs[0].name, b, 0)
            elif op == "rebuild":
                g.rebuild_node(a, "relu")
            elif op == "replace" and a in g and b in g:
                g.replace_uses((a, 0), (b, 0))
        except (GraphError, KeyError, nx.NetworkXError):
            pass
        g.lint()
