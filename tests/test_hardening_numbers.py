"""Numbers read from files go through one checked reader; error lists are bounded (issue 21, "Numbers").

Regression tests: a subnormal PNode speed or link bandwidth was a ZeroDivisionError in the step cost
model (analyze, partition); a fleet of 3,000 regions without links printed 4.5 million errors.
"""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY
from vgraph.base.diagnostics import MAX_DIAGNOSTICS, Diagnostic, DiagnosticSink, VGraphError
from vgraph.base.numbers import NumberError, checked_number, number_or_none
from vgraph.cli.main import main
from vgraph.cost.fleet import FleetError, loads_fleet

TWO = ("name: two\npnodes:\n  - {id: w0, memory: 1GiB, flops: %s, bandwidth: %s, accelerator: cpu}\n"
       "  - {id: w1, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}\n")
LINKED = ("name: geo\nregions:\n  - {name: a}\n  - {name: b}\nlinks:\n  - {between: [a, b], bandwidth: %s}\n"
          "pnodes:\n  - {id: w0, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, region: a}\n"
          "  - {id: w1, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, region: b}\n")


# -- the reader ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,why", [(True, "true/false"), ("1", "str"), ([1], "list"), ({"a": 1}, "dict"),
                                       (None, "NoneType"), (float("nan"), "finite"), (float("inf"), "finite"),
                                       (5e-324, "subnormal"), (-1e-310, "subnormal"), (10**400, "digits")])
def test_what_is_not_a_number_is_named(value, why: str) -> None:
    with pytest.raises(NumberError, match=why):
        checked_number(value, "loss")


def test_integers_and_ranges() -> None:
    assert checked_number(3, "step", integer=True, low=0) == 3
    assert checked_number(0.0, "loss") == 0.0 and checked_number(sys.float_info.min, "x") == sys.float_info.min
    for bad, kw in ((3.0, {"integer": True}), (-1, {"low": 0}), (10**30, {"high": 2**63 - 1})):
        with pytest.raises(NumberError):
            checked_number(bad, "step", **kw)


@settings(derandomize=True, max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                max_size=3), max_leaves=8))
def test_the_reader_never_raises_anything_but_its_own_error(value) -> None:
    got = number_or_none(value)
    assert got is None or (isinstance(got, (int, float)) and not isinstance(got, bool))
    if got is not None:
        float(got)  # usable in arithmetic: never OverflowError


# -- fleets: subnormal and absurdly small quantities ---------------------------------------------------------

@pytest.mark.parametrize("flops,bandwidth", [("1e-310", "1GB/s"), ("1G", "1e-310"), ("0.5", "1GB/s"),
                                             ("1G", "4e-320GB/s")])
def test_a_pnode_slower_than_one_unit_per_second_is_a_diagnostic(flops: str, bandwidth: str) -> None:
    with pytest.raises(FleetError) as info:
        loads_fleet(TWO % (flops, bandwidth))
    assert "w0" in str(info.value) and ("subnormal" in str(info.value) or "at least 1" in str(info.value))


def test_a_subnormal_link_bandwidth_is_a_diagnostic() -> None:
    with pytest.raises(FleetError, match="link bandwidth"):
        loads_fleet(LINKED % "1e-310")


@pytest.mark.parametrize("command", ["analyze", "partition"])
@pytest.mark.parametrize("fleet", ["pnode", "link"])
def test_subnormal_fleet_numbers_exit_2_in_analyze_and_partition(command: str, fleet: str, tmp_path, capsys) -> None:
    path = tmp_path / "fleet.yml"
    path.write_text(TWO % ("1e-310", "1GB/s") if fleet == "pnode" else LINKED % "1e-310")
    argv = [command, str(TINY), "--fleet", str(path)]
    argv += ["-o", str(tmp_path / "parts")] if command == "partition" else ["--batch", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err
    assert not (tmp_path / "parts").exists()


# -- bounded error lists -------------------------------------------------------------------------------------

def _regions_without_links(n: int) -> str:
    regions = "".join(f"  - {{name: r{i}}}\n" for i in range(n))
    return (f"name: world\nregions:\n{regions}pnodes:\n"
            "  - {id: w0, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, region: r0}\n")


def test_missing_links_are_counted_not_listed() -> None:
    """3,000 regions without links: 4,498,500 missing pairs, reported as a bounded list and a count."""
    with pytest.raises(FleetError) as info:
        loads_fleet(_regions_without_links(3000))
    diags = info.value.diagnostics
    assert len(diags) <= MAX_DIAGNOSTICS + 1
    assert "4,498,500" in str(info.value) or "4,4" in str(info.value)
    assert any("more" in d.message for d in diags)


def test_a_sink_keeps_at_most_a_bounded_list_and_counts_the_rest() -> None:
    sink = DiagnosticSink()
    for i in range(MAX_DIAGNOSTICS * 3):
        sink.error(f"problem {i}")
    with pytest.raises(VGraphError) as info:
        sink.raise_if_errors()
    diags = info.value.diagnostics
    assert len(diags) == MAX_DIAGNOSTICS + 1
    assert diags[-1].message.startswith(f"... and {MAX_DIAGNOSTICS * 2:,} more")
    assert len(str(info.value)) < 200 * MAX_DIAGNOSTICS


def test_an_error_built_from_a_huge_list_is_bounded() -> None:
    err = VGraphError(Diagnostic(f"problem {i}") for i in range(50_000))
    assert len(err.diagnostics) == MAX_DIAGNOSTICS + 1 and "49,000 more" in err.diagnostics[-1].message
