"""A checkpoint never silently describes another function (issue 10 item 5, issue 11 item 14).

A run trained after a pass that changes what the network computes stores the network it trained;
every command that loads a checkpoint against a network refuses one trained on another network,
naming the node or key that differs; resume compares networks (refuses, or records an accepted
change and updates network.yml) and never loads (or recommends) non-finite weights.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import vgraph
from conftest import TINY_FP32
from vgraph.backends.torch import TrainConfig, TrainingError, load_trained, train
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.run.network_match import NetworkMismatch, difference, fingerprint
from vgraph.transform.pass_api import LOCAL_PASSES, Pass, register_pass


class SwapGeluForRelu(Pass):
    """Test pass: every gelu becomes relu (changes the function, keeps every weight shape)."""

    name = "test-gelu-to-relu"

    def run(self, graph, ctx):
        count = Counter()
        for node in graph.nodes_of_type("gelu"):
            node.type = "relu"
            node.__dict__.pop("cfg", None)
            node.__dict__.pop("op", None)
            count["swapped"] += 1
        return count


@pytest.fixture(autouse=True)
def swap_pass():
    register_pass(SwapGeluForRelu)
    yield
    LOCAL_PASSES.pop(SwapGeluForRelu.name, None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return path


def run(corpus, out, network=TINY_FP32, **kw):
    cfg = dict(network=str(network), data=str(corpus), steps=2, batch=2, val_every=0, progress=False,
               out=str(out), threads=1)
    cfg.update(kw)
    return train(TrainConfig(**cfg))


def relu_variant(tmp_path):
    path = tmp_path / "relu.yml"
    path.write_text(TINY_FP32.read_text().replace("type: gelu", "type: relu"))
    return path


def test_a_non_preserving_pass_makes_the_run_store_the_trained_network(corpus, tmp_path):
    result = run(corpus, tmp_path / "run", passes="test-gelu-to-relu")
    stored = (tmp_path / "run" / "network.yml").read_text()
    assert "type: relu" in stored and "type: gelu" not in stored
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["semantic_changes"] == ["test-gelu-to-relu"]
    _, _, graph = load_trained(result.checkpoint, device="cpu")
    assert graph.nodes_of_type("relu") and not graph.nodes_of_type("gelu")
    # the same command resumes (the definition after the pass is the stored one)
    resumed = run(corpus, tmp_path / "run", passes="test-gelu-to-relu", steps=3, resume=True)
    assert resumed.step == 3


def test_check_onnx_refuses_the_original_network_and_accepts_the_stored_one(corpus, tmp_path):
    from vgraph.backends.onnx.check import weights_from_checkpoint

    result = run(corpus, tmp_path / "run", passes="test-gelu-to-relu")
    original = vgraph.load(TINY_FP32)
    with pytest.raises(NetworkMismatch, match=r"node 'block0_ffn_gelu' is a relu in the checkpoint's network, "
                                              r"a gelu in this one.*test-gelu-to-relu"):
        weights_from_checkpoint(result.checkpoint, original, given=str(TINY_FP32))
    stored = vgraph.load(tmp_path / "run" / "network.yml")
    weights = weights_from_checkpoint(result.checkpoint, stored)
    assert "block0_ffn_up.weight" in weights
    # a fused form of the stored network is the same network
    fused = stored.copy()
    from vgraph.transform.pipeline import run_pipeline

    run_pipeline(fused, "fuse-heads,fuse-lm-head-ce")
    assert difference(stored, fused) is None and fingerprint(stored) == fingerprint(fused)
    assert weights_from_checkpoint(result.checkpoint, fused)


def test_resume_refuses_another_network_unless_told(corpus, tmp_path):
    run(corpus, tmp_path / "run")
    changed = relu_variant(tmp_path)
    with pytest.raises(NetworkMismatch, match=r"cannot resume .*trained on another network than .*relu\.yml"
                                              r".*'block0_ffn_gelu' is a gelu in the checkpoint's network, a relu "
                                              r"in this one.*--accept-network-change"):
        run(corpus, tmp_path / "run", network=changed, steps=3, resume=True)
    assert "type: gelu" in (tmp_path / "run" / "network.yml").read_text()  # nothing changed
    result = run(corpus, tmp_path / "run", network=changed, steps=3, resume=True, accept_network_change=True)
    assert result.step == 3
    assert "type: relu" in (tmp_path / "run" / "network.yml").read_text()
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    [change] = info["network_changes"]
    assert change["at_step"] == 2 and "block0_ffn_gelu" in change["difference"]
    assert change["network"] == str(changed)


def test_resume_with_other_shapes_names_the_key(corpus, tmp_path):
    run(corpus, tmp_path / "run")
    wide = tmp_path / "wide.yml"
    wide.write_text(TINY_FP32.read_text().replace('out_dim: "64"\n', 'out_dim: "128"\n', 1)
                    .replace('in_dim: "64"\n', 'in_dim: "128"\n', 1))  # a wider first feed-forward
    with pytest.raises(NetworkMismatch, match=r"config 'out_dim' is 64 in the checkpoint's network, 128 in this"):
        run(corpus, tmp_path / "run", network=wide, steps=3, resume=True)


def poison(checkpoint):
    from safetensors.torch import load_file, save_file

    path = checkpoint / "model.safetensors"
    state = load_file(str(path))
    key = sorted(state)[0]
    state[key][0] = float("nan")
    save_file(state, str(path))
    return key


def test_a_checkpoint_with_non_finite_weights_is_never_loaded(corpus, tmp_path):
    result = run(corpus, tmp_path / "run")
    key = poison(result.checkpoint)
    with pytest.raises(TrainingError, match=rf"holds non-finite weights \({key}\)"):
        run(corpus, tmp_path / "run", steps=3, resume=True)
    with pytest.raises(TrainingError, match="holds non-finite weights"):
        load_trained(tmp_path / "run", device="cpu")


def test_divergence_never_recommends_a_non_finite_checkpoint(corpus, tmp_path):
    from vgraph.backends.torch.training.step import LossCheck

    result = run(corpus, tmp_path / "run")
    check = LossCheck(torch.amp.GradScaler("cpu", enabled=False), False, 0, vgraph.load(TINY_FP32), tmp_path / "run")
    assert "resume from it (--resume)" in check._diverged(3, float("nan"))
    poison(result.checkpoint)
    message = check._diverged(3, float("nan"))
    assert "holds non-finite weights and cannot be resumed" in message and "--resume" not in message


def test_generate_refuses_a_run_whose_network_yml_is_not_the_checkpoints(corpus, tmp_path):
    run(corpus, tmp_path / "run")
    (tmp_path / "run" / "network.yml").write_text(relu_variant(tmp_path).read_text())
    with pytest.raises(NetworkMismatch, match=r"trained on another network than .*network\.yml.*block0_ffn_gelu"):
        load_trained(tmp_path / "run", device="cpu")


def test_launch_refuses_a_pass_that_changes_the_network(corpus, tmp_path):
    from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch

    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    with pytest.raises(TrainingError, match=r"test-gelu-to-relu changes what the network computes.*vgraph "
                                            r"optimize .*tiny_1l_fp32\.yml --passes 'test-gelu-to-relu'"):
        launch(LaunchConfig(network=str(TINY_FP32), data=str(corpus), steps=2, batch=2, val_every=0,
                            progress=False, out=str(tmp_path / "run"), fleet=str(fleet),
                            passes="test-gelu-to-relu"))
    assert not list((tmp_path / "run").glob("step-*"))
