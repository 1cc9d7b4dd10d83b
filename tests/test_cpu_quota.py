"""A CPU quota's burst (vgraph/cost/cpu_quota.py): how a PNode's `cpu_burst` is read and written, every
mistake at its line, the formula of one op run from the bucket, and what it does to a pipeline's makespan
(a stage that waits for its neighbour refills) and to plans that never wait (nothing)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph.cost.cpu_quota import CpuBurst, burst_seconds, parse_cpu_burst
from vgraph.cost.fleet import Fleet, FleetError, PNode, fleet_text, load_fleet, loads_fleet
from vgraph.cost.makespan import Durations, compile_program, makespan
from vgraph.cost.stepcost import FleetArrays, StageLoads, step_cost_of
from vgraph.cost.tasks import chain_tasks

HEAD = "name: f\npnodes:\n"


def _pnode(burst: str) -> str:
    return HEAD + f"  - {{id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s, cpu_burst: {burst}}}\n"


def test_a_pnode_carries_its_cpu_burst_and_writes_it_back(tmp_path):
    (p,) = loads_fleet(_pnode("{speedup: 2.7, bucket: 0.75ms}"), "f.yml").pnodes
    assert p.cpu_burst == CpuBurst(pytest.approx(2.7), pytest.approx(0.75e-3))
    path = tmp_path / "again.yml"
    path.write_text(fleet_text("again", [p]))
    (q,) = load_fleet(path).pnodes
    assert q.cpu_burst == CpuBurst(pytest.approx(2.7, rel=1e-4), pytest.approx(0.75e-3, rel=1e-4))
    (bare,) = loads_fleet(HEAD + "  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n", "f.yml").pnodes
    assert bare.cpu_burst is None and "cpu_burst" not in fleet_text("bare", [bare])


@settings(derandomize=True, max_examples=60, deadline=None)
@given(speedup=st.floats(1, 1000), bucket=st.floats(0, 3600))
def test_any_cpu_burst_survives_being_written_and_read(speedup, bucket):
    (p,) = loads_fleet(_pnode(CpuBurst(speedup, bucket).flow()), "f.yml").pnodes
    assert p.cpu_burst.speedup == pytest.approx(speedup, rel=1e-3)
    assert p.cpu_burst.bucket == pytest.approx(bucket, rel=1e-3, abs=1e-12)


@pytest.mark.parametrize("burst, message", [
    ("{speedup: 2}", "missing 'bucket'"),
    ("{bucket: 1ms}", "missing 'speedup'"),
    ("{}", "missing 'speedup'"),
    ("{speedup: 2, bucket: 1ms, extra: 2}", "unknown key 'extra'"),
    ("{speedup: 0.5, bucket: 1ms}", "speedup must be from 1 to 1000"),
    ("{speedup: -2, bucket: 1ms}", "speedup must be from 1 to 1000"),
    ("{speedup: nan, bucket: 1ms}", "speedup must be from 1 to 1000"),
    ("{speedup: .inf, bucket: 1ms}", "speedup must be a number"),
    ("{speedup: 1e400, bucket: 1ms}", "speedup must be from 1 to 1000"),
    ("{speedup: fast, bucket: 1ms}", "speedup must be a number"),
    ("{speedup: 2, bucket: -1ms}", "bucket: expected a time"),
    ("{speedup: 2, bucket: nan}", "bucket: expected a time"),
    ("{speedup: 2, bucket: 1e400}", "more than an hour"),
    ("{speedup: 2, bucket: \"1ms\\x07\"}", "bucket: expected a time"),
    ("{speedup: [2], bucket: 1ms}", "must be a single value"),
    ("[2, 1ms]", "'cpu_burst' must be a mapping"),
    ("7", "'cpu_burst' must be a mapping"),
])
def test_a_bad_cpu_burst_is_reported_on_its_pnode_and_line(burst, message):
    with pytest.raises(FleetError) as err:
        loads_fleet(_pnode(burst), "f.yml")
    text = str(err.value)
    assert "f.yml:3" in text and "pnode 'a'" in text and message in text, text


def test_parse_cpu_burst_names_what_is_wrong():
    assert parse_cpu_burst({"speedup": "1", "bucket": "0"}) == CpuBurst(1.0, 0.0)
    with pytest.raises(ValueError, match="give both"):
        parse_cpu_burst({"speedup": "2"})


# -- the formula ------------------------------------------------------------------------------------

def test_one_op_from_the_bucket_by_hand():
    """Speedup 2.5 (the figures' rate is 0.4 of the CPU's), an op of 10 ms at that rate is 4 ms of work at
    the CPU's speed.  With 2 ms of tokens: the bucket drains at 0.6 a second, so 3.33 ms at full speed do
    3.33 ms of the work, the 0.67 ms left take 1.67 ms at the rate: 5 ms, the bucket empty.  A 1 ms op fits
    the bucket: 0.4 ms, 2 - 0.6 x 0.4 = 1.76 ms left.  No tokens, or no quota (speedup 1): the duration."""
    seconds, left = burst_seconds(np.array([10e-3, 1e-3, 10e-3, 10e-3]), np.array([2e-3, 2e-3, 0.0, 2e-3]),
                                  np.array([2.5, 2.5, 2.5, 1.0]))
    assert seconds == pytest.approx([5e-3, 0.4e-3, 10e-3, 10e-3])
    assert left == pytest.approx([0.0, 1.76e-3, 0.0, 2e-3])


@settings(derandomize=True, max_examples=80, deadline=None)
@given(d=st.floats(0, 1), tokens=st.floats(0, 1), speedup=st.floats(1, 100))
def test_an_op_never_beats_the_cpus_speed_nor_loses_to_the_rate(d, tokens, speedup):
    seconds, left = burst_seconds(np.array([d]), np.array([tokens]), np.array([speedup]))
    assert d / speedup * (1 - 1e-9) - 1e-15 <= seconds[0] <= d * (1 + 1e-9) + 1e-15
    assert 0.0 <= left[0] <= tokens + 1e-15


def _chain(cpu_speedup=None, cpu_bucket=None):
    """Two stages, one micro-batch: F0 2, F1 2, B1 4, B0 4 (at the figures' rate), no traffic."""
    tasks = chain_tasks(np.ones(2), np.zeros((2, 2)))
    program = compile_program(tasks.scheduled, tasks.edges, 2, 1)
    d = Durations(np.array([[[2.0], [2.0]]]), np.array([[[4.0], [4.0]]]), np.zeros((1, 1, 1)), np.zeros((1, 1, 1)),
                  np.zeros((1, 1)), np.zeros((1, 0)), None,
                  None if cpu_speedup is None else np.array([cpu_speedup], dtype=float),
                  None if cpu_bucket is None else np.array([cpu_bucket], dtype=float))
    return makespan(program, d)[0]


def test_a_stage_that_waits_refills_by_hand():
    """Speedup 2 (refill 0.5 a second), bucket 0.5.  Rank 0: F0 0-2 (empty bucket: at the rate).  Rank 1
    idled 2 s: 1 s of refill, capped at 0.5; F1 is 1 s of work, 1 s at full speed drains the 0.5: 2-3.
    B1 3-7 (empty).  Rank 0 idled 5 s: 0.5 again; B0 is 2 s of work, 1 s at full speed, the other 1 at
    the rate in 2 s: 7-10.  Without the figure, or at speedup 1, one op after another: 12."""
    assert _chain([2.0, 2.0], [0.5, 0.5]) == pytest.approx(10.0)
    assert _chain() == pytest.approx(12.0)
    assert _chain([1.0, 1.0], [0.5, 0.5]) == pytest.approx(12.0)
    assert _chain([2.0, 2.0], [0.0, 0.0]) == pytest.approx(12.0)


def test_plans_that_never_wait_are_priced_as_before_and_pipelines_less():
    """One rank computes without pause (its bucket starts empty: the previous step's update drained it),
    so a one-stage plan's step is the same with the figure; a two-stage pipeline's stages wait for each
    other and it is cheaper."""
    def loads(S: int) -> StageLoads:
        send = np.zeros((S, S))
        for s in range(S - 1):
            send[s, s + 1] = send[s + 1, s] = 1e3
        return StageLoads(np.full(S, 1e9), send * 2, np.zeros((S, S)), np.full(S, 1e6), np.zeros(S), np.zeros(S),
                          send=send)

    def fleet(burst: CpuBurst | None) -> FleetArrays:
        return FleetArrays(Fleet.of("f", *[PNode(f"p{i}", 2**30, 1e10, 1e9, cpu_burst=burst) for i in range(2)]))

    burst = CpuBurst(2.5, 50e-3)  # ops of 33 and 67 ms at the rate (0.1 s a sample, a third forward)
    one = np.zeros((1, 1), dtype=np.int64)
    assert (step_cost_of(loads(1), fleet(burst), one, [4], 4).step_seconds
            == pytest.approx(step_cost_of(loads(1), fleet(None), one, [4], 4).step_seconds, rel=1e-12))
    two = np.arange(2).reshape(1, 2)
    quota = step_cost_of(loads(2), fleet(burst), two, [4], 4).step_seconds
    bare = step_cost_of(loads(2), fleet(None), two, [4], 4).step_seconds
    assert quota < bare * 0.95 and quota >= bare / 2.5
