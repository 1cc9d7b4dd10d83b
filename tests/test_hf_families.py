"""Reading config.json into a family (backends/hf/families.py), torch- and transformers-free: the configs
transformers 4 and 5 write, null meaning the default, and the recognition of a network as a family."""
from __future__ import annotations

import pytest

from vgraph.backends.hf.families import hf_config, network, read_spec, recognise
from vgraph.base.diagnostics import VGraphError

LLAMA_V4 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
            "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16", "attention_bias": False,
            "head_dim": None, "quantization_config": None}
QWEN2_V4 = {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
            "rope_theta": 1e6, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 21,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_transformers_4_configs_read_with_null_as_the_default() -> None:
    spec = read_spec(LLAMA_V4, "c.json")
    assert (spec.family, spec.heads, spec.kv_heads, spec.head_dim, spec.rope_theta, spec.tied, spec.qkv_bias) == \
        ("llama", 8, 2, 8, 500000.0, True, False)
    qwen = read_spec(QWEN2_V4, "c.json")  # the window is off: sliding_window is only a size
    assert (qwen.family, qwen.qkv_bias, qwen.o_bias, qwen.rope_theta, qwen.tied) == ("qwen2", True, False, 1e6, False)
    assert read_spec({**LLAMA_V4, "rope_theta": None}, "c.json").rope_theta == 10000.0
    v5 = {**LLAMA_V4, "rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert read_spec(v5, "c.json").rope_theta == 5e5
    with pytest.raises(VGraphError, match="differs from rope_parameters.rope_theta"):
        read_spec({**v5, "rope_theta": 1e4}, "c.json")
    with pytest.raises(VGraphError, match="quantization_config"):
        read_spec({**LLAMA_V4, "quantization_config": {"bits": 4}}, "c.json")
    with pytest.raises(VGraphError, match="not a JSON object"):
        read_spec([1, 2], "c.json")


@pytest.mark.parametrize("config", [LLAMA_V4, QWEN2_V4, {**LLAMA_V4, "num_key_value_heads": 8},
                                    {**LLAMA_V4, "num_key_value_heads": 1, "attention_bias": True,
                                     "mlp_bias": True, "tie_word_embeddings": False}],
                         ids=["llama-gqa", "qwen2", "llama-mha", "llama-mqa-biases"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_family_network_is_recognised_as_its_spec_and_written_back(config, fused) -> None:
    spec = read_spec(config, "c.json")
    graph = network(spec, "m", fused=fused)
    assert recognise(graph) == (spec, fused)
    back = read_spec(hf_config(spec), "exported")  # the exported config.json reads as the same model
    assert back == spec


def test_gpt2_with_dropout_and_its_default_sizes() -> None:
    spec = read_spec({"model_type": "gpt2", "vocab_size": 50, "n_positions": 16, "n_embd": 16, "n_layer": 1,
                      "n_head": 2, "n_inner": None}, "c.json")
    assert (spec.ffn, spec.dropout, spec.embd_dropout, spec.activation) == (64, 0.1, 0.1, "gelu_new")
    graph = network(spec, "g")
    assert {n.id for n in graph.nodes_of_type("dropout")} == {"embedder_dropout", "block0_attn_dropout",
                                                              "block0_ffn_dropout"}
    assert recognise(graph) == (spec, False)
    assert read_spec(hf_config(spec), "exported") == spec
