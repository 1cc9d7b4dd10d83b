"""The honest baseline: the production transformer written by hand in plain PyTorch.

This is what an expert would write for the production networks without
vgraph (pre-LayerNorm decoder, fused QKV projection, RoPE in the rotate-half
convention, causal `scaled_dot_product_attention`, GELU FFN, a SwiGLU "head"
MLP, LM head tied to the token embedding, `F.cross_entropy` on the full
logits).  It has exactly the parameters of the vgraph network of the same
`TransformerSpec` (same count, same shapes up to the QKV concatenation), and
`load_vgraph_state` copies a vgraph module's weights into it, so benchmarks
compare the two on the same weights and can check they compute the same loss.

Written for speed on a CPU the way one would by hand: one GEMM for q, k and v,
RoPE applied to q and k in one elementwise pass on cached tables, SDPA (which
picks the fused flash kernel on the CPU), no Python-level per-head loops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HandwrittenConfig", "HandwrittenTransformer", "load_vgraph_state", "flops_per_step"]


@dataclass(frozen=True)
class HandwrittenConfig:
    layers: int
    vocab: int
    seq_len: int
    dim: int = 512
    heads: int = 8
    ffn: int = 2048
    head_up: int = 4096
    rope_theta: float = 10000.0
    dropout: float = 0.1

    @classmethod
    def from_spec(cls, spec) -> HandwrittenConfig:
        """From a `tools.gen_networks.TransformerSpec` (the generator of the production YAML)."""
        return cls(spec.layers, spec.vocab, spec.seq_len, spec.dim, spec.heads, spec.ffn, spec.head_up,
                   spec.rope_theta, spec.dropout)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def _rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


class Block(nn.Module):
    def __init__(self, cfg: HandwrittenConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h, hd = self.cfg.heads, self.cfg.head_dim
        qkv = self.qkv(x).view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)  # [3, B, H, S, hd]
        qk, v = qkv[:2], qkv[2]
        # RoPE on q and k together (rotate-half): one pass over both.
        half = hd // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos.to(qk.dtype) + rotated * sin.to(qk.dtype)  # tables follow autocast's dtype
        out = F.scaled_dot_product_attention(qk[0], qk[1], v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln1(x), cos, sin))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class HandwrittenTransformer(nn.Module):
    """Token ids [B, S] (+ targets [B, S]) -> mean next-token cross-entropy (or logits)."""

    def __init__(self, cfg: HandwrittenConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.dim)
        self.head_up = nn.Linear(cfg.dim, cfg.head_up)
        self.head_down = nn.Linear(cfg.head_up // 2, cfg.dim)
        cos, sin = _rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name or "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        value, gate = self.head_up(self.final_norm(x)).chunk(2, dim=-1)
        return self.head_down(value * F.silu(gate))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = F.linear(self.hidden(ids), self.embed.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


def load_vgraph_state(model: HandwrittenTransformer, unfused: Mapping[str, torch.Tensor]) -> None:
    """Copy a vgraph module's weights (its `unfused_state_dict()`) into `model`.

    vgraph's per-head `wq/wk/wv` (and biases) of heads 0..H-1 are stacked as
    [all q heads, all k heads, all v heads]: the row layout of `qkv`.
    """
    cfg = model.cfg
    mine: dict[str, torch.Tensor] = {"embed.weight": unfused["embedder.weight"]}
    for i in range(cfg.layers):
        p, q = f"block{i}", f"blocks.{i}"
        for part, names in (("weight", ("wq", "wk", "wv")), ("bias", ("bq", "bk", "bv"))):
            mine[f"{q}.qkv.{part}"] = torch.cat([unfused[f"{p}_head{h}.{name}"]
                                                 for name in names for h in range(cfg.heads)])
        for src, dst in (("ln1", "ln1"), ("attn_proj", "proj"), ("ln2", "ln2"), ("ffn_up", "up"),
                         ("ffn_down", "down")):
            for part in ("weight", "bias"):
                mine[f"{q}.{dst}.{part}"] = unfused[f"{p}_{src}.{part}"]
    for src, dst in (("final_norm", "final_norm"), ("head_up", "head_up"), ("head_down", "head_down")):
        for part in ("weight", "bias"):
            mine[f"{dst}.{part}"] = unfused[f"{src}.{part}"]
    model.load_state_dict(mine, strict=True)


def flops_per_step(cfg: HandwrittenConfig, batch: int) -> int:
    """Training FLOPs of one step (3x forward), counted like `vgraph analyze` (full S x S scores)."""
    s, d = cfg.seq_len, cfg.dim
    per_layer = 2 * s * d * 3 * d + 2 * 2 * s * s * d + 2 * s * d * d + 2 * 2 * s * d * cfg.ffn
    head = 2 * s * d * cfg.head_up + 2 * s * (cfg.head_up // 2) * d + 2 * s * d * cfg.vocab
    return 3 * batch * (cfg.layers * per_layer + head)

