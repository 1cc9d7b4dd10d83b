"""Training step on a GPU with the production precision policy: step time, tokens/s, MFU, peak memory.

Made for one run on the project's H200 machine (benchmarks/gpu_check.sh runs it
there): the 8-layer network at batch 128 (65,536 tokens a step), bf16 autocast
from sm80 (fp16 + dynamic loss scaling below), float32 master weights and
Adam, float32 loss, exactly as `vgraph train` runs it.  Variants:

* ``vgraph fused``            the production pipeline (dead-nodes, precision, fuse-heads,
                              fuse-lm-head-ce): the [B, S, V] logits never exist;
* ``vgraph unfused``          `vgraph train --no-fuse`: per-head attention VNodes, plain tied
                              LM head + cross-entropy cost (the logits are materialised);
* ``vgraph no-lm-fuse``       fuse-heads without fuse-lm-head-ce (the logits are materialised);
* ``vgraph fused-global-rng`` fused, with dropout drawn by F.dropout from the global RNG
                              instead of `vgraph train`'s masks keyed per (step, VNode,
                              sample) (dropout.py): what the keying costs;
* ``handwritten``             benchmarks/handwritten_model.py under the same autocast
                              (F.cross_entropy on the full logits);
* ``... +compile``            each under `torch.compile` (with `--compile`, as time allows;
                              `--compile-backend aot_eager` checks the same path quickly on a CPU).

Graph breaks of each compiled variant's forward are counted with
`torch._dynamo.explain` (backends/torch/lowering/graph_breaks.py; goal 0).  The run
fails (exit 1, after writing the table) if the fused eager step formed a
tensor as large as the `[B, S, V]` logits.

Per variant: median step time over `--rounds` rounds of `--steps-per-round`
steps (synchronised), tokens/s, model TFLOP/s (3 x `vgraph analyze`'s
forward FLOPs), MFU against a large GEMM in the compute dtype measured in
the same run, the allocator's peak during one step above what was allocated
before it, the persistent parameter + Adam state, and the largest tensor any
op produced in one step (proof that the fused step never forms the logits).
Each variant gets one timed round as soon as it is built, then the
remaining rounds alternate between all of them.  The table is rewritten to
`--out` after every variant and round, so a run cut short still leaves its
results.

    python benchmarks/bench_gpu.py [--network 8] [--batch 128] [--device cuda] [--compile]
        [--variants fused,no-lm-fuse,handwritten,fused-global-rng] [--out results.md] [--budget-s 480]
    # on a CPU, to check the script itself:
    python benchmarks/bench_gpu.py --network tiny --batch 4 --device cpu --rounds 2
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import vgraph  # noqa: E402
from handwritten_model import HandwrittenConfig, HandwrittenTransformer, load_vgraph_state  # noqa: E402
from rounds import paired_median, rotated, rounds_note  # noqa: E402
from tools.gen_networks import PRODUCTION, TINY, transformer  # noqa: E402
from vgraph.backends.torch import compile_network, compute_dtype, prepare_graph  # noqa: E402
from vgraph.backends.torch.lowering import kernels as K  # noqa: E402
from vgraph.backends.torch.lowering.graph_breaks import explain_program  # noqa: E402
from vgraph.backends.torch.training.optimizers import NodeOptimizers, make_adam  # noqa: E402
from vgraph.backends.torch.training.setup import device_target  # noqa: E402
from vgraph.cost.analyze import analyze  # noqa: E402

NETWORKS = {
    "6": (ROOT / "networks" / "distributed_attention_example_6_swiglu_head.yml",
          PRODUCTION["distributed_attention_example_6_swiglu_head.yml"]),
    "8": (ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml",
          PRODUCTION["distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml"]),
    "tiny": (ROOT / "tests" / "fixtures" / "tiny_2l.yml", TINY["tiny_2l.yml"]),
    # tiny's one-block twin (same shapes and precision policy), written from its spec as tools/gen_networks.py
    # writes the fixtures: the suite's smoke compiles it (dynamo's tracing and AOT autograd cost ~1.3 CPU-s a block)
    "tiny-1l": (None, dataclasses.replace(TINY["tiny_2l.yml"], name="tiny-1l", layers=1)),
}
# kind -> prepare_graph arguments (None: the production pipeline; fuse=False: `--no-fuse`)
PIPELINES = {"fused": {}, "unfused": {"fuse": False}, "no-lm-fuse": {"passes": "dead-nodes,precision,fuse-heads"},
             "fused-global-rng": {}}
COMPILED_FIRST = ("fused", "handwritten", "unfused", "no-lm-fuse", "fused-global-rng")  # as the budget allows
LR = 6e-4
GOAL_MS = 60.0


@dataclass
class Variant:
    name: str
    step: Callable[[], Any]
    persistent_bytes: Callable[[], int]
    compiled: bool = False
    breaks: int | None = None  # graph breaks of the compiled forward
    times: list[float] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(params, optimizers) -> int:
    total = sum(p.numel() * p.element_size() for p in params)
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _amp(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def _dropout_key(step: int):
    """`vgraph train` keys dropout masks by (seed, step, VNode, sample) (backends/torch/lowering/dropout.py)."""
    try:
        from vgraph.backends.torch.lowering.dropout import dropout_key
    except ImportError:
        return contextlib.nullcontext()
    return dropout_key(0, step)


def _compile(module, backend: str, variant_name: str):
    """torch.compile with a counting backend: how many graphs were compiled over the whole run (1: one graph
    per step and no recompilation, whatever the step's dropout key)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    COMPILES[variant_name] = counter
    return torch.compile(module, backend=counter)


COMPILES: dict[str, Any] = {}


def vgraph_variant(kind: str, graph, device, ids, targets, compiled: bool, backend: str = "inductor") -> Variant:
    """One training step as `vgraph train` runs it (autocast, loss scaling below sm80, fused Adam)."""
    prepared = prepare_graph(graph, target=device_target(device), **PIPELINES[kind])
    module = compile_network(prepared, device=device, train=True, seed=0)
    optimizers = NodeOptimizers(module, LR)
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    name = f"vgraph {kind}{' +compile' if compiled else ''}"
    forward = _compile(program.module, backend, name) if compiled else program.module
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]
    dtype = compute_dtype(prepared)
    scaling = bool((prepared.meta.get("precision") or {}).get("loss_scaling")) and dtype == torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=scaling)

    steps = itertools.count(1)
    keyed = kind != "fused-global-rng"

    def step():
        with _amp(device, dtype), (_dropout_key(next(steps)) if keyed else contextlib.nullcontext()):
            out = forward(*args)
        loss = out[costs[0]]
        scaler.scale(loss).backward()
        for opt in optimizers.optimizers:
            scaler.step(opt)
        scaler.update()
        optimizers.zero_grad()
        return loss.detach()

    name = f"vgraph {kind}{' +compile' if compiled else ''}"
    variant = Variant(name, step, lambda: _state_bytes(module.parameters(), optimizers.optimizers), compiled)
    if compiled:
        variant.breaks = explain_program(name, program.module, args, dtype=dtype, device_type=device.type,
                                         reset=False).breaks
    variant.result["dtype"] = str(dtype).removeprefix("torch.")
    variant.result["passes"] = ",".join(prepared.meta.get("applied_passes", []))
    variant.module = module  # type: ignore[attr-defined]
    return variant


