"""The networks benchmark scripts run, by the short name their `--network(s)` option takes.

One table, so that a script added later names the same files the same way.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NETWORK_FILES = {
    "6": ROOT / "networks" / "distributed_attention_example_6_swiglu_head.yml",
    "8": ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml",
    "12": ROOT / "networks" / "distributed_attention_example_12_swiglu_head_vocab32768_seq2048.yml",
    "tiny": ROOT / "tests" / "fixtures" / "tiny_2l.yml",
}
LABELS = {"6": "6-layer", "8": "8-layer", "12": "12-layer", "tiny": "tiny_2l"}
