"""Network YAML against hostile documents (issue 11): the whole document's alias expansion is bounded,
quoted input is cut, the file read is a bounded regular file, and `save` is atomic."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import TINY
from vgraph import VGraphError, load, loads
from vgraph.cli.main import main
from vgraph.yamlio.yaml_reader import MAX_ALIAS_EXPANSION


def _with_aliases(keys: int, width: int, depth: int) -> str:
    """The tiny network plus `keys` top-level keys that all name one anchor of width**depth scalars."""
    lines = [f"x0: &x0 [{', '.join(['a'] * width)}]"]
    for i in range(1, depth):
        lines.append(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * width)}]")
    lines += [f"k{j}: *x{depth - 1}" for j in range(keys)]
    return TINY.read_text() + "\n".join(lines) + "\n"


def test_many_keys_naming_one_anchor_are_refused_as_one_document() -> None:
    text = _with_aliases(keys=300, width=10, depth=4)  # each key alone is ~11k nodes, far below any per-key cap
    assert len(text) < 16_000
    with pytest.raises(VGraphError, match="alias bomb") as info:
        loads(text)
    assert len(str(info.value)) < 300


def test_shared_blocks_within_the_bound_still_load_and_optimize_stays_proportionate(tmp_path: Path) -> None:
    text = _with_aliases(keys=20, width=10, depth=2)  # 20 x 111 nodes: ordinary sharing
    src = tmp_path / "shared.yml"
    src.write_text(text)
    assert len(load(src).extra) == 22
    out = tmp_path / "out.yml"
    assert main(["optimize", str(src), "-o", str(out)]) == 0
    assert out.stat().st_size < 20 * len(text)


def test_the_bound_is_on_expansion_not_on_plain_size() -> None:
    wide = TINY.read_text() + "notes: [" + ", ".join(["n"] * (2 * MAX_ALIAS_EXPANSION)) + "]\n"
    assert len(loads(wide).extra["notes"]) == 2 * MAX_ALIAS_EXPANSION


@pytest.mark.parametrize("doc", ["x" * 5_000_000, "- " + "y" * 100_000, "nodes: " + "z" * 100_000])
def test_messages_quote_at_most_a_little_of_the_input(doc: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "big.yml"
    path.write_text(doc + "\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1_000 and max(err.count(c) for c in "xyz") <= 100


def test_validate_of_a_file_that_is_no_network_prints_no_content(tmp_path: Path, capsys) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 2000)
    assert main(["validate", str(secret)]) == 2
    err = capsys.readouterr().err
    assert err.count("root:x:0") <= 3 and len(err) < 600 and "more characters" in err


@pytest.mark.parametrize("kind", ["fifo", "dev", "dir", "latin1"])
def test_network_file_must_be_a_regular_utf8_file(kind: str, tmp_path: Path, capsys) -> None:
    path = {"dev": Path("/dev/zero"), "dir": tmp_path}.get(kind, tmp_path / "net.yml")
    if kind == "fifo":
        os.mkfifo(path)
    if kind == "latin1":
        path.write_bytes(TINY.read_bytes().replace(b"tiny", b"t\xefny", 1))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err


def test_save_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    out = tmp_path / "net.yml"
    out.write_text("old")
    out.chmod(0o640)
    from vgraph import save
    save(load(TINY), out)
    assert oct(out.stat().st_mode & 0o777) == "0o640" and load(out).name == load(TINY).name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.yml"]


def test_an_embedder_with_rope_is_accepted_with_a_warning(tmp_path: Path, capsys) -> None:
    path = tmp_path / "rope.yml"
    text = TINY.read_text()
    start = text.index("type: embedder")
    path.write_text(text[:start] + text[start:].replace('position_encoding: "none"', 'position_encoding: "rope"', 1))
    warnings: list = []
    load(path, warnings=warnings)
    assert [w.node for w in warnings] == ["embedder"] and "does nothing on an embedder" in str(warnings[0])
    assert main(["validate", str(path)]) == 0
    assert "warning: node 'embedder': position_encoding 'rope' does nothing" in capsys.readouterr().err
    assert main(["optimize", str(path), "-o", str(tmp_path / "out.yml")]) == 0
    assert "does nothing on an embedder" in capsys.readouterr().err
    load(TINY, warnings=warnings)
    assert len(warnings) == 1  # the fixture's embedder says 'none': nothing to say