def handwritten_variant(cfg: HandwrittenConfig, unfused_state, device, dtype, ids, targets, compiled,
                        backend: str = "inductor") -> Variant:
    model = HandwrittenTransformer(cfg)
    load_vgraph_state(model, unfused_state)
    model.to(device).train()
    optimizer = make_adam([{"params": list(model.parameters()), "lr": LR}])
    forward = _compile(model, backend, "handwritten +compile") if compiled else model
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step():
        with _amp(device, dtype):
            loss = forward(ids, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    variant = Variant(f"handwritten{' +compile' if compiled else ''}", step,
                      lambda: _state_bytes(model.parameters(), [optimizer]), compiled)
    if compiled:
        variant.breaks = explain_program(variant.name, model, [ids, targets], dtype=dtype,
                                         device_type=device.type, reset=False).breaks
    variant.result["dtype"] = str(dtype).removeprefix("torch.")
    variant.result["passes"] = "-"
    return variant


class LargestTensor(TorchDispatchMode):
    """The largest tensor any aten op produces while active, overall and with a last dim of `vocab`."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.numel = 0
        self.shape: tuple[int, ...] = ()
        self.vocab_numel = 0
        self.vocab_shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            if leaf.numel() > self.numel:
                self.numel, self.shape = leaf.numel(), tuple(leaf.shape)
            if leaf.dim() and leaf.shape[-1] == self.vocab and leaf.numel() > self.vocab_numel:
                self.vocab_numel, self.vocab_shape = leaf.numel(), tuple(leaf.shape)
        return out


def _label(kind: str, compiled: bool) -> str:
    return f"{kind if kind == 'handwritten' else 'vgraph ' + kind}{' +compile' if compiled else ''}"


def _time_round(variant: Variant, device: torch.device, steps: int) -> None:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        variant.step()
    _sync(device)
    variant.times.append((time.perf_counter() - start) / steps)


def measure_memory(variant: Variant, device: torch.device) -> None:
    """Peak allocator bytes during one step above what was allocated before it (CUDA only)."""
    variant.result["persistent_bytes"] = variant.persistent_bytes()
    if device.type != "cuda":
        return
    gc.collect()
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    variant.step()
    _sync(device)
    variant.result["step_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before


def largest_tensor(variant: Variant, device: torch.device, vocab: int) -> None:
    if variant.compiled:
        return  # a dispatch mode sees a compiled graph's ops only partly; the eager twin answers
    tracker = LargestTensor(vocab)
    with tracker:
        variant.step()
    _sync(device)
    variant.result["largest_shape"] = tracker.shape
    variant.result["vocab_shape"] = tracker.vocab_shape
    variant.result["vocab_numel"] = tracker.vocab_numel


def gemm_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square GEMM in `dtype` (the throughput MFU is relative to)."""
    n = 8192 if device.type == "cuda" else 1536
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10 if device.type == "cuda" else 3):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def environment(device: torch.device) -> str:
    parts = [f"torch {torch.__version__}", f"Python {platform.python_version()}", platform.machine()]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts.insert(0, f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}, "
                        f"{props.multi_processor_count} SMs), CUDA {torch.version.cuda}")
    else:
        parts.insert(0, f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    return ", ".join(parts)


def render(args, graph, variants, tokens, model_flops, rate, gemm_dtype, env, started) -> str:
    gib = 2**30
    lines = [
        f"### Training step on {args.device}: {graph.name}, batch {args.batch} x {tokens // args.batch} tokens",
        "",
        f"Command: `python benchmarks/bench_gpu.py {' '.join(args.argv)}`".replace("  ", " "),
        f"Machine: {env}. Date: {datetime.date.today().isoformat()}. Wall time of the run so far: "
        f"{time.perf_counter() - started:.0f} s.",
        f"Model FLOPs per step: {model_flops / 1e12:.2f} TFLOP (3 x forward, `vgraph analyze`). "
        f"GEMM reference ({gemm_dtype}, same run): {rate / 1e12:.1f} TFLOP/s. Medians of up to {args.rounds} rounds x "
        f"{args.steps_per_round} steps (one right after a variant is built, the rest alternating).",
        "",
        "| variant | compute | step (ms) | tokens/s | model TFLOP/s | MFU | step peak above start (GiB) | "
        "params + Adam (GiB) | largest tensor | largest [..., V] tensor | graph breaks | graphs compiled | "
        "first step (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for v in variants:
        r = v.result
        if not v.times:
            lines.append(f"| {v.name} | {r.get('dtype', '-')} | {r.get('skipped', 'not measured')} | | | | | | | | | | |")
            continue
        t = statistics.median(v.times)
        peak = r.get("step_peak_bytes")
        shape, vshape = r.get("largest_shape"), r.get("vocab_shape")
        lines.append(
            f"| {v.name} | {r['dtype']} | {t * 1e3:.1f} | {tokens / t:,.0f} | {model_flops / t / 1e12:.1f} | "
            f"{model_flops / t / rate:.0%} | {'-' if peak is None else f'{peak / gib:.2f}'} | "
            f"{r['persistent_bytes'] / gib:.2f} | {'-' if shape is None else 'x'.join(map(str, shape))} | "
            f"{'-' if vshape is None else 'x'.join(map(str, vshape)) or 'none'} | "
            f"{'-' if v.breaks is None else v.breaks} | "
            f"{COMPILES[v.name].frame_count if v.name in COMPILES else '-'} | {r.get('first_s', 0):.1f} |")
    logits = args.batch * (tokens // args.batch) * graph.node("embedder").cfg["vocab_size"]
    lines += ["", f"The logits would be {args.batch} x {tokens // args.batch} x "
                  f"{graph.node('embedder').cfg['vocab_size']} = {logits:,} elements."]
    vocab, dim = graph.node("embedder").cfg["vocab_size"], graph.node("embedder").cfg["dim"]
    chunk = K.default_ce_chunk_size(vocab, device=args.device, dim=dim)
    rows = args.batch * (tokens // args.batch)
    if chunk >= rows:
        lines.append(f"One chunk of the fused CE holds all {rows:,} rows here (chunk {chunk:,} rows at vocab "
                     f"{vocab:,}), so the fused step forms them too; the check applies when chunk < rows.")
    for v in variants:
        if "vocab_numel" in v.result:
            verdict = "formed" if v.result["vocab_numel"] >= logits else "never formed"
            lines.append(f"{v.name}: largest tensor with last dim V has {v.result['vocab_numel']:,} elements: "
                         f"the logits are {verdict}.")
    best = min(((statistics.median(v.times), len(v.times)) for v in variants
                if v.times and v.name in ("vgraph fused", "vgraph fused +compile")), default=None)
    if best is not None and args.device.startswith("cuda"):
        lines.append(f"Best vgraph fused step: {best[0] * 1e3:.1f} ms (median of {best[1]} rounds; goal: under "
                     f"{GOAL_MS:.0f} ms on an H200).")
    lines += ratio_lines(variants)
    return "\n".join(lines) + "\n"


RATIOS = [("vgraph fused", "handwritten"), ("vgraph fused +compile", "handwritten +compile"),
          ("vgraph fused", "vgraph unfused")]


def ratio_lines(variants: list[Variant]) -> list[str]:
    """The comparisons the goals are read on, from the alternated rounds only (a variant's first round ran
    right after it was built, alone): the median of the rounds' own ratios, with their count."""
    by_name = {v.name: v.times for v in variants if "skipped" not in v.result}
    out = []
    for a, b in RATIOS:
        n = min(len(by_name.get(a, [])), len(by_name.get(b, []))) - 1
        if n >= 1:
            out.append(f"{a} / {b} step: {paired_median(by_name[a][1:n + 1], by_name[b][1:n + 1]):.3f} "
                       f"({rounds_note(n)})")
    return out


def network(name: str):
    """(graph, TransformerSpec) of a NETWORKS entry: its file loaded, or one with no file written from its spec
    (the YAML `tools/gen_networks.py` would check in) and loaded back, as a file is."""
    path, spec = NETWORKS[name]
    if path is not None:
        return vgraph.load(path), spec
    from vgraph.yamlio import dumps, loads

    return loads(dumps(transformer(spec)), file=f"<{spec.name}>"), spec


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=sorted(NETWORKS), default="8")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="fused,unfused,handwritten,no-lm-fuse,fused-global-rng")
    ap.add_argument("--compile-variants", help="the variants compiled with --compile (default: --variants)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled twins (aot_eager: the same tracing, no codegen)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd twins, as --budget-s allows")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before measuring")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="stop adding variants (compiled ones first) once this much wall time is spent")
    ap.add_argument("--out", type=Path, help="also write the markdown table (and a .json) here")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    args = ap.parse_args(argv)
    args.argv = argv
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available on this machine; use --device cpu to check the script", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 stays float32, as in `vgraph train`

    graph, spec = network(args.network)
    cfg = HandwrittenConfig.from_spec(spec)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=gen).to(device)
    tokens = args.batch * cfg.seq_len
    model_flops = 3 * analyze(graph).flops_per_sample * args.batch
    env = environment(device)
    dtype = compute_dtype(prepare_graph(graph, target=device_target(device)))
    rate = gemm_rate(device, dtype)
    gemm_dtype = str(dtype).removeprefix("torch.")
    print(f"{env}; compute {gemm_dtype}; GEMM {rate / 1e12:.2f} TFLOP/s", file=sys.stderr, flush=True)

    kinds = [k.strip() for k in args.variants.split(",") if k.strip()]
    unknown = [k for k in kinds + [k.strip() for k in (args.compile_variants or "").split(",") if k.strip()]
               if k not in (*PIPELINES, "handwritten")]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}: choose from {', '.join([*PIPELINES, 'handwritten'])}")
    compile_kinds = [k.strip() for k in (args.compile_variants or args.variants).split(",") if k.strip()]
    compiled_order = sorted(compile_kinds, key=lambda k: COMPILED_FIRST.index(k))
    plan = [(k, False) for k in kinds] + ([(k, True) for k in compiled_order] if args.compile else [])
    variants: list[Variant] = []
    unfused_state = None

    def write() -> str:
        text = render(args, graph, variants, tokens, model_flops, rate, gemm_dtype, env, started)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text, encoding="utf-8")
            rows = [{"name": v.name, "times_s": v.times,
                     **{k: (list(x) if isinstance(x, tuple) else x) for k, x in v.result.items()}} for v in variants]
            args.out.with_suffix(".json").write_text(json.dumps(
                {"environment": env, "gemm_flops": rate, "model_flops": model_flops, "tokens": tokens,
                 "variants": rows}, indent=2), encoding="utf-8")
        return text

    for kind, compiled in plan:
        spent = time.perf_counter() - started
        if spent > args.budget_s * (0.6 if compiled else 0.9):
            skipped = Variant(_label(kind, compiled), lambda: None, lambda: 0, compiled)
            skipped.result["skipped"] = f"skipped: {spent:.0f} s of the {args.budget_s:.0f} s budget spent"
            variants.append(skipped)
            continue
        try:
            if kind == "handwritten":
                if unfused_state is None:
                    unfused_state = compile_network(prepare_graph(graph, fuse=False), seed=0).unfused_state_dict()
                v = handwritten_variant(cfg, unfused_state, device, dtype, ids, targets, compiled,
                                        args.compile_backend)
            else:
                v = vgraph_variant(kind, graph, device, ids, targets, compiled, args.compile_backend)
                if unfused_state is None:
                    unfused_state = {k: t.cpu() for k, t in v.module.unfused_state_dict().items()}
            start = time.perf_counter()
            v.step()
            _sync(device)
            v.result["first_s"] = time.perf_counter() - start
            for _ in range(args.warmup):
                v.step()
            _sync(device)
            measure_memory(v, device)
            largest_tensor(v, device, cfg.vocab)
            _time_round(v, device, args.steps_per_round)  # a result even if the run is cut short later
        except torch.OutOfMemoryError as exc:  # a variant that does not fit is a result, not a crash
            v = Variant(_label(kind, compiled), lambda: None, lambda: 0, compiled)
            v.result["skipped"] = f"out of memory: {str(exc).splitlines()[0][:80]}"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        variants.append(v)
        print(f"  built {v.name} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        write()

    live = [v for v in variants if "skipped" not in v.result]
    for r in range(args.rounds - 1):
        for v in rotated(live, r):
            _time_round(v, device, args.steps_per_round)
        print(f"  round {r + 2}/{args.rounds}: " + ", ".join(f"{v.name} {v.times[-1] * 1e3:.1f} ms" for v in live),
              file=sys.stderr, flush=True)
        write()
    print(write())
    logits = args.batch * cfg.seq_len * cfg.vocab
    chunked = K.default_ce_chunk_size(cfg.vocab, device=device, dim=cfg.dim) < args.batch * cfg.seq_len
    formed = [v.name for v in variants if v.name == "vgraph fused" and v.result.get("vocab_numel", 0) >= logits]
    if chunked and formed:
        print(f"FAIL: the fused step formed a tensor of {logits:,} elements with last dim {cfg.vocab} "
              f"(the [{args.batch}, {cfg.seq_len}, {cfg.vocab}] logits fuse-lm-head-ce must never form)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
