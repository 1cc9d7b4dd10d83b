"""Plugins: one loading point for every command, lazy backend lowerings, `vgraph ops`, and plugins that
misbehave (raise, exit, shadow a built-in, return nonsense) named in an exit-2 diagnostic.

The installed distribution is tests/plugin_dist (vgraph-geglu, see docs/plugins.md); the commands run
as subprocesses of the installed `vgraph` script with the distribution on PYTHONPATH only (the commands'
parsers, checked for --plugin, are built in this process).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import TINY_FP32
from plugin_site import geglu_site, python, vgraph  # noqa: F401  (geglu_site is a fixture)
from vgraph.plugins import BACKENDS, discover, lowering_group

DIST = "vgraph-geglu 1.0.0"


def no_traceback(done) -> None:
    assert "Traceback" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def geglu_net(geglu_site, tmp_path_factory):
    """A tiny network using `geglu`, written by the plugin's own pass."""
    out = tmp_path_factory.mktemp("nets") / "geglu.yml"
    done = vgraph(["optimize", TINY_FP32, "--passes", "swap-swiglu-for-geglu", "-o", out], geglu_site)
    assert done.returncode == 0, done.stderr
    assert "swapped=1" in done.stdout and "type: geglu" in out.read_text()
    return out


# -- discovery --------------------------------------------------------------------------------------

def test_builtin_passes_register_through_entry_points():
    names = [p.name for p in discover("vgraph.passes")]
    assert {"dead-nodes", "precision", "fuse-heads", "fuse-lm-head-ce"} <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_builtin_lowering_entry_points_are_the_backend_tables(backend):
    """`vgraph ops` trusts these names; they must say exactly what the backend lowers."""
    import importlib

    from vgraph.ops import REGISTRY

    table = importlib.import_module(f"vgraph.backends.{backend}").LOWERINGS
    declared = {p.name for p in discover(lowering_group(backend)) if p.builtin}
    assert declared == {op.name for op in REGISTRY if op.origin == "vgraph" and op.name in table}
    assert declared == {op.name for op in REGISTRY if op.origin == "vgraph"}  # every built-in is lowered


def test_installed_plugin_is_listed_by_passes_and_ops(geglu_site):
    passes = vgraph(["passes"], geglu_site)
    assert passes.returncode == 0, passes.stderr
    assert f"swap-swiglu-for-geglu  [{DIST}]" in passes.stdout
    text = vgraph(["ops"], geglu_site)
    assert text.returncode == 0, text.stderr
    assert f"geglu  [layer; {DIST}; lowered by onnx, torch]" in text.stdout
    assert "approximate: str, default none, one of none|tanh" in text.stdout
    doc = json.loads(vgraph(["ops", "--json"], geglu_site).stdout)
    ops = {op["name"]: op for op in doc["ops"]}
    geglu = ops["geglu"]
    assert geglu["origin"] == DIST and geglu["lowered_by"] == ["onnx", "torch"] and geglu["trainable"]
    assert {"name": "approximate", "type": "str", "required": False, "default": "none",
            "choices": ["none", "tanh"], "doc": "GELU form: exact (erf) or tanh"} in geglu["config"]
    assert ops["linear"]["origin"] == "built-in" and ops["linear"]["aliases"] == ["dense"]
    assert all(op["lowered_by"] == ["onnx", "torch"] for op in doc["ops"])
    assert "fused_from" in {f["name"] for f in doc["common_config"]}


