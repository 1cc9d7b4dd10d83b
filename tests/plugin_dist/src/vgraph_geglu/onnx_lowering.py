"""The ONNX meaning of `geglu` (entry point of group `vgraph.lowerings.onnx`), written independently
of the torch one so that `vgraph check-onnx` compares two implementations."""
from __future__ import annotations

from vgraph.backends.onnx import NodeLowering, register_lowering


def lower(n: NodeLowering) -> list[str]:
    up = n.linear(n.inputs[0], n.param("up_weight"), n.param("up_bias"), "up")
    value, gate = n.op("Split", [up], "halves", outputs=2, axis=-1, num_outputs=2)
    act = n.op("Gelu", [gate], "gelu", approximate=n.cfg["approximate"])
    hidden = n.op("Mul", [value, act], "gated")
    return [n.linear(hidden, n.param("down_weight"), n.param("down_bias"), "down", out=n.out(0))]


def register() -> None:
    # positionwise: each position's output reads only that position, so a KV-cache decoder may run it on
    # the new positions alone (`vgraph export-onnx --kv-cache`)
    register_lowering("geglu", lower, positionwise=True)


def lower_gelu_ffn(n: NodeLowering) -> list[str]:
    up = n.linear(n.inputs[0], n.param("up_weight"), n.param("up_bias"), "up")
    act = n.op("Gelu", [up], "gelu", approximate="none")
    return [n.linear(act, n.param("down_weight"), n.param("down_bias"), "down", out=n.out(0))]


def register_gelu_ffn() -> None:
    register_lowering("gelu_ffn", lower_gelu_ffn, positionwise=True)
