"""Fleet specs: units, the example fleets, and errors a user can act on."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import NET8, ROOT
from vgraph.cli.main import main
from vgraph.cost.fleet import (Fleet, FleetError, PNode, load_fleet, loads_fleet, parse_bandwidth, parse_bytes,
                               parse_flops)

FLEETS = ROOT / "networks" / "fleets"


@pytest.mark.parametrize("text, expected", [
    ("1024", 1024), ("16GiB", 16 * 2 ** 30), ("16 GiB", 16 * 2 ** 30), ("512MB", 512_000_000),
    ("1.5KiB", 1536), ("2kB", 2000), ("2KB", 2000), ("1TiB", 2 ** 40), ("1e9", 10 ** 9), ("64B", 64),
])
def test_memory_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("8.1T", 8.1e12), ("65e12", 65e12), ("25 TFLOPS", 25e12), ("300G", 3e11), ("1.5 PFLOP/s", 1.5e15),
    ("1000", 1000.0),
])
def test_flops_units(text, expected):
    assert parse_flops(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("10Gbit/s", 1.25e9), ("10Gbps", 1.25e9), ("10 Gb/s", 1.25e9), ("1.25GB/s", 1.25e9),
    ("1GiB/s", 2.0 ** 30), ("100MB/s", 1e8), ("1e9", 1e9), ("800 Mbit/s", 1e8),
])
def test_bandwidth_units_bits_versus_bytes(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("parse, text", [(parse_bytes, "16G"), (parse_bytes, "lots"), (parse_flops, "8.1X"),
                                         (parse_bandwidth, "10 Gbit"), (parse_bandwidth, "fast")])
def test_bad_quantities_are_refused(parse, text):
    with pytest.raises(ValueError, match="expected"):
        parse(text)


def test_example_fleets():
    laptop, t4, mixed = (load_fleet(FLEETS / f"{n}.yml") for n in ("laptop", "t4x4", "mixed16"))
    assert (len(laptop), len(t4), len(mixed)) == (1, 4, 16)
    assert laptop.pnodes[0].accelerator == "cpu"
    p = t4.pnode("t4-2")
    assert (p.memory, p.flops, p.bandwidth, p.accelerator) == (16 * 2 ** 30, 25e12, 1.25e9, "cuda-sm75")
    assert {p.accelerator for p in mixed} == {"cpu", "cuda-sm61", "cuda-sm86"}
    assert len(set(mixed.ids)) == 16
    assert mixed.largest().memory == 12 * 2 ** 30
    assert p.loc is not None and p.loc.line == 7


def test_every_problem_is_reported_with_file_line_and_pnode():
    text = """name: broken
pnodes:
  - id: a
    memory: 16QB
    flops: 1T
    bandwdth: 1Gbps
  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbps}
  - id: b
    memory: 1GiB
    flops: 0
    bandwidth: 1Gbps
    accelerator: tpu-v4
"""
    with pytest.raises(FleetError) as info:
        loads_fleet(text, "fleet.yml")
    lines = str(info.value).splitlines()
    assert "fleet.yml:3: pnode 'a': PNode has no 'bandwidth'" in lines
    assert any(line.startswith("fleet.yml:4: pnode 'a': memory: expected bytes") for line in lines)
    assert "fleet.yml:6: pnode 'a': unknown PNode key 'bandwdth' (did you mean 'bandwidth'?)" in lines
    assert "fleet.yml:7: pnode 'a': duplicate PNode id (first defined at line 3)" in lines
    assert "fleet.yml:10: pnode 'b': flops must be positive, got '0'" in lines
    assert any(line.startswith("fleet.yml:12: pnode 'b': accelerator 'tpu-v4'") for line in lines)
    assert len(lines) == 6


@pytest.mark.parametrize("text, message", [
    ("", "fleet.yml:1: fleet: empty file"),
    ("pnodes: [\n", "fleet.yml:2: fleet: YAML syntax error"),
    ("- a\n", "fleet.yml:1: fleet: a fleet must be a mapping"),
    ("name: x\n", "fleet.yml:1: fleet: the fleet has no 'pnodes' list"),
    ("pnodes: []\n", "fleet.yml:1: fleet: 'pnodes' is empty"),
    ("pnodez: []\n", "unknown top-level key 'pnodez' (did you mean 'pnodes'?)"),
    ("pnodes:\n  - !!python/object:os.system {id: x}\n", "unsafe or unsupported YAML tag"),
    ("pnodes:\n  - {id: ../etc, memory: 1, flops: 1, bandwidth: 1}\n", "pnode '../etc': id must be letters"),
])
def test_structural_errors(text, message):
    with pytest.raises(FleetError) as info:
        loads_fleet(text, "fleet.yml")
    assert message in str(info.value)


def test_missing_file_is_a_user_error(tmp_path: Path):
    with pytest.raises(FleetError, match="no such fleet file"):
        load_fleet(tmp_path / "nope.yml")


def test_fleet_in_code_is_checked():
    ok = Fleet.of("two", PNode("a", 10, 1.0, 1.0), PNode("b", 20, 2.0, 1.0, "cuda-sm80"))
    assert ok.ids == ["a", "b"] and ok.largest().id == "b"
    with pytest.raises(FleetError, match="duplicate PNode id 'a'"):
        Fleet.of("dup", PNode("a", 10, 1.0, 1.0), PNode("a", 10, 1.0, 1.0))
    with pytest.raises(FleetError, match="memory must be positive"):
        Fleet.of("bad", PNode("a", 0, 1.0, 1.0))


def test_cli_reports_a_bad_fleet_without_traceback(tmp_path: Path, capsys):
    bad = tmp_path / "bad.yml"
    bad.write_text("pnodes:\n  - {id: x, memory: 1GiB, flops: fast, bandwidth: 1Gbps}\n")
    assert main(["analyze", str(NET8), "--fleet", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: pnode 'x': flops: expected FLOP/s" in err
    assert "Traceback" not in err
