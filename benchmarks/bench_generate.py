"""Sampling speed: `vgraph generate` through the torch backend (the window recomputed for every token, and
the KV cache) and through onnxruntime (with and without its cache), on one trained run; whether they pick
the same greedy tokens; and a batch of prompts through the torch cache.

The recomputing torch way runs the whole right-padded context-length window for every token (what
`generate` did before the cache, `--no-kv-cache` now); the torch cache prefills the prompt once and then
runs one position per token against the cached keys and values (backends/torch/generation.py); the ONNX
decoder without a cache recomputes the context at its real length, with it runs only the new token.  All
decode greedily from the same prompt, so their tokens must be equal; the script exits 1 if they are not.
Each way is loaded once (the run, for ONNX the model built and its session created, and one token drawn:
"setup"); the sampling loop alone is timed.  The ways alternate whole generations over `--repeat` rounds
(the order turning every round) and the median per token is reported, with the prefill and decode speeds of
the median round; the last line gives each way's time per token against the first way's, the median of
the rounds' own ratios.  The batch row runs `--batch` different prompts as one left-padded batch through the
torch cache (its tokens/s counts every row's tokens; each row must equal its prompt's single run).

    .venv/bin/python benchmarks/bench_generate.py RUN [--tokens 60] [--prompt "def "] [--repeat 3] [--batch 4]
                                                      [--threads N]
    .venv/bin/python benchmarks/bench_generate.py --smoke DIR     # trains the tiny fixture 3 steps into DIR first
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from rounds import paired_median, rotated, rounds_note  # noqa: E402
from vgraph.backends.torch.cli import LogitsSource  # noqa: E402
from vgraph.backends.torch.generation import Speeds  # noqa: E402

WAYS = [("torch, window recomputed", "torch", False), ("torch, KV cache", "torch", True),
        ("onnxruntime, no cache", "onnx", False), ("onnxruntime, KV cache", "onnx", True)]
BATCH_PROMPTS = ["def ", "The ", "class ", "import ", "return ", "if ", "for ", "with "]


def smoke_run(where: Path) -> str:
    """A 3-step run of the tiny fixture network (the script's smallest setting)."""
    from vgraph.cli import main as vgraph

    tiny = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_1l_fp32.yml"
    code = vgraph(["train", str(tiny), "--steps", "3", "--batch", "2", "--val-every", "0", "--quiet",
                   "--no-tensorboard", "--corpus-bytes", "20000", "--out", str(where / "run")])
    if code:
        raise SystemExit(f"training the smoke run failed ({code})")
    return str(where / "run")


def timed(source: LogitsSource, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, Speeds]:
    """(rows, seconds, speeds) of one greedy generation of `prompts`."""
    source.speeds = Speeds()
    start = time.perf_counter()
    rows = source.sample_many(prompts, max_new_tokens=tokens, temperature=0.0, top_k=0, seed=0)
    return rows, time.perf_counter() - start, source.speeds


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.1f}" if seconds > 0 else "-"


def main() -> int:
    """Long because it is the benchmark's one script: set up each way, alternate the rounds, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="a run directory or checkpoint of `vgraph train`")
    ap.add_argument("--smoke", metavar="DIR", help="train the tiny fixture network 3 steps into DIR and use that run")
    ap.add_argument("--tokens", type=int, default=60, help="new tokens per generation (default 60)")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--repeat", type=int, default=3, help="timed generations per way (median reported)")
    ap.add_argument("--batch", type=int, default=4, help=f"prompts of the batch row (1 to {len(BATCH_PROMPTS)})")
    ap.add_argument("--threads", type=int, help="torch's and onnxruntime's threads (default: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.run = smoke_run(Path(args.smoke))
    elif not args.run:
        ap.error("give a RUN directory (or --smoke DIR)")
    if not 1 <= args.batch <= len(BATCH_PROMPTS):
        ap.error(f"--batch is 1 to {len(BATCH_PROMPTS)}")
    sources, setup = {}, {}
    for label, backend, cache in WAYS:  # setup: load, build, and a first token (the torch program is traced)
        start = time.perf_counter()
        sources[label] = LogitsSource(args.run, backend=backend, kv_cache=cache)
        prompt = sources[label].encode(args.prompt)
        sources[label].sample(prompt, max_new_tokens=1, temperature=0.0, top_k=0, seed=0)
        setup[label] = time.perf_counter() - start
    cached = sources["torch, KV cache"]
    batch = [cached.encode(p) for p in BATCH_PROMPTS[: args.batch]]
    batch_label = f"torch, KV cache, batch of {args.batch}"
    rounds: dict[str, list[tuple[float, Speeds, int]]] = {label: [] for label, _, _ in WAYS}
    rounds[batch_label] = []
    ids: dict[str, list[list[int]]] = {}
    for i in range(args.repeat):
        labels = [label for label, _, _ in WAYS] + [batch_label]
        for label in rotated(labels, i):
            prompts = batch if label == batch_label else [prompt]
            rows, seconds, speeds = timed(cached if label == batch_label else sources[label], prompts, args.tokens)
            new = sum(len(r) - len(p) for r, p in zip(rows, prompts))
            rounds[label].append((seconds / max(1, new), speeds, new))
            ids[label] = rows
    reference = ids[WAYS[0][0]][0][len(prompt):]
    singles = [cached.sample(p, max_new_tokens=args.tokens, temperature=0.0, top_k=0, seed=0) for p in batch]
    print(f"run {args.run}, prompt {args.prompt!r}, {len(reference)} greedy tokens, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, {platform.machine()}, {datetime.date.today()}")
    print("| way | setup (s) | ms per token | prefill tokens/s | decode tokens/s | tokens equal to the reference |")
    print("|---|---:|---:|---:|---:|---|")
    ok = True
    for label in [label for label, _, _ in WAYS] + [batch_label]:
        per_token, speeds, _ = sorted(rounds[label], key=lambda r: r[0])[len(rounds[label]) // 2]
        if label == batch_label:
            same = ids[label] == singles
            what = "each row its single run" if same else "NO"
        else:
            same = ids[label][0][len(prompt):] == reference
            what = "yes" if same else "NO"
        ok = ok and same
        print(f"| {label} | {setup.get(label, setup['torch, KV cache']):.1f} | {per_token * 1e3:.1f} | "
              f"{rate(speeds.prefill_tokens, speeds.prefill_s)} | {rate(speeds.decode_tokens, speeds.decode_s)} "
              f"| {what} |")
    first = WAYS[0][0]
    per_round = {label: [r[0] for r in rounds[label]] for label in rounds}
    print(f"\nms per token / {first}'s: " + "; ".join(
        f"{label} {paired_median(per_round[label], per_round[first]):.3f}" for label in list(rounds)[1:])
        + f" ({rounds_note(args.repeat)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
