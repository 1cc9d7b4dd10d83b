"""`export-onnx` writes atomically and never over an input (issue 11, items 4, 5, 6)."""
from __future__ import annotations

import stat
from pathlib import Path

from conftest import TINY
from hardening_util import file_size_limit
from vgraph.cli.main import main


def test_export_on_a_full_disk_leaves_no_file(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.onnx"
    with file_size_limit(100):  # every write past 100 bytes fails, as on a full disk
        code = main(["export-onnx", str(TINY), "--random-weights", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "m.onnx: cannot write: File too large" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no truncated model, no temporary


def test_export_keeps_the_mode_of_a_replaced_model_and_refuses_its_input(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.onnx"
    out.write_bytes(b"old")
    out.chmod(0o644)
    assert main(["export-onnx", str(TINY), "--random-weights", "-o", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o644 and out.stat().st_size > 1000
    net = tmp_path / "net.yml"
    net.write_bytes(TINY.read_bytes())
    assert main(["export-onnx", str(net), "--random-weights", "-o", str(net)]) == 2
    assert "refusing to overwrite an input" in capsys.readouterr().err
    assert net.read_bytes() == TINY.read_bytes()
