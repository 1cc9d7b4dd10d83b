"""Issue 23 through an installed plugin (tests/plugin_dist), as a user runs it:

* check-onnx bites: a plugin whose ONNX lowering computes tanh-approximated GELU where its torch lowering
  computes the exact one fails `check-onnx` on a network that uses it and `check-onnx --ops`; the
  correct plugin passes both;
* checkpoints across a plugin's semantics-preserving fusion (`fuse-gelu-ffn`): a run trained with or
  without it fits the network fused or not, in check-onnx and export-onnx;
* runs remember their plugins: run.json names the distribution, and `generate` without it installed says
  which package to install.
"""
from __future__ import annotations

import json

import pytest

from conftest import TINY
from plugin_site import geglu_site, tanh_geglu_site, vgraph  # noqa: F401  (fixtures)
from vgraph.backends.torch.training.batches import default_corpus_documents

pytestmark = pytest.mark.slow

TRAIN = ["--steps", "3", "--batch", "2", "--val-every", "0", "--threads", "1", "--quiet", "--no-tensorboard"]
FUSE_ALL = "dead-nodes,precision,fuse-heads,fuse-lm-head-ce,fuse-gelu-ffn"


def ok(done):
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "Traceback" not in done.stderr
    return done


def failed_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.endswith(" FAIL")]


@pytest.fixture(scope="module")
def work(tmp_path_factory, geglu_site):
    d = tmp_path_factory.mktemp("parity")
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    ok(vgraph(["optimize", TINY, "--passes", "swap-swiglu-for-geglu", "-o", d / "geglu.yml"], geglu_site, cwd=d))
    ok(vgraph(["optimize", TINY, "--passes", "fuse-gelu-ffn", "-o", d / "fused.yml"], geglu_site, cwd=d))
    return d


def test_a_tanh_gelu_lowering_fails_check_onnx_and_the_correct_one_passes(work, geglu_site, tanh_geglu_site):
    d = work
    wrong = vgraph(["check-onnx", d / "geglu.yml"], tanh_geglu_site, cwd=d)
    assert wrong.returncode == 1 and wrong.stdout.rstrip().endswith("FAIL") and "Traceback" not in wrong.stderr
    assert any(r.startswith("training graph, x1 ") for r in failed_rows(wrong.stdout))
    assert "PASS" == ok(vgraph(["check-onnx", d / "geglu.yml"], geglu_site, cwd=d)).stdout.rstrip().splitlines()[-1]

    wrong = vgraph(["check-onnx", "--ops", "geglu"], tanh_geglu_site, cwd=d)
    assert wrong.returncode == 1
    failed = failed_rows(wrong.stdout)
    assert failed and all(r.startswith("geglu none x") for r in failed)  # the tanh example agrees, as it should
    assert {r.split()[2] for r in failed} >= {"x1"}
    right = ok(vgraph(["check-onnx", "--ops", "geglu", "gelu_ffn"], geglu_site, cwd=d)).stdout
    assert right.rstrip().endswith("PASS") and "gelu_ffn #1 x100" in right and "geglu tanh x0.3" in right


@pytest.fixture(scope="module")
def runs(work, geglu_site):
    """Two short runs of the tiny network: one trained with the plugin's preserving fusion, one without."""
    d = work
    fused_run, plain_run = d / "fused_run", d / "plain_run"
    ok(vgraph(["train", TINY, "--passes", FUSE_ALL, "--data", d / "corpus.txt", "--out", fused_run, *TRAIN],
              geglu_site, cwd=d))
    ok(vgraph(["train", TINY, "--data", d / "corpus.txt", "--out", plain_run, *TRAIN], geglu_site, cwd=d))
    return fused_run, plain_run


def test_checkpoints_fit_across_a_plugins_preserving_fusion(work, runs, geglu_site):
    d = work
    fused_run, plain_run = runs
    assert json.loads((fused_run / "run.json").read_text())["plugin_distributions"] == [
        {"name": "vgraph-geglu", "version": "1.0.0"}]
    assert json.loads((plain_run / "run.json").read_text())["plugin_distributions"] == []
    # trained fused or not, x given fused (by file or --passes) or not, through both commands
    for run, network in ((fused_run, [TINY]), (fused_run, [d / "fused.yml"]),
                         (plain_run, ["--passes", "fuse-gelu-ffn", TINY])):
        done = ok(vgraph(["check-onnx", *network, "--checkpoint", run], geglu_site, cwd=d))
        assert done.stdout.rstrip().endswith("PASS")
    for run, network in ((plain_run, [d / "fused.yml"]), (fused_run, ["--passes", "fuse-gelu-ffn", TINY])):
        out = d / f"{run.name}.onnx"
        done = ok(vgraph(["export-onnx", *network, "--checkpoint", run, "-o", out], geglu_site, cwd=d))
        assert "from 35 VNodes" in done.stdout and out.stat().st_size > 100_000  # gelu_ffn nodes: fused


def test_a_command_lacking_the_runs_plugin_names_the_distribution(work, runs, geglu_site):
    d, (run, _) = work, runs
    refused = vgraph(["generate", run, "--max-new-tokens", "2"], None, cwd=d)  # the plugin not installed
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "unknown pass 'fuse-gelu-ffn'" in refused.stderr
    assert ("the run used plugin distribution vgraph-geglu 1.0.0 (an op type or pass of it), which is not "
            "installed here: pip install 'vgraph-geglu==1.0.0'") in refused.stderr
    ok(vgraph(["generate", run, "--max-new-tokens", "2"], geglu_site, cwd=d))
