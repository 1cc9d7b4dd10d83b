"""Generate the production networks (and tiny variants) as network YAML.

The production networks follow the compute network's description of them
(block diagram, colocation groups, tied embedding, precision policy), which
networks/README.md restates; the format is docs/network-yaml.md.  `python tools/gen_networks.py`
rewrites networks/*.yml; a test checks the checked-in files equal this output.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from vgraph.ir.builder import NetBuilder
from vgraph.ir.graph import Graph
from vgraph.yamlio import dumps

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TransformerSpec:
    name: str
    layers: int
    vocab: int
    seq_len: int
    dim: int = 512
    heads: int = 8
    ffn: int = 2048
    head_up: int = 4096  # SwiGLU LM head: dim -> head_up -> head_up/2 -> dim
    rope_theta: float = 10000.0
    dropout: float = 0.1
    precision: str | None = "fp16"
    # Llama-style variants (tests/fixtures): grouped-query attention with `kv_heads` K/V heads (per head:
    # a kv_head per group; fused: one attention with num_kv_heads), RMSNorm, no biases, a SwiGLU MLP.
    kv_heads: int | None = None
    fused_attention: bool = False
    norm: str = "layernorm"
    bias: bool = True
    mlp: str = "gelu"


PRODUCTION = {
    "distributed_attention_example_6_swiglu_head.yml": TransformerSpec(
        "distributed-multi-head-attention-6l-swiglu_ffn", layers=6, vocab=10000, seq_len=128),
    "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml": TransformerSpec(
        "distributed-multi-head-attention-8l-swiglu_ffn", layers=8, vocab=32768, seq_len=512),
}

# The seed roadmap's next step: a GPT-2-small-sized decoder (12 x 12 heads of 64, dim 768) at 2K context.
NEXT = {
    "distributed_attention_example_12_swiglu_head_vocab32768_seq2048.yml": TransformerSpec(
        "distributed-multi-head-attention-12l-swiglu_ffn-seq2048", layers=12, vocab=32768, seq_len=2048,
        dim=768, heads=12, ffn=3072, head_up=6144),
}

TINY = {
    "tiny_2l.yml": TransformerSpec("tiny-2l", layers=2, vocab=96, seq_len=16, dim=32, heads=2,
                                   ffn=128, head_up=64),
    "tiny_1l_fp32.yml": TransformerSpec("tiny-1l-fp32", layers=1, vocab=64, seq_len=8, dim=32, heads=2,
                                        ffn=64, head_up=64, precision=None),
    "tiny_gqa.yml": TransformerSpec("tiny-gqa", layers=2, vocab=64, seq_len=8, dim=32, heads=4, ffn=48,
                                    head_up=64, precision=None, kv_heads=2, norm="rmsnorm", bias=False,
                                    mlp="swiglu"),
    "tiny_gqa_fused.yml": TransformerSpec("tiny-gqa-fused", layers=2, vocab=64, seq_len=8, dim=32, heads=4,
                                          ffn=48, head_up=64, precision=None, kv_heads=2, fused_attention=True,
                                          norm="rmsnorm", bias=False, mlp="swiglu"),
}

BLOCK_VNODES = 22  # broadcast, ln, head broadcast, H heads (8), stack, proj, dropout, add, + FFN half (10)


def transformer(spec: TransformerSpec) -> Graph:
    """A decoder-only transformer with distributed attention heads, as in production."""
    attrs = {"precision": spec.precision} if spec.precision else {}
    b = NetBuilder(spec.name, **attrs)
    hd = spec.dim // spec.heads
    emb_group = dict(colocate_group="token_embedding", colocate_policy="required")
    train = dict(optimizer="adam")
    b.node("embedder", "embedder", vocab_size=spec.vocab, dim=spec.dim, seq_len=spec.seq_len,
           position_encoding="none", shared_weight_alias="token_embedding", **emb_group, **train)
    x = "embedder"
    for i in range(spec.layers):
        x = _block(b, i, x, spec, hd, train)
    b.node("final_norm", spec.norm, dim=spec.dim, **emb_group, **train)
    b.node("head_up", "linear", in_dim=spec.dim, out_dim=spec.head_up, **emb_group, **train)
    b.node("head_swiglu", "swiglu", **emb_group)
    b.node("head_down", "linear", in_dim=spec.head_up // 2, out_dim=spec.dim, **emb_group, **train)
    b.node("lm_head", "linear", in_dim=spec.dim, out_dim=spec.vocab, tie_weight_alias="token_embedding",
           **emb_group, **train)
    b.node("loss", "cost", cost_function="ce_logits", vocab_size=spec.vocab, cost_precision="float32",
           **emb_group)
    b.chain(x, "final_norm", "head_up", "head_swiglu", "head_down", "lm_head", "loss")
    b.output("logits", "lm_head")
    b.cost("ce_loss", "loss")
    b.metric("learning_rate", "lm_head")
    return b.build()


def _block(b: NetBuilder, i: int, x: str, spec: TransformerSpec, hd: int, train: dict) -> str:
    p = f"block{i}"
    g = dict(colocate_group=f"transformer_block_{i}", colocate_policy="required")
    bias = {} if spec.bias else {"bias": False}
    b.node(f"{p}_in", "broadcast", num_outputs=2, **g)
    b.node(f"{p}_ln1", spec.norm, dim=spec.dim, **g, **train)
    attn = _attention(b, p, spec, hd, g, train)
    b.node(f"{p}_attn_proj", "linear", in_dim=spec.dim, out_dim=spec.dim, **bias, **g, **train)
    b.node(f"{p}_attn_dropout", "dropout", rate=spec.dropout, **g)
    b.node(f"{p}_attn_residual", "add", **g)
    b.node(f"{p}_mid", "broadcast", num_outputs=2, **g)
    b.node(f"{p}_ln2", spec.norm, dim=spec.dim, **g, **train)
    up = spec.ffn * (2 if spec.mlp == "swiglu" else 1)  # swiglu: the value half, then the gate half
    b.node(f"{p}_ffn_up", "linear", in_dim=spec.dim, out_dim=up, **bias, **g, **train)
    b.node(f"{p}_ffn_{spec.mlp}", spec.mlp, **g)
    b.node(f"{p}_ffn_down", "linear", in_dim=spec.ffn, out_dim=spec.dim, **bias, **g, **train)
    b.node(f"{p}_ffn_dropout", "dropout", rate=spec.dropout, **g)
    b.node(f"{p}_ffn_residual", "add", **g)

    b.edge(x, f"{p}_in")
    b.edge(f"{p}_in", f"{p}_ln1", 0)
    b.edge(f"{p}_ln1", attn[0])
    b.chain(attn[1], f"{p}_attn_proj", f"{p}_attn_dropout", f"{p}_attn_residual")
    b.edge(f"{p}_in", f"{p}_attn_residual", 1, 1)
    b.edge(f"{p}_attn_residual", f"{p}_mid")
    b.edge(f"{p}_mid", f"{p}_ln2", 0)
    b.chain(f"{p}_ln2", f"{p}_ffn_up", f"{p}_ffn_{spec.mlp}", f"{p}_ffn_down", f"{p}_ffn_dropout",
            f"{p}_ffn_residual")
    b.edge(f"{p}_mid", f"{p}_ffn_residual", 1, 1)
    return f"{p}_ffn_residual"


def _attention(b: NetBuilder, p: str, spec: TransformerSpec, hd: int, g: dict, train: dict) -> tuple[str, str]:
    """The block's attention: (the node reading the normed input, the node the output projection reads).

    Per head (as in production): a broadcast to every query head, then to every kv_head with grouped-query
    attention (query heads first, in slots 0 .. heads-1); each kv_head feeds the consecutive query heads of
    its group on their input 1; a stack joins the heads' outputs in head order."""
    rope = dict(position_encoding="rope", rope_theta=spec.rope_theta)
    bias = {} if spec.bias else {"qkv_bias": False}
    if spec.fused_attention:
        kv = {"num_kv_heads": spec.kv_heads} if spec.kv_heads else {}
        b.node(f"{p}_attention", "attention", num_heads=spec.heads, head_dim=hd, dim=spec.dim, seq_len=spec.seq_len,
               causal=True, **kv, **rope, **bias, **g, **train)
        return f"{p}_attention", f"{p}_attention"
    kv_heads = spec.kv_heads or 0
    b.node(f"{p}_heads", "broadcast", num_outputs=spec.heads + kv_heads, **g)
    grouped = {"kv_input": True} if kv_heads else {}
    for h in range(spec.heads):
        b.node(f"{p}_head{h}", "attention_head", head_dim=hd, input_dim=spec.dim, seq_len=spec.seq_len, causal=True,
               **grouped, **rope, **bias, **g, **train)
    for k in range(kv_heads):
        b.node(f"{p}_kv{k}", "kv_head", head_dim=hd, input_dim=spec.dim, seq_len=spec.seq_len, **rope, **bias, **g,
               **train)
    b.node(f"{p}_stack", "stack", axis=-1, **g)
    for h in range(spec.heads):
        b.edge(f"{p}_heads", f"{p}_head{h}", h)
        b.edge(f"{p}_head{h}", f"{p}_stack", 0, h)
    for k in range(kv_heads):
        b.edge(f"{p}_heads", f"{p}_kv{k}", spec.heads + k)
        for h in range(k * spec.heads // kv_heads, (k + 1) * spec.heads // kv_heads):
            b.edge(f"{p}_kv{k}", f"{p}_head{h}", 0, 1)
    return f"{p}_heads", f"{p}_stack"


def synthetic(vnodes: int) -> Graph:
    """A tiny-dimension transformer with about `vnodes` VNodes, for scaling benchmarks."""
    layers = max(1, round((vnodes - 7) / 16))  # 2 heads: 16 VNodes a block
    return transformer(TransformerSpec(f"synthetic-{vnodes}", layers=layers, vocab=96, seq_len=16,
                                       dim=32, heads=2, ffn=64, head_up=64))


def expected_files() -> dict[Path, str]:
    out = {ROOT / "networks" / name: dumps(transformer(spec)) for name, spec in {**PRODUCTION, **NEXT}.items()}
    out.update({ROOT / "tests" / "fixtures" / name: dumps(transformer(spec)) for name, spec in TINY.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a checked-in file differs")
    args = ap.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        current = path.read_text() if path.exists() else None
        if current != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
