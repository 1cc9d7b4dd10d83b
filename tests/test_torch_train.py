"""`vgraph train` / `vgraph generate`: run directory, per-VNode optimizers, precision, errors."""
from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import vgraph
from vgraph import Endpoint
from conftest import TINY, TINY_FP32
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import (TrainConfig, TrainingError, compile_network, init_state, load_trained,
                                   train)
from vgraph.backends.torch import cli
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.memory import MemoryRefused
from vgraph.backends.torch.training.train import NodeOptimizers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=30_000)), encoding="utf-8")
    return str(path)


def test_cli_train_writes_the_run_directory_and_generate_samples(tmp_path, corpus, capsys) -> None:
    out = tmp_path / "run"
    rc = cli.main(["train", str(TINY), "--data", corpus, "--steps", "40", "--batch", "8", "--lr", "3e-3",
                   "--out", str(out), "--val-every", "20", "--checkpoint-every", "20", "--quiet"])
    assert rc == 0
    assert "step 40" in capsys.readouterr().out
    for name in ("network.yml", "tokenizer.json", "run.json", "metrics.jsonl", "metrics.csv",
                 "loss_curve.png", "latest", "step-00000020", "step-00000040"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["lr"] == 3e-3 for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert rows[-1]["learning_rate"] == 3e-3  # the YAML's `metrics:` entry (type learning_rate)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)  # it learns
    with open(out / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 40 and float(table[-1]["loss"]) == rows[-1]["loss"] and table[-1]["val_loss"]
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = json.loads((out / "run.json").read_text())
    assert run["tokenizer"] == "char" and run["precision"]["compute_dtype"] == "float32"

    # generate: self-contained checkpoint, deterministic for a seed, continues the prompt.
    args = ["generate", str(out / "step-00000040"), "--prompt", "The ", "--max-new-tokens", "20", "--seed", "3"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text.strip()) > 4
    assert cli.main(args) == 0
    assert capsys.readouterr().out == text
    assert cli.main(["generate", str(out), "--prompt", "The ", "--temperature", "0", "--max-new-tokens", "5"]) == 0
    # The checkpoint loads into the fused graph it was trained with; the logits need no targets.
    module, tokenizer, graph = load_trained(out)
    assert graph.nodes_of_type("tied_lm_head_ce") and module.feeds_needed(("logits",)) == ("embedder:in0",)


def test_default_corpus_with_a_bpe_vocabulary(tmp_path) -> None:
    spec = TransformerSpec("tiny-bpe", layers=1, vocab=300, seq_len=16, dim=32, heads=2, ffn=64, head_up=64,
                           precision=None)
    net = tmp_path / "tiny_bpe.yml"
    vgraph.save(transformer(spec), net)
    result = train(TrainConfig(network=str(net), steps=3, batch=2, corpus_bytes=40_000, val_every=3,
                               val_batches=2, out=tmp_path / "run", cache_dir=tmp_path / "cache", progress=False))
    assert result.step == 3 and math.isfinite(result.val_loss)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["tokenizer"] == "bpe" and run["data"].startswith("default corpus")
    assert list((tmp_path / "cache" / "corpora").glob("stdlib-*/manifest.json"))  # prepared once, for the next run


def _yaml_with(config_lines: dict[str, dict[str, str]]) -> str:
    """TINY_FP32 with extra config keys on some nodes."""
    graph = vgraph.load(TINY_FP32)
    for node_id, extra in config_lines.items():
        node = graph.node(node_id)
        node.set_config(**{k: node.op.schema.by_name[k].parse(v) for k, v in extra.items()})
    return vgraph.dumps(graph)


def test_per_vnode_optimizers_and_learning_rates(tmp_path) -> None:
    text = _yaml_with({"block0_ffn_up": {"optimizer": "sgd", "learning_rate": "0.5"},
                       "block0_ffn_down": {"optimizer": "none"},
                       "embedder": {"learning_rate": "0.01"}})
    graph = vgraph.loads(text)
    module = compile_network(graph, seed=0)
    opts = NodeOptimizers(module, base_lr=1e-3)
    assert opts.lr_of("block0_ffn_up") == 0.5 and opts.lr_of("head_up") == 1e-3
    assert opts.lr_of("lm_head") == 0.01  # tied: trained by the publisher's optimizer
    assert sorted(type(o).__name__ for o in opts.optimizers) == ["Adam", "SGD"]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    module({"embedder:in0": ids, "loss:in1": ids}, want=("ce_loss",))["ce_loss"].backward()
    grad_up = module.namespace("block0_ffn_up").weight.grad.clone()
    for opt in opts.optimizers:
        opt.step()
    after = module.state_dict()
    torch.testing.assert_close(after["block0_ffn_up.weight"], before["block0_ffn_up.weight"] - 0.5 * grad_up)
    assert torch.equal(after["block0_ffn_down.weight"], before["block0_ffn_down.weight"])  # frozen
    # Adam's first step moves every weight by about lr: the embedder's own rate.
    moved = (after["embedder.weight"] - before["embedder.weight"]).abs().max()
    assert 0.005 < float(moved) <= 0.0101
    opts.set_factor(0.5)
    assert opts.lr_of("block0_ffn_up") == 0.25


def test_metrics_entries_follow_the_schedule(tmp_path, corpus) -> None:
    graph = vgraph.load(TINY_FP32)
    graph.add_endpoint("metrics", Endpoint("ffn_up_grad_norm", "block0_ffn_up", 0, "grad_norm"))
    graph.add_endpoint("metrics", Endpoint("train_loss", "loss", 0, "loss"))
    config = TrainConfig(network=graph, data=corpus, steps=6, batch=2, lr=1e-3, warmup=4, schedule="cosine",
                         grad_clip=1.0, val_every=0, out=tmp_path / "run", progress=False)
    result = train(config)
    rows = result.history
    lrs = [r["learning_rate"] for r in rows]
    # By hand: warmup 4 -> s/4 for steps 1-4; then cosine over the remaining 2 steps to min_lr_ratio 0.1:
    # step 5 is halfway, 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55; step 6 the end, 0.1.
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 5.5e-4, 1e-4])
    assert [r["lr"] for r in rows] == pytest.approx(lrs)  # the logged lr is the one the optimizer used
    assert all(r["train_loss"] == r["loss"] for r in rows)
    assert all(r["ffn_up_grad_norm"] > 0 for r in rows)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header[:5] == ["step", "loss", "lr", "tokens_per_s", "elapsed_s"]
    assert {"learning_rate", "ffn_up_grad_norm", "train_loss"} <= set(header)


