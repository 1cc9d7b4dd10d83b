"""vgraph as a user gets it: the wheel, installed into a fresh virtual environment outside the checkout, runs a
shipped network by name (issue 28's acceptance: `vgraph train distributed_attention_example_6_swiglu_head`).

The wheel is built once from a copy of the working tree (so the build leaves nothing in the checkout) and
installed with --no-deps; the new environment sees the checkout's .venv packages through symbolic links, all
but vgraph's own editable install and metadata, so the vgraph it imports and whose entry points it finds is
the wheel's alone.  Measured on 2026-12-01 (2 cores at load 13, TESTING.md): wheel, venv and install 8 s,
the two-step training of the 27M-parameter network 54 s wall (10 s of CPU).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import NETWORKS, ROOT

NET6 = "distributed_attention_example_6_swiglu_head"
pytestmark = pytest.mark.slow


def _tree_copy(dest: Path) -> Path:
    """The files git would take from the working tree (tracked and new, not ignored), copied to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with the wheel installed; its bin/ folder."""
    work = tmp_path_factory.mktemp("wheel")
    source = _tree_copy(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(work / "dist"), str(source)], check=True, capture_output=True,
                   env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
    [wheel] = (work / "dist").glob("vgraph-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_path("purelib")).iterdir():  # .venv's packages, not its vgraph
        if not entry.name.startswith(("vgraph", "__editable__")):
            (site / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    return venv / "bin"


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def test_the_wheel_holds_the_networks_and_fleets(installed: Path) -> None:
    [wheel] = installed.parent.parent.glob("dist/vgraph-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in [*NETWORKS.glob("*.yml"), *(NETWORKS / "fleets").glob("*.yml")]:
        assert f"vgraph/networks/{path.relative_to(NETWORKS).as_posix()}" in names, path.name


def test_an_installed_vgraph_runs_a_shipped_network_by_name(installed: Path, tmp_path: Path) -> None:
    import vgraph

    where = run(installed, "python", "-c", "import vgraph; print(vgraph.__file__)", cwd=tmp_path)
    assert where.stdout.startswith(str(installed.parent)), where.stdout  # the wheel's vgraph, not the checkout
    assert run(installed, "vgraph", "--version", cwd=tmp_path).stdout == f"vgraph {vgraph.__version__}\n"
    listing = run(installed, "vgraph", "networks", cwd=tmp_path)
    assert listing.returncode == 0 and NET6 in listing.stdout and "t4x4" in listing.stdout
    corpus = tmp_path / "corpus.txt"  # a small corpus: the embedded one is built once per cache (~16 s)
    corpus.write_text((ROOT / "README.md").read_text(encoding="utf-8") * 4, encoding="utf-8")
    done = run(installed, "vgraph", "train", NET6, "--steps", "2", "--batch", "1", "--val-every", "0",
               "--no-tensorboard", "--data", str(corpus), "--out", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and (tmp_path / "run" / "step-00000002" / "model.safetensors").is_file()
    refused = run(installed, "vgraph", "train", "no_such_network", cwd=tmp_path)
    assert refused.returncode == 2 and NET6 in refused.stderr and "Traceback" not in refused.stderr
