"""Prepared corpora: prepare throughput against the tokenizers library, and training memory against corpus size.

Two claims of issue 24, measured side by side in one run:

1. `vgraph data prepare` of a generated corpus (default 2 GB; deterministic,
   built from the standard library's docstrings, written once into --workdir
   and reused) runs at >= 0.8x the throughput of the `tokenizers` library's
   own batch encoding (`encode_batch_fast`) of the same units of the same
   files, with the same number of processes, each single-threaded.  The
   baseline reads and encodes only; prepare also splits, hashes, writes and
   checksums the shards.
2. Training the 6-layer production network from those shards for 200 steps
   grows resident memory (VmRSS from /proc, sampled every 0.1 s) by < 200 MB
   over the run after a warm-up of --warm steps, and the same run on a 4 MB
   corpus grows about as much: windows are read, not mapped
   (vgraph/data/shards.py ShardFile), so memory does not follow the corpus size.

With `--rounds N` each comparison runs N times, its two sides in an order that turns every round, and the
ratio and the differences printed are medians of the rounds' own (benchmarks/rounds.py); the default is one
round, the full run taking tens of minutes.

    python benchmarks/bench_data.py                    # 2 GB, 200 steps (tens of minutes on 2 cores)
    python benchmarks/bench_data.py --smoke            # seconds: the suite's smoke setting
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from rounds import paired_median, rotated, rounds_note  # noqa: E402

NET6 = ROOT / "networks" / "distributed_attention_example_6_swiglu_head.yml"
TINY = ROOT / "tests" / "fixtures" / "tiny_2l.yml"


def generate(path: Path, size: int, seed: int = 0) -> None:
    """A deterministic text corpus of `size` bytes: documents of 1-8 stdlib docstrings each, separated by
    lines <|endoftext|> (built once; a file of the right size is reused)."""
    if path.is_file() and path.stat().st_size >= size:
        return
    from vgraph.data.stdlib_corpus import default_corpus_documents

    docs = default_corpus_documents(max_bytes=min(size, 4_000_000))
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    written, n = 0, 0
    with open(tmp, "w", encoding="utf-8") as fh:
        while written < size:
            text = f"Document {n}.\n" + "\n\n".join(rng.choice(docs) for _ in range(rng.randint(1, 8)))
            chunk = text + "\n<|endoftext|>\n"
            fh.write(chunk)
            written += len(chunk.encode("utf-8"))
            n += 1
    os.replace(tmp, path)


def _baseline_unit(args: tuple[str, int, int]) -> int:
    """One unit, the library's way: read it, split it into documents, encode them in one batch call."""
    path, start, end = args
    with open(path, "rb") as fh:
        fh.seek(start)
        text = fh.read(end - start).decode("utf-8")
    docs = [d for d in text.split("\n<|endoftext|>\n") if d.strip()]
    _TOKENIZER[0].encode_batch_fast(docs, add_special_tokens=False)
    return end - start


_TOKENIZER: list = []


def _baseline_init(tokenizer_json: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _TOKENIZER.append(Tokenizer.from_str(tokenizer_json))


def baseline(path: Path, tokenizer_json: str, workers: int, unit_bytes: int) -> float:
    """Seconds the tokenizers library takes for the same units with `workers` processes."""
    from vgraph.data.sources import find_sources, plan_units

    units = plan_units(find_sources([str(path)]), unit_bytes)
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_baseline_init,
                                initargs=(tokenizer_json,)) as pool:
        sum(pool.map(_baseline_unit, [(str(path), u.start, u.end) for u in units]))
    return time.perf_counter() - t0


def prepare_once(path: Path, out: Path, tokenizer: Path, workers: int, unit_bytes: int) -> float:
    import shutil

    from vgraph.data.prepare import PrepareOptions, prepare

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    prepare([str(path)], out, PrepareOptions(tokenizer=str(tokenizer), workers=workers, unit_bytes=unit_bytes),
            say=lambda m: None, progress=False)
    return time.perf_counter() - t0


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of `pid` in bytes (/proc/PID/status)."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out