def test_memory_refusal_names_the_estimate(tmp_path, corpus, capsys) -> None:
    with pytest.raises(MemoryRefused, match=r"needs an estimated .* parameters .* activations .* batch 64"):
        train(TrainConfig(network=str(TINY), data=corpus, steps=1, batch=64, memory_limit=200_000,
                          out=tmp_path / "run", progress=False))
    assert not list((tmp_path / "run").glob("step-*"))
    rc = cli.main(["train", str(TINY), "--data", corpus, "--steps", "1", "--memory-limit", "100K",
                   "--out", str(tmp_path / "run2"), "--quiet"])
    assert rc == 2 and "Nothing was allocated" in capsys.readouterr().err


def test_non_finite_loss_stops_with_the_step(tmp_path, corpus) -> None:
    with pytest.raises(TrainingError, match=r"the loss at step \d+ is (nan|inf).*not finite"):
        train(TrainConfig(network=str(TINY_FP32), data=corpus, steps=30, batch=2, lr=1e30, val_every=0,
                          out=tmp_path / "run", progress=False))


def test_fp16_loss_scaling_skips_overflowing_steps(tmp_path, corpus) -> None:
    """fp16 autocast with dynamic loss scaling (on tiny tensors; the CPU has no fast fp16)."""
    graph = vgraph.load(TINY_FP32)
    graph.meta["precision"] = {"target": "cuda-sm75", "compute_dtype": "float16", "loss_scaling": True,
                               "reason": "test"}
    result = train(TrainConfig(network=graph, passes="", data=corpus, steps=16, batch=2, lr=1e-3,
                               val_every=0, initial_loss_scale=2.0**30, out=tmp_path / "run", progress=False))
    scales = [r["loss_scale"] for r in result.history]
    # A scale of 2**30 overflows the fp16 gradients: those steps are skipped and the scale halves,
    # until it fits and the updates go through (the scale then stays).
    assert scales[:3] == [2.0**29, 2.0**28, 2.0**27]
    assert result.skipped_steps >= 3 and scales[-1] == scales[-2] == 2.0 ** (30 - result.skipped_steps)
    assert all(math.isfinite(r["loss"]) for r in result.history)
    final = load_checkpoint(result.checkpoint)
    init = init_state(graph, seed=0)
    assert all(torch.isfinite(t).all() for t in final.model_state.values())
    assert not torch.equal(final.model_state["head_up.weight"], init["head_up.weight"])  # steps were applied
    assert final.extra["grad_scaler"]["scale"] == scales[-1]


def test_user_mistakes_exit_2_with_a_message(tmp_path, corpus, capsys) -> None:
    assert cli.main(["train", str(tmp_path / "missing.yml"), "--quiet"]) == 2
    assert "network file not found" in capsys.readouterr().err
    assert cli.main(["train", str(TINY), "--data", str(tmp_path / "nothing*.txt"), "--quiet",
                     "--out", str(tmp_path / "a")]) == 2
    assert "no such file, directory or matching file" in capsys.readouterr().err
    assert cli.main(["train", str(TINY), "--passes", "fuse-heads", "--no-fuse", "--quiet",
                     "--out", str(tmp_path / "b")]) == 2
    assert "either --passes or --no-fuse" in capsys.readouterr().err
    out = tmp_path / "c"
    assert cli.main(["train", str(TINY_FP32), "--data", corpus, "--steps", "2", "--batch", "2", "--out", str(out),
                     "--quiet", "--val-every", "0"]) == 0
    capsys.readouterr()
    assert cli.main(["train", str(TINY_FP32), "--data", corpus, "--steps", "4", "--out", str(out), "--quiet"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert cli.main(["train", str(TINY_FP32), "--data", corpus, "--steps", "4", "--batch", "2", "--seed", "9",
                     "--out", str(out), "--resume", "--quiet"]) == 2
    assert "seed=0" in capsys.readouterr().err
    assert cli.main(["generate", str(tmp_path / "nope")]) == 2
