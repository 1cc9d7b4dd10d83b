"""Decoder-only transformers in the production networks' shape, from a few numbers (`vgraph new`).

Why in the package: a user who wants another size or context should not edit a 1,368-line YAML whose heads
are written out one by one, and an installed vgraph has no `tools/`.  The production networks (networks/*.yml)
and the test fixtures are this generator's output (`tools/gen_networks.py --check` holds them equal): one
VNode per attention head (`attention_head`, RoPE, causal), colocation groups per block and for the tied
embedding / LM head, a SwiGLU LM head, dropout after attention and FFN, per-VNode Adam.
"""
from __future__ import annotations

from dataclasses import dataclass

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.builder import NetBuilder
from vgraph.ir.graph import Graph

__all__ = ["TransformerSpec", "transformer", "synthetic", "check_spec", "BLOCK_VNODES", "FFN_KINDS"]

FFN_KINDS = ("gelu", "swiglu")


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
    ffn_kind: str = "gelu"  # gelu: dim -> ffn -> dim; swiglu: dim -> ffn -> ffn/2 (gated) -> dim
    # Llama-style variants: grouped-query attention with `kv_heads` K/V heads (per head: a kv_head per group;
    # fused: one attention with num_kv_heads), RMSNorm, no biases.
    kv_heads: int | None = None
    fused_attention: bool = False
    norm: str = "layernorm"
    bias: bool = True


def check_spec(spec: TransformerSpec) -> None:
    """A VGraphError naming every number that cannot make this network (each with the option that sets it)."""
    problems = []
    if spec.heads < 1 or spec.dim % spec.heads:
        problems.append(f"--dim {spec.dim} is not a multiple of --heads {spec.heads}: each head gets dim / heads")
    elif (spec.dim // spec.heads) % 2:
        problems.append(f"--dim / --heads = {spec.dim // spec.heads} is odd: RoPE rotates pairs of a head's features")
    if spec.kv_heads is not None and (spec.kv_heads < 1 or spec.heads % spec.kv_heads):
        problems.append(f"--kv-heads {spec.kv_heads} does not divide --heads {spec.heads}: every K/V head serves "
                        f"an equal group of query heads")
    if spec.ffn_kind not in FFN_KINDS:
        problems.append(f"--ffn-kind {spec.ffn_kind!r}: one of {', '.join(FFN_KINDS)}")
    elif spec.ffn_kind == "swiglu" and spec.ffn % 2:
        problems.append(f"--ffn {spec.ffn} is odd: SwiGLU gates one half of it with the other")
    if spec.head_up % 2:
        problems.append(f"the LM head's width {spec.head_up} is odd: its SwiGLU gates one half with the other")
    if not 0.0 <= spec.dropout < 1.0:
        problems.append(f"--dropout {spec.dropout}: from 0 up to (not including) 1")
    if problems:
        raise VGraphError("; ".join(problems))


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
    b.node(f"{p}_ffn_up", "linear", in_dim=spec.dim, out_dim=spec.ffn, **bias, **g, **train)
    b.node(f"{p}_ffn_{spec.ffn_kind}", spec.ffn_kind, **g)
    hidden = spec.ffn // 2 if spec.ffn_kind == "swiglu" else spec.ffn  # swiglu: the value half, then the gate
    b.node(f"{p}_ffn_down", "linear", in_dim=hidden, out_dim=spec.dim, **bias, **g, **train)
    b.node(f"{p}_ffn_dropout", "dropout", rate=spec.dropout, **g)
    b.node(f"{p}_ffn_residual", "add", **g)

    b.edge(x, f"{p}_in")
    b.edge(f"{p}_in", f"{p}_ln1", 0)
    b.edge(f"{p}_ln1", attn[0])
    b.chain(attn[1], f"{p}_attn_proj", f"{p}_attn_dropout", f"{p}_attn_residual")
    b.edge(f"{p}_in", f"{p}_attn_residual", 1, 1)
    b.edge(f"{p}_attn_residual", f"{p}_mid")
    b.edge(f"{p}_mid", f"{p}_ln2", 0)
    b.chain(f"{p}_ln2", f"{p}_ffn_up", f"{p}_ffn_{spec.ffn_kind}", f"{p}_ffn_down", f"{p}_ffn_dropout",
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


