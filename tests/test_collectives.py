"""The fleet's measured collectives table and a link's burst (vgraph/cost/collectives.py, makespan.py): how the
table is read and interpolated, every mistake with its line, and what each figure adds to a plan's price."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph.cost.collectives import NO_COLLECTIVES, Collectives, collectives_of
from vgraph.cost.fleet import Fleet, FleetError, PNode, fleet_text, loads_fleet
from vgraph.cost.makespan import compile_program, makespan
from vgraph.cost.stepcost import FleetArrays, StageLoads, allreduce_seconds, pipeline_seconds, step_cost_of
from vgraph.cost.tasks import chain_tasks

from tests.test_makespan import durations

PNODES = "pnodes:\n  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n"
TABLE = collectives_of([(2, 1e-3, 1e-4), (4, 12e-3, 1e-3)])


def test_the_table_is_interpolated_between_rank_counts_and_scaled_by_ring_hops_beyond():
    assert TABLE.at(1) == (0.0, 0.0) and TABLE.at(0) == (0.0, 0.0)  # one rank, not measured: nothing
    alone = collectives_of([(1, 2e-3, 0.0), (2, 3e-3, 1e-4)])
    assert alone.at(1) == (2e-3, 0.0) and alone.at(3) == (pytest.approx(6e-3), 1e-4)  # measured alone: its figure
    assert TABLE.at(2) == (1e-3, 1e-4) and TABLE.at(4) == (12e-3, 1e-3)
    control, hop = TABLE.at(3)
    assert control == pytest.approx(6.5e-3) and hop == pytest.approx(5.5e-4)
    assert TABLE.at(7) == (pytest.approx(12e-3 * 6 / 3), 1e-3)  # 6 ring hops against 3
    one = collectives_of([(4, 12e-3, 1e-3)])
    assert one.at(2) == (pytest.approx(4e-3), 1e-3)  # below the smallest: its control per hop, its hop
    assert NO_COLLECTIVES.at(64) == (0.0, 0.0)


@settings(derandomize=True, max_examples=80, deadline=None)
@given(rows=st.dictionaries(st.integers(1, 64), st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1,
                            max_size=6), n=st.integers(2, 200))
def test_an_interpolated_figure_lies_between_its_neighbours(rows, n):
    table = collectives_of([(k, c, h) for k, (c, h) in rows.items()])
    control, hop = table.at(n)
    ks = sorted(rows)
    if ks[0] <= n <= ks[-1]:
        below = max(k for k in ks if k <= n)
        above = min(k for k in ks if k >= n)
        for i, got in ((0, control), (1, hop)):
            lo, hi = sorted((rows[below][i], rows[above][i]))
            assert lo - 1e-12 <= got <= hi + 1e-12
    else:
        near = ks[0] if n < ks[0] else ks[-1]
        assert hop == rows[near][1]
        assert control == pytest.approx(rows[near][0] * ((n - 1) / (near - 1) if near > 1 else 1))


def test_a_fleet_carries_the_table_and_writes_it_back():
    text = "name: lab\ncollectives:\n  - {ranks: 4, control: 11.4ms, hop: 1.15ms}\n  - {ranks: 2, control: 1ms, " \
           "hop: 130us}\n" + PNODES
    fleet = loads_fleet(text, "f.yml")
    assert fleet.collectives.rows == ((2, 1e-3, pytest.approx(1.3e-4)), (4, pytest.approx(0.0114), 1.15e-3))
    again = loads_fleet(fleet_text(fleet.name, fleet.pnodes, "", fleet.collectives))
    assert [x for row in again.collectives.rows for x in row] == pytest.approx(
        [x for row in fleet.collectives.rows for x in row])
    assert fleet.without({"zz"}).collectives is fleet.collectives
    assert loads_fleet(PNODES).collectives == NO_COLLECTIVES


def test_the_all_reduce_rate_caps_a_gradient_ring_at_the_rank_count_measured():
    text = ("collectives:\n  - {ranks: 2, control: 1ms, hop: 0.1ms, ring: 100MB/s}\n"
            "  - {ranks: 4, control: 9ms, hop: 1ms, ring: 40MB/s}\n" + PNODES)
    table = loads_fleet(text, "f.yml").collectives
    assert table.rings == ((2, 1e8), (4, 4e7))
    assert (table.ring(1), table.ring(2), table.ring(3), table.ring(4), table.ring(9)) == (math.inf, 1e8, 4e7, 4e7,
                                                                                           4e7)
    again = loads_fleet(fleet_text("f", loads_fleet(text).pnodes, "", table)).collectives
    assert again.rings == table.rings
    assert collectives_of([(2, 0.0, 0.0)]).ring(2) == math.inf  # not measured: no cap
    # 4 replicas of one stage: 2 (R - 1) / R of 1 MB at the ring's 40 MB/s, not the links' 100 MB/s (1e8 B/s)
    idx = np.arange(4).reshape(4, 1)
    capped = allreduce_seconds(_loads(1), _fleet(4, table), idx)[0]
    assert capped == pytest.approx(1.5 * 1e6 / 4e7 + 6 * 1e-3)



def test_a_two_by_two_plans_gradient_ring_is_capped_at_the_rate_of_all_four_ranks():
    """2 replicas x 2 stages: the two stage groups all-reduce at once, so all R x S = 4 ranks communicate and
    the ring rate is the table's at 4 ranks (40 MB/s), not at the R = 2 members of one group (100 MB/s).
    By hand, a stage's 1 MB of gradients: 2 (R - 1) / R x 1e6 B / 4e7 B/s = 25 ms, plus 2 (R - 1) hops of
    the 4-rank hop (1 ms) = 27 ms (at the 2-rank rate it would be 10 + 2 = 12 ms)."""
    text = ("collectives:\n  - {ranks: 2, control: 1ms, hop: 0.1ms, ring: 100MB/s}\n"
            "  - {ranks: 4, control: 9ms, hop: 1ms, ring: 40MB/s}\n" + PNODES)
    table = loads_fleet(text, "f.yml").collectives
    idx = np.arange(4).reshape(2, 2)  # replica r, stage s on PNode 2 r + s
    reduce = allreduce_seconds(_loads(2), _fleet(4, table), idx)
    assert reduce.tolist() == pytest.approx([0.027, 0.027])
    assert _fleet(4, table).bandwidth.min() == 1e8  # the premise: the links alone would allow 100 MB/s

BROKEN = [
    ("collectives:\n  - {ranks: 0, control: 1ms, hop: 1us}\n", 2, "whole number from 1"),
    ("collectives:\n  - {ranks: two, control: 1ms, hop: 1us}\n", 2, "whole number from 1"),
    ("collectives:\n  - {ranks: -3, control: 1ms, hop: 1us}\n", 2, "whole number from 1"),
    ("collectives:\n  - {ranks: \"\\u0663\", control: 1ms, hop: 1us}\n", 2, "whole number from 1"),
    ("collectives:\n  - {ranks: 99999999999999999999, control: 1ms, hop: 1us}\n", 2, "whole number from 1"),
    ("collectives:\n  - {control: 1ms, hop: 1us}\n", 2, "has no 'ranks'"),
    ("collectives:\n  - {ranks: 2, hop: 1us}\n", 2, "has no 'control'"),
    ("collectives:\n  - {ranks: 2, control: 1ms}\n", 2, "has no 'hop'"),
    ("collectives:\n  - {ranks: 2, control: -1ms, hop: 1us}\n", 2, "control"),
    ("collectives:\n  - {ranks: 2, control: nan, hop: 1us}\n", 2, "control"),
    ("collectives:\n  - {ranks: 2, control: 1ms, hop: inf}\n", 2, "hop"),
    ("collectives:\n  - {ranks: 2, control: 1e9s, hop: 1us}\n", 2, "plausible"),
    ("collectives:\n  - {ranks: 2, control: 1ms, hop: 1us, rate: 3}\n", 2, "unknown collectives entry key 'rate'"),
    ("collectives:\n  - {ranks: 2, control: 1ms, hop: 1us}\n  - {ranks: 2, control: 2ms, hop: 1us}\n", 3,
     "a second collectives entry for 2 ranks (first at line 2)"),
    ("collectives: []\n", 1, "'collectives' is empty"),
    ("collectives: 3\n", 1, "must be a list"),
    ("collectives:\n  - 3\n", 2, "must be a mapping"),
    ("collectives:\n  - {ranks: [2], control: 1ms, hop: 1us}\n", 2, "ranks"),
    ("colectives:\n  - {ranks: 2, control: 1ms, hop: 1us}\n", 1, "did you mean 'collectives'"),
    ("collectives:\n  - {ranks: 2, control: 1ms, hop: 1us, ring: fast}\n", 2, "ring"),
    ("collectives:\n  - {ranks: 2, control: 1ms, hop: 1us, ring: 0}\n", 2, "must be positive"),
    ("collectives:\n  - {ranks: 2, control: 1ms, hop: 1us, ring: 1e400}\n", 2, "ring"),
]


@pytest.mark.parametrize("head, line, message", BROKEN)
def test_mistakes_in_the_table_are_reported_with_their_line(head, line, message):
    with pytest.raises(FleetError) as err:
        loads_fleet(head + PNODES, "f.yml")
    lines = [str(d) for d in err.value.diagnostics]
    assert any(s.startswith(f"f.yml:{line}: ") and message in s for s in lines), lines


@pytest.mark.parametrize("rows", [[(0, 0.0, 0.0)], [(True, 0.0, 0.0)], [(2, -1.0, 0.0)], [(2, 0.0, math.nan)], [(2, 0.0, 0.0)] * 2,
                                  [(2.5, 0.0, 0.0)]])
def test_a_table_built_in_code_is_checked_as_a_read_one(rows):
    with pytest.raises(ValueError):
        collectives_of(rows)
    with pytest.raises(ValueError):
        collectives_of([(2, 0.0, 0.0)], {3: 1e8})  # a rate without its row
    with pytest.raises(ValueError):
        collectives_of([(2, 0.0, 0.0)], {2: math.inf})


def test_a_code_built_tables_limits_are_the_readers():
    """The limits themselves hold and their neighbours outside do not (mutants moving a limit survived the
    audit of issue 41): a ring rate from 1 byte/s, control and hop up to an hour."""
    assert collectives_of([(2, 3600.0, 3600.0)], {2: 1}).ring(2) == 1
    for rows, rings in (([(2, 3600.5, 0.0)], None), ([(2, 0.0, 3600.5)], None), ([(2, 0.0, 0.0)], {2: 0.5}),
                        ([(2, 0.0, 0.0)], {2: 1e31})):
        with pytest.raises(ValueError):
            collectives_of(rows, rings)


@pytest.mark.parametrize("text, burst", [("16KiB", 16384), ("0", 0), ("250000", 250000), ("1MB", 10**6)])
def test_a_pnode_burst_is_bytes(text, burst):
    fleet = loads_fleet(PNODES.replace("1Gbit/s}", f"1Gbit/s, burst: {text}}}"), "f.yml")
    assert fleet.pnodes[0].burst == burst
    assert loads_fleet(fleet_text("f", fleet.pnodes)).pnodes[0].burst == burst


@pytest.mark.parametrize("text", ["-1", "lots", "nan", "1e400", "0.5", "[1]"])
def test_a_bad_burst_is_reported_on_its_pnode(text):
    with pytest.raises(FleetError) as err:
        loads_fleet(PNODES.replace("1Gbit/s}", f"1Gbit/s, burst: {text}}}"), "f.yml")
    assert any(str(d).startswith("f.yml:2: pnode 'a': ") and "burst" in str(d) for d in err.value.diagnostics)


# -- a burst in the simulation ------------------------------------------------------------------------

def _two_ranks(send: float, bucket: float, M: int = 1, forward: float = 1.0) -> float:
    """Rank 0 computes `forward` per micro-batch and sends each result (`send` seconds at its rate) to rank 1,
    which computes nothing; the makespan of the forward round (backwards of 0)."""
    tasks = chain_tasks(np.ones(2), np.array([[0.0, 1.0], [0.0, 0.0]]))
    program = compile_program(tasks.scheduled, tasks.edges, 2, M)
    d = durations(np.array([[forward] * M, [0.0] * M]), np.zeros((2, M)), np.full((1, M), send), np.zeros((1, M)),
                  np.zeros(1))
    d = type(d)(**{**d.__dict__, "bucket": np.array([[bucket, 0.0]])})
    return float(makespan(program, d)[0])


def test_a_message_within_the_burst_crosses_at_once_and_the_rest_pays_the_rate():
    assert _two_ranks(send=0.5, bucket=0.0) == pytest.approx(1.5)  # no bucket: the rate
    assert _two_ranks(send=0.5, bucket=0.5) == pytest.approx(1.0)  # all of it within the burst
    assert _two_ranks(send=0.5, bucket=0.2) == pytest.approx(1.3)  # 0.2 at once, 0.3 at the rate


def test_the_bucket_refills_only_while_the_link_idles():
    # Sends of 0.5 every 1.0 (the forward) with a bucket of 0.5: the link idles 1.0 between sends, enough to
    # refill, so every message crosses at once and the round ends with the last forward.
    assert _two_ranks(send=0.5, bucket=0.5, M=3, forward=1.0) == pytest.approx(3.0)
    # Sends of 2.0 every 1.0: the link never idles after the first, so only the first message gets its
    # bucket (0.5) and the others pay their full 2.0: 1 + 1.5, then 2.0 each back to back.
    assert _two_ranks(send=2.0, bucket=0.5, M=3, forward=1.0) == pytest.approx(1.0 + 1.5 + 2.0 + 2.0)


# -- what the table adds to a plan's price ------------------------------------------------------------

def _loads(stages: int) -> StageLoads:
    S = stages
    send = np.zeros((S, S))
    for s in range(S - 1):
        send[s, s + 1] = send[s + 1, s] = 1e3
    return StageLoads(np.full(S, 1e9), send * 2, np.zeros((S, S)), np.full(S, 1e6), np.zeros(S), np.zeros(S),
                      send=send)


def _fleet(n: int, table: Collectives = NO_COLLECTIVES, burst: int = 0) -> FleetArrays:
    pnodes = [PNode(f"p{i}", 2**30, 1e12, 1e8, burst=burst) for i in range(n)]
    return FleetArrays(Fleet.of("f", *pnodes, collectives=table))


@pytest.mark.parametrize("R, S", [(1, 4), (4, 1), (2, 2), (1, 2)])
def test_the_control_collectives_are_priced_over_all_ranks_of_the_plan(R, S):
    idx = np.arange(R * S).reshape(R, S)
    bare = step_cost_of(_loads(S), _fleet(4), idx, [2] * R, 2)
    priced = step_cost_of(_loads(S), _fleet(4, TABLE), idx, [2] * R, 2)
    control, hop = TABLE.at(R * S)
    assert priced.control_seconds == control and bare.control_seconds == 0.0
    assert priced.allreduce_seconds == pytest.approx(bare.allreduce_seconds + (2 * (R - 1) * hop if R > 1 else 0))
    assert priced.step_seconds == pytest.approx(priced.pipeline_seconds + priced.allreduce_seconds + control)
    assert priced.pipeline_seconds > bare.pipeline_seconds if S > 1 else priced.pipeline_seconds == bare.pipeline_seconds


def test_every_message_of_a_pipeline_pays_the_measured_hop():
    """Two stages, one micro-batch: forward, message, forward, backward, message, backward; each message
    pays the hop among the plan's ranks once."""
    idx = np.arange(2).reshape(1, 2)
    bare = pipeline_seconds(_loads(2), _fleet(2), idx, [1], 1)[0]
    priced = pipeline_seconds(_loads(2), _fleet(2, TABLE), idx, [1], 1)[0]
    assert priced - bare == pytest.approx(2 * TABLE.at(2)[1])
    as_if_four = pipeline_seconds(_loads(2), _fleet(2, TABLE), idx, [1], 1, ranks=4)[0]
    assert as_if_four - bare == pytest.approx(2 * TABLE.at(4)[1])


def test_a_burst_makes_a_small_message_free_and_a_fleet_without_one_prices_as_before():
    idx = np.arange(2).reshape(1, 2)
    bare = pipeline_seconds(_loads(2), _fleet(2), idx, [1], 1)[0]
    burst = pipeline_seconds(_loads(2), _fleet(2, burst=10_000), idx, [1], 1)[0]
    assert bare - burst == pytest.approx(2 * 1e3 / 1e8)  # both 1 kB messages crossed at once
    assert allreduce_seconds(_loads(2), _fleet(4, burst=10_000), np.arange(4).reshape(2, 2)) == pytest.approx(
        allreduce_seconds(_loads(2), _fleet(4), np.arange(4).reshape(2, 2)))  # the ring pays its bytes
