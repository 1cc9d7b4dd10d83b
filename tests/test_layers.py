"""The layer contracts of `.importlinter` hold, a violating import breaks them, and no import cycle exists.

The core is in layers (base < types < ops < plugins < ir < yamlio < cost | transform < placement < run < report
< cli), finds passes and backends through entry points and never imports them, and imports no torch or onnx;
passes are IR to IR and import no backend; the ONNX backend reaches the torch backend at one declared edge
(check.py, through its package API) and the torch backend imports nothing of the ONNX one (an entry point);
the torch backend stands in phases (probe > distributed > training > lowering; launcher > runtime).
import-linter (run by tools/check_layers.py on the installed package layout) checks that on every suite run;
grimp's import graph shows the cycles no contract names.
"""
from __future__ import annotations

import json
import re
import shutil
import tomllib
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from conftest import ROOT
from tools.check_layers import CONFIG, check, installed_layout


def test_the_layer_contracts_are_kept() -> None:
    result = check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 12 kept, 0 broken." in result.stdout


def test_the_installed_layout_holds_the_mapped_packages(tmp_path: Path) -> None:
    layout = installed_layout(ROOT, tmp_path)
    for module in ("vgraph/ir/graph.py", "vgraph/passes/fuse_heads.py", "vgraph/backends/torch/lowering/kernels.py",
                   "vgraph/backends/onnx/check.py"):
        assert (layout / module).is_file(), module


def _copy_of_sources(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    shutil.copy(ROOT / "pyproject.toml", root)
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    for name in set(mapping.values()):  # every folder pyproject maps into the package (networks/ too)
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("module, line, broken", [
    ("vgraph/cost/analyze.py", "from vgraph.passes import dead_nodes",
     "vgraph.cost.analyze -> vgraph.passes.dead_nodes"),
    ("vgraph/ir/graph.py", "import vgraph.backends.torch", "vgraph.ir.graph -> vgraph.backends.torch"),
    ("passes/dead_nodes.py", "from vgraph.backends.onnx import lower",
     "vgraph.passes.dead_nodes -> vgraph.backends.onnx"),
    ("backends/onnx/cli.py", "from vgraph.backends.torch.lowering.kernels import swiglu",
     "vgraph.backends.onnx.cli -> vgraph.backends.torch.lowering.kernels"),
    ("vgraph/ir/verify.py", "from vgraph.report import render", "vgraph.ir.verify -> vgraph.report.render"),
    ("vgraph/transform/pipeline.py", "from vgraph.cost import costmodel",
     "vgraph.transform.pipeline -> vgraph.cost.costmodel"),
    ("vgraph/cost/costmodel.py", "import torch", "vgraph.cost.costmodel -> torch"),
    ("passes/precision.py", "import onnx", "vgraph.passes.precision -> onnx"),
    ("backends/torch/training/train.py", "from benchmarks import handwritten_model",
     "vgraph.backends.torch.training.train -> benchmarks"),
], ids=["core-imports-a-pass", "core-imports-a-backend", "pass-imports-a-backend", "onnx-imports-torch-internals",
        "ir-imports-the-report-layer", "transform-imports-its-independent-sibling", "core-imports-torch",
        "pass-imports-onnx", "backend-imports-a-benchmark"])
def test_a_violating_import_breaks_a_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy_of_sources(tmp_path)
    path = root / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # a layering violation\n", encoding="utf-8")
    result = check(root, CONFIG)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and broken in result.stdout, result.stdout


def test_the_backend_contracts_catch_each_violation(tmp_path: Path) -> None:
    """The backends' own contracts, one violation each, in one run (each contract reports its own)."""
    root = _copy_of_sources(tmp_path)
    violations = {
        "backends/torch/cli.py": ("import vgraph.backends.onnx", "vgraph.backends.torch.cli -> vgraph.backends.onnx"),
        "backends/onnx/lower.py": ("import vgraph.backends.torch",
                                   "vgraph.backends.onnx.lower -> vgraph.backends.torch"),
        "backends/torch/lowering/kernels.py": ("from vgraph.backends.torch.training import config",
                                               "vgraph.backends.torch.lowering.kernels -> "
                                               "vgraph.backends.torch.training.config"),
        "backends/torch/distributed/runtime/comm.py": (
            "from vgraph.backends.torch.distributed.launcher import supervisor",
            "vgraph.backends.torch.distributed.runtime.comm -> vgraph.backends.torch.distributed.launcher.supervisor"),
    }
    for module, (line, _) in violations.items():
        path = root / module
        path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # a layering violation\n", encoding="utf-8")
    result = check(root, CONFIG)
    assert result.returncode == 1, result.stdout + result.stderr
    report = " ".join(result.stdout.split())  # import-linter wraps long lines
    assert "Contracts: 8 kept, 4 broken." in report, result.stdout
    for _, broken in violations.values():
        assert broken in report, (broken, result.stdout)


def _import_graph(root: Path, tmp_path: Path) -> dict[str, set[str]]:
    """Module -> the vgraph modules it imports (anywhere in the file), from grimp on the installed layout."""
    layout = installed_layout(root, tmp_path / "layout")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import grimp; g = grimp.build_graph('vgraph'); "
            "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))")
    out = subprocess.run([sys.executable, "-c", code, str(layout)], capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    return {m: set(deps) for m, deps in json.loads(out.stdout).items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    g = nx.DiGraph((m, d) for m, deps in graph.items() for d in deps)
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_import_cycle_anywhere(tmp_path: Path) -> None:
    assert _cycles(_import_graph(ROOT, tmp_path)) == []


def test_an_import_cycle_is_found(tmp_path: Path) -> None:
    root = _copy_of_sources(tmp_path)
    path = root / "vgraph/cost/fleet_links.py"
    path.write_text(path.read_text(encoding="utf-8") + "\nfrom vgraph.cost import fleet  # a cycle\n",
                    encoding="utf-8")
    cycles = _cycles(_import_graph(root, tmp_path))
    assert any({"vgraph.cost.fleet", "vgraph.cost.fleet_links"} <= set(c) for c in cycles), cycles


def test_nothing_outside_the_ir_touches_a_graphs_private_fields() -> None:
    """`Graph` keeps the use-def links; code elsewhere changes and reads a graph only through its methods."""
    private = re.compile(r"\.(_vnodes|_in|_out|_nx|_add|_link|_topo_ids|_topo_iter)\b")
    offenders = []
    for folder in ("vgraph", "passes", "backends", "tools", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent == ROOT / "vgraph" / "ir":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if private.search(line) and "graph" in line.lower():
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
