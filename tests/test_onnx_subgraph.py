"""Per-PNode export: parts of a network run one after the other equal the whole network."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import shape_inference

import vgraph
from vgraph import Graph, VGraphError
from vgraph.backends.onnx import (boundary, export_pieces, export_subgraph, lower_network,
                                  run_in_sequence, split_topological, runnable_pieces)
from vgraph.backends.onnx.check import onnx_outputs, random_feeds, random_weights
from vgraph.backends.onnx.subgraph import assignment_by_group, assignment_from_meta

from tests.conftest import NET6, TINY, TINY_FP32
from tests.test_onnx_lowering import fuse_by_hand, fused_feeds


def _run_parts(graph: Graph, assignment: dict[str, str], weights, feeds) -> tuple[list, dict]:
    pieces = runnable_pieces(graph, assignment)
    models = export_pieces(graph, pieces, weights)
    for model in models:
        onnx.checker.check_model(model, full_check=True)
    return pieces, run_in_sequence(models, feeds)


def _assert_equal_to_whole(graph: Graph, values: dict, weights, feeds) -> None:
    whole, _ = onnx_outputs(lower_network(graph, weights), feeds)
    assert whole
    for name, want in whole.items():
        np.testing.assert_allclose(values[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("parts", [2, 3])
def test_topological_split_runs_in_sequence_like_the_whole(parts: int) -> None:
    graph = vgraph.load(TINY)
    weights, feeds = random_weights(graph, 1), random_feeds(graph, 2, 1)
    pieces, values = _run_parts(graph, split_topological(graph, parts), weights, feeds)
    assert [p.name for p in pieces] == [f"part{i}" for i in range(parts)]
    _assert_equal_to_whole(graph, values, weights, feeds)


def test_boundary_tensors_are_named_after_their_producer_slot() -> None:
    graph = vgraph.load(TINY_FP32)
    pieces = runnable_pieces(graph, split_topological(graph, 3))
    models = export_pieces(graph, pieces, None)
    produced: dict[str, onnx.ValueInfoProto] = {}
    for piece, model in zip(pieces, models):
        b = boundary(graph, piece.node_ids)
        params = {i.name for i in model.graph.input if "." in i.name}
        data_inputs = [i for i in model.graph.input if i.name not in params]
        assert [i.name for i in data_inputs] == b.input_names
        for vi in data_inputs:
            if ":in" in vi.name:  # a network input: token ids or targets
                continue
            producer, slot = vi.name.rsplit(":", 1)
            assert producer in graph and producer not in piece.node_ids
            assert vi.type == produced[vi.name].type  # same name, same type on both sides of the cut
        inferred = shape_inference.infer_shapes(model, strict_mode=True)
        produced.update({o.name: o for o in inferred.graph.output})
        assert [o.name for o in model.graph.output] == b.output_names


def test_colocation_groups_split_into_runnable_stages() -> None:
    """token_embedding holds the embedder and the LM head: its PNode runs twice."""
    graph = vgraph.load(TINY)
    weights, feeds = random_weights(graph, 2), random_feeds(graph, 3, 2)
    pieces, values = _run_parts(graph, assignment_by_group(graph), weights, feeds)
    assert [p.name for p in pieces] == ["token_embedding@0", "transformer_block_0", "transformer_block_1",
                                        "token_embedding@1"]
    assert pieces[0].node_ids == ("embedder",)
    _assert_equal_to_whole(graph, values, weights, feeds)


def test_heads_on_different_pnodes_from_partition_meta() -> None:
    """The partition pass's node.meta["pnode"]: one head elsewhere splits its block's PNode in two."""
    graph = vgraph.load(TINY_FP32)
    for n in graph.nodes:
        n.meta["pnode"] = "pnode-b" if n.id == "block0_head1" else "pnode-a"
    weights, feeds = random_weights(graph, 3), random_feeds(graph, 2, 3)
    pieces, values = _run_parts(graph, assignment_from_meta(graph), weights, feeds)
    assert [p.name for p in pieces] == ["pnode-a@0", "pnode-b", "pnode-a@1"]
    assert pieces[1].node_ids == ("block0_head1",)
    _assert_equal_to_whole(graph, values, weights, feeds)


def test_fused_part_with_tied_head_carries_its_own_copy_of_the_embedding() -> None:
    graph, weights = fuse_by_hand(vgraph.load(TINY_FP32), random_weights(vgraph.load(TINY_FP32), 5))
    feeds = fused_feeds(random_feeds(vgraph.load(TINY_FP32), 2, 5))
    order = [n.id for n in graph.topo_order()]
    cut = order.index("final_norm")
    head = export_subgraph(graph, order[cut:], weights)
    assert "embedder.weight" in {t.name for t in head.graph.initializer}
    values = run_in_sequence([export_subgraph(graph, order[:cut], weights), head], feeds)
    _assert_equal_to_whole(graph, values, weights, feeds)


def test_production_network_by_colocation_group() -> None:
    graph = vgraph.load(NET6)
    weights, feeds = random_weights(graph, 6), random_feeds(graph, 1, 6)
    pieces, values = _run_parts(graph, assignment_by_group(graph), weights, feeds)
    assert len(pieces) == 8  # embedder, 6 blocks, LM head
    _assert_equal_to_whole(graph, values, weights, feeds)


def test_mistakes_are_user_errors() -> None:
    graph = vgraph.load(TINY_FP32)
    with pytest.raises(VGraphError, match="no such VNode.*nope"):
        export_subgraph(graph, ["embedder", "nope"])
    with pytest.raises(VGraphError, match="no meta\\['pnode'\\]"):
        assignment_from_meta(graph)
    pieces = runnable_pieces(graph, split_topological(graph, 2))
    models = export_pieces(graph, pieces, random_weights(graph))
    with pytest.raises(VGraphError, match="needs .*which no feed or earlier part provides"):
        run_in_sequence(models[::-1], random_feeds(graph, 1))


def test_parts_without_a_cycle_stay_whole_even_when_reached_by_paths_of_different_lengths() -> None:
    """A -> C -> B and A -> B: B runs once, after C (not cut in two by path length)."""
    graph = vgraph.load(TINY_FP32)
    order = [n.id for n in graph.topo_order()]
    assignment = {node_id: "A" for node_id in order}
    assignment["block0_head1"] = "C"
    for node_id in ["block0_head0", *order[order.index("block0_stack"):]]:
        assignment[node_id] = "B"  # head0 reads only A; the stack reads head0 (B) and head1 (C)
    pieces = runnable_pieces(graph, assignment)
    assert [p.name for p in pieces] == ["A", "C", "B"]
    assert pieces[2].node_ids[0] == "block0_head0"
    weights, feeds = random_weights(graph, 8), random_feeds(graph, 2, 8)
    values = run_in_sequence(export_pieces(graph, pieces, weights), feeds)
    _assert_equal_to_whole(graph, values, weights, feeds)
