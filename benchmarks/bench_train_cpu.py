"""Training step time on the CPU: vgraph-compiled graph vs a hand-written PyTorch model, side by side.

One training step = forward + backward + Adam step (+ zero_grad), float32,
batch `--batch` of `seq_len` tokens.  Variants, all on the same weights
(the vgraph seed-0 initialisation, copied into the hand-written model):

* ``vgraph fused``    the production pipeline (dead-nodes, precision, fuse-heads,
                      fuse-lm-head-ce), exactly what `vgraph train` runs (dropout
                      masks keyed by step like its loop does);
* ``vgraph unfused``  `--no-fuse` (dead-nodes, precision): per-head attention nodes,
                      plain LM head + cross-entropy cost;
* ``handwritten``     benchmarks/handwritten_model.py: nn.Linear, fused QKV + SDPA,
                      F.cross_entropy on the full logits;
* ``... +compile``    the same under `torch.compile` (with `--compile`);
* ``gemm``            a large float32 GEMM (the machine's matmul throughput, measured
                      in the same rounds so that load from other processes hits it alike).

Every round runs each variant once, the order rotating from round to round;
the table reports medians over the timed rounds after `--warmup` rounds.
MFU = model FLOPs per step / step time / GEMM throughput, with model FLOPs
= 3 x the forward FLOPs `vgraph analyze` counts for the unfused network (the
full S x S attention square, matmuls and elementwise ops).

OpenMP: torch's CPU thread pool is libgomp, whose default makes a thread that
waits at the end of a parallel op spin; when other processes share the
cores (as on the project's 2-core machines), every op then waits for a
descheduled thread and eager step times triple and scatter.
`--omp-wait-policy passive` (the default here) sets OMP_WAIT_POLICY=PASSIVE
before torch loads; `default` leaves libgomp's behaviour.  It applies to every
variant alike.

    .venv/bin/python benchmarks/bench_train_cpu.py [--network 6|8|tiny] [--batch 8] [--rounds 7]
        [--warmup 2] [--threads 2] [--compile] [--variants fused,unfused,handwritten]
        [--omp-wait-policy passive|active|default] [--lm-head]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
POLICIES = ("passive", "active", "default")


def _omp_policy(argv: list[str]) -> str:
    """--omp-wait-policy from the command line, read before torch (and libgomp) load."""
    for i, arg in enumerate(argv):
        if arg.startswith("--omp-wait-policy="):
            return arg.split("=", 1)[1]
        if arg == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1]
    return "passive"


if "torch" not in sys.modules and _omp_policy(sys.argv[1:]) in ("passive", "active"):
    os.environ["OMP_WAIT_POLICY"] = _omp_policy(sys.argv[1:]).upper()

import torch  # noqa: E402

import vgraph  # noqa: E402
from handwritten_model import HandwrittenConfig, HandwrittenTransformer, load_vgraph_state  # noqa: E402
from rounds import paired_median, rotated, rounds_note, timed_rounds  # noqa: E402
from tools.gen_networks import PRODUCTION, TINY  # noqa: E402
from vgraph.backends.torch import compile_network, prepare_graph  # noqa: E402
from vgraph.backends.torch.training.optimizers import NodeOptimizers, make_adam  # noqa: E402
from vgraph.cost.analyze import analyze  # noqa: E402

NETWORKS = {
    "6": ("distributed_attention_example_6_swiglu_head.yml", PRODUCTION),
    "8": ("distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml", PRODUCTION),
    "tiny": ("tiny_2l.yml", TINY),
}
LR = 6e-4


def network_path(key: str) -> Path:
    name, _ = NETWORKS[key]
    return (ROOT / "networks" / name) if key != "tiny" else (ROOT / "tests" / "fixtures" / name)


@dataclass
class Variant:
    name: str
    step: Callable[[], torch.Tensor]
    loss_eval: Callable[[], float]
    setup_s: float = 0.0


def vgraph_variant(name: str, graph: vgraph.Graph, fuse: bool, ids: torch.Tensor, targets: torch.Tensor,
                   compiled: bool) -> Variant:
    """A training step exactly as `vgraph train`'s loop runs it."""
    start = time.perf_counter()
    prepared = prepare_graph(graph, fuse=fuse, target="cpu")
    module = compile_network(prepared, device="cpu", train=True, seed=0)
    optimizers = NodeOptimizers(module, LR)
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    forward = torch.compile(program.module) if compiled else program.module
    args = [ids if name_.startswith("embedder") else targets for name_ in program.feeds]

    steps = itertools.count(1)

    def step() -> torch.Tensor:
        with dropout_keyed_like_train(next(steps)):
            out = forward(*args)
        loss = out[costs[0]]
        loss.backward()
        for opt in optimizers.optimizers:
            opt.step()
        optimizers.zero_grad()
        return loss.detach()

    def loss_eval() -> float:
        module.eval()
        try:
            with torch.no_grad():
                feeds = {f: (ids if f.startswith("embedder") else targets) for f in module.feeds_needed(costs)}
                return float(module(feeds, want=costs)[costs[0]])
        finally:
            module.train()

    variant = Variant(name, step, loss_eval, time.perf_counter() - start)
    variant.module = module  # type: ignore[attr-defined]
    return variant


