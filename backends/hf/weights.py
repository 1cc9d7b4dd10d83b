"""Weights between a Hugging Face checkpoint's names and layouts and vgraph's unfused checkpoint layout.

Both directions go through one intermediate, a block's weights in the math's own terms (`_Block`: Q, K, V
as [heads x head_dim, dim] row blocks, the output projection, the MLP's up and down projections as
`y = x W^T + b` matrices, the norms), so each side is written once:

* HF side: GPT-2's `Conv1D` stores `W` as [in, out] (transposed here), its `c_attn` is Q, K and V side by
  side; Llama and Qwen2 keep `q_proj`, `k_proj`, `v_proj`, `o_proj` and a gated MLP whose `gate_proj` and
  `up_proj` become one vgraph up-projection [up; gate] (kernels.swiglu: the first half is the value, the
  second the gate: down(up(x) * silu(gate(x))), transformers' LlamaMLP).
* vgraph side: per-head VNodes hold their rows of Q, K, V (`wq`, `wk`, `wv`), a grouped-query K/V head
  (`kv_head`) its K and V rows; a fused `attention` VNode holds [all Q heads; all K heads; all V heads].

RoPE needs no permutation: transformers' Llama rotates halves (`rotate_half`), and so do vgraph's kernels
(kernels.py: rotate-half, not the interleaved GPT-J pairs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vgraph.base.diagnostics import VGraphError, quote

from .families import Spec

__all__ = ["hf_shapes", "hf_prefix", "ignorable", "to_vgraph", "to_hf"]


@dataclass
class _Block:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    ln1: torch.Tensor
    ln2: torch.Tensor
    bias: dict[str, torch.Tensor | None] = field(default_factory=dict)  # bq bk bv bo bup bdown ln1 ln2


# -- the HF side ---------------------------------------------------------------------------------------


def hf_prefix(spec: Spec) -> str:
    """The prefix of the base model's tensors as `save_pretrained` writes them for a *ForCausalLM."""
    return "transformer." if spec.family == "gpt2" else "model."


