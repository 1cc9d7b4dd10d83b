"""Llama and Qwen2 through `vgraph import hf` / `export hf`: grouped-query, multi-query and plain multi-head
attention, tied and untied heads, Qwen2's Q/K/V biases, per-head and fused graphs, against transformers.

Tolerance as in test_hf_gpt2.py: the issue's 1e-4 absolute on float32 logits of magnitude ~4 (measured:
under 1e-5); a wrong RoPE layout, GQA grouping or SwiGLU half moves them by O(1).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import vgraph

from hf_util import POSITIONS, VOCAB, edit_config, llama, vg
from conftest import TINY
from vgraph.backends.torch import load_model

pytest.importorskip("transformers")

CASES = {  # name: (family, heads, kv_heads, tied)
    "llama-gqa": ("llama", 4, 2, False),
    "llama-mqa-tied": ("llama", 4, 1, True),
    "llama-mha": ("llama", 4, 4, False),
    "qwen2-gqa": ("qwen2", 4, 2, False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    out = {}
    for seed, (name, (family, heads, kv, tied)) in enumerate(CASES.items()):
        out[name] = (llama(d / name, seed, family=family, heads=heads, kv_heads=kv, tied=tied), d / name)
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["per-head", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_the_export_are_transformers(models, name, fused, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model, src = models[name]
    family, heads, kv, tied = CASES[name]
    run = tmp_path / "run"
    assert vg("import", "hf", src, "-o", run, *(["--fused-attention"] if fused else [])) == 0
    lm = load_model(run)
    x = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x).logits
        assert want.abs().max() > 1
        assert (lm(x) - want).abs().max() <= 1e-4
    types = [n.type for n in lm.graph.nodes]  # after the production pipeline: heads fused either way
    assert "attention" in types and "rmsnorm" in types
    written = vgraph.load(run / "network.yml")
    kv_nodes = written.nodes_of_type("kv_head")
    assert len(kv_nodes) == (0 if fused or kv == heads else 2 * kv)
    assert bool(written.nodes_of_type("attention")) == fused
    assert bool(written.node("lm_head").cfg.get("tie_weight_alias")) == tied
    out = tmp_path / "out"
    assert vg("export", "hf", run, "-o", out) == 0
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(x).logits - want).abs().max() <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (family, kv, tied)


def test_greedy_generate_by_ids_is_transformers_generate(models, tmp_path, capsys) -> None:
    model, src = models["qwen2-gqa"]
    assert vg("import", "hf", src, "-o", tmp_path / "run") == 0
    want = model.generate(torch.tensor([[7, 1, 30]]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                          pad_token_id=0)[0].tolist()
    capsys.readouterr()
    assert vg("generate", tmp_path / "run", "--prompt-ids", "7,1,30", "--temperature", "0",
              "--max-new-tokens", "20") == 0
    assert [int(t) for t in capsys.readouterr().out.strip().split(",")] == want


def _refused(src: Path, out: Path, capsys, *phrases: str) -> None:
    capsys.readouterr()
    assert vg("import", "hf", src, "-o", out) == 2
    err = capsys.readouterr().err
    assert all(p in err for p in phrases), err
    assert "Traceback" not in err and not out.exists()


def test_configs_that_change_the_computation_are_refused(tmp_path, capsys) -> None:
    src = tmp_path / "src"
    llama(src, family="llama")
    original = json.loads((src / "config.json").read_text())
    out = tmp_path / "run"
    cases = [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_type 'llama3'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling with rope_type 'linear'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),  # a mistake, not a family
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"sliding_window": 8}, "key 'sliding_window'"),
        ({"head_dim": 7}, "odd"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ]
    for change, phrase in cases:
        (src / "config.json").write_text(json.dumps({**original, **change}))
        unsupported = "multiple" not in phrase and "odd" not in phrase and "eps" not in phrase
        _refused(src, out, capsys, phrase, *(["vgraph imports GPT-2", "Llama", "Qwen2"] if unsupported else []))
    qwen = tmp_path / "qwen"
    llama(qwen, family="qwen2")
    edit_config(qwen, use_sliding_window=True, sliding_window=8)
    _refused(qwen, out, capsys, "use_sliding_window=true")
    edit_config(qwen, use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])
    _refused(qwen, out, capsys, "layer_types")


def test_a_network_no_family_expresses_is_refused_naming_its_first_misfit(tmp_path, capsys) -> None:
    """The production layout's SwiGLU LM head (tiny_2l.yml, the production networks in small) fits no family."""
    from vgraph.backends.torch import capture_rng_state, init_state, save_checkpoint

    graph = vgraph.load(TINY)
    run = tmp_path / "run"
    save_checkpoint(run / "step-00000000", step=0, model_state=init_state(graph), optimizer_states={},
                    rng_state=capture_rng_state(), extra={"network_yaml": TINY.read_text()})
    capsys.readouterr()
    assert vg("export", "hf", run, "-o", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "no Hugging Face family expresses this network" in err and "Traceback" not in err
    assert "block0_ln1" in err  # layernorm with RoPE heads: neither GPT-2 (learned positions) nor Llama (RMSNorm)
    assert not (tmp_path / "out").exists()
    # A Llama import with one more VNode before its LM head (an activation) is refused at that VNode.
    src = tmp_path / "src"
    llama(src)
    assert vg("import", "hf", src, "-o", tmp_path / "imported") == 0
    text = (tmp_path / "imported" / "network.yml").read_text()
    edited = text.replace("  - id: lm_head\n", "  - id: head_act\n    type: silu\n  - id: lm_head\n", 1)
    edited = edited.replace("{from: final_norm, to: lm_head}", "{from: final_norm, to: head_act}\n"
                            "  - {from: head_act, to: lm_head}")
    assert edited.count("head_act") == 3
    vgraph.loads(edited)  # a valid network
    state = load_model(tmp_path / "imported").network.unfused_state_dict()
    save_checkpoint(tmp_path / "bad" / "step-00000000", step=0, model_state=state, optimizer_states={},
                    rng_state=capture_rng_state(), extra={"network_yaml": edited})
    assert vg("export", "hf", tmp_path / "bad", "-o", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "VNode 'head_act' (silu) has no place in a llama model" in err, err


def test_sharded_bfloat16_weights_import_as_their_float32_values(models, tmp_path) -> None:
    """A model saved in bfloat16 over several safetensors files (with its index) is the same model in float32."""
    model, _ = models["llama-gqa"]
    half = tmp_path / "half"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(half, max_shard_size="20KB")
    assert len(list(half.glob("*.safetensors"))) > 1 and (half / "model.safetensors.index.json").exists()
    assert vg("import", "hf", half, "-o", tmp_path / "run") == 0
    from transformers import AutoModelForCausalLM

    rounded = AutoModelForCausalLM.from_pretrained(half).float().eval()  # the bfloat16 weights, upcast
    x = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = rounded(x).logits
        assert (model(x).logits - want).abs().max() > 1e-3  # the premise: rounding to bfloat16 shows
        assert (load_model(tmp_path / "run")(x) - want).abs().max() <= 1e-4
