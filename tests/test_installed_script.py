"""Every backend command through the installed `vgraph` script, as a user runs it.

The other tests call `vgraph.cli.main.main` or the backends' functions in-process; a broken console-script
entry, a `vgraph.commands` entry point that no longer resolves, or an import that only fails in a fresh
interpreter would pass them all.  Here each command (train, generate, launch, export-onnx, check-onnx,
and optimize's --target, --dump-dir and --explain) runs in a subprocess of `.venv/bin/vgraph` on the
tiny networks, and its results are checked as numbers: the losses are finite and falling, `launch`
trains exactly like `train`, the exported model passes the ONNX checker, check-onnx's differences are
within its tolerance.  The training of the `trained` fixture executes the script (its shebang's interpreter, a
fresh process); the other commands run the same script file in a fork of the zygote (tests/zygote.py), which
imported torch but nothing of vgraph, so vgraph's imports and entry points are still loaded as in a fresh
interpreter, without torch's import (~5 CPU-s) for each command.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, TINY, TINY_FP32
from vgraph import load
from zygote import run_python

SCRIPT = Path(sys.executable).with_name("vgraph")  # installed by `pip install -e .` next to the interpreter
STEPS = 4
TRAIN = ["--steps", str(STEPS), "--batch", "2", "--lr", "3e-3", "--seed", "2", "--val-every", "0",
         "--checkpoint-every", "0", "--threads", "1", "--quiet"]


def vgraph(*args: str, cwd: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the installed package, not the checkout on the path
    if fresh:
        return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    return run_python([SCRIPT, *args], timeout=300, env=env, cwd=cwd)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from vgraph.backends.torch.training.batches import default_corpus_documents

    path = tmp_path_factory.mktemp("script") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("script") / "run"
    r = vgraph("train", str(TINY_FP32), "--data", str(corpus), "--out", str(out), *TRAIN, fresh=True)
    assert r.returncode == 0, r.stderr
    return out


def test_the_script_is_installed() -> None:
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK), SCRIPT


def test_train(trained) -> None:
    values = losses(trained)
    assert len(values) == STEPS and all(math.isfinite(v) for v in values)
    assert abs(values[0] - math.log(64)) < 0.5  # vocabulary 64: about ln 64 at initialisation
    assert (trained / "latest").is_file()


def test_generate(trained) -> None:
    r = vgraph("generate", str(trained), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0",
               "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout.strip()) > len("def")


def test_launch_trains_like_train(corpus, trained, tmp_path) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    out = tmp_path / "launched"
    r = vgraph("launch", str(TINY_FP32), "--fleet", str(fleet), "--data", str(corpus), "--out", str(out), *TRAIN)
    assert r.returncode == 0, r.stderr
    launched, single = losses(out), losses(trained)
    assert len(launched) == STEPS
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(launched, single)), (launched, single)


def test_export_onnx_and_check_onnx(trained, tmp_path) -> None:
    import onnx

    model = tmp_path / "tiny.onnx"
    r = vgraph("export-onnx", str(TINY_FP32), "--checkpoint", str(trained), "-o", str(model))
    assert r.returncode == 0, r.stderr
    onnx.checker.check_model(onnx.load(str(model)))
    r = vgraph("check-onnx", str(TINY_FP32), "--checkpoint", str(trained), "--batch", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "logits" in r.stdout


def test_a_backend_command_reports_bad_input_without_a_traceback(tmp_path) -> None:
    r = vgraph("export-onnx", str(tmp_path / "missing.yml"), "-o", str(tmp_path / "x.onnx"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "missing.yml" in r.stderr
    assert not (tmp_path / "x.onnx").exists()


# -- optimize's flags, through the script ------------------------------------------------------------

def test_optimize_target_sets_the_precision_policy(tmp_path) -> None:
    out = tmp_path / "sm75.yml"
    r = vgraph("optimize", str(TINY), "-o", str(out), "--passes", "precision,fuse-heads", "--target", "cuda-sm75")
    assert r.returncode == 0, r.stderr
    optimized = load(out)
    assert len(optimized.nodes_of_type("attention")) == 2 and not optimized.nodes_of_type("attention_head")
    r = vgraph("optimize", str(TINY), "-o", str(tmp_path / "bad.yml"), "--target", "tpu-v9")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "tpu-v9" in r.stderr
    assert not (tmp_path / "bad.yml").exists()


def test_optimize_dump_dir_writes_the_graph_after_each_pass(tmp_path) -> None:
    dump = tmp_path / "dump"
    r = vgraph("optimize", str(TINY), "-o", str(tmp_path / "out.yml"), "--passes", "fuse-heads,fuse-lm-head-ce",
               "--dump-dir", str(dump))
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in dump.glob("*.yml"))  # (and a drawing of each where Graphviz is installed)
    assert names == ["00_input.yml", "01_fuse-heads.yml", "02_fuse-lm-head-ce.yml"], names
    before, after_heads, after_all = (load(dump / name) for name in names)
    assert before.nodes_of_type("attention_head") and not before.nodes_of_type("attention")
    assert after_heads.nodes_of_type("attention") and not after_heads.nodes_of_type("tied_lm_head_ce")
    assert after_all.nodes_of_type("tied_lm_head_ce")
    assert (dump / names[-1]).read_text() == (tmp_path / "out.yml").read_text()


def test_optimize_explain_says_why_a_candidate_was_left(tmp_path) -> None:
    net = tmp_path / "odd.yml"
    text = TINY.read_text()
    assert text.count('rope_theta: "10000.0"') >= 2
    net.write_text(text.replace('rope_theta: "10000.0"', 'rope_theta: "500.0"', 1))
    r = vgraph("optimize", str(net), "-o", str(tmp_path / "out.yml"), "--passes", "fuse-heads", "--explain")
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "fuse-heads: 'block0_stack' not rewritten: head 'block0_head1' differs from 'block0_head0' in " \
           "rope_theta" in said, said
