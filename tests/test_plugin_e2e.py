"""The plugin author's path end to end (issue 10 acceptance), through the installed `vgraph` script.

tests/plugin_dist (vgraph-geglu, written from docs/plugins.md) pip-installed into a private
directory and found through its entry points only: `passes` and `ops` list it; `validate`,
`optimize`, `train --steps 3`, `generate`, `check-onnx` and `launch` on a two-PNode fleet work on
a tiny network that uses `geglu`; a run trained with the non-preserving swap stores the network it
trained, and `check-onnx --checkpoint` refuses the original YAML, naming the node, and accepts the
stored one.  A --plugin file travels to launch's workers in the job file.
"""
from __future__ import annotations

import json

import pytest

from conftest import TINY_FP32
from plugin_site import geglu_site, vgraph  # noqa: F401  (geglu_site is a fixture)
from vgraph.backends.torch.training.batches import default_corpus_documents

pytestmark = pytest.mark.slow

TRAIN = ["--steps", "3", "--batch", "2", "--val-every", "0", "--threads", "1", "--quiet"]

DOUBLE = '''
from vgraph.ops import OpDef, register_op
from vgraph.plugins import lowering

register_op(OpDef("double", "activation", "2 x"))

@lowering("torch", "double")
def _torch():
    from vgraph.backends.torch import register_lowering
    register_lowering("double")(lambda ctx: [ctx.call(lambda x: 2 * x, ctx.inputs[0])])
'''


def ok(done):
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "Traceback" not in done.stderr
    return done


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    (d / "fleet2.yml").write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    return d


def test_an_installed_plugin_works_in_every_command(geglu_site, work):
    site, d = geglu_site, work
    assert "swap-swiglu-for-geglu  [vgraph-geglu 1.0.0]" in ok(vgraph(["passes"], site, cwd=d)).stdout
    ops = json.loads(ok(vgraph(["ops", "--json"], site, cwd=d)).stdout)
    assert {"name": "geglu", "origin": "vgraph-geglu 1.0.0"}.items() <= next(
        op for op in ops["ops"] if op["name"] == "geglu").items()

    net = d / "geglu.yml"
    ok(vgraph(["optimize", TINY_FP32, "--passes", "swap-swiglu-for-geglu", "-o", net], site, cwd=d))
    assert "type: geglu" in net.read_text()
    assert "ok (21 VNodes" in ok(vgraph(["validate", net], site, cwd=d)).stdout

    run = d / "run"
    ok(vgraph(["train", net, "--data", d / "corpus.txt", "--out", run, *TRAIN], site, cwd=d))
    assert ok(vgraph(["generate", run, "--prompt", "def ", "--max-new-tokens", "4"], site, cwd=d)).stdout.strip()
    assert "PASS" in ok(vgraph(["check-onnx", net, "--checkpoint", run], site, cwd=d)).stdout

    # launch on two PNodes: the head (with the geglu) on one worker, the block on the other; a --plugin
    # file's op (with its lazy torch lowering) reaches the workers through the job file
    plugin = d / "double.py"
    plugin.write_text(DOUBLE)
    split = d / "geglu_split.yml"
    split.write_text(net.read_text().replace('colocate_group: "token_embedding"', 'colocate_group: "lm_head"')
                     .replace("type: gelu", "type: double"))
    done = ok(vgraph(["launch", split, "--fleet", d / "fleet2.yml", "--data", d / "corpus.txt", "--out", d / "lrun",
                      "--plugin", plugin, *TRAIN], site, cwd=d, timeout=600))
    assert "step 3" in done.stdout
    job = json.loads((d / "lrun" / "launch" / "job-0.json").read_text())
    assert job["plugins"] == [str(plugin.resolve())] and len(job["ranks"]) == 2


def test_training_after_the_non_preserving_swap_keeps_its_checkpoints_honest(geglu_site, work):
    site, d = geglu_site, work
    run = d / "swapped"
    ok(vgraph(["train", TINY_FP32, "--passes", "swap-swiglu-for-geglu", "--data", d / "corpus.txt", "--out", run,
               *TRAIN], site, cwd=d))
    assert "type: geglu" in (run / "network.yml").read_text()
    refused = vgraph(["check-onnx", TINY_FP32, "--checkpoint", run], site, cwd=d)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert ("node 'head_swiglu_geglu' (geglu) is in the checkpoint's network but not in this one" in refused.stderr)
    assert "swap-swiglu-for-geglu" in refused.stderr and str(TINY_FP32) in refused.stderr
    assert "PASS" in ok(vgraph(["check-onnx", run / "network.yml", "--checkpoint", run], site, cwd=d)).stdout
    refused = vgraph(["export-onnx", TINY_FP32, "--checkpoint", run, "-o", d / "x.onnx"], site, cwd=d)
    assert refused.returncode == 2 and "head_swiglu_geglu" in refused.stderr and not (d / "x.onnx").exists()


def test_a_run_names_the_plugin_files_a_later_command_needs(work):
    d = work
    plugin = d / "double_only.py"
    plugin.write_text(DOUBLE)
    net = d / "double.yml"
    net.write_text(TINY_FP32.read_text().replace("type: gelu", "type: double"))
    run = d / "doubled"
    ok(vgraph(["train", net, "--plugin", plugin, "--data", d / "corpus.txt", "--out", run, *TRAIN], cwd=d))
    assert json.loads((run / "run.json").read_text())["plugins"] == [str(plugin.resolve())]
    refused = vgraph(["generate", run, "--max-new-tokens", "2"], cwd=d)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "unknown node type 'double'" in refused.stderr
    assert f"the run was trained with --plugin {plugin.resolve()}" in refused.stderr
    ok(vgraph(["generate", run, "--plugin", plugin, "--max-new-tokens", "2"], cwd=d))