def dropout_keyed_like_train(step: int):
    """`vgraph train` keys dropout masks by (seed, step, VNode, sample) (backends/torch/lowering/dropout.py)."""
    try:
        from vgraph.backends.torch.lowering.dropout import dropout_key
    except ImportError:  # a tree without keyed dropout: F.dropout on the global RNG, as train then does
        return contextlib.nullcontext()
    return dropout_key(0, step)


def handwritten_variant(name: str, cfg: HandwrittenConfig, unfused_state, ids, targets, compiled: bool) -> Variant:
    start = time.perf_counter()
    model = HandwrittenTransformer(cfg)
    load_vgraph_state(model, unfused_state)
    model.train()
    optimizer = make_adam([{"params": list(model.parameters()), "lr": LR}])  # fused Adam, like vgraph
    forward = torch.compile(model) if compiled else model

    def step() -> torch.Tensor:
        loss = forward(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def loss_eval() -> float:
        model.eval()
        try:
            with torch.no_grad():
                return float(model(ids, targets))
        finally:
            model.train()

    return Variant(name, step, loss_eval, time.perf_counter() - start)


def gemm_variant(size: int, reps: int) -> tuple[Variant, int]:
    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def step() -> torch.Tensor:
        out = None
        for _ in range(reps):
            out = a @ b
        return out

    return Variant("gemm", step, lambda: 0.0), 2 * size**3 * reps


def machine_line(load: tuple[float, float, float]) -> str:
    return (f"{platform.machine()} {os.cpu_count()}-core CPU, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; "
            f"load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")


def lm_head_table(cfg: HandwrittenConfig, batch: int, rounds: int, warmup: int) -> None:
    """Forward + backward of the tied LM head and its loss alone, plain vs fused, alternating."""
    import torch.nn.functional as F

    from vgraph.backends.torch.lowering.kernels import tied_lm_head_ce

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cfg.seq_len, cfg.dim, generator=gen).requires_grad_()
    w = (torch.randn(cfg.vocab, cfg.dim, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)

    def plain():
        return F.cross_entropy(F.linear(x, w).reshape(-1, cfg.vocab), t.reshape(-1))

    def fused():
        return tied_lm_head_ce(x, w, t)

    grads = {}

    def run(name: str, loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            x.grad = w.grad = None
            loss().backward()
            grads[name] = (x.grad, w.grad)
        return go

    base = "F.linear + F.cross_entropy"
    runs = {base: plain, "kernels.tied_lm_head_ce (chunked)": fused}
    times = timed_rounds({name: run(name, fn) for name, fn in runs.items()}, rounds, warmup)
    (px, pw), (fx, fw) = (grads[name] for name in runs)
    err = max(float((fx - px).abs().max() / px.abs().max()), float((fw - pw).abs().max() / pw.abs().max()))
    print(f"\nLM head + loss alone ({batch * cfg.seq_len} rows x vocab {cfg.vocab} x dim {cfg.dim}, forward + "
          f"backward, {rounds} alternating rounds; gradients agree to {err:.1e} relative):\n")
    print("| loss | ms (median) | vs plain (median of per-round ratios) |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {paired_median(ts, times[base]):.3f} |")
    print(f"\nFused / plain LM head + loss: {paired_median(times['kernels.tied_lm_head_ce (chunked)'], times[base]):.3f} "
          f"({rounds_note(rounds)}).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=sorted(NETWORKS), default="6")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd fused vgraph and handwritten")
    ap.add_argument("--variants", default="fused,unfused,handwritten",
                    help="comma list of fused, unfused, handwritten (compile adds their +compile twins)")
    ap.add_argument("--gemm-size", type=int, default=2048)
    ap.add_argument("--omp-wait-policy", choices=POLICIES, default="passive",
                    help="OMP_WAIT_POLICY for torch's threads (set before torch loads; 'default': leave it)")
    ap.add_argument("--lm-head", action="store_true",
                    help="time only the LM head + loss (plain vs the fused chunked kernel) and exit")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()

    path = network_path(args.network)
    name, specs = NETWORKS[args.network]
    spec = specs[name]
    graph = vgraph.load(path)
    cfg = HandwrittenConfig.from_spec(spec)
    if args.lm_head:
        print(f"Machine: {machine_line(load_before)}. Date: {datetime.date.today().isoformat()}.")
        lm_head_table(cfg, args.batch, max(args.rounds, 10), args.warmup)
        return 0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=gen)

    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    variants: list[Variant] = []
    unfused_state = None
    for compiled in ([False, True] if args.compile else [False]):
        suffix = " +compile" if compiled else ""
        for kind in wanted:
            if compiled and kind == "unfused":
                continue
            if kind in ("fused", "unfused"):
                v = vgraph_variant(f"vgraph {kind}{suffix}", graph, kind == "fused", ids, targets, compiled)
                if unfused_state is None:
                    unfused_state = v.module.unfused_state_dict()  # type: ignore[attr-defined]
                variants.append(v)
            elif kind == "handwritten":
                if unfused_state is None:
                    unfused_state = compile_network(prepare_graph(graph, fuse=False), seed=0).unfused_state_dict()
                variants.append(handwritten_variant(f"handwritten{suffix}", cfg, unfused_state, ids, targets,
                                                    compiled))
            else:
                ap.error(f"unknown variant {kind!r}")
    gemm, gemm_flops = gemm_variant(args.gemm_size, 4)

    # Same weights, same function: the eval losses agree (before any training step).
    losses = {v.name: v.loss_eval() for v in variants}
    ref = next(iter(losses.values()))
    loss_diff = max(abs(l - ref) / abs(ref) for l in losses.values())

    model_flops = 3 * analyze(graph).flops_per_sample * args.batch
    tokens = args.batch * cfg.seq_len
    everything = [*variants, gemm]
    times: dict[str, list[float]] = {v.name: [] for v in everything}
    first: dict[str, float] = {}
    for r in range(args.warmup + args.rounds):
        for v in rotated(everything, r):
            start = time.perf_counter()
            v.step()
            elapsed = time.perf_counter() - start
            if r == 0:
                first[v.name] = elapsed
            if r >= args.warmup:
                times[v.name].append(elapsed)
        print(f"round {r + 1}/{args.warmup + args.rounds}: " +
              ", ".join(f"{v.name} {times[v.name][-1] * 1e3:.0f} ms" if r >= args.warmup else
                        f"{v.name} (warm-up)" for v in everything), file=sys.stderr)

    med = {k: statistics.median(v) for k, v in times.items()}
    gemm_rate = gemm_flops / med["gemm"]
    base_name = {False: "handwritten", True: "handwritten +compile"}

    def paired(name: str, ref: str) -> float | None:
        """Median over rounds of this round's ratio: robust to load that changes between rounds."""
        if ref not in times:
            return None
        return paired_median(times[name], times[ref])

    def round_mfu(name: str) -> float:
        return statistics.median(model_flops / t / (gemm_flops / g) for t, g in zip(times[name], times["gemm"]))
    date = datetime.date.today().isoformat()
    print(f"\n### Training step, {graph.name}, batch {args.batch} x {cfg.seq_len} tokens, CPU float32\n")
    print(f"Command: `.venv/bin/python benchmarks/bench_train_cpu.py {' '.join(argv or sys.argv[1:])}`".rstrip())
    print(f"\nMachine: {machine_line(load_before)}. Date: {date}. {args.rounds} timed rounds after {args.warmup} "
          f"warm-up rounds, medians; order rotates every round.")
    print(f"Model FLOPs per step: {model_flops / 1e9:.1f} GFLOP (3 x forward, `vgraph analyze`). "
          f"GEMM ({args.gemm_size}^3 float32, same rounds): {gemm_rate / 1e9:.1f} GFLOP/s. "
          f"Eval losses on the same weights agree to {loss_diff:.1e} (relative).\n")
    print("| variant | step (ms) | min-max (ms) | tokens/s | vs handwritten | GFLOP/s | MFU | first step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        t = med[v.name]
        ratio = paired(v.name, base_name[v.name.endswith("+compile")])
        print(f"| {v.name} | {t * 1e3:.0f} | {min(times[v.name]) * 1e3:.0f}-{max(times[v.name]) * 1e3:.0f} | "
              f"{tokens / t:,.0f} | {'-' if ratio is None else f'{ratio:.3f}'} | {model_flops / t / 1e9:.1f} | "
              f"{round_mfu(v.name):.0%} | {first[v.name]:.1f} |")
    print(f"| gemm {args.gemm_size}^3 x4 | {med['gemm'] * 1e3:.0f} | "
          f"{min(times['gemm']) * 1e3:.0f}-{max(times['gemm']) * 1e3:.0f} | - | - | {gemm_rate / 1e9:.1f} | 100% | - |")
    print("\nRatios and MFU are medians of the per-round values (each round runs every variant back to back).")
    if "vgraph fused" in times and "handwritten" in times:
        print(f"vgraph fused / handwritten step time = {paired('vgraph fused', 'handwritten'):.3f} "
              f"({rounds_note(args.rounds)}).")
    if "vgraph fused" in times and "vgraph unfused" in times:
        print(f"Head fusion: fused / unfused step time = {paired('vgraph fused', 'vgraph unfused'):.3f} "
              f"({rounds_note(args.rounds)}).")
    if "vgraph fused +compile" in times and "handwritten" in times:
        print(f"Best of each: vgraph fused +compile / handwritten (eager) = "
              f"{paired('vgraph fused +compile', 'handwritten'):.3f} ({rounds_note(args.rounds)}).")
    print(f"Load average after the run: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
