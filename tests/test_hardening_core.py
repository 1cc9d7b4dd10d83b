"""Hostile and careless input against the core (issue 11): what is echoed is escaped, ids are printable,
outputs are atomic, keep modes, never replace an input, and a partition directory holds one partition."""
from __future__ import annotations

import errno
import os
import stat
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import ROOT, TINY
from hardening_util import file_size_limit
from vgraph import VGraphError, load, loads
from vgraph.base.diagnostics import Diagnostic, SourceLoc, printable, quote
from vgraph.base.safeio import atomic_write, atomic_write_with, check_output, read_input
from vgraph.cli.main import main
from vgraph.cost.fleet import FleetError, load_fleet, loads_fleet
from vgraph.report.render import render_svg

FLEETS = ROOT / "networks" / "fleets"
ONE_PNODE = "pnodes:\n  - {id: %s, memory: 64GiB, flops: 10T, bandwidth: 10GB/s}\n"


def _renamed(old: str, new: str) -> str:
    """The tiny network with VNode `old` renamed to `new` (a YAML double-quoted scalar)."""
    return TINY.read_text().replace(old, new)


# -- 9, 10: ids and echoes ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ['"a\\e[31mred"', '"two\\nlines"', '""', '" lead"', '"bidi\\u202e"', '"x\\0"'])
def test_a_node_id_must_be_printable_and_its_echo_is_escaped(bad: str) -> None:
    text = _renamed("block0_ffn_gelu", bad)
    with pytest.raises(VGraphError) as info:
        loads(text)
    shown = str(info.value)
    assert "node id" in shown
    assert all(c.isprintable() or c == "\n" for c in shown)  # "\n" only between diagnostics
    assert all(line.startswith("<string>:") for line in shown.splitlines())  # no forged lines


def test_awkward_but_printable_ids_stay_valid() -> None:
    for good in ('"q\\"uote"', '"a b"', '"<&>"', '"\u00e9t\u00e9"', '"#1: x"'):
        assert len(loads(_renamed("block0_ffn_gelu", good))) == len(load(TINY))


def test_diagnostics_escape_every_part_and_cut_long_messages() -> None:
    d = Diagnostic("x\x1b[2J" + "y" * 5000, SourceLoc("f\n.yml", 1), "n\r\n")
    text = str(d)
    assert text.isprintable() and "\\x1b[2J" in text and "f\\n.yml:1" in text and "'n\\r\\n'" in text
    assert len(text) < 2100 and "more characters" in text
    assert quote("z" * 1000).endswith("... (920 more characters)'")
    assert printable("\u2028\x85\ufeff") == "\\u2028\\x85\\ufeff"


def test_render_writes_well_formed_xml_whatever_the_ids(tmp_path: Path) -> None:
    g = loads(_renamed("block0_ffn_gelu", '"g<&>\\"\\e]0;title\\a\\n"'), validate=False)
    g2 = load(TINY)
    for graph in (g, g2):
        try:
            svg = render_svg(graph)
        except VGraphError as exc:  # no Graphviz: the escaping is still checked on the DOT text
            pytest.skip(str(exc))
        ET.fromstring(svg)  # well-formed (raises ParseError otherwise)
        assert "\x1b" not in svg and "\x07" not in svg


@pytest.mark.parametrize("pid", ['"a\\n"', '"a/b"', '".."', '""', '"a\\e"', "x" * 201])
def test_a_pnode_id_names_a_file_so_it_is_a_plain_file_name(pid: str) -> None:
    with pytest.raises(FleetError) as info:
        loads_fleet(ONE_PNODE % pid)
    assert "id must be letters" in str(info.value) and str(info.value).isprintable()


@pytest.mark.parametrize("field,value", [("memory", "1e400"), ("flops", "1e400"), ("bandwidth", "1e999GB/s")])
def test_fleet_quantities_beyond_any_machine_are_diagnostics(field: str, value: str) -> None:
    text = "pnodes:\n  - {id: a, memory: 1GB, flops: 1T, bandwidth: 1GB/s}\n".replace(
        {"memory": "1GB", "flops": "1T", "bandwidth": "1GB/s"}[field], value)
    with pytest.raises(FleetError, match=f"{field}: '{value}' is beyond any machine"):
        loads_fleet(text)


# -- 8: inputs that are not files ----------------------------------------------------------------------

