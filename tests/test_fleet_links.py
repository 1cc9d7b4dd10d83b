"""Regions and per-pair links in the fleet format: what a transfer gets, and every mistake, compiler-style."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.gen_fleet import heterogeneous, to_yaml
from vgraph.cli.main import main
from vgraph.cost.fleet import FleetError, loads_fleet
from vgraph.cost.fleet_links import parse_latency

GOOD = """\
name: geo
regions:
  - {name: eu, bandwidth: 2Gbit/s, latency: 10ms}
  - {name: us}
links:
  - {between: [eu, us], bandwidth: 500Mbit/s, latency: 80ms}
pnodes:
  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 10Gbit/s, region: eu}
  - {id: b, memory: 1GiB, flops: 1T, bandwidth: 10Gbit/s, region: eu}
  - {id: c, memory: 1GiB, flops: 1T, bandwidth: 100Mbit/s, region: us}
"""


def test_links_between_pnodes():
    f = loads_fleet(GOOD)
    a, b, c = f.pnodes
    assert f.link(a, b) == (2e9 / 8, 0.010)  # inside eu: the region's link
    assert f.link(a, c) == (500e6 / 8, 0.080)  # across: the slower of NIC and link
    assert f.link(c, a) == (100e6 / 8, 0.080)  # c's own NIC is slower than the link
    assert f.link(c, c) == (100e6 / 8, 0.0)  # a region without its own figures: the PNode's
    assert f.without({"b"}).ids == ["a", "c"] and f.without({"b"}).links is f.links


def test_fleets_without_regions_keep_the_old_rule():
    f = loads_fleet("pnodes:\n  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 8Gbit/s}\n"
                    "  - {id: b, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n")
    a, b = f.pnodes
    assert f.link(a, b) == (1e9, 0.0) and f.link(b, a) == (1.25e8, 0.0)


@pytest.mark.parametrize("text, seconds", [("67ms", 0.067), ("0.5s", 0.5), ("150us", 1.5e-4), ("0", 0.0),
                                           ("2", 2.0), ("1e-3 s", 1e-3)])
def test_latency_units(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-1ms", "fast", "nan", "inf", "1e400s", "5 hours", "7200s", ""])
def test_bad_latencies(text):
    with pytest.raises(ValueError):
        parse_latency(text)


BROKEN = [
    ("regions:\n  - {name: eu}\n  - {name: eu}\n", 3, "duplicate region 'eu' (first defined at line 2)"),
    ("regions:\n  - {nam: eu}\n", 2, "unknown region key 'nam' (did you mean 'name'?)"),
    ("regions:\n  - {bandwidth: 1Gbit/s}\n", 2, "region has no 'name'"),
    ("regions:\n  - {name: eu, latency: -3ms}\n", 2, "latency"),
    ("regions:\n  - {name: eu, bandwidth: nan}\n", 2, "bandwidth"),
    ("regions:\n  - {name: eu, bandwidth: 0}\n", 2, "must be positive"),
    ("regions:\n  - {name: eu}\n  - {name: us}\n", 1, "no link between regions 'eu' and 'us'"),
    ("regions:\n  - {name: eu}\nlinks:\n  - {between: [eu, eu], bandwidth: 1Gbit/s}\n", 4, "'eu' is given twice"),
    ("regions:\n  - {name: eu}\nlinks:\n  - {between: [eu, mars], bandwidth: 1Gbit/s}\n", 4,
     "undeclared region(s) 'mars'"),
    ("regions:\n  - {name: eu}\nlinks:\n  - {between: [eu], bandwidth: 1Gbit/s}\n", 4, "exactly two regions"),
    ("regions:\n  - {name: eu}\n  - {name: us}\nlinks:\n  - {between: [eu, us]}\n", 5, "link has no 'bandwidth'"),
    ("regions:\n  - {name: eu}\n  - {name: us}\nlinks:\n  - {between: [eu, us], bandwidth: 1Gbit/s, latency: 1e9}\n", 5,
     "plausible"),
    ("regions:\n  - {name: eu}\n  - {name: us}\nlinks:\n  - {between: [eu, us], bandwidth: 1Gbit/s}\n"
     "  - {between: [us, eu], bandwidth: 2Gbit/s}\n", 6, "duplicate link between 'us' and 'eu' (first at line 5)"),
    ("links:\n  - {between: [eu, us], bandwidth: 1Gbit/s}\n", 1, "declares no 'regions'"),
    ("regions: 3\n", 1, "'regions' must be a list"),
    ("regions:\n  - eu\n", 2, "a region must be a mapping"),
]


@pytest.mark.parametrize("head, line, message", BROKEN)
def test_mistakes_are_reported_with_their_line(head, line, message):
    text = head + "pnodes:\n  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n"
    with pytest.raises(FleetError) as err:
        loads_fleet(text, "f.yml")
    lines = [str(d) for d in err.value.diagnostics]
    assert any(s.startswith(f"f.yml:{line}: ") and message in s for s in lines), lines


def test_regions_are_all_or_nothing_and_declared():
    text = GOOD.replace("region: us}", "region: mars}").replace(
        "  - {id: b, memory: 1GiB, flops: 1T, bandwidth: 10Gbit/s, region: eu}\n",
        "  - {id: b, memory: 1GiB, flops: 1T, bandwidth: 10Gbit/s}\n")
    with pytest.raises(FleetError) as err:
        loads_fleet(text, "f.yml")
    lines = [str(d) for d in err.value.diagnostics]
    assert "f.yml:10: pnode 'c': region 'mars' is not declared in 'regions'" in lines
    assert any(s.startswith("f.yml:9: pnode 'b': has no 'region' while other PNodes do (1 without)")
               for s in lines), lines


def test_cli_reports_a_bad_region_link_with_exit_2(tmp_path, capsys):
    net = tmp_path / "f.yml"
    net.write_text(GOOD.replace("500Mbit/s", "lots"))
    from conftest import ROOT
    code = main(["analyze", str(ROOT / "tests" / "fixtures" / "tiny_2l.yml"), "--fleet", str(net)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"{net}:6: fleet: link bandwidth: expected bandwidth" in err


@given(st.integers(1, 60), st.integers(0, 3), st.booleans())
def test_generated_fleets_round_trip_through_the_format(n, seed, world):
    fleet = heterogeneous(n, seed=seed, world=world)
    again = loads_fleet(to_yaml(fleet))
    assert [(p.id, p.memory, p.region, p.accelerator) for p in again] == \
        [(p.id, p.memory, p.region, p.accelerator) for p in fleet]
    for p, q in zip(fleet.pnodes[:5], again.pnodes[-5:]):
        assert again.link(again.pnode(p.id), q) == pytest.approx(fleet.link(p, fleet.pnode(q.id)), rel=1e-5)


@given(st.floats(0, 3600, allow_nan=False), st.sampled_from([("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("", 1.0)]))
def test_latency_round_trips(value, unit):
    name, scale = unit
    assert parse_latency(f"{value!r}{name}") == pytest.approx(value * scale, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("name", ["a\\x07b", "../etc", "a/b", "x" * 300])
def test_odd_region_names_are_quoted_in_messages(name):
    text = (f'regions:\n  - {{name: "{name}"}}\n  - {{name: "{name}"}}\n'
            "pnodes:\n  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n")
    with pytest.raises(FleetError) as err:
        loads_fleet(text, "f.yml")
    lines = [str(d) for d in err.value.diagnostics]
    assert any(s.startswith("f.yml:3: fleet: duplicate region") for s in lines), lines
    assert all("\x07" not in s and len(s) < 2000 for s in lines)
