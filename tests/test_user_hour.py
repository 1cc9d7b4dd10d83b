"""The new user's hour (issue 38): exports that say where their weights come from and take a run directory,
torchrun restarts and a SIGTERM save, the resume hint, help and output, fleets, `vgraph new`, AdamW and
gradient accumulation."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import TINY
from vgraph.cli.main import main

TINY_FP32 = Path(__file__).resolve().parent / "fixtures" / "tiny_1l_fp32.yml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny trained run: a checkpoint that carries its network and tokenizer."""
    from vgraph.data.stdlib_corpus import default_corpus_documents

    d = tmp_path_factory.mktemp("hour")
    corpus = d / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["train", str(TINY_FP32), "--data", str(corpus), "--steps", "3", "--batch", "2", "--val-every", "0",
                 "--out", str(d / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0
    return d / "run"


# -- item 3: exports -------------------------------------------------------------------------------------------


def test_export_without_weights_is_refused_unless_random_weights_is_asked_for(tmp_path, capsys) -> None:
    out = tmp_path / "m.onnx"
    assert main(["export-onnx", str(TINY), "--kv-cache", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "--random-weights" in err and "run directory" in err
    assert "Traceback" not in err and not out.exists()
    assert main(["export-onnx", str(TINY), "--kv-cache", "--random-weights", "-o", str(out)]) == 0
    assert "random: seeded initialisation, seed 0, not trained" in capsys.readouterr().out and out.exists()
    assert main(["export-onnx", str(TINY), "--random-weights", "--no-weights", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "--random-weights excludes --no-weights" in capsys.readouterr().err


def test_export_and_check_take_a_run_directory(run_dir, tmp_path, capsys) -> None:
    """`export-onnx RUN` is `export-onnx NETWORK --checkpoint RUN`: the run's network and latest weights."""
    from vgraph.backends.onnx.check import onnx_outputs, random_feeds, read_checkpoint

    by_run, by_checkpoint = tmp_path / "run.onnx", tmp_path / "ckpt.onnx"
    assert main(["export-onnx", str(run_dir), "-o", str(by_run)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "random" not in printed
    assert main(["export-onnx", str(TINY_FP32), "--checkpoint", str(run_dir), "-o", str(by_checkpoint)]) == 0
    capsys.readouterr()
    a, b = onnx.load(str(by_run)), onnx.load(str(by_checkpoint))
    trained = read_checkpoint(run_dir).state
    key = next(k for k in trained if k.endswith("embedding") or k.endswith(".weight"))
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in a.graph.initializer}
    np.testing.assert_array_equal(stored[key], trained[key].float().numpy())  # the trained weights, not random
    feeds = random_feeds(read_checkpoint(run_dir).network(), 2, seed=3)
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in a.graph.input}}
    got_a, _ = onnx_outputs(a, feeds)
    got_b, _ = onnx_outputs(b, feeds)
    assert got_a.keys() == got_b.keys()
    for name in got_a:
        np.testing.assert_array_equal(got_a[name], got_b[name])  # the same model, bit for bit
    assert main(["check-onnx", str(run_dir)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_run_directory_errors_are_diagnostics(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "m.onnx"
    assert main(["export-onnx", str(run_dir), "--checkpoint", str(run_dir), "-o", str(out)]) == 2
    assert "leave out --checkpoint" in capsys.readouterr().err
    assert main(["export-onnx", str(run_dir), "--random-weights", "-o", str(out)]) == 2
    assert "--random-weights excludes trained weights" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["export-onnx", str(empty), "-o", str(out)], ["check-onnx", str(empty)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "neither a checkpoint" in err and "Traceback" not in err
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "run.json").write_text("{}")
    assert main(["generate", str(fresh)]) == 2
    assert "has no checkpoint yet" in capsys.readouterr().err
    assert not out.exists()


# -- item 8: the resume hint -----------------------------------------------------------------------------------


def test_resume_hint_names_the_network_as_typed_with_every_option_set(tmp_path, monkeypatch) -> None:
    from vgraph.backends.torch.cli import resume_command
    from vgraph.base.shipped import shipped
    from vgraph.cli.main import build_parser

    name = next(iter(shipped("network")))
    argv = ["train", name, "--data", "my corpus", "--batch", "4", "--lr", "0.001", "--grad-clip", "1.0",
            "--no-tensorboard", "--accept-network-change", "--passes", ""]
    monkeypatch.chdir(tmp_path)
    args = build_parser("train").parse_args(argv)
    assert args.network != name  # the premise: the parser resolved the name to the package's file
    line = resume_command(args)(tmp_path / "r")
    assert line == (f"vgraph train {name} --data 'my corpus' --batch 4 --lr 0.001 --out {tmp_path / 'r'} --resume "
                    f"--passes '' --grad-clip 1.0 --no-tensorboard")
    (tmp_path / f"{name}.yml").write_text("a local file of that name would win over the shipped one")
    assert f"vgraph train {args.network} " in resume_command(args)(tmp_path / "r")
    launch = build_parser("launch").parse_args(["launch", name, "--fleet", "t4x4", "--steps", "5"])
    assert resume_command(launch)("runs/x").startswith(f"vgraph launch {args.network} --fleet t4x4 --steps 5 ")


def test_the_printed_resume_command_resumes(tmp_path, capsys) -> None:
    import shlex
    import signal

    from hardening_util import signal_after_rows
    from vgraph.data.stdlib_corpus import default_corpus_documents

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    out = tmp_path / "run"
    with signal_after_rows(out / "metrics.jsonl", 2, signal.SIGINT):
        code = main(["train", str(TINY), "--data", str(corpus), "--out", str(out), "--steps", "100", "--batch", "2",
                     "--val-every", "0", "--checkpoint-every", "0", "--quiet", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 130, err
    command = shlex.split(err.split("Continue with: ")[1].splitlines()[0])
    assert command[:2] == ["vgraph", "train"] and "--data" in command and "--resume" in command
    stopped = len((out / "metrics.jsonl").read_text().splitlines())
    assert main(command[1:]) == 0, capsys.readouterr().err  # copied as printed
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 101)) and stopped < 100  # went on from the checkpoint to the end
