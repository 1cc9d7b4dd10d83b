"""pyproject.toml declares what the code imports (tools/check_imports.py), the ONNX runtime a platform has wheels
for, and the extras the test command installs."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import ROOT
from tools.check_imports import check

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_import_is_declared_where_its_code_needs_it() -> None:
    rows, problems = check(ROOT)
    assert problems == []
    installed = {r.split()[1] for r in rows if r.startswith("installed")}
    assert {"numpy", "PIL", "torch", "yaml"} <= installed  # the check reads the package (a check of nothing passes)


def test_test_and_benchmark_tools_are_extras_not_dependencies() -> None:
    runtime = {Requirement(r).name for r in PROJECT["dependencies"]}
    extras = {name: {Requirement(r).name for r in reqs} for name, reqs in PROJECT["optional-dependencies"].items()}
    assert not runtime & {"pulp", "pymetis", "pytest", "hypothesis", "pyarrow"}
    assert {"pulp", "pytest", "hypothesis"} <= extras["dev"] and {"pulp", "pymetis"} <= extras["bench"]
    assert '-e "$ROOT[$EXTRAS]"' in (ROOT / "tools" / "setup_env.sh").read_text()


@pytest.mark.parametrize("platform,machine,gpu", [
    ("linux", "x86_64", True), ("win32", "AMD64", True), ("linux", "aarch64", False), ("darwin", "arm64", False),
    ("darwin", "x86_64", False), ("win32", "ARM64", False), ("freebsd14", "amd64", False)])
def test_the_cpu_onnx_runtime_everywhere_and_the_cuda_build_as_the_gpu_extra(platform: str, machine: str,
                                                                              gpu: bool) -> None:
    """The base install takes onnxruntime (the CPU build) on every platform; `[gpu]` adds onnxruntime-gpu
    only where PyPI has its wheels (x86-64 Linux and Windows), so the extra installs everywhere."""
    env = {"sys_platform": platform, "platform_machine": machine, "extra": ""}

    def chosen(reqs: list[str], extra: str = "") -> list[str]:
        return [r.name for r in map(Requirement, reqs) if r.name.startswith("onnxruntime")
                and (r.marker is None or r.marker.evaluate({**env, "extra": extra}))]

    assert chosen(PROJECT["dependencies"]) == ["onnxruntime"]
    assert chosen(PROJECT["optional-dependencies"]["gpu"], "gpu") == (["onnxruntime-gpu"] if gpu else [])


def test_the_test_environment_holds_one_onnx_runtime_build() -> None:
    """Both builds install the module `onnxruntime` (whichever came last owns its files): setup_env.sh, which
    builds this environment, removes the one it did not choose."""
    from importlib.metadata import PackageNotFoundError, distribution

    present = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            distribution(name)
            present.append(name)
        except PackageNotFoundError:
            pass
    assert len(present) == 1, present


@pytest.mark.parametrize("value", ["tpu", "GPU", "cpu gpu"])
def test_setup_env_refuses_an_unknown_onnx_runtime_choice(value: str) -> None:
    import subprocess

    run = subprocess.run(["bash", str(ROOT / "tools" / "setup_env.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "VGRAPH_ONNXRUNTIME": value}, timeout=60)
    assert run.returncode == 2 and "VGRAPH_ONNXRUNTIME must be cpu or gpu" in run.stderr


def _tree(root: Path, files: dict[str, str], deps: list[str], extras: dict[str, list[str]]) -> Path:
    lines = [f"dependencies = {deps!r}", "[project.optional-dependencies]",
             *(f"{k} = {v!r}" for k, v in extras.items())]
    (root / "pyproject.toml").write_text(
        "[project]\nname = 'x'\n" + "\n".join(lines) + '\n[tool.setuptools.package-dir]\n"vgraph" = "vgraph"\n'
        '"vgraph.passes" = "passes"\n')
    for folder in ("vgraph", "passes", "backends", "networks", "tests", "tools", "benchmarks"):
        (root / folder).mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_an_undeclared_import_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "vgraph/top.py": "import numpy\nfrom vgraph.passes.oracle import solve\nfrom . import eager\n",
        "vgraph/lazy.py": "def f():\n    import pyarrow\n",  # an extra, imported when needed: fine
        "vgraph/eager.py": "import pyarrow\n",  # an extra at import time: not fine
        "passes/oracle.py": "import pulp\n",  # an extra's oracle... which vgraph/top.py imports
        "passes/ilp.py": "import pulp\n",  # an oracle only tests import: fine
        "tests/test_x.py": "import pymetis\nimport pytest\n",  # bench only; dev
        "benchmarks/bench_x.py": "import pymetis\n"},  # bench: fine
        deps=[], extras={"data": ["pyarrow"], "dev": ["pytest", "pulp"], "bench": ["pulp", "pymetis"]})
    _, problems = check(root)
    assert [p.split(":")[0] for p in problems] == ["passes/oracle.py", "tests/test_x.py", "vgraph/eager.py",
                                                   "vgraph/top.py"]
    assert "imports numpy (numpy), which pyproject.toml declares in nothing" in problems[-1]
    assert "tests/ may use dependencies or the dev extra" in problems[1]
