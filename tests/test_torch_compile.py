"""One graph per training step: `vgraph train --compile` and `vgraph launch`'s stage programs trace without
a graph break (backends/torch/lowering/graph_breaks.py), on the tiny networks, fused and unfused, in every precision.

The production networks are counted by benchmarks/bench_graph_breaks.py (tracing them is too slow here).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import prepare_graph
from vgraph.backends.torch.distributed.launcher.launch import place, split_pipeline
from vgraph.backends.torch.lowering.graph_breaks import explain_program, stage_breaks, training_breaks
from vgraph.cost.fleet import loads_fleet

FIXTURES = Path(__file__).parent / "fixtures"
# cpu: float32; cuda-sm80: bf16 autocast; cuda-sm75: fp16 autocast (+ loss scaling outside the graph).
TARGETS = {"cpu": torch.float32, "cuda-sm80": torch.bfloat16, "cuda-sm75": torch.float16}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_the_training_step_of_the_tiny_network_is_one_graph(target, fuse) -> None:
    graph = prepare_graph(vgraph.load(FIXTURES / "tiny_2l.yml"), fuse=fuse, target=target)
    assert vgraph.backends.torch.compute_dtype(graph) == TARGETS[target]
    assert any(n.type == "dropout" for n in graph.nodes)  # keyed dropout is in the traced step
    report = training_breaks(graph)
    assert (report.graphs, report.breaks) == (1, 0), report.describe()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_the_float32_fixture_is_one_graph_too(fuse) -> None:
    report = training_breaks(prepare_graph(vgraph.load(FIXTURES / "tiny_1l_fp32.yml"), fuse=fuse))
    assert (report.graphs, report.breaks) == (1, 0), report.describe()


def test_a_graph_break_is_counted_and_explained() -> None:
    """The counter itself: a data-dependent Python branch is a break, and its reason names the line."""

    class Branchy(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            if float(y.sum()) > 0:  # reads a tensor's value into Python: dynamo must break here
                return y + 1
            return y - 1

    report = explain_program("branchy", Branchy(), [torch.ones(3)], dtype=torch.float32)
    assert report.breaks >= 1 and report.graphs >= 2
    assert any("test_torch_compile.py" in r for r in report.reasons), report.reasons
    assert "graph break" in report.describe()


@pytest.mark.parametrize("target", ["cpu", "cuda-sm80"])
def test_launch_stage_programs_are_one_graph_each(target) -> None:
    """Blocks on three PNodes, the LM head away from the embedding (its tied weight a remote replica)."""
    graph = transformer(TransformerSpec("tiny-stages", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                        head_up=64, precision="fp16"))
    for node_id in ("final_norm", "head_up", "head_swiglu", "head_down", "lm_head", "loss"):
        graph.node(node_id).set_config(colocate_group="lm_head")
    groups = {"token_embedding": "w0", "transformer_block_0": "w1", "transformer_block_1": "w2", "lm_head": "w1"}
    assignment = {n.id: groups[n.cfg["colocate_group"]] for n in graph.nodes}
    fleet = loads_fleet("name: t\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(3)))
    before, partition, after = split_pipeline(None, True, {"batch": "4", "micro_batches": "2"})
    placed = place(graph, fleet, before=before, partition=partition, after=after, target=target, batch=4,
                   micro_batches=2, assignment=assignment)
    reports = stage_breaks(placed.graph, placed.final, placed.ranks)
    assert len(reports) == 4  # w0 embeds, w1 runs block 0, w2 block 1, w1 again the head and loss
    for report in reports:
        assert (report.graphs, report.breaks) == (1, 0), report.describe()