def test_validate_and_ops_import_neither_torch_nor_onnx(geglu_site, geglu_net):
    probe = ("import sys\nfrom vgraph.cli.main import main\n"
             "rc = [main(['validate', {net!r}]), main(['ops', '--json']), main(['passes'])]\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'onnxruntime'))\n"
             "print('RESULT', rc, heavy)\n").format(net=str(geglu_net))
    done = python(probe, geglu_site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "RESULT [0, 0, 0] []"


def test_without_the_plugin_the_op_is_unknown(geglu_net):
    done = vgraph(["validate", geglu_net])
    assert done.returncode == 2 and "unknown node type 'geglu'" in done.stderr
    no_traceback(done)


def test_every_network_command_loads_installed_ops(geglu_site, geglu_net, tmp_path):
    assert vgraph(["analyze", geglu_net], geglu_site).returncode == 0
    done = vgraph(["render", geglu_net, "-o", tmp_path / "g.svg"], geglu_site)
    assert done.returncode == 0 or "Graphviz" in done.stderr, done.stderr
    done = vgraph(["export-onnx", geglu_net, "--random-weights", "-o", tmp_path / "g.onnx"], geglu_site)
    assert done.returncode == 0, done.stderr
    assert "geglu" in (tmp_path / "g.onnx").read_bytes().decode("latin-1")  # the VNode names its ONNX nodes


# -- plugin files ----------------------------------------------------------------------------------

LOCAL = '''
from collections import Counter
from vgraph.ops import OpDef, register_op
from vgraph.plugins import lowering
from vgraph.transform.pass_api import Pass, register_pass

register_op(OpDef("double", "activation", "2 x"))

@lowering("torch", "double")
def _torch():
    from vgraph.backends.torch import register_lowering
    register_lowering("double")(lambda ctx: [ctx.call(lambda x: 2 * x, ctx.inputs[0])])

@register_pass
class CountNodes(Pass):
    """Count VNodes (changes nothing)."""
    name = "count-nodes"
    preserves_semantics = True
    def run(self, graph, ctx):
        ctx.notes.append(f"{len(graph)} nodes")
        return Counter()
'''


def test_local_plugin_file_pass_op_and_lazy_lowering(tmp_path):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(LOCAL)
    listing = vgraph(["passes", "--plugin", plugin])
    assert "count-nodes" in listing.stdout and str(plugin) in listing.stdout
    done = vgraph(["optimize", TINY_FP32, "--plugin", plugin, "--passes", "count-nodes", "-o", tmp_path / "o.yml"])
    assert done.returncode == 0 and "note: 23 nodes" in done.stdout
    ops = json.loads(vgraph(["ops", "--json", "--plugin", plugin]).stdout)
    double = next(op for op in ops["ops"] if op["name"] == "double")
    assert double["origin"] == str(plugin) and double["lowered_by"] == ["torch"]
    net = tmp_path / "double.yml"
    net.write_text(TINY_FP32.read_text().replace("type: gelu", "type: double"))
    done = vgraph(["check-onnx", net, "--plugin", plugin])  # torch runs (lazy lowering); ONNX has none
    assert done.returncode == 2
    assert (f"node 'block0_ffn_gelu': op type 'double' (defined by plugin {plugin}) has no onnx lowering"
            in done.stderr)
    assert "vgraph.lowerings.onnx" in done.stderr
    no_traceback(done)


def test_a_declared_lowering_that_registers_nothing_is_named(tmp_path):
    plugin = tmp_path / "lazy.py"
    plugin.write_text("from vgraph.ops import OpDef, register_op\nfrom vgraph.plugins import lowering\n"
                      "register_op(OpDef('double', 'activation', '2 x'))\n"
                      "@lowering('onnx', 'double')\ndef _onnx():\n    pass\n")
    net = tmp_path / "double.yml"
    net.write_text(TINY_FP32.read_text().replace("type: gelu", "type: double"))
    done = vgraph(["export-onnx", net, "--plugin", plugin, "--no-weights", "-o", tmp_path / "x.onnx"])
    assert done.returncode == 2
    assert f"{plugin} declares one but did not register it" in done.stderr
    assert not (tmp_path / "x.onnx").exists()
    no_traceback(done)


@pytest.mark.parametrize("body, expected", [
    ("import sys\nsys.exit(0)\n", "called sys.exit(0) while loading"),
    ("raise SystemExit('bye')\n", "called sys.exit('bye') while loading"),
    ("raise RuntimeError('broken on purpose')\n", "failed while loading: RuntimeError: broken on purpose"),
    ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
    ("from vgraph.ops import OpDef, register_op\nregister_op(OpDef('linear', 'layer'))\n",
     "op type 'linear' is already registered (by vgraph)"),
])
def test_a_plugin_file_that_misbehaves_while_loading_is_named(tmp_path, body, expected):
    plugin = tmp_path / "bad.py"
    plugin.write_text(body)
    out = tmp_path / "o.yml"
    done = vgraph(["optimize", TINY_FP32, "--plugin", plugin, "-o", out])
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"plugin file {plugin}" in done.stderr and expected in done.stderr
    assert not out.exists()
    no_traceback(done)


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "missing.py", "plugin file not found"),
    (lambda d: d, "must be a Python file, not a directory"),
    (lambda d: (d / "notes.txt", (d / "notes.txt").write_text("x = 1\n"))[0], "ending in .py"),
    (lambda d: d / "sub" / ".." / ".." / "nope.py", "plugin file not found"),
    (lambda d: d / "bad\x1b[2Jname.py", "\\x1b[2J"),
    (lambda d: "", "got an empty one"),
    (lambda d: (d / "fifo.py", os.mkfifo(d / "fifo.py"))[0], "not a special file"),
    (lambda d: "/dev/zero", "not a special file"),
])
def test_bad_plugin_paths(tmp_path, make, expected):
    path = make(tmp_path)
    done = vgraph(["validate", TINY_FP32, "--plugin", path])
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert "\x1b" not in done.stderr
    no_traceback(done)


def test_a_broken_installed_plugin_names_its_distribution(tmp_path):
    dist = tmp_path / "site" / "bad_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vgraph.passes]\nbad-pass = bad_plugin_missing:Pass\n")
    done = vgraph(["passes"], tmp_path / "site")
    assert done.returncode == 2
    assert "bad-pass" in done.stderr and "bad-plugin 0.1" in done.stderr
    no_traceback(done)


def test_two_distributions_claiming_one_pass_name_are_refused(tmp_path):
    site = tmp_path / "site"
    for dist in ("one", "two"):
        info = site / f"claim_{dist}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: claim-{dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[vgraph.passes]\nshared-name = claim_{dist}:Pass\n")
    done = vgraph(["passes"], site)
    assert done.returncode == 2
    assert "pass 'shared-name' is defined twice: by claim-one 1.0 and by claim-two 1.0" in done.stderr
    no_traceback(done)


