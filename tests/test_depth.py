"""The one stage rule (vgraph.ir.depth): a VNode's depth is the number of stage changes on the longest path
reaching it, and the three cutters (torch step plan, cost model tasks, ONNX pieces) all use it."""
from __future__ import annotations

import numpy as np
import pytest

from vgraph.ir.builder import NetBuilder
from vgraph.ir.depth import depths, graph_depths

#   tok -> emb -> a ----> c -> d -> head
#           |  \-> b --/      ^
#           \-----------------/   (skip connection emb -> d)
# placed: tok, emb, head on P0; a on P1; b on P2; c, d on P1.
EDGES = [("tok", "emb"), ("emb", "a"), ("emb", "b"), ("a", "c"), ("b", "c"), ("c", "d"), ("emb", "d"),
         ("d", "head")]
WHERE = {"tok": "P0", "emb": "P0", "a": "P1", "b": "P2", "c": "P1", "d": "P1", "head": "P0"}
# By hand: tok 0; emb 0 (same stage); a 1 (P0->P1); b 1 (P0->P2); c: via a 1+0, via b 1+1 = 2;
# d: via c 2+0, via the skip emb 0+1 = 2; head: d 2+1 = 3 (the LM head comes back to P0 after the blocks).
EXPECTED = {"tok": 0, "emb": 0, "a": 1, "b": 1, "c": 2, "d": 2, "head": 3}


def _graph():
    b = NetBuilder("branches")
    b.node("tok", "tokenizer", pad_length=4, vocab_size=16)
    b.node("emb", "embedder", vocab_size=16, dim=8, seq_len=4)
    for name in ("a", "b"):
        b.node(name, "linear", in_dim=8, out_dim=8)
    b.node("c", "add")
    b.node("d", "add")
    b.node("head", "linear", in_dim=8, out_dim=16)
    b.chain("tok", "emb", "a")
    b.edge("emb", "b")
    b.edge("a", "c", dst_slot=0)
    b.edge("b", "c", dst_slot=1)
    b.edge("c", "d", dst_slot=0)
    b.edge("emb", "d", dst_slot=1)
    b.edge("d", "head")
    b.output("logits", "head")
    return b.build()


def test_the_rule_on_named_nodes() -> None:
    preds = {v: [s for s, d in EDGES if d == v] for v in EXPECTED}
    assert depths(list(EXPECTED), preds, WHERE) == EXPECTED


def test_the_rule_on_a_graph_and_on_the_cost_models_integer_columns() -> None:
    graph = _graph()
    assert graph_depths(graph, WHERE) == EXPECTED
    names = [n.id for n in graph.topo_order()]
    index = {v: i for i, v in enumerate(names)}
    preds = [[index[s] for s, d in EDGES if d == v] for v in names]
    out = depths(range(len(names)), preds, [WHERE[v] for v in names])
    assert {names[i]: d for i, d in out.items()} == EXPECTED


def test_one_stage_everywhere_is_depth_zero_and_a_chain_counts_every_change() -> None:
    preds = {v: [s for s, d in EDGES if d == v] for v in EXPECTED}
    assert set(depths(list(EXPECTED), preds, dict.fromkeys(WHERE, "P0")).values()) == {0}
    chain = ["x0", "x1", "x2", "x3"]
    where = {"x0": "A", "x1": "B", "x2": "A", "x3": "A"}
    assert depths(chain, {"x0": [], "x1": ["x0"], "x2": ["x1"], "x3": ["x2"]}, where) == {
        "x0": 0, "x1": 1, "x2": 2, "x3": 2}


def test_a_producer_after_its_user_is_refused() -> None:
    """The order must be topological: a user seen before its producer has no depth to read."""
    with pytest.raises(KeyError):
        depths(["x1", "x0"], {"x0": [], "x1": ["x0"]}, {"x0": "A", "x1": "B"})


def test_the_three_cutters_agree_with_the_rule() -> None:
    graph = _graph()
    from vgraph.cost.tasks import TaskGraphIndex
    from vgraph.run.step_plan import make_plan

    names = [n.id for n in graph.topo_order()]
    index = {v: i for i, v in enumerate(names)}
    src = np.asarray([index[s] for s, _ in EDGES])
    dst = np.asarray([index[d] for _, d in EDGES])
    stage = np.asarray([int(WHERE[v][1]) for v in names])
    assert dict(zip(names, TaskGraphIndex(len(names), src, dst).depth(stage).tolist())) == EXPECTED
    plan = make_plan(graph, WHERE, ["P0", "P1", "P2"])
    assert {v: task.depth for task in plan.tasks.values() for v in _own_nodes(task, graph)} == EXPECTED
    onnx_backend = pytest.importorskip("vgraph.backends.onnx")
    pieces = onnx_backend.runnable_pieces(graph, WHERE)  # the parts cycle (P0 -> P1 -> P0): cut by depth
    assert {v: p.depth for p in pieces for v in p.node_ids} == EXPECTED
    assert [p.name for p in pieces] == ["P0@0", "P1@0", "P2", "P1@1", "P0@1"]


def _own_nodes(task, graph) -> list[str]:
    """The network's VNodes in a task's part (its send/receive/replica VNodes are the cut's own)."""
    return [n.id for n in task.graph.nodes if n.id in graph and graph.node(n.id).type == task.graph.node(n.id).type]