def test_inputs_must_be_regular_files_of_bounded_size(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in (("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                      (tmp_path, "is a directory"), (tmp_path / "none", "no such")):
        with pytest.raises(VGraphError, match=why):
            read_input(path)
        with pytest.raises(FleetError, match=why):
            load_fleet(path)
    big = tmp_path / "big.yml"
    big.write_bytes(b"#" * 101)
    with pytest.raises(VGraphError, match="at most 100 bytes"):
        read_input(big, limit=100)
    latin = tmp_path / "latin.yml"
    latin.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(VGraphError, match=r"latin.yml:1: not UTF-8"):
        read_input(latin)


# -- 4, 6: atomic outputs that keep modes ----------------------------------------------------------------

def test_atomic_write_keeps_the_mode_of_a_replaced_file_and_respects_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        fresh = atomic_write(tmp_path / "new.txt", "x")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        os.umask(0o077)
        assert stat.S_IMODE(atomic_write(tmp_path / "private.txt", "x").stat().st_mode) == 0o600
        shared = tmp_path / "shared.txt"
        shared.write_text("old")
        shared.chmod(0o664)
        atomic_write(shared, "new")
        assert stat.S_IMODE(shared.stat().st_mode) == 0o664 and shared.read_text() == "new"
    finally:
        os.umask(old)


def _private_writer(content: bytes):
    """A library's way of writing by name (safetensors' save_file): its own temporary, 0600, renamed over."""
    def write(path: Path) -> None:
        own = path.with_name(path.name + ".own")
        fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, content)
        os.close(fd)
        os.replace(own, path)
    return write


def test_a_file_a_library_writes_by_name_gets_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        out = atomic_write_with(tmp_path / "t.safetensors", _private_writer(b"new"))
        assert stat.S_IMODE(out.stat().st_mode) == 0o640 and out.read_bytes() == b"new"
        out.chmod(0o664)
        atomic_write_with(out, _private_writer(b"newer"))  # a replaced file keeps its mode
        assert stat.S_IMODE(out.stat().st_mode) == 0o664 and out.read_bytes() == b"newer"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]  # no temporary left


def test_a_library_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "t.safetensors"
    target.write_bytes(b"old")

    def failing(path: Path) -> None:
        path.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(VGraphError, match="t.safetensors: cannot write: No space left on device"):
        atomic_write_with(target, failing)
    with pytest.raises(ValueError, match="not an OSError"):
        atomic_write_with(target, lambda path: (_ for _ in ()).throw(ValueError("not an OSError")))
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"] and target.read_bytes() == b"old"
    with pytest.raises(VGraphError, match="is a directory"):
        atomic_write_with(tmp_path, _private_writer(b"x"))


def _disk_full(monkeypatch) -> None:
    real_write = os.write

    def write(fd: int, data) -> int:
        if os.fstat(fd).st_size > 16:  # fail part of the way through, as a full disk does
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data)[:8])

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "out.svg"
    target.write_text("old drawing")
    _disk_full(monkeypatch)
    with pytest.raises(VGraphError, match="out.svg: cannot write: No space left on device"):
        atomic_write(target, "<svg>" + "x" * 1000 + "</svg>")
    monkeypatch.undo()
    assert target.read_text() == "old drawing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.svg"]


def test_render_on_a_full_disk_is_a_diagnostic_and_leaves_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "net.svg"
    out.write_text("<svg>old</svg>")
    with file_size_limit(200):  # every write past 200 bytes fails, as on a full disk
        code = main(["render", str(TINY), "-o", str(out)])
    err = capsys.readouterr().err
    if "Graphviz" in err:
        pytest.skip(err)
    assert code == 2 and "net.svg: cannot write: File too large" in err and "Traceback" not in err
    assert out.read_text() == "<svg>old</svg>" and list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("command", ["optimize", "render"])
