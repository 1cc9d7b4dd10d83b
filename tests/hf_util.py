"""Tiny Hugging Face models for the import/export tests: built from configs with random weights, saved with
`save_pretrained` (nothing downloaded), and the CLI run in-process.

Sizes: vocabulary 64, width 32, 2 blocks, 32 positions (a prompt of 3 plus 20 generated tokens fits, so
transformers' generate and vgraph's see the same context).  Dropout is 0 (the comparisons are of the same
function); the weights are scaled up from transformers' 0.02 init so that logits differ by more than
rounding between a right and a wrong mapping (a transposed or swapped weight moves them by O(1)).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vgraph.cli import main as vgraph_main

VOCAB, DIM, LAYERS, POSITIONS = 64, 32, 2, 32


def _scaled(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def gpt2(path: Path, seed: int = 0, **overrides):
    """A tiny GPT2LMHeadModel saved at `path` (gelu_new, tied head); the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=DIM, n_layer=LAYERS, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                        **overrides)
    torch.manual_seed(seed)
    model = _scaled(GPT2LMHeadModel(config), seed)
    model.save_pretrained(path)
    return model


def llama(path: Path, seed: int = 0, *, family: str = "llama", heads: int = 4, kv_heads: int = 2,
          tied: bool = False, **overrides):
    """A tiny LlamaForCausalLM (or Qwen2ForCausalLM: family='qwen2') saved at `path`; the model."""
    import transformers

    cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                      "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    config = getattr(transformers, cls)(
        vocab_size=VOCAB, max_position_embeddings=POSITIONS, hidden_size=DIM, intermediate_size=48,
        num_hidden_layers=LAYERS, num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
        rope_theta=5000.0, bos_token_id=None, eos_token_id=None, **overrides)
    torch.manual_seed(seed)
    model = _scaled(getattr(transformers, model_cls)(config), seed)
    model.save_pretrained(path)
    return model


def vg(*argv: str) -> int:
    """`vgraph ARGV...` in this process; its exit status."""
    return vgraph_main([str(a) for a in argv])


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
