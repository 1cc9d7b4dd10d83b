"""Plugins: a third-party distribution installed with pip, a local --plugin file, broken plugins."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY_FP32
from vgraph.plugins import discover

PLUGIN_DIST = Path(__file__).parent / "plugin_dist"
VGRAPH = [sys.executable, "-m", "vgraph"]


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """pip-install the tiny plugin distribution into a private target directory."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(PLUGIN_DIST)],
                   check=True, cwd=build, env={**os.environ, "PIP_NO_CACHE_DIR": "1"})
    return target


def run_cli(args, site=None, cwd=None):
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run(VGRAPH + args, capture_output=True, text=True, env=env, cwd=cwd or ROOT)


def test_builtin_passes_register_through_entry_points():
    names = [p.name for p in discover("vgraph.passes")]
    assert {"dead-nodes", "precision", "fuse-heads", "fuse-lm-head-ce"} <= set(names)
    assert names == sorted(names)


def test_installed_plugin_shows_up_and_runs(installed_plugin, tmp_path):
    listing = run_cli(["passes"], site=installed_plugin)
    assert listing.returncode == 0, listing.stderr
    assert "relu-to-gelu  [vgraph-relu-counter 1.2.0]" in listing.stdout
    assert "Replace every relu activation with gelu." in listing.stdout
    net = tmp_path / "relu.yml"
    net.write_text(TINY_FP32.read_text().replace("type: gelu", "type: relu"))
    out = tmp_path / "out.yml"
    done = run_cli(["optimize", str(net), "--passes", "relu-to-gelu", "-o", str(out)], site=installed_plugin)
    assert done.returncode == 0, done.stderr
    assert "replaced=1" in done.stdout
    assert "type: relu" not in out.read_text() and "type: gelu" in out.read_text()


def test_installed_op_plugin_registers_its_type(installed_plugin, tmp_path):
    net = tmp_path / "square.yml"
    net.write_text(TINY_FP32.read_text().replace("type: gelu", "type: square"))
    done = run_cli(["validate", str(net)], site=installed_plugin)
    assert done.returncode == 0, done.stderr
    assert run_cli(["validate", str(net)]).returncode == 2  # without the plugin: unknown type


def test_local_plugin_file(tmp_path):
    plugin = tmp_path / "my_pass.py"
    plugin.write_text(
        "from collections import Counter\n"
        "from vgraph.pass_api import Pass, register_pass\n\n"
        "@register_pass\n"
        "class CountNodes(Pass):\n"
        "    '''Count VNodes by type (changes nothing).'''\n"
        "    name = 'count-nodes'\n"
        "    def run(self, graph, ctx):\n"
        "        ctx.notes.append(f'{len(graph)} nodes')\n"
        "        return Counter()\n")
    listing = run_cli(["passes", "--plugin", str(plugin)])
    assert "count-nodes" in listing.stdout and str(plugin) in listing.stdout
    done = run_cli(["optimize", str(TINY_FP32), "--plugin", str(plugin), "--passes", "count-nodes",
                    "-o", str(tmp_path / "o.yml")])
    assert done.returncode == 0 and "note: 23 nodes" in done.stdout


def test_broken_plugins_name_their_origin(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    done = run_cli(["passes", "--plugin", str(broken)])
    assert done.returncode == 2
    assert str(broken) in done.stderr and "ModuleNotFoundError" in done.stderr
    assert "Traceback" not in done.stderr
    dist = tmp_path / "site" / "bad_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vgraph.passes]\nbad-pass = bad_plugin_missing:Pass\n")
    done = run_cli(["passes"], site=tmp_path / "site")
    assert done.returncode == 2
    assert "bad-pass" in done.stderr and "bad-plugin 0.1" in done.stderr
    assert "Traceback" not in done.stderr
