"""An imported model trained, exported to ONNX and launched: each against its independent oracle.

* Training: `vgraph train RUN/network.yml --out RUN --resume` from the imported step 0 against the same steps
  in plain torch on the transformers model (torch.optim.Adam with vgraph's per-VNode Adam's hyperparameters,
  the same batches, dropout 0), compared weight by weight after the steps.  Tolerance: each Adam step moves a
  weight by at most about lr; the two sides' gradients differ by float32 rounding of the same sums in another
  order, which moves m / sqrt(v) by a relative ~1e-6 (measured: at most 1.3e-6 after 3 steps), so 1e-5
  absolute (lr / 100) passes the right training and fails a wrong gradient, which moves weights by ~lr a step.
  GPT-2's key biases are the exception weights_util.py explains: their gradient is analytically zero, so both
  sides step on rounding noise, up to 3.2 x lr a step in any direction.
* ONNX: the inference export of an imported run (`export-onnx --checkpoint RUN`) against transformers' logits.
* Launch: the imported run partitioned onto a 2-PNode fleet trains under `vgraph launch` as under `train`.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_util import DIM, POSITIONS, VOCAB, gpt2, llama, vg
from vgraph.backends.torch import TrainConfig, train

pytest.importorskip("transformers")

STEPS, BATCH, LR = 3, 4, 1e-3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A prepared corpus of random words, tokenized by a 64-word vocabulary (the tiny models')."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("corpus")
    words = ["<|endoftext|>"] + [f"w{i}" for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tok.json"))
    rng = random.Random(0)
    (d / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words[1:]) for _ in range(200))
                                              for _ in range(30)))
    assert vg("data", "prepare", d / "corpus.txt", "-o", d / "data", "--tokenizer", d / "tok.json", "--quiet") == 0
    return d / "data"


def _config(run: Path, data: Path, **kw) -> dict:
    return dict(network=str(run / "network.yml"), out=str(run), resume=True, data=str(data), steps=STEPS,
                batch=BATCH, lr=LR, seed=0, val_every=0, threads=1, progress=False, tensorboard=False, **kw)


def _torch_steps(model, data: Path) -> list[float]:
    """The same steps in plain torch on the transformers model; the losses."""
    from vgraph.backends.torch.training.batches import TokenShards
    from vgraph.data.shards import open_prepared

    shards = TokenShards(open_prepared(str(data)), seq_len=POSITIONS, vocab=VOCAB, seed=0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = shards.batch(step, BATCH)
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_training_from_imported_weights_is_the_same_training_as_in_torch(family, corpus, tmp_path) -> None:
    from safetensors.torch import load_file

    src, run = tmp_path / "src", tmp_path / "run"
    model = gpt2(src) if family == "gpt2" else llama(src)
    assert vg("import", "hf", src, "-o", run) == 0
    result = train(TrainConfig(**_config(run, corpus)))
    want = _torch_steps(model, corpus)
    assert [r["step"] for r in result.history] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in result.history], want, rtol=1e-5)
    assert vg("export", "hf", run, "-o", tmp_path / "out") == 0
    trained, ref = load_file(tmp_path / "out" / "model.safetensors"), model.state_dict()
    start = load_file(src / "model.safetensors")
    moved = 0.0
    for name, tensor in trained.items():
        diff = (tensor - ref[name]).abs()
        if name.endswith("attn.c_attn.bias"):  # Q | K | V: K's gradient is rounding noise (module docstring)
            d = DIM
            assert diff[d:2 * d].max() <= 2 * 3.2 * LR * STEPS, name
            diff = torch.cat([diff[:d], diff[2 * d:]])
        assert diff.max() <= 1e-5, (name, float(diff.max()))
        moved = max(moved, float((tensor - start[name]).abs().max()))
    assert moved >= 2 * LR  # the premise: the steps moved weights by 200 x the tolerance


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_the_onnx_export_of_an_imported_run_computes_transformers_logits(family, tmp_path) -> None:
    import onnxruntime as ort

    src = tmp_path / "src"
    model = gpt2(src) if family == "gpt2" else llama(src, family="qwen2")
    assert vg("import", "hf", src, "-o", tmp_path / "run") == 0
    assert vg("export-onnx", tmp_path / "run" / "network.yml", "--checkpoint", tmp_path / "run",
              "-o", tmp_path / "model.onnx") == 0
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (feed,) = session.get_inputs()
    x = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(9))
    for length in (POSITIONS, 11):
        (got,) = session.run(None, {feed.name: x[:, :length].numpy()})
        with torch.no_grad():
            want = model(x[:, :length]).logits.numpy()
        assert np.abs(want).max() > 1 and np.abs(got - want).max() <= 1e-4
    assert vg("check-onnx", tmp_path / "run" / "network.yml", "--checkpoint", tmp_path / "run") == 0


@pytest.mark.slow
def test_an_imported_model_partitioned_onto_a_fleet_trains_under_launch_as_under_train(corpus, tmp_path) -> None:
    from weights_util import assert_same_weights

    from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch

    src = tmp_path / "src"
    llama(src, heads=4, kv_heads=2)
    assert vg("import", "hf", src, "-o", tmp_path / "single") == 0
    shutil.copytree(tmp_path / "single", tmp_path / "launched")
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    ref = train(TrainConfig(**_config(tmp_path / "single", corpus)))
    result = launch(LaunchConfig(**_config(tmp_path / "launched", corpus), fleet=str(fleet), micro_batches=2,
                                 log=lambda line: None))
    assert result.restarts == 0 and sorted(set(result.placement["assignment"].values())) == ["w0", "w1"]
    np.testing.assert_allclose([r["loss"] for r in result.history], [r["loss"] for r in ref.history], rtol=1e-5)
    last = f"step-{STEPS:08d}"
    assert_same_weights(tmp_path / "launched" / last, tmp_path / "single" / last, steps=STEPS, lr=LR)


def test_eval_on_a_prepared_corpus_scores_its_validation_split_as_transformers(corpus, tmp_path, capsys) -> None:
    import json

    from vgraph.data.shards import open_prepared

    src = tmp_path / "src"
    model = llama(src)
    assert vg("import", "hf", src, "-o", tmp_path / "run") == 0
    val = open_prepared(str(corpus)).val
    ids = torch.from_numpy(val.window(0, val.tokens).astype(np.int64))
    total, count = 0.0, 0
    with torch.no_grad():  # the split as one sequence, windows of POSITIONS + 1 overlapping by one
        for start in range(0, (len(ids) - 1) // POSITIONS * POSITIONS, POSITIONS):
            w = ids[start:start + POSITIONS + 1]
            logits = model(w[None, :-1]).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += POSITIONS
    capsys.readouterr()
    assert vg("eval", tmp_path / "run", "--data", corpus, "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == count > 0 and got["loss"] == pytest.approx(total / count, rel=1e-5)
