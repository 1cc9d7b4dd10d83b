"""The layer contracts of `.importlinter` hold, and a violating import breaks them.

The core finds passes and backends through entry points and never imports them; passes are IR to IR
and import no backend; the torch and ONNX backends use each other's package API only.  import-linter
(run by tools/check_layers.py on the installed package layout) checks that on every suite run.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from tools.check_layers import CONFIG, check, installed_layout


def test_the_layer_contracts_are_kept() -> None:
    result = check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


def test_the_installed_layout_holds_the_mapped_packages(tmp_path: Path) -> None:
    layout = installed_layout(ROOT, tmp_path)
    for module in ("vgraph/ir.py", "vgraph/passes/fuse_heads.py", "vgraph/backends/torch/kernels.py",
                   "vgraph/backends/onnx/check.py"):
        assert (layout / module).is_file(), module


def _copy_of_sources(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    shutil.copy(ROOT / "pyproject.toml", root)
    for name in ("vgraph", "passes", "backends"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("module, line, broken", [
    ("vgraph/analyze.py", "from vgraph.passes import dead_nodes", "vgraph.analyze -> vgraph.passes.dead_nodes"),
    ("vgraph/ir.py", "import vgraph.backends.torch", "vgraph.ir -> vgraph.backends.torch"),
    ("passes/dead_nodes.py", "from vgraph.backends.onnx import lower",
     "vgraph.passes.dead_nodes -> vgraph.backends.onnx"),
    ("backends/onnx/cli.py", "from vgraph.backends.torch.kernels import swiglu",
     "vgraph.backends.onnx.cli -> vgraph.backends.torch.kernels"),
], ids=["core-imports-a-pass", "core-imports-a-backend", "pass-imports-a-backend", "onnx-imports-torch-internals"])
def test_a_violating_import_breaks_a_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy_of_sources(tmp_path)
    path = root / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # a layering violation\n", encoding="utf-8")
    result = check(root, CONFIG)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and broken in result.stdout, result.stdout