def hf_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of `spec` holds, by its name without `hf_prefix`, and its shape."""
    d, f, v = spec.dim, spec.ffn, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    out: dict[str, tuple[int, ...]] = {}
    if spec.family == "gpt2":
        out.update({"wte.weight": (v, d), "wpe.weight": (spec.max_positions, d), "ln_f.weight": (d,),
                    "ln_f.bias": (d,)})
        for i in range(spec.layers):
            h = f"h.{i}."
            out.update({h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "ln_2.weight": (d,),
                        h + "ln_2.bias": (d,), h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                        h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                        h + "mlp.c_fc.weight": (d, f), h + "mlp.c_fc.bias": (f,), h + "mlp.c_proj.weight": (f, d),
                        h + "mlp.c_proj.bias": (d,)})
        return out
    out.update({"embed_tokens.weight": (v, d), "norm.weight": (d,)})
    if not spec.tied:
        out["lm_head.weight"] = (v, d)
    for i in range(spec.layers):
        h = f"layers.{i}."
        out.update({h + "input_layernorm.weight": (d,), h + "post_attention_layernorm.weight": (d,),
                    h + "self_attn.q_proj.weight": (q, d), h + "self_attn.k_proj.weight": (kv, d),
                    h + "self_attn.v_proj.weight": (kv, d), h + "self_attn.o_proj.weight": (d, q),
                    h + "mlp.gate_proj.weight": (f, d), h + "mlp.up_proj.weight": (f, d),
                    h + "mlp.down_proj.weight": (d, f)})
        if spec.qkv_bias:
            out.update({h + "self_attn.q_proj.bias": (q,), h + "self_attn.k_proj.bias": (kv,),
                        h + "self_attn.v_proj.bias": (kv,)})
        if spec.o_bias:
            out[h + "self_attn.o_proj.bias"] = (d,)
        if spec.mlp_bias:
            out.update({h + "mlp.gate_proj.bias": (f,), h + "mlp.up_proj.bias": (f,), h + "mlp.down_proj.bias": (d,)})
    return out


def ignorable(spec: Spec, name: str, shape: tuple[int, ...]) -> bool:
    """Whether a stored tensor is a buffer transformers recomputes (GPT-2's causal mask, RoPE's inverse
    frequencies), not a weight."""
    if spec.family == "gpt2":
        return name.endswith((".attn.bias", ".attn.masked_bias")) and len(shape) in (0, 4)
    return name.endswith("rotary_emb.inv_freq")


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def _from_hf_block(spec: Spec, w: dict[str, torch.Tensor], i: int) -> _Block:
    d = spec.dim
    if spec.family == "gpt2":
        h = f"h.{i}."
        qkv, bqkv = _t(w[h + "attn.c_attn.weight"]), w[h + "attn.c_attn.bias"]
        q, k, v = qkv.split(d)
        bq, bk, bv = bqkv.split(d)
        return _Block(q, k, v, _t(w[h + "attn.c_proj.weight"]), _t(w[h + "mlp.c_fc.weight"]),
                      _t(w[h + "mlp.c_proj.weight"]), w[h + "ln_1.weight"], w[h + "ln_2.weight"],
                      dict(bq=bq, bk=bk, bv=bv, bo=w[h + "attn.c_proj.bias"], bup=w[h + "mlp.c_fc.bias"],
                           bdown=w[h + "mlp.c_proj.bias"], ln1=w[h + "ln_1.bias"], ln2=w[h + "ln_2.bias"]))
    h = f"layers.{i}."
    a, m = h + "self_attn.", h + "mlp."
    up = torch.cat([w[m + "up_proj.weight"], w[m + "gate_proj.weight"]])
    bias: dict[str, torch.Tensor | None] = {}
    if spec.qkv_bias:
        bias.update(bq=w[a + "q_proj.bias"], bk=w[a + "k_proj.bias"], bv=w[a + "v_proj.bias"])
    if spec.o_bias:
        bias["bo"] = w[a + "o_proj.bias"]
    if spec.mlp_bias:
        bias.update(bup=torch.cat([w[m + "up_proj.bias"], w[m + "gate_proj.bias"]]), bdown=w[m + "down_proj.bias"])
    return _Block(w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"], w[a + "o_proj.weight"],
                  up, w[m + "down_proj.weight"], w[h + "input_layernorm.weight"],
                  w[h + "post_attention_layernorm.weight"], bias)


def _to_hf_block(spec: Spec, b: _Block, i: int) -> dict[str, torch.Tensor]:
    if spec.family == "gpt2":
        h = f"h.{i}."
        return {h + "attn.c_attn.weight": _t(torch.cat([b.q, b.k, b.v])),
                h + "attn.c_attn.bias": torch.cat([b.bias["bq"], b.bias["bk"], b.bias["bv"]]),
                h + "attn.c_proj.weight": _t(b.o), h + "attn.c_proj.bias": b.bias["bo"],
                h + "mlp.c_fc.weight": _t(b.up), h + "mlp.c_fc.bias": b.bias["bup"],
                h + "mlp.c_proj.weight": _t(b.down), h + "mlp.c_proj.bias": b.bias["bdown"],
                h + "ln_1.weight": b.ln1, h + "ln_1.bias": b.bias["ln1"], h + "ln_2.weight": b.ln2,
                h + "ln_2.bias": b.bias["ln2"]}
    h = f"layers.{i}."
    a, m = h + "self_attn.", h + "mlp."
    up, gate = b.up.chunk(2)
    out = {a + "q_proj.weight": b.q, a + "k_proj.weight": b.k, a + "v_proj.weight": b.v, a + "o_proj.weight": b.o,
           m + "up_proj.weight": up, m + "gate_proj.weight": gate, m + "down_proj.weight": b.down,
           h + "input_layernorm.weight": b.ln1, h + "post_attention_layernorm.weight": b.ln2}
    if spec.qkv_bias:
        out.update({a + "q_proj.bias": b.bias["bq"], a + "k_proj.bias": b.bias["bk"], a + "v_proj.bias": b.bias["bv"]})
    if spec.o_bias:
        out[a + "o_proj.bias"] = b.bias["bo"]
    if spec.mlp_bias:
        bup, bgate = b.bias["bup"].chunk(2)
        out.update({m + "up_proj.bias": bup, m + "gate_proj.bias": bgate, m + "down_proj.bias": b.bias["bdown"]})
    return out


# -- the vgraph side -----------------------------------------------------------------------------------


def _put(state: dict[str, torch.Tensor], key: str, value: torch.Tensor | None) -> None:
    if value is not None:
        state[key] = value


def _block_to_vgraph(spec: Spec, b: _Block, i: int, fused: bool) -> dict[str, torch.Tensor]:
    p, hd = f"block{i}_", spec.head_dim
    s: dict[str, torch.Tensor] = {}
    _put(s, p + "ln1.weight", b.ln1)
    _put(s, p + "ln1.bias", b.bias.get("ln1"))
    _put(s, p + "ln2.weight", b.ln2)
    _put(s, p + "ln2.bias", b.bias.get("ln2"))
    _put(s, p + "attn_proj.weight", b.o)
    _put(s, p + "attn_proj.bias", b.bias.get("bo"))
    _put(s, p + "ffn_up.weight", b.up)
    _put(s, p + "ffn_up.bias", b.bias.get("bup"))
    _put(s, p + "ffn_down.weight", b.down)
    _put(s, p + "ffn_down.bias", b.bias.get("bdown"))
    if fused:
        s[p + "attn.qkv_weight"] = torch.cat([b.q, b.k, b.v])
        if spec.qkv_bias:
            s[p + "attn.qkv_bias"] = torch.cat([b.bias["bq"], b.bias["bk"], b.bias["bv"]])
        return s
    grouped = spec.kv_heads != spec.heads
    for h in range(spec.heads):
        rows = slice(h * hd, (h + 1) * hd)
        s[f"{p}head{h}.wq"] = b.q[rows]
        if spec.qkv_bias:
            s[f"{p}head{h}.bq"] = b.bias["bq"][rows]
        if not grouped:
            s[f"{p}head{h}.wk"], s[f"{p}head{h}.wv"] = b.k[rows], b.v[rows]
            if spec.qkv_bias:
                s[f"{p}head{h}.bk"], s[f"{p}head{h}.bv"] = b.bias["bk"][rows], b.bias["bv"][rows]
    for g in range(spec.kv_heads if grouped else 0):
        rows = slice(g * hd, (g + 1) * hd)
        s[f"{p}kv{g}.wk"], s[f"{p}kv{g}.wv"] = b.k[rows], b.v[rows]
        if spec.qkv_bias:
            s[f"{p}kv{g}.bk"], s[f"{p}kv{g}.bv"] = b.bias["bk"][rows], b.bias["bv"][rows]
    return s


def _block_from_vgraph(spec: Spec, s: dict[str, torch.Tensor], i: int, fused: bool) -> _Block:
    p = f"block{i}_"
    q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    bias = {name: s.get(p + key) for name, key in (("ln1", "ln1.bias"), ("ln2", "ln2.bias"), ("bo", "attn_proj.bias"),
                                                   ("bup", "ffn_up.bias"), ("bdown", "ffn_down.bias"))}
    if fused:
        q, k, v = s[p + "attn.qkv_weight"].split([q_rows, kv_rows, kv_rows])
        if spec.qkv_bias:
            bias["bq"], bias["bk"], bias["bv"] = s[p + "attn.qkv_bias"].split([q_rows, kv_rows, kv_rows])
    else:
        grouped = spec.kv_heads != spec.heads
        src = [f"{p}kv{g}" for g in range(spec.kv_heads)] if grouped else [f"{p}head{h}" for h in range(spec.heads)]
        heads = [f"{p}head{h}" for h in range(spec.heads)]
        q = torch.cat([s[h + ".wq"] for h in heads])
        k, v = torch.cat([s[x + ".wk"] for x in src]), torch.cat([s[x + ".wv"] for x in src])
        if spec.qkv_bias:
            bias["bq"] = torch.cat([s[h + ".bq"] for h in heads])
            bias["bk"], bias["bv"] = torch.cat([s[x + ".bk"] for x in src]), torch.cat([s[x + ".bv"] for x in src])
    return _Block(q, k, v, s[p + "attn_proj.weight"], s[p + "ffn_up.weight"], s[p + "ffn_down.weight"],
                  s[p + "ln1.weight"], s[p + "ln2.weight"], bias)


def to_vgraph(spec: Spec, weights: dict[str, torch.Tensor], *, fused: bool) -> dict[str, torch.Tensor]:
    """vgraph's unfused state (float32, contiguous) of HF `weights` (names without `hf_prefix`)."""
    w = {k: v.to(torch.float32) for k, v in weights.items()}
    state: dict[str, torch.Tensor] = {}
    if spec.family == "gpt2":
        state["embedder.weight"] = w["wte.weight"]
        state["embedder.position"] = w["wpe.weight"][: spec.seq_len]
        state["final_norm.weight"], state["final_norm.bias"] = w["ln_f.weight"], w["ln_f.bias"]
    else:
        state["embedder.weight"] = w["embed_tokens.weight"]
        state["final_norm.weight"] = w["norm.weight"]
        if not spec.tied:
            state["lm_head.weight"] = w["lm_head.weight"]
    for i in range(spec.layers):
        state.update(_block_to_vgraph(spec, _from_hf_block(spec, w, i), i, fused))
    return {k: v.contiguous().clone() for k, v in state.items()}


