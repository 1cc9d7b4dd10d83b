"""The PyTorch meaning of `geglu` (entry point of group `vgraph.lowerings.torch`).

Imported only when the torch backend meets a geglu VNode.  Parameters are
initialised by the backend's default rule (weights normal(0, 0.02), `*_bias`
zero); `ctx.param(name)` reads this VNode's own parameter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vgraph.backends.torch import LowerCtx, register_lowering


def geglu(x: torch.Tensor, up_weight: torch.Tensor, up_bias: torch.Tensor, down_weight: torch.Tensor,
          down_bias: torch.Tensor, approximate: str) -> torch.Tensor:
    value, gate = F.linear(x, up_weight, up_bias).chunk(2, dim=-1)
    return F.linear(value * F.gelu(gate, approximate=approximate), down_weight, down_bias)


def emit(ctx: LowerCtx):
    """One value per output slot; the computation is recorded into the network's torch.fx program."""
    return [ctx.call(geglu, ctx.inputs[0], ctx.param("up_weight"), ctx.param("up_bias"),
                     ctx.param("down_weight"), ctx.param("down_bias"), ctx.cfg["approximate"])]


def register() -> None:
    register_lowering("geglu", origin="vgraph-geglu", positionwise=True)(emit)


def gelu_ffn(x: torch.Tensor, up_weight: torch.Tensor, up_bias: torch.Tensor, down_weight: torch.Tensor,
             down_bias: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, up_weight, up_bias)), down_weight, down_bias)


def emit_gelu_ffn(ctx: LowerCtx):
    return [ctx.call(gelu_ffn, ctx.inputs[0], ctx.param("up_weight"), ctx.param("up_bias"),
                     ctx.param("down_weight"), ctx.param("down_bias"))]


def register_gelu_ffn() -> None:
    register_lowering("gelu_ffn", origin="vgraph-geglu")(emit_gelu_ffn)
