"""The example plugin distribution (tests/plugin_dist, docs/plugins.md) pip-installed for a test session.

It goes into a private target directory put on PYTHONPATH of the commands a
test runs, never into the shared virtual environment: vgraph must find it
through the installed metadata (its entry points) alone.  The source is
copied first so the build leaves nothing in the checkout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zygote import run_python

PLUGIN_DIST = Path(__file__).parent / "plugin_dist"
VGRAPH_SCRIPT = Path(sys.executable).with_name("vgraph")  # the installed console script


def install(work: Path, patch: dict[str, tuple[str, str]] | None = None) -> Path:
    """pip-install a copy of tests/plugin_dist (with `patch`: file -> (old text, new text)) into `work`/site."""
    source = work / "vgraph-geglu"
    shutil.copytree(PLUGIN_DIST, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    for name, (old, new) in (patch or {}).items():
        text = (source / name).read_text()
        assert old in text, f"{name} no longer holds {old!r}: update the fixture"
        (source / name).write_text(text.replace(old, new))
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(source)],
                   check=True, cwd=work, env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
    return site


@pytest.fixture(scope="session")
def geglu_site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("plugin_build"))


#: The plugin with a wrong ONNX lowering: tanh-approximated GELU whatever the node asks for, where the
#: torch lowering computes the exact (erf) one.  Right to about 1e-3 of a unit input, so only a check
#: whose inputs reach GELU's curved range sees it (issue 23).
TANH_GELU_PATCH = {"src/vgraph_geglu/onnx_lowering.py": ('approximate=n.cfg["approximate"]', 'approximate="tanh"')}


@pytest.fixture(scope="session")
def tanh_geglu_site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("plugin_build_tanh"), TANH_GELU_PATCH)


def env_with(site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    return env


def vgraph(args, site: Path | None = None, cwd: Path | None = None, timeout: float = 300):
    """Run the installed `vgraph` script (the console entry point, as a user would), in a process forked from the
    zygote (tests/zygote.py): vgraph and the plugin are imported there, and the entry points found, as in a fresh
    interpreter with PYTHONPATH=site; torch was imported once by the zygote."""
    return run_python([VGRAPH_SCRIPT, *args], env=env_with(site), cwd=cwd, timeout=timeout)


def python(code: str, site: Path | None = None):
    """A fresh interpreter (not the zygote's fork): what it imports, torch not among them, is what is checked."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with(site))
