"""A re-plan decision prices the boundary at what this run's last boundary measured (boundaries.overhead_s):
the `moved` row's seconds, from the stop request to the next attempt's first logged step; before any boundary,
the launch's setting (replan.DEFAULT_REPLAN_OVERHEAD_S)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from vgraph.backends.torch.distributed.launcher.boundaries import move_measured, overhead_s
from vgraph.placement.replan import DEFAULT_REPLAN_OVERHEAD_S
from vgraph.run.files import METRICS_JSONL


def test_the_next_decision_prices_the_boundary_this_run_measured(tmp_path) -> None:
    rows: list[dict] = []
    said: list[str] = []
    run = SimpleNamespace(run_dir=tmp_path, moving=None, moved_s=None, replan_overhead_s=DEFAULT_REPLAN_OVERHEAD_S,
                          admission=SimpleNamespace(event=rows.append), say=said.append)
    assert overhead_s(run) == DEFAULT_REPLAN_OVERHEAD_S  # no boundary yet
    (tmp_path / METRICS_JSONL).write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    run.moving = (3, time.time() - 20.0, 0.0)  # a boundary after step 3, asked 20 s ago, no step trained since
    move_measured(run, 1)
    assert run.moving is not None and run.moved_s is None and not rows  # step 4 not logged yet: not measured
    with open(tmp_path / METRICS_JSONL, "a") as f:
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    move_measured(run, 1)
    (row,) = rows
    assert row["event"] == "moved" and row["first_step"] == 4 and 20.0 <= row["seconds"] < 60.0
    assert run.moving is None and overhead_s(run) == run.moved_s == pytest.approx(row["seconds"], abs=5e-4)  # rounded
    assert row["lost_s"] == pytest.approx(row["seconds"], abs=1e-3)
    # Steps trained after the request are progress, not the boundary's cost: 5 s of them leave 15 s priced.
    run.moving = (4, time.time() - 20.0, 5.0)
    with open(tmp_path / METRICS_JSONL, "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    move_measured(run, 2)
    assert rows[-1]["seconds"] - rows[-1]["lost_s"] == pytest.approx(5.0, abs=2e-3)
    assert overhead_s(run) == run.moved_s == pytest.approx(rows[-1]["lost_s"], abs=5e-4) and 15.0 <= run.moved_s < 55.0


def test_the_steps_trained_after_the_request_are_taken_at_the_old_attempts_median_step() -> None:
    """trained_after_request: asked after step 8, boundary after step 15: steps 9..15 and the next attempt's
    first, 8 steps, at the median of the last ten step gaps (0.2 s; one checkpoint's 1.5 s gap and a restart's
    reset to a smaller elapsed_s left out by the median and the sign); 0 when the request's step is unknown or
    later than the boundary, or no two consecutive rows have times."""
    from vgraph.backends.torch.distributed.launcher.boundaries import trained_after_request

    rows, t = [], 3.0
    for step in range(1, 16):
        t += 1.5 if step == 12 else 0.2
        rows.append({"step": step, "elapsed_s": t if step != 6 else 0.1})
    assert trained_after_request(rows, 8, 15) == pytest.approx(8 * 0.2)
    assert trained_after_request(rows, 15, 15) == pytest.approx(0.2)  # only the next attempt's first step
    assert trained_after_request(rows, None, 15) == 0.0 and trained_after_request(rows, 16, 15) == 0.0
    assert trained_after_request([{"step": 3}, {"step": 4, "elapsed_s": "x"}], 2, 4) == 0.0
    assert trained_after_request([{"step": 3, "elapsed_s": 1.0}, {"step": 5, "elapsed_s": 2.0}], 2, 5) == 0.0
    nan = [{"step": 3, "elapsed_s": 1.0}, {"step": 4, "elapsed_s": float("nan")}, {"step": 5, "elapsed_s": float("inf")}]
    assert trained_after_request(nan, 2, 5) == 0.0


def test_a_drift_the_last_decision_priced_is_not_decided_again() -> None:
    """placement/drift.new_evidence: a report is decided on only when a PNode's measured busy time left the
    drift band (25% either way) around the figure the last decision priced, or a PNode is new to it."""
    from vgraph.placement.drift import DRIFT_TOLERANCE, new_evidence

    decided = {"h0": 0.146, "h1": 0.06}
    assert new_evidence({"h0": 0.146}, None) and new_evidence({"h0": 0.146}, {})  # nothing decided yet
    assert not new_evidence({"h0": 0.146 * 1.2, "h1": 0.06 / 1.2}, decided)  # inside the band: the same
    assert not new_evidence({"h0": 0.146 * DRIFT_TOLERANCE}, decided)  # its edge still is
    assert new_evidence({"h0": 0.146 * 1.3}, decided) and new_evidence({"h1": 0.06 / 1.3}, decided)
    assert new_evidence({"h2": 0.05}, decided)  # a PNode the decision did not see


@pytest.mark.parametrize("given", [False, True])
def test_a_decision_prices_the_state_of_the_vnodes_the_plan_assigned(tmp_path, given: bool) -> None:
    """boundaries._decision prices the move with `Placement.assigned`, the network as the partition pass saw
    it, instead of running the passes before the partition on the source again: the same VNodes as the
    assignment names, with the same state bytes (placed by the pass, or from a given assignment)."""
    from pathlib import Path

    from vgraph.backends.torch.distributed.launcher.placing import place, split_pipeline
    from vgraph.backends.torch.training.setup import load_network
    from vgraph.cost.fleet import loads_fleet
    from vgraph.placement.replan import state_bytes
    from vgraph.transform.pipeline import run_pipeline

    source, _ = load_network(str(Path(__file__).parent / "fixtures" / "tiny_2l.yml"))
    fleet = loads_fleet("name: two\npnodes:\n  - {id: a, memory: 8GiB, flops: 100G, bandwidth: 1Gbit/s}\n"
                        "  - {id: b, memory: 8GiB, flops: 50G, bandwidth: 1Gbit/s}\n", "<two>")
    before, partition, after = split_pipeline(None, True, {"batch": "4", "micro_batches": "2"})
    seen = source.copy()
    run_pipeline(seen, before, target="cpu")  # what the partition pass sees
    assignment = {n.id: ("a" if i % 2 else "b") for i, n in enumerate(seen.topo_order())} if given else None
    placed = place(source, fleet, before=before, partition=partition, after=after, target="cpu", batch=4,
                   micro_batches=2, assignment=assignment)
    assert placed.assigned is not None and placed.assigned is not placed.graph  # the premise: not the fused one
    assert {n.id for n in placed.assigned.nodes} == set(placed.assignment) == {n.id for n in seen.nodes}
    sizes = state_bytes(placed.assigned)
    assert sum(sizes.values()) > 0 and sizes == state_bytes(seen)


def test_a_drift_decision_prices_the_widest_spread_rank_0_reported() -> None:
    """boundaries._spread: the widest of the drifting PNodes' spreads (placement/drift.relative_spread) from the
    row rank 0 wrote; a spread that is missing, not a number, NaN, infinite, negative or above 10 counts as 0
    (the figures priced as exact, as before spreads were reported) instead of stopping the decision."""
    from vgraph.backends.torch.distributed.launcher.boundaries import _spread

    assert _spread({"h0": {"measured_s": 0.1, "spread": 0.12}, "h1": {"measured_s": 0.2, "spread": 0.3}}) == 0.3
    assert _spread({"h0": {"measured_s": 0.1}}) == 0.0 and _spread({}) == 0.0
    for bad in (float("nan"), float("inf"), -0.1, 11.0, "0.2", True, None, [0.2]):
        assert _spread({"h0": {"spread": bad}, "h1": {"spread": 0.05}}) == 0.05, bad
    for junk in (None, [], "x", {"h0": 3}, {"h0": None}):
        assert _spread(junk) == 0.0
