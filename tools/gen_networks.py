"""Generate the production networks (and tiny variants) as network YAML.

The production networks follow the compute network's description of them
(block diagram, colocation groups, tied embedding, precision policy), which
networks/README.md restates; the format is docs/network-yaml.md.  The generator
itself is installed (`vgraph/ir/transformer.py`, what `vgraph new` runs); this
script names the checked-in networks and fixtures it writes.  `python tools/gen_networks.py`
rewrites networks/*.yml; a test checks the checked-in files equal this output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vgraph.ir.transformer import BLOCK_VNODES, TransformerSpec, synthetic, transformer  # noqa: F401 (re-exported)
from vgraph.yamlio import dumps

ROOT = Path(__file__).resolve().parent.parent


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
    # Llama-style (grouped-query attention, RMSNorm, no biases, a SwiGLU MLP of 48), per head and fused
    "tiny_gqa.yml": TransformerSpec("tiny-gqa", layers=2, vocab=64, seq_len=8, dim=32, heads=4, ffn=96,
                                    head_up=64, precision=None, kv_heads=2, norm="rmsnorm", bias=False,
                                    ffn_kind="swiglu"),
    "tiny_gqa_fused.yml": TransformerSpec("tiny-gqa-fused", layers=2, vocab=64, seq_len=8, dim=32, heads=4,
                                          ffn=96, head_up=64, precision=None, kv_heads=2, fused_attention=True,
                                          norm="rmsnorm", bias=False, ffn_kind="swiglu"),
}

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
