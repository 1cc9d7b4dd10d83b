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
    # A row every step, so the interrupt lands a few steps in on any machine: at the default cadence (a row
    # a second) a fast machine trains all 100 steps before the second row is written, and the premise fails.
    with signal_after_rows(out / "metrics.jsonl", 2, signal.SIGINT):
        code = main(["train", str(TINY), "--data", str(corpus), "--out", str(out), "--steps", "100", "--batch", "2",
                     "--val-every", "0", "--checkpoint-every", "0", "--log-every", "1", "--quiet", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 130, err
    command = shlex.split(err.split("Continue with: ")[1].splitlines()[0])
    assert command[:2] == ["vgraph", "train"] and "--data" in command and "--resume" in command
    stopped = len((out / "metrics.jsonl").read_text().splitlines())
    assert main(command[1:]) == 0, capsys.readouterr().err  # copied as printed
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 101)) and stopped < 100  # went on from the checkpoint to the end


# -- item 9: output and help -----------------------------------------------------------------------------------


def test_top_level_help_summarises_every_command_without_importing_the_backends() -> None:
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom vgraph.cli.main import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n    main(['--help'])\n"
            "print(out.getvalue())\nprint('imported:', 'torch' in sys.modules, 'onnx' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = " ".join(done.stdout.split())
    assert "see 'vgraph" not in shown
    for summary in ("train a network YAML on text with PyTorch", "sample text from a checkpoint",
                    "train a network partitioned over a fleet", "prepare a text corpus as token shards",
                    "write a trained network's inference model as ONNX", "run the torch backend and onnxruntime",
                    "measure this machine for a network"):
        assert summary in shown
    assert "imported: False False" in shown  # read from the modules' source, not by importing them


