"""A rank's work each step beyond its program (vgraph/cost/update.py): how a PNode's `update` is read and
written, every mistake at its line, what it adds to a plan's price (the slowest rank's, by the parameters
its stage trains), and the probe's line through the whole program's times (backends/torch/probe/measure.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph.cost.fleet import Fleet, FleetError, PNode, fleet_text, load_fleet, loads_fleet
from vgraph.cost.stepcost import FleetArrays, StageLoads, step_cost_of, step_lower_bound, update_seconds
from vgraph.cost.update import Update, parse_update

HEAD = "name: f\npnodes:\n"


def _pnode(update: str) -> str:
    return HEAD + f"  - {{id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s, update: {update}}}\n"


def test_a_pnode_carries_its_update_and_writes_it_back(tmp_path):
    (p,) = loads_fleet(_pnode("{fixed: 1.4ms, per_param: 0.6ns}"), "f.yml").pnodes
    assert p.update == Update(pytest.approx(1.4e-3), pytest.approx(0.6e-9))
    assert p.update.seconds(1_000_000) == pytest.approx(1.4e-3 + 0.6e-3)
    path = tmp_path / "again.yml"
    path.write_text(fleet_text("again", [p]))
    (q,) = load_fleet(path).pnodes
    assert q.update == Update(pytest.approx(p.update.fixed, rel=1e-4), pytest.approx(p.update.per_param, rel=1e-4))
    (bare,) = loads_fleet(HEAD + "  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n", "f.yml").pnodes
    assert bare.update is None


@settings(derandomize=True, max_examples=60, deadline=None)
@given(fixed=st.floats(0, 3600), per_param=st.floats(0, 1e-3))
def test_any_update_survives_being_written_and_read(fixed, per_param):
    u = Update(fixed, per_param)
    (p,) = loads_fleet(_pnode(u.flow()), "f.yml").pnodes
    assert p.update.fixed == pytest.approx(fixed, rel=1e-3, abs=1e-12)
    assert p.update.per_param == pytest.approx(per_param, rel=1e-3, abs=1e-15)


@pytest.mark.parametrize("update, message", [
    ("{fixed: 1ms}", "missing 'per_param'"),
    ("{per_param: 1ns}", "missing 'fixed'"),
    ("{}", "missing 'fixed'"),
    ("{fixed: 1ms, per_param: 1ns, extra: 2}", "unknown key 'extra'"),
    ("{fixed: -1ms, per_param: 1ns}", "fixed: expected a time"),
    ("{fixed: nan, per_param: 1ns}", "fixed: expected a time"),
    ("{fixed: .inf, per_param: 1ns}", "fixed: expected a time"),
    ("{fixed: 1e400, per_param: 1ns}", "more than an hour"),
    ("{fixed: 2h, per_param: 1ns}", "fixed: expected a time"),
    ("{fixed: 1ms, per_param: 2ms}", "more than a millisecond per parameter"),
    ("{fixed: 1ms, per_param: fast}", "per_param: expected a time"),
    ("{fixed: [1], per_param: 1ns}", "must be a single value"),
    ("[1ms, 1ns]", "'update' must be a mapping"),
    ("7", "'update' must be a mapping"),
    ("{fixed: \"1ms\\x07\", per_param: 1ns}", "fixed: expected a time"),
])
def test_a_bad_update_is_reported_on_its_pnode_and_line(update, message):
    with pytest.raises(FleetError) as err:
        loads_fleet(_pnode(update), "f.yml")
    text = str(err.value)
    assert "f.yml:3" in text and "pnode 'a'" in text and message in text, text


def test_parse_update_names_what_is_wrong():
    assert parse_update({"fixed": "0", "per_param": "0"}) == Update(0.0, 0.0)
    with pytest.raises(ValueError, match="give both"):
        parse_update({"fixed": "1ms"})


# -- what it adds to a plan's price -------------------------------------------------------------------

def _loads(params: list[float]) -> StageLoads:
    S = len(params)
    send = np.zeros((S, S))
    for s in range(S - 1):
        send[s, s + 1] = send[s + 1, s] = 1e3
    return StageLoads(np.full(S, 1e9), send * 2, np.zeros((S, S)), np.full(S, 1e6), np.zeros(S), np.zeros(S),
                      send=send, params=np.array(params, dtype=float))


def _fleet(updates: list[Update | None]) -> FleetArrays:
    return FleetArrays(Fleet.of("f", *[PNode(f"p{i}", 2**30, 1e12, 1e8, update=u) for i, u in enumerate(updates)]))


def test_the_step_waits_for_the_slowest_ranks_update():
    """Two replicas of two stages; the stages train 1M and 3M parameters.  The slowest rank is the one whose
    fixed time plus parameters x its rate is largest, which is neither the largest fixed time nor the
    largest rate alone."""
    loads = _loads([1e6, 3e6])
    updates = [Update(5e-3, 0.0), Update(1e-3, 1e-9), Update(1e-3, 1e-9), Update(0.5e-3, 2e-9)]
    idx = np.arange(4).reshape(2, 2)
    bare = step_cost_of(loads, _fleet([None] * 4), idx, [2, 2], 2)
    priced = step_cost_of(loads, _fleet(updates), idx, [2, 2], 2)
    per_rank = update_seconds(loads, _fleet(updates), idx)
    assert per_rank == pytest.approx(np.array([[5e-3, 4e-3], [2e-3, 6.5e-3]]))
    assert priced.update_seconds == pytest.approx(6.5e-3) and bare.update_seconds == 0.0
    assert priced.step_seconds == pytest.approx(bare.step_seconds + 6.5e-3)
    assert priced.pipeline_seconds == bare.pipeline_seconds  # after the step's collectives, not inside them
    low = step_lower_bound(loads, _fleet(updates), idx, 4)
    assert low <= priced.step_seconds and low == pytest.approx(step_lower_bound(loads, _fleet([None] * 4), idx, 4)
                                                                + 6.5e-3)


def test_loads_without_parameters_pay_only_the_fixed_part():
    loads = _loads([1e6])
    loads.params = None
    idx = np.arange(1).reshape(1, 1)
    assert step_cost_of(loads, _fleet([Update(2e-3, 1e-6)]), idx, [1], 1).update_seconds == pytest.approx(2e-3)


def test_a_stage_counts_the_parameters_its_ranks_update():
    import vgraph
    from conftest import TINY_FP32
    from vgraph.cost.costmodel import cost_model
    from vgraph.cost.stepcost import stage_loads

    graph = vgraph.load(TINY_FP32)
    cm = cost_model(graph, batch=4)
    loads = stage_loads(cm, {v: 0 for v in cm.node_columns["id"]}, 1)
    assert loads.params is not None and loads.params[0] == sum(cm.node_columns["params"]) > 0
    fa = _fleet([Update(1e-3, 1e-9)])
    cost = step_cost_of(loads, fa, np.zeros((1, 1), dtype=np.int64), [4], 1)
    assert cost.update_seconds == pytest.approx(1e-3 + 1e-9 * loads.params[0])


# -- the probe's line through the whole program --------------------------------------------------------

def test_the_line_is_exact_on_linear_times_and_closer_where_they_bend():
    from vgraph.backends.torch.probe.measure import _line, fit_line

    assert fit_line([1, 2, 4, 8], [3.0, 4.0, 6.0, 10.0]) == (pytest.approx(2.0), pytest.approx(1.0))
    sizes, times = [1, 2, 4, 8], [8.1, 10.2, 12.9, 17.1]  # tb-small in a 0.5-core host, ms
    fixed, slope = fit_line(sizes, times)
    two = fixed + 2 * slope
    f18, s18 = _line(times[0], times[3], 1, 8)
    assert abs(two / 10.2 - 1) < abs((f18 + 2 * s18) / 10.2 - 1)  # the plans' 2 samples, better priced
    errors = [abs((fixed + m * slope) / t - 1) for m, t in zip(sizes, times)]
    assert max(errors) < 0.06


def test_the_line_stays_non_negative_and_refuses_what_is_no_line():
    from vgraph.backends.torch.probe.measure import fit_line

    assert fit_line([1, 8], [5.0, 4.0]) == (pytest.approx(4.5, rel=0.05), 0.0)  # no per-sample cost: flat
    fixed, slope = fit_line([1, 2, 8], [0.5, 2.0, 8.0])  # would cross below zero: through the origin
    assert fixed == 0.0 and slope > 0
    for sizes, times in (([1], [1.0]), ([2, 2], [1.0, 1.0]), ([1, 2], [1.0, float("nan")]), ([1, 2], [0.0, 1.0])):
        with pytest.raises(ValueError):
            fit_line(sizes, times)
