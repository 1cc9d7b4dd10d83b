"""`vgraph analyze --max-batch`: the largest batch each PNode fits, with and without remat."""
from __future__ import annotations

import json
from math import ceil

from hypothesis import given, strategies as st

from conftest import NET12, ROOT, TINY
from vgraph.cli.main import main
from vgraph.cost.max_batch import LIMIT, largest_batch

T4X1 = ROOT / "networks" / "fleets" / "t4x1.yml"
T4X4 = ROOT / "networks" / "fleets" / "t4x4.yml"


def fits(b, cap, static, per, m, s):
    return static + per * ceil(b / m) * max(1, min(m, s)) <= cap


@given(st.integers(0, 10**12), st.integers(0, 10**11), st.integers(1, 10**9), st.integers(1, 64), st.integers(1, 8))
def test_largest_batch_is_the_largest_that_fits(cap, static, per, m, s):
    b = largest_batch(cap, static, per, m, s)
    if b == 0:
        assert not fits(1, cap, static, per, m, s)
    else:
        assert fits(b, cap, static, per, m, s) and (b == LIMIT or not fits(b + 1, cap, static, per, m, s))


def test_nothing_fits_when_the_weights_overflow():
    assert largest_batch(100, 200, 1) == 0
    assert largest_batch(100, 0, 0) == LIMIT


def test_124m_on_one_t4_remat_at_least_doubles_the_batch(capsys):
    assert main(["analyze", str(NET12), "--fleet", str(T4X1), "--max-batch", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["max_batch"] >= 1 and doc["max_batch_remat"] >= 2 * doc["max_batch"]
    (row,) = doc["pnodes"]
    assert row["pnode"] == "t4-0" and row["max_batch"] == doc["max_batch"]
    assert fits(row["max_batch"], row["memory_bytes"], row["static_bytes"], row["activation_bytes_per_sample"], 1, 1)
    assert not fits(row["max_batch"] + 1, row["memory_bytes"], row["static_bytes"],
                    row["activation_bytes_per_sample"], 1, 1)


def test_table_per_pnode_of_a_plan(capsys):
    assert main(["analyze", str(NET12), "--fleet", str(T4X4), "--max-batch", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "max batch (remat)" in out and all(f"t4-{i}" in out for i in range(4))


def test_max_batch_needs_a_fleet_and_a_good_one(tmp_path, capsys):
    assert main(["analyze", str(TINY), "--max-batch"]) == 2
    err = capsys.readouterr().err
    assert "--fleet" in err and "Traceback" not in err
    assert main(["analyze", str(TINY), "--max-batch", "--fleet", str(tmp_path)]) == 2
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\npnodes:\n  - {id: a, memory: lots, flops: 1T, bandwidth: 1GB/s}\n")
    assert main(["analyze", str(TINY), "--max-batch", "--fleet", str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err