def test_a_summary_that_cannot_be_read_falls_back(tmp_path, monkeypatch) -> None:
    from vgraph.cli.command_help import summary

    (tmp_path / "computed_help.py").write_text("HELP = 'x'\ndef register(s):\n    s.add_parser('c', help=HELP)\n")
    (tmp_path / "broken_help.py").write_text("def register(s):\n    s.add_parser('c', help='unclosed\n")
    (tmp_path / "fine_help.py").write_text("def register(s):\n    s.add_parser('c', help='one ' 'line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert summary("c", "computed_help:register") is None
    assert summary("c", "broken_help:register") is None
    assert summary("c", "no.such.module:register") is None
    assert summary("other", "fine_help:register") is None
    assert summary("c", "fine_help:register") == "one line"


def test_export_onnx_help_is_a_description_not_a_docstring(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["export-onnx", "-h"])
    shown = capsys.readouterr().out
    assert "Write the inference model of a trained network" in shown and "``" not in shown


@pytest.mark.parametrize("typed, meant", [("--batch-size", "--batch"), ("--learning-rate", "--lr"),
                                          ("--max-step", "--steps"), ("--val-evry", "--val-every")])
def test_a_mistyped_option_gets_did_you_mean_and_the_commands_usage(typed, meant, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", str(TINY), typed, "4"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"{typed}: did you mean {meant}?" in err and "usage: vgraph train" in err


def test_an_unknown_option_with_nothing_close_is_named_alone(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["validate", str(TINY), "--zzzzqqq"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err


def test_validation_loss_shows_as_it_happens_under_a_short_prefix(tmp_path, capsys) -> None:
    from vgraph.data.stdlib_corpus import default_corpus_documents

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["train", str(TINY), "--data", str(corpus), "--out", str(tmp_path / "run"), "--steps", "7",
                 "--batch", "2", "--val-every", "3", "--val-batches", "1", "--threads", "1",
                 "--no-tensorboard"]) == 0
    err = capsys.readouterr().err  # captured, not a terminal: progress lines
    progress = [line for line in err.splitlines() if ": step " in line]
    assert [line.split(" ")[2] for line in progress] == ["1/7", "3/7", "6/7", "7/7"], progress
    assert all(line.startswith("train: step ") for line in progress)
    assert "val=" not in progress[0] and all("val=" in line for line in progress[1:])


# -- item 6: fleets --------------------------------------------------------------------------------------------


def test_docs_name_only_fleets_that_exist() -> None:
    import re

    from vgraph.base.shipped import is_bare_name, shipped

    root = Path(__file__).resolve().parent.parent
    texts = {p: p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    named = [(p.name, m) for p, t in texts.items() for m in re.findall(r"--fleet[ =]([^\s`'\"\])]+)", t)]
    assert ("distributed.md", "cpu2") in named  # the premise: the docs do name shipped fleets
    unknown = [(f, m) for f, m in named if is_bare_name(m) and not m.endswith((".yml", ".yaml"))
               and not m.isupper() and m not in shipped("fleet")]
    assert not unknown, f"docs name fleets that do not ship: {unknown}"
    files = [(p.name, m) for p, t in texts.items() for m in re.findall(r"fleets/([\w.-]+\.ya?ml)", t)]
    assert not [(f, m) for f, m in files if not (root / "networks" / "fleets" / m).is_file()]


def test_cpu2_ships_and_holds_the_production_network_on_one_cpu_machine(tmp_path, capsys) -> None:
    from vgraph.base.shipped import shipped
    from vgraph.cost.fleet import load_fleet

    fleet = load_fleet(shipped("fleet")["cpu2"])
    assert len(fleet) == 2 and all(p.accelerator == "cpu" for p in fleet)
    assert main(["partition", "distributed_attention_example_6_swiglu_head", "--fleet", "cpu2",
                 "-o", str(tmp_path / "parts")]) == 0
    assert "does not fit" not in capsys.readouterr().err


def _rows(step_s: float, n: int = 5) -> list[dict]:
    return [{"step": s, "pnodes": {"a": {"step_s": step_s}, "b": {"step_s": step_s / 2}}} for s in range(1, n + 1)]


@pytest.mark.parametrize("measured, flagged, words", [(3.77, True, "1,109x slower"), (0.0068, False, ""),
                                                      (0.0016, True, "2.1x faster"), (0.0069, True, "2.0x slower")])
def test_a_prediction_off_by_more_than_2x_is_flagged_with_what_to_do(measured, flagged, words) -> None:
    from vgraph.placement.replica_report import step_prediction_gap

    gap = step_prediction_gap({"step_seconds": 0.0034}, _rows(measured))
    assert (gap is not None) == flagged
    if flagged:
        assert words in gap and "vgraph probe" in gap and f"{measured:.3g} s" in gap


@pytest.mark.parametrize("placement, rows", [
    ({"step_seconds": float("nan")}, _rows(3.0)), ({"step_seconds": -1.0}, _rows(3.0)), ({"step_seconds": "1"},
     _rows(3.0)), ({"step_seconds": True}, _rows(3.0)), ({}, _rows(3.0)), ({"step_seconds": 0.001}, _rows(3.0, n=2)),
    ({"step_seconds": 0.001}, [{"pnodes": {"a": {"step_s": float("inf")}}}] * 5),
    ({"step_seconds": 0.001}, [{"pnodes": 1}, {"pnodes": {"a": "x"}}, "row", {"pnodes": {"a": {"step_s": None}}}] * 3),
])
def test_damaged_figures_flag_nothing(placement, rows) -> None:
    from vgraph.placement.replica_report import step_prediction_gap

    assert step_prediction_gap(placement, rows) is None


def test_the_report_flags_a_prediction_off_by_more_than_2x(tmp_path) -> None:
    import json

    from test_report import make_run, placement, rows, run_info
    from vgraph.report.page import write_report

    for predicted, flagged in ((0.0034, True), (0.05, False)):
        run = make_run(tmp_path / f"run{predicted}", info=run_info(launch={"fleet": "t", "pnodes": ["w0", "w1"]}),
                       metrics=rows(pnodes=("w0", "w1")))
        (run / "placement.json").write_text(json.dumps({**placement(), "step_seconds": predicted}))
        out, _, _ = write_report(run, tmp_path / f"report{predicted}.html")
        page = out.read_text()
        assert ('class="warning">Prediction off' in page) == flagged
        if flagged:
            assert "vgraph probe" in page and "0.0034 s predicted" in page


def test_launch_says_when_a_gpu_fleet_runs_on_the_cpu_and_its_prediction_is_off(tmp_path, capsys) -> None:
    from vgraph.data.stdlib_corpus import default_corpus_documents

    fleet = tmp_path / "gpus.yml"
    fleet.write_text("name: gpus\npnodes:\n" + "".join(
        f"  - {{id: g{i}, memory: 16GiB, flops: 25T, bandwidth: 10Gbit/s, accelerator: cuda-sm75}}\n" for i in range(2)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["launch", str(TINY), "--fleet", str(fleet), "--data", str(corpus), "--steps", "5", "--batch", "2",
                 "--val-every", "0", "--threads", "1", "--device", "cpu", "--out", str(tmp_path / "run"),
                 "--no-tensorboard"]) == 0
    err = capsys.readouterr().err
    assert "fleet 'gpus' describes cuda-sm75 PNodes and this run is on the CPU" in err
    assert "note: prediction off: the step took" in err and "x slower" in err and "vgraph probe" in err


# -- item 10: AdamW and gradient accumulation ------------------------------------------------------------------

ACCUM_STEPS, ACCUM_LR = 4, 3e-3


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    from vgraph.data.stdlib_corpus import default_corpus_documents

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return path


def _train(out: Path, corpus: Path, *extra: str) -> Path:
    assert main(["train", str(TINY), "--data", str(corpus), "--out", str(out), "--steps", str(ACCUM_STEPS),
                 "--lr", str(ACCUM_LR), "--val-every", "0", "--deterministic", "--threads", "1", "--quiet",
                 "--no-tensorboard", *extra]) == 0
    return out / f"step-{ACCUM_STEPS:08d}"


def test_gradient_accumulation_is_the_step_of_the_whole_batch(tmp_path, corpus_file) -> None:
    """--batch 2 --grad-accum 3 trains what --batch 6 trains: the same samples, the same dropout masks (keyed by
    the sample's index in the whole batch; the tiny network has dropout), the gradients of the mean over all
    six; they differ only by float rounding of the sums, which weights_util bounds per Adam step."""
    import vgraph
    from weights_util import assert_same_weights

    assert any(n.type == "dropout" for n in vgraph.load(TINY).nodes)  # the premise: masks must line up
    whole = _train(tmp_path / "whole", corpus_file, "--batch", "6")
    accumulated = _train(tmp_path / "accum", corpus_file, "--batch", "2", "--grad-accum", "3")
    assert_same_weights(accumulated, whole, steps=ACCUM_STEPS, lr=ACCUM_LR)
    import json

    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (tmp_path / "accum", tmp_path / "whole")]  # Adam hides a scale error in the gradients:
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)  # the step's loss (the mean over 6) does not
    small = _train(tmp_path / "small", corpus_file, "--batch", "2")
    with pytest.raises(AssertionError):  # the bound is tight enough to tell another batch apart
        assert_same_weights(small, whole, steps=ACCUM_STEPS, lr=ACCUM_LR)


def test_weight_decay_is_adamw_on_matrices_and_adam_without_it(tmp_path, corpus_file) -> None:
    """--weight-decay WD: torch's AdamW on every matrix and embedding (decoupled decay), none on vectors; the
    default 0 is Adam exactly (the weights bit for bit), so runs of before stay comparable."""
    import torch

    from vgraph.backends.torch import compile_network
    from vgraph.backends.torch.training.optimizers import NodeOptimizers
    from vgraph.backends.torch.training.checkpoint import load_checkpoint

    import vgraph

    module = compile_network(vgraph.load(TINY), train=True, seed=0)
    opts = NodeOptimizers(module, 1e-3, 0.1)
    kinds = {type(o).__name__: o for o in opts.optimizers}
    assert set(kinds) == {"Adam", "AdamW"}
    decayed = [p for g in kinds["AdamW"].param_groups for p in g["params"]]
    assert decayed and all(p.dim() >= 2 for p in decayed)
    assert all(g["weight_decay"] == 0.1 for g in kinds["AdamW"].param_groups)
    assert all(p.dim() < 2 for g in kinds["Adam"].param_groups for p in g["params"])
    assert [type(o).__name__ for o in NodeOptimizers(module, 1e-3).optimizers] == ["Adam"]

    plain = _train(tmp_path / "plain", corpus_file, "--batch", "2")
    zero = _train(tmp_path / "zero", corpus_file, "--batch", "2", "--weight-decay", "0")
    decay = _train(tmp_path / "decay", corpus_file, "--batch", "2", "--weight-decay", "0.5")
    a, b, c = (load_checkpoint(p).model_state for p in (plain, zero, decay))
    assert all(torch.equal(a[k], b[k]) for k in a)
    matrices = [k for k in a if a[k].dim() >= 2]
    vectors = [k for k in a if a[k].dim() < 2]
    # decoupled decay shrinks every matrix a little each step: smaller norms than without it
    assert all(float(c[k].norm()) < float(a[k].norm()) for k in matrices)
    assert vectors and max(float((c[k] - a[k]).abs().max()) for k in vectors) < 0.05


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x", ""])
def test_bad_weight_decay_and_accumulation_are_usage_errors(value, capsys) -> None:
    for option in ("--weight-decay", "--grad-accum"):
        with pytest.raises(SystemExit) as info:
            main(["train", str(TINY), option, value])
        assert info.value.code == 2 and option in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(TINY), "--grad-accum", "0"])


# -- item 10: vgraph new ---------------------------------------------------------------------------------------


def test_vgraph_new_with_the_production_numbers_writes_the_shipped_network(tmp_path, capsys) -> None:
    from vgraph.base.shipped import shipped

    out = tmp_path / "net.yml"
    assert main(["new", "-o", str(out), "--name", "distributed-multi-head-attention-6l-swiglu_ffn", "--layers", "6",
                 "--dim", "512", "--heads", "8", "--vocab", "10000", "--context", "128"]) == 0
    assert "27,185,664 parameters" in capsys.readouterr().out
    assert out.read_text() == shipped("network")["distributed_attention_example_6_swiglu_head"].read_text()


def test_vgraph_new_writes_a_swiglu_network_that_trains(tmp_path, corpus_file, capsys) -> None:
    import vgraph

    out = tmp_path / "small.yml"
    assert main(["new", "-o", str(out), "--layers", "2", "--dim", "32", "--heads", "2", "--vocab", "96",
                 "--context", "16", "--ffn", "64", "--ffn-kind", "swiglu", "--precision", "fp32"]) == 0
    graph = vgraph.load(out)
    assert graph.name == "small" and len(graph.nodes_of_type("attention_head")) == 4
    assert [n.cfg["in_dim"] for n in graph.nodes if n.id.endswith("_ffn_down")] == [32, 32]  # gated: 64 -> 32
    assert len(graph.nodes_of_type("swiglu")) == 3  # two FFNs and the LM head
    assert main(["train", str(out), "--data", str(corpus_file), "--steps", "2", "--batch", "2", "--val-every", "0",
                 "--out", str(tmp_path / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--dim", "100", "--heads", "8"], "not a multiple of --heads 8"),
    (["--dim", "24", "--heads", "8"], "is odd: RoPE"),
    (["--ffn-kind", "swiglu", "--ffn", "255"], "--ffn 255 is odd"),
    (["--layers", "1000000000"], "--layers 1000000000 is over 4,096"),
    (["--context", "99999999999"], "--context 99999999999 is over"),
    (["--dropout", "1"], "--dropout 1.0: from 0 up to"),
    (["--name", "a\x1bb"], "printable name"),
])
def test_vgraph_new_refuses_what_cannot_make_a_network(argv, message, tmp_path, capsys) -> None:
    out = tmp_path / "x.yml"
    assert main(["new", "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--dim", "nan"], ["--dropout", "inf"], ["--vocab", ""],
                                  ["--ffn-kind", "relu"], ["--precision", "fp8"]])
def test_vgraph_new_bad_numbers_are_usage_errors(argv, tmp_path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["new", "-o", str(tmp_path / "x.yml"), *argv])
    assert info.value.code == 2


def test_vgraph_new_output_must_be_a_file(tmp_path, capsys) -> None:
    assert main(["new", "-o", str(tmp_path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_launch_grad_accum_is_the_global_batch_in_at_least_k_micro_batches(tmp_path, corpus_file) -> None:
    """A pipeline's micro-batches accumulate gradients already: launch --batch 2 --grad-accum 3 is the global
    batch 6 cut into at least 3 micro-batches per replica (the job the workers read says so)."""
    import json

    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    assert main(["launch", str(TINY), "--fleet", str(fleet), "--data", str(corpus_file), "--batch", "2",
                 "--grad-accum", "3", "--replicas", "1", "--weight-decay", "0.1", "--out", str(tmp_path / "run"),
                 "--emit-job", str(tmp_path / "job"), "--quiet"]) == 0
    job = json.loads((tmp_path / "job" / "job.json").read_text())
    assert job["train"]["batch"] == 6 and job["micro_batches"] >= 3 and job["train"]["weight_decay"] == 0.1


def test_a_vnodes_own_adamw_and_weight_decay_win() -> None:
    import vgraph
    from vgraph.backends.torch import compile_network
    from vgraph.backends.torch.training.optimizers import NodeOptimizers

    graph = vgraph.load(TINY)
    graph.node("block0_ffn_up").set_config(optimizer="adamw")  # AdamW's customary 0.01
    graph.node("block0_ffn_down").set_config(weight_decay=0.3)  # an Adam node with its own decay
    graph.node("head_up").set_config(weight_decay=0.0)  # no decay even under --weight-decay
    module = compile_network(graph, train=True, seed=0)
    for run_decay, want in ((0.0, {"block0_ffn_up": 0.01, "block0_ffn_down": 0.3}),
                            (0.2, {"block0_ffn_up": 0.2, "block0_ffn_down": 0.3, "block1_ffn_up": 0.2})):
        opts = NodeOptimizers(module, 1e-3, run_decay)
        decay = {opts.key_of[p].split(".")[0]: g["weight_decay"] for o in opts.optimizers
                 if type(o).__name__ == "AdamW" for g in o.param_groups for p in g["params"]}
        assert {k: decay[k] for k in want} == want and "head_up" not in decay
    assert vgraph.loads(vgraph.dumps(graph)).node("block0_ffn_down").cfg["weight_decay"] == 0.3  # YAML round trip