def test_outputs_that_cannot_be_written_are_diagnostics(command: str, tmp_path: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        for out in (tmp_path, locked / "x.out", tmp_path / "file" / "below"):
            if out.name == "below":
                (tmp_path / "file").write_text("a file, not a directory")
            if out == locked / "x.out" and os.access(locked, os.W_OK):
                continue  # running as root: permissions do not stop us
            assert main([command, str(TINY), "-o", str(out)]) == 2
            err = capsys.readouterr().err
            assert str(out.parent if out.name == "below" else out).split("/")[-1] in err
            assert "Traceback" not in err
    finally:
        locked.chmod(0o700)


# -- 5: never over an input; one partition per directory --------------------------------------------------

def test_optimize_refuses_to_overwrite_its_input(tmp_path: Path, capsys) -> None:
    net = tmp_path / "in.yml"
    net.write_text(TINY.read_text())
    (tmp_path / "link.yml").symlink_to(net)
    before = net.read_bytes()
    for out in (net, tmp_path / "." / "in.yml", tmp_path / "link.yml"):
        assert main(["optimize", str(net), "-o", str(out)]) == 2
        assert "refusing to overwrite an input" in capsys.readouterr().err
    assert net.read_bytes() == before
    with pytest.raises(VGraphError, match="is a directory"):
        check_output(tmp_path)


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_an_output_that_is_a_device_is_refused_not_replaced(device: str, capsys) -> None:
    before = os.stat(device)
    for command in (["optimize", str(TINY), "-o", device], ["render", str(TINY), "-o", device]):
        assert main(command) == 2
        assert "not a regular file" in capsys.readouterr().err
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino
    with pytest.raises(VGraphError, match="not a regular file"):
        atomic_write(device, "x")


def test_partition_refuses_a_part_that_would_replace_the_network(tmp_path: Path, capsys, monkeypatch) -> None:
    net = tmp_path / "big.yml"
    net.write_text(TINY.read_text())
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(ONE_PNODE % "big")
    before = net.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["partition", "big.yml", "--fleet", "fleet.yml", "-o", "."]) == 2
    assert "refusing to overwrite an input" in capsys.readouterr().err
    assert net.read_bytes() == before and not (tmp_path / "placement.json").exists()


def test_a_partition_directory_holds_exactly_one_partition(tmp_path: Path, capsys) -> None:
    out = tmp_path / "parts"
    two = tmp_path / "two.yml"
    two.write_text("pnodes:\n  - {id: p0, memory: 600KB, flops: 10T, bandwidth: 10GB/s}\n"
                   "  - {id: p1, memory: 600KB, flops: 10T, bandwidth: 10GB/s}\n")
    one = tmp_path / "one.yml"
    one.write_text(ONE_PNODE % "solo")
    assert main(["partition", str(TINY), "--fleet", str(two), "-o", str(out)]) == 0
    first = sorted(p.name for p in out.iterdir())
    assert {"p0.yml", "p1.yml", "placement.json"} <= set(first)
    (out / "notes.txt").write_text("mine")
    assert main(["partition", str(TINY), "--fleet", str(one), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".vgraph-outputs.json", "notes.txt", "placement.json", "solo.yml"]
    (out / "placement.json").unlink()
    (out / "placement.json").mkdir()
    capsys.readouterr()
    assert main(["partition", str(TINY), "--fleet", str(one), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "placement.json" in err and "Traceback" not in err


def test_command_outputs_get_the_umask_mode_not_0600(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(ONE_PNODE % "solo")
    old = os.umask(0o022)
    try:
        assert main(["optimize", str(TINY), "-o", str(tmp_path / "o.yml")]) == 0
        assert main(["partition", str(TINY), "--fleet", str(fleet), "-o", str(tmp_path / "parts")]) == 0
    finally:
        os.umask(old)
    for path in (tmp_path / "o.yml", tmp_path / "parts" / "solo.yml", tmp_path / "parts" / "placement.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_nothing_a_command_prints_can_drive_the_terminal(tmp_path: Path, capsys) -> None:
    from vgraph.base.terminal import escape_controls

    net = tmp_path / "esc.yml"
    net.write_text(TINY.read_text().replace('colocate_group: "transformer_block_0"',
                                            'colocate_group: "blk\\e]0;title\\a\\e[2J\\u202eRED"'))
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(ONE_PNODE % "solo")
    for argv in (["analyze", str(net)], ["analyze", str(net), "--fleet", str(fleet)],
                 ["partition", str(net), "--fleet", str(fleet), "-o", str(tmp_path / "parts")]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        if argv[0] == "analyze":  # its tables name every colocation group
            assert "blk\\x1b]0;title\\x07\\x1b[2J\\u202eRED" in out, argv
        assert not any(c in out + err for c in "\x1b\x07\u202e"), argv
    assert escape_controls("a\tb\r\nc\x1b[0m\x85") == "a\tb\r\nc\\x1b[0m\\x85"