def rss_of_training(network: Path, data: Path, out: Path, steps: int, batch: int, threads: int, warm: int) -> dict:
    """Run `vgraph train` in a child process, sampling its memory every 0.1 s: VmRSS after step 1, after step
    `warm` and at its highest afterwards, and from step `warm` to the last step (before the run's final
    checkpoint is written) the growth of VmRSS, RssAnon (the process's own memory) and RssFile (file pages
    mapped in, e.g. a memory-mapped shard's).  The first steps are a warm-up whatever the corpus (the
    optimizer's state appears at step 1, the allocator's pools over the next few: the 6-layer network's
    RssAnon rose 778 -> 1,098 MB over steps 1-4, then stayed within 1,084-1,135 MB to step 50)."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "vgraph.backends.torch.cli", "train", str(network), "--data", str(data), "--steps",
           str(steps), "--batch", str(batch), "--threads", str(threads), "--val-every", "0", "--checkpoint-every", "0",
           "--no-tensorboard", "--quiet", "--device", "cpu", "--out", str(out)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    samples: list[tuple[int, dict[str, int]]] = []  # (steps logged, memory)

    def watch() -> None:
        metrics = out / "metrics.jsonl"
        while proc.poll() is None:
            try:
                memory = _status(proc.pid)
                logged = metrics.read_text().count("\n") if metrics.is_file() else 0
            except (OSError, ValueError):
                break
            if "VmRSS" in memory:
                samples.append((logged, memory))
            time.sleep(0.1)

    t0 = time.perf_counter()
    thread = threading.Thread(target=watch)
    thread.start()
    _, err = proc.communicate()
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"training failed: {err[-2000:]}")
    after_first = [m for logged, m in samples if logged >= 1] or [m for _, m in samples[-1:]]
    stepping = [m for logged, m in samples if warm <= logged < steps] or after_first[-1:]

    def grew(key: str, rows: list[dict[str, int]]) -> int:
        return max(m.get(key, 0) for m in rows) - rows[0].get(key, 0)

    return {"first": after_first[0]["VmRSS"], "warm": stepping[0]["VmRSS"], "peak": max(m["VmRSS"] for m in after_first),
            "growth": grew("VmRSS", after_first), "steps_growth": grew("VmRSS", stepping),
            "anon_growth": grew("RssAnon", stepping), "file_growth": grew("RssFile", stepping),
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vgraph-bench-data"), help="corpora and runs go here")
    p.add_argument("--size-mb", type=float, default=2048, help="generated corpus size (default 2048 MB)")
    p.add_argument("--small-mb", type=float, default=4, help="the small corpus of the memory comparison (4 MB)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes, both sides")
    p.add_argument("--unit-mb", type=float, default=32, help="input per unit of work (default 32 MB)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm", type=int, default=10, help="steps of warm-up before memory growth is counted (10)")
    p.add_argument("--network", type=Path, default=NET6)
    p.add_argument("--skip-prepare", action="store_true", help="only the memory comparison (prepared corpora reused)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, the tiny network, 3 steps")
    p.add_argument("--rounds", type=int, default=1, help="runs of each comparison, alternated (default 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.smoke:  # the big corpus still 4 units (both workers of both sides busy), the small one 1
        # (0.5 MB: the stdlib walk behind the corpus and the tokenizer's sample costs ~1.2 CPU-s a MB)
        args.size_mb, args.small_mb, args.unit_mb = 0.5, 0.125, 0.125
        args.steps, args.batch, args.threads, args.warm = 3, 2, 1, 1
        args.network = TINY
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VGRAPH_CACHE_DIR", str(work / "cache"))
    from vgraph.data.stdlib_corpus import default_corpus_documents
    from vgraph.data.tokenizer import train_tokenizer
    from vgraph.yamlio import load

    vocab = int(load(args.network).nodes_of_type("embedder")[0].cfg["vocab_size"])
    tokenizer = work / f"tokenizer-{vocab}.json"
    if not tokenizer.is_file():
        sample = default_corpus_documents(max_bytes=min(4_000_000, int(args.size_mb * 1e6)))
        tokenizer.write_text(train_tokenizer(sample, vocab).to_str(), encoding="utf-8")
    big, small = work / f"corpus-{args.size_mb:g}MB.txt", work / f"corpus-{args.small_mb:g}MB.txt"
    t0 = time.perf_counter()
    generate(big, int(args.size_mb * 1e6))
    generate(small, int(args.small_mb * 1e6), seed=1)
    print(f"corpora: {big} ({big.stat().st_size / 1e6:,.0f} MB), {small} ({small.stat().st_size / 1e6:,.1f} MB); "
          f"vocabulary {vocab}; {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
    unit = int(args.unit_mb * 2**20)
    prepared_big, prepared_small = work / f"prepared-{big.stem}-{vocab}", work / f"prepared-{small.stem}-{vocab}"
    if not args.skip_prepare:
        mb = big.stat().st_size / 1e6
        seconds: dict[str, list[float]] = {"tokenizers": [], "prepare": []}
        for r in range(args.rounds):
            for way in rotated(list(seconds), r):
                seconds[way].append(baseline(big, tokenizer.read_text(encoding="utf-8"), args.workers, unit)
                                    if way == "tokenizers" else
                                    prepare_once(big, prepared_big, tokenizer, args.workers, unit))
        base_s, prep_s = statistics.median(seconds["tokenizers"]), statistics.median(seconds["prepare"])
        ratio = paired_median(seconds["tokenizers"], seconds["prepare"])  # prepare's throughput over the baseline's
        print(f"\n| {args.workers} processes, {mb:,.0f} MB | seconds (median) | MB/s | ratio |\n|---|---:|---:|---:|\n"
              f"| tokenizers encode_batch_fast (read + encode) | {base_s:.1f} | {mb / base_s:.2f} | 1.00 |\n"
              f"| vgraph data prepare (read, split, hash, encode, write shards) | {prep_s:.1f} | {mb / prep_s:.2f} | "
              f"{ratio:.2f} |\n\nprepare / tokenizers throughput: {ratio:.2f} ({rounds_note(args.rounds)})", flush=True)
    prepare_once(small, prepared_small, tokenizer, args.workers, unit)
    runs: dict[str, list[dict]] = {"small": [], "big": []}
    for r in range(args.rounds):
        for name in rotated(list(runs), r):
            runs[name].append(rss_of_training(args.network, prepared_big if name == "big" else prepared_small,
                                              work / f"run-{name}", args.steps, args.batch, args.threads, args.warm))
    rows = {name: {key: statistics.median(run[key] for run in done) for key in done[0]} for name, done in runs.items()}

    def big_minus_small(key: str) -> float:
        return statistics.median(b[key] - s[key] for b, s in zip(runs["big"], runs["small"]))
    print(f"\n| training {args.network.name}, {args.steps} steps, batch {args.batch} | RSS after step 1 | "
          f"after step {args.warm} | growth from step {args.warm} to {args.steps} (RSS / anon / file) | "
          f"peak RSS, final save included | seconds |\n|---|---:|---:|---:|---:|---:|")
    mb = 2**20
    for name, r in rows.items():
        size = (big if name == "big" else small).stat().st_size / 1e6
        print(f"| {size:,.1f} MB corpus | {r['first'] / mb:,.0f} MB | {r['warm'] / mb:,.0f} MB | "
              f"{r['steps_growth'] / mb:,.1f} / {r['anon_growth'] / mb:,.1f} / {r['file_growth'] / mb:,.1f} MB | "
              f"{r['peak'] / mb:,.0f} MB | {r['seconds']:.0f} |")
    print(f"\ngrowth from step {args.warm}, big - small corpus: {big_minus_small('steps_growth') / mb:,.1f} MB; "
          f"peak RSS, big - small corpus: {big_minus_small('peak') / mb:,.1f} MB ({rounds_note(args.rounds)}); "
          f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
