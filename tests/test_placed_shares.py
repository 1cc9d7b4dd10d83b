"""A launch's batch shares are the least step of the graph its workers run, not of the graph the partition
pass saw (issue 42: on the testbed's uneven hosts the planner chose [5, 3] where the step cost of the
placed graph priced [4, 4] 1.8% lower).

Why they differ: the partition pass runs before the fusions (fuse-heads, fuse-lm-head-ce), so it counts a
per-VNode overhead (what `vgraph probe` measured on the fused program's VNodes) on every attention head, its
broadcast and its stack, where the workers run one fused attention.  A slow host pays those overheads at its
own rate, so the pass gives it too few samples.  The oracle: the placement report's step (the step cost of
the placed graph) at every split of the batch.
"""
from __future__ import annotations

import pytest

import vgraph
from vgraph.backends.torch.distributed.launcher.placing import place, split_pipeline
from vgraph.cost.fleet import Fleet, PNode
from vgraph.cost.op_kinds import Efficiency, KindCost
from vgraph.passes.partition_replicas import plan_replicas
from vgraph.transform.pipeline import run_pipeline

from conftest import FIXTURES

BATCH = 8


def pnode(i: int, slower: float) -> PNode:
    """A probed CPU host `slower` times slower than h0 in every figure (a smaller CPU quota)."""
    eff = Efficiency((("matmul", KindCost(0.3, 40e-6 * slower)), ("attention", KindCost(0.1, 2e-3 * slower)),
                      ("elementwise", KindCost(0.01, 20e-6 * slower)), ("structural", KindCost(None, 10e-6 * slower))))
    return PNode(id=f"h{i}", memory=2 ** 33, flops=20e9 / slower, bandwidth=1.25e9, accelerator="cpu", efficiency=eff)


@pytest.mark.parametrize("slower", [2.0])
def test_the_launchs_shares_are_the_least_step_of_the_graph_that_runs(slower):
    graph = vgraph.load(FIXTURES / "tiny_2l.yml")
    fleet = Fleet("uneven", (pnode(0, 1.0), pnode(1, slower)))
    before, partition, after = split_pipeline(None, True, {"replicas": "2"})
    seen = graph.copy()
    run_pipeline(seen, before, target="cpu")

    def priced(rows, shares) -> float:
        return place(graph, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                     micro_batches=1, assignment={n.id: rows[0][0] for n in seen.nodes},
                     replicas=(rows, shares)).report["step_seconds"]

    planned = place(graph, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                    micro_batches=1)
    rows = planned.rows
    assert rows in ([["h0"], ["h1"]], [["h1"], ["h0"]])
    steps = {a: priced(rows, [a, BATCH - a]) for a in range(1, BATCH)}
    least = min(steps.values())
    # The premise: the fusions merge VNodes, and the pass's own shares (balanced on the graph before them)
    # are not the least step of the graph that runs; otherwise this test would hold for any launcher.
    assert len(planned.graph.nodes) < len(seen.nodes)
    passes_own, _ = plan_replicas(seen, fleet, batch=BATCH, micro_batches=1, replicas=2)
    assert passes_own.pnodes == rows
    assert steps[passes_own.shares[0]] > least * (1 + 1e-6)
    assert steps[planned.shares[0]] == pytest.approx(least, rel=1e-9)
    assert planned.report["step_seconds"] == pytest.approx(least, rel=1e-9)
    assert planned.report["batch_shares"] == planned.shares and sum(planned.shares) == BATCH
    # Shares the run was given (a --placement file, a re-planned layout) are the run's, not rebalanced.
    forced = place(graph, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                   micro_batches=1, assignment={n.id: rows[0][0] for n in seen.nodes},
                   replicas=(rows, passes_own.shares))
    assert forced.shares == passes_own.shares