def test_a_command_plugin_that_raises_while_adding_its_command_is_named(tmp_path):
    site = tmp_path / "site"
    (site / "bad_cmd").mkdir(parents=True)
    (site / "bad_cmd" / "__init__.py").write_text("def register(sub):\n    raise RuntimeError('no parser today')\n")
    info = site / "bad_cmd-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-cmd\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vgraph.commands]\nboom = bad_cmd:register\n")
    done = vgraph(["boom"], site)
    assert done.returncode == 2
    assert "'bad-cmd 0.1' failed while adding its command: RuntimeError: no parser today" in done.stderr
    no_traceback(done)
    assert vgraph(["validate", TINY_FP32], site).returncode == 0  # other commands never import it


def test_an_installed_op_plugin_that_exits_is_named(tmp_path):
    site = tmp_path / "site"
    (site / "exiting_ops").mkdir(parents=True)
    (site / "exiting_ops" / "__init__.py").write_text("import sys\ndef register():\n    sys.exit(3)\n")
    info = site / "exiting_ops-0.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exiting-ops\nVersion: 0.2\n")
    (info / "entry_points.txt").write_text("[vgraph.ops]\nexits = exiting_ops:register\n")
    done = vgraph(["validate", TINY_FP32], site)
    assert done.returncode == 2
    assert "'exiting-ops 0.2'" in done.stderr and "called sys.exit(3) while registering its op types" in done.stderr
    no_traceback(done)


# -- passes that shadow a built-in, raise or return nonsense ---------------------------------------------

SHADOW = '''
from vgraph.transform.pass_api import Pass, register_pass

@register_pass
class MyPrecision(Pass):
    """Not the built-in precision pass."""
    name = "precision"
    preserves_semantics = True
{extra}
    def run(self, graph, ctx):
        ctx.notes.append("the plugin's precision ran")
        return {{}}
'''


def test_a_plugin_pass_named_like_a_builtin_is_refused(tmp_path):
    plugin = tmp_path / "shadow.py"
    plugin.write_text(SHADOW.format(extra=""))
    for args in (["passes"], ["optimize", TINY_FP32, "-o", tmp_path / "o.yml"]):
        done = vgraph([*args, "--plugin", plugin])
        assert done.returncode == 2, done.stdout
        assert "pass 'precision' from" in done.stderr and "has the name of a built-in pass" in done.stderr
        assert "overrides = 'precision'" in done.stderr
        no_traceback(done)
    assert not (tmp_path / "o.yml").exists()


def test_an_explicit_override_is_announced_on_every_run(tmp_path):
    plugin = tmp_path / "shadow.py"
    plugin.write_text(SHADOW.format(extra="    overrides = 'precision'\n"))
    for _ in range(2):
        done = vgraph(["optimize", TINY_FP32, "--plugin", plugin, "-o", tmp_path / "o.yml"])
        assert done.returncode == 0, done.stderr
        assert "the plugin's precision ran" in done.stdout
        assert done.stderr.count(f"warning: pass 'precision' is {plugin}'s, which overrides the built-in") == 1


BAD_PASS = '''
from vgraph.transform.pass_api import Pass, register_pass

@register_pass
class Bad(Pass):
    """Misbehaves."""
    name = "bad"
    def run(self, graph, ctx):
{body}
'''


@pytest.mark.parametrize("body, expected", [
    ("        raise KeyError('block0_ln1')", "failed while running: KeyError: 'block0_ln1'"),
    ("        import sys; sys.exit(0)", "called sys.exit(0) while running"),
    ("        return 'done'", "returned 'done'; a pass returns counts"),
    ("        return {'nodes': 1.5}", "returned {'nodes': 1.5}; a pass returns counts"),
    ("        return [1, 2]", "returned [1, 2]"),
])
def test_a_plugin_pass_that_fails_is_named(tmp_path, body, expected):
    plugin = tmp_path / "bad.py"
    plugin.write_text(BAD_PASS.format(body=body))
    out = tmp_path / "o.yml"
    done = vgraph(["optimize", TINY_FP32, "--plugin", plugin, "--passes", "bad", "-o", out])
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "pass 'bad'" in done.stderr and expected in done.stderr, done.stderr
    assert not out.exists()
    no_traceback(done)


def test_plugin_option_reaches_every_command_that_reads_a_network(capsys):
    """Every command that reads a network (or a run) accepts --plugin; `ops` and `passes` too.  In this process:
    each command's parser is what is checked, the same parser the installed script builds (the script itself is
    run by the tests above), and twelve script starts would import torch for nothing."""
    from vgraph.cli import main

    for command in ("validate", "analyze", "optimize", "passes", "ops", "partition", "render", "train",
                    "generate", "launch", "export-onnx", "check-onnx"):
        with pytest.raises(SystemExit) as done:
            main([command, "-h"])
        shown = capsys.readouterr()
        assert done.value.code == 0, (command, shown.err)
        assert "--plugin FILE.py" in shown.out, command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
