"""`vgraph validate` and `vgraph analyze`, called in-process (and once as the installed script)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NET6, NET8, ROOT, TINY
from vgraph.cli.main import main
from vgraph.cost.analyze import compact_types, human_bytes


def test_validate_accepts_both_production_networks(capsys) -> None:
    assert main(["validate", str(NET6), str(NET8)]) == 0
    out = capsys.readouterr().out
    assert f"{NET6}: ok (139 VNodes" in out and f"{NET8}: ok (183 VNodes, 254 edges)" in out


def test_validate_reports_each_file_and_fails_if_any_is_bad(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(TINY.read_text().replace("    type: gelu\n", "    type: geluu\n", 1))
    assert main(["validate", str(TINY), str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"{TINY}: ok" in captured.out
    assert f"{bad}:" in captured.err and "node 'block0_ffn_gelu': unknown node type 'geluu'" in captured.err
    assert f"{bad}: invalid (1 error)" in captured.err


def test_validate_prints_warnings_but_passes(tmp_path: Path, capsys) -> None:
    path = tmp_path / "extra.yml"
    path.write_text(TINY.read_text() + "owner: research\n")
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: unknown top-level key 'owner'" in err


@pytest.mark.parametrize("path,vnodes,params", [(NET6, 139, 27_185_664), (NET8, 183, 45_147_648)])
def test_analyze_json(path: Path, vnodes: int, params: int, capsys) -> None:
    assert main(["analyze", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["vnodes"] == vnodes and doc["params"] == params
    layers = (vnodes - 7) // 22
    assert doc["by_type"]["attention_head"] == 8 * layers and doc["by_type"]["cost"] == 1
    assert set(doc["groups"]) == {"token_embedding"} | {f"transformer_block_{i}" for i in range(layers)}
    assert sum(g["params"] for g in doc["groups"].values()) == doc["params"]
    assert sum(g["flops_per_sample"] for g in doc["groups"].values()) == doc["flops_per_sample"]
    assert sum(g["vnodes"] for g in doc["groups"].values()) == doc["vnodes"]
    assert len({g["params"] for name, g in doc["groups"].items() if name != "token_embedding"}) == 1
    assert abs(doc["params"] / (27.19e6 if layers == 6 else 45.15e6) - 1) < 0.01


def test_analyze_table_is_compact_and_readable(capsys) -> None:
    assert main(["analyze", str(NET8)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("network 'distributed-multi-head-attention-8l-swiglu_ffn': 183 VNodes, "
                               "45,147,648 parameters")
    heads = next(line for line in lines if line.startswith("block0_heads "))
    assert "8 x float16[512, 512]" in heads and heads.count("float16") == 1
    assert max(len(line) for line in lines[1:]) <= 100  # the tables fit a terminal
    total = next(line for line in lines if line.startswith("total "))
    assert "45,147,648" in total and "183" in total


def test_analyze_of_a_bad_file_exits_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\nnodes: [\n")
    assert main(["analyze", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "YAML syntax error" in err


def test_missing_file_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(tmp_path / "nope.yml")]) == 2
    assert "nope.yml: no such network file" in capsys.readouterr().err


def test_compact_types() -> None:
    assert compact_types(["a"] * 8) == "8 x a"
    assert compact_types(["a", "a", "b", "a"]) == "2 x a, b, a"
    assert compact_types([]) == "-"
    assert human_bytes(15_728_640) == "15.73 MB" and human_bytes(12) == "12 B"


def test_installed_script_exits_2_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("name: !!python/object/apply:os.system ['echo pwned']\nnodes: []\n")
    script = Path(sys.executable).parent / "vgraph"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "vgraph"]
    proc = subprocess.run([*command, "validate", str(bad)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "pwned" not in proc.stdout
    assert f"{bad}:1: unsafe or unsupported YAML tag" in proc.stderr


def test_version_is_printed_and_is_the_installed_one(tmp_path: Path, capsys) -> None:
    """`vgraph --version`: vgraph.__version__, which is also what pip installed (pyproject reads it)."""
    import vgraph

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"vgraph {vgraph.__version__}\n"
    assert vgraph.__version__ == "0.2.0"
    installed = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('vgraph'))"],
                               capture_output=True, text=True, cwd=tmp_path, timeout=60, check=True).stdout.strip()
    assert installed == vgraph.__version__