def to_hf(spec: Spec, state: dict[str, torch.Tensor], *, fused: bool) -> dict[str, torch.Tensor]:
    """HF tensors, with `hf_prefix` and an untied `lm_head.weight`, of vgraph's unfused `state`."""
    try:
        s = {k: v.detach().to(torch.float32).cpu() for k, v in state.items()}
        out: dict[str, torch.Tensor] = {}
        if spec.family == "gpt2":
            if s["embedder.position"].shape[0] != spec.max_positions:
                raise VGraphError(f"embedder.position has {s['embedder.position'].shape[0]} rows, the network's "
                                  f"seq_len is {spec.max_positions}")
            out.update({"wte.weight": s["embedder.weight"], "wpe.weight": s["embedder.position"],
                        "ln_f.weight": s["final_norm.weight"], "ln_f.bias": s["final_norm.bias"]})
        else:
            out.update({"embed_tokens.weight": s["embedder.weight"], "norm.weight": s["final_norm.weight"]})
        for i in range(spec.layers):
            out.update(_to_hf_block(spec, _block_from_vgraph(spec, s, i, fused), i))
    except KeyError as exc:
        raise VGraphError(f"the checkpoint has no weight {quote(exc.args[0])} the network needs") from None
    prefixed = {hf_prefix(spec) + k: v.contiguous().clone() for k, v in out.items()}
    if not spec.tied:
        prefixed["lm_head.weight"] = s["lm_head.weight"].contiguous().clone()
    return prefixed
