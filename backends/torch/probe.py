"""What this machine delivers for a network: the measurements behind `vgraph probe` (probe_cli.py).

A fleet's figures were guesses (a two-worker launch was predicted at 0.016 s a step and measured at 0.142 s);
a PNode entry from a probe is measured, with the engine that will train:

* `peak`: the sustained FLOP/s of a large GEMM at the network's compute precision (what a fleet's `flops`
  has always meant: the rate the other figures are shares of);
* per VNode of the network's training program, forward + backward time at two micro-batch sizes, each
  VNode run eagerly through the torch backend's own lowering rule (ops.py) on inputs of its real shapes:
  a line `overhead + m x per-sample` per VNode;
* the whole training program (the compiled forward and its backward, as `vgraph train` and every launch
  worker run it) at the same two sizes.  Isolated VNodes miss what the whole program adds (the autograd
  engine walking the graph, the fx module's own calls): the per-VNode lines are scaled, overheads and
  per-sample costs separately, so that their sums are the whole program's line.  Per op kind
  (vgraph/cost/op_kinds.py) that gives the share of the peak its FLOPs reach and its overhead per VNode
  and micro-batch: the figures the cost model prices a stage with.  The optimizer step is not part of
  it (fused Adam over the tiny test network's 13,824 parameters: 14 us, measured);
* per precision the device supports (CPU: float32, bfloat16; CUDA: float32, float16, and bfloat16 from
  compute capability 8.0), the FLOP/s the network's own matmul and attention VNodes reach;
* the memory the device can still give and the accelerator (`cpu`, `cuda-smXY`).

Timings are medians of repeated runs, each repetition at least MIN_REPEAT_S long (a loop of calls), with
CUDA synchronised; they measure this machine as it is now: on a machine busy with other work, probe when
it is quiet, and inside the CPU share (cgroup quota) its workers will have.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vgraph.cost.costmodel import cost_model
from vgraph.cost.op_kinds import KINDS, Efficiency, KindCost, op_kind
from vgraph.ir.graph import Graph

from .dropout import dropout_key
from .lower import VGraphModule, compile_network, compute_dtype
from .ops import LowerCtx, get_lowering

MIN_REPEAT_S = 0.02  # one timed repetition lasts at least this long (a loop of calls)
REPEATS = 5
RATED_KINDS = ("matmul", "attention")  # the kinds the per-precision table rates


@dataclass
class ProbeResult:
    peak: float  # FLOP/s of a large GEMM at the network's compute precision
    precision: str  # that precision
    efficiency: Efficiency
    rates: dict[str, dict[str, float]] = field(default_factory=dict)  # precision -> kind -> FLOP/s
    memory: int | None = None
    memory_source: str = ""
    accelerator: str = "cpu"
    whole: tuple[float, float] = (0.0, 0.0)  # the training program's seconds per micro-batch: fixed, per sample
    sizes: tuple[int, int] = (1, 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int | None = None) -> float:
    """Median seconds of one call of `fn`: each of REPEATS repetitions loops until MIN_REPEAT_S has passed."""
    fn()  # warm up (allocations, lazy initialisation)
    _sync(device)
    samples = []
    for _ in range(repeats or REPEATS):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= MIN_REPEAT_S:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


def peak_flops(device: torch.device, dtype: torch.dtype, size: int | None = None) -> float:
    """Sustained FLOP/s of an n x n x n GEMM (n = 1024 on a CPU, 4096 on a GPU)."""
    n = size or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2.0 * n ** 3 / timed(lambda: torch.mm(a, b), device, repeats=min(3, REPEATS))


def supported_precisions(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return [torch.float32, torch.float16] + ([torch.bfloat16] if major >= 8 else [])
    return [torch.float32, torch.bfloat16]


def accelerator_of(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return "cpu"


# -- the network's VNodes, one at a time ------------------------------------------------------------

class _Eager:
    """Runs a lowering rule's calls at once, on the compiled module's own parameters."""

    def __init__(self, module: VGraphModule) -> None:
        self.module = module

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def param(self, node_id: str, name: str) -> torch.Tensor:
        return self.module.get_parameter(f"{node_id}.{name}")

    def call_module(self, node_id: str, args: tuple) -> Any:
        return self.module.get_submodule(node_id)(*args)


def training_nodes(graph: Graph) -> list:
    """The VNodes the training program runs, in topological order: those the costs depend on."""
    needed = {ep.node for ep in graph.costs}
    for node in reversed(graph.topo_order()):
        if node.id in needed:
            needed.update(e.src for e in graph.in_edges(node.id))
    return [n for n in graph.topo_order() if n.id in needed]


def _feeds(graph: Graph, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    embed = graph.nodes_of_type("embedder")[0].cfg
    vocab, seq = int(embed["vocab_size"]), int(embed["seq_len"])
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (m, seq), generator=gen).to(device),
            torch.randint(0, vocab, (m, seq), generator=gen).to(device))


def vnode_times(graph: Graph, module: VGraphModule, device: torch.device, m: int, amp: Callable[[], Any],
                only: set[str] | None = None) -> dict[str, float]:
    """Seconds of forward + backward of each training VNode (those in `only`, default all) for a
    micro-batch of `m` samples, each alone on inputs of its real shapes (a forward of the network first)."""
    ids, targets = _feeds(graph, m, device)
    eager = _Eager(module)
    values: dict[tuple[str, int], Any] = {}
    out: dict[str, float] = {}
    with dropout_key(0, 1), amp():
        for node in training_nodes(graph):
            inputs = []
            for slot in range(graph.num_inputs(node.id)):
                edge = graph.input_edge(node.id, slot)
                inputs.append(values[(edge.src, edge.src_slot)] if edge is not None
                              else ids if node.type == "embedder" else targets)
            rule = get_lowering(node)
            every = frozenset(range(node.num_outputs))
            with torch.no_grad():
                for slot, v in enumerate(rule.emit(LowerCtx(node, graph, inputs, every, True, eager))):
                    values[(node.id, slot)] = v
            if only is not None and node.id not in only:
                continue
            out[node.id] = timed(lambda: _forward_backward(node, graph, inputs, rule, eager), device)
    return out


def _forward_backward(node, graph: Graph, inputs: list, rule, eager: _Eager) -> None:
    leaves = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
    outs = rule.emit(LowerCtx(node, graph, leaves, frozenset(range(node.num_outputs)), True, eager))
    grads = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if grads:
        torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])


def forward_flops(graph: Graph) -> dict[str, int]:
    """Forward FLOPs per sample of each VNode: the core's count, what the cost model prices."""
    cm = cost_model(graph, batch=1)
    return dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))


def program_time(graph: Graph, module: VGraphModule, device: torch.device, m: int, amp: Callable[[], Any]) -> float:
    """Seconds of the whole training program (compiled forward of every cost, its backward) at `m` samples."""
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    ids, targets = _feeds(graph, m, device)
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]

    def step() -> None:
        with dropout_key(0, 1), amp():
            result = program.module(*args)
            loss = sum(result[c] for c in costs)
        loss.backward()
        module.zero_grad(set_to_none=True)

    return timed(step, device)


# -- from timings to the fleet entry's figures ------------------------------------------------------

def _line(t1: float, t2: float, m1: int, m2: int) -> tuple[float, float]:
    """(fixed, per sample) of the line through (m1, t1) and (m2, t2), both clamped at zero."""
    slope = max(0.0, (t2 - t1) / (m2 - m1))
    return max(0.0, t1 - slope * m1), slope


def calibrate(graph: Graph, per_vnode: tuple[dict[str, float], dict[str, float]],
              whole: tuple[float, float], sizes: tuple[int, int], peak: float) -> Efficiency:
    """Per op kind: (share of `peak`, overhead per VNode and micro-batch), from per-VNode times at the two
    micro-batch `sizes` scaled so that they add up to the whole program's (see the module docstring)."""
    m1, m2 = sizes
    flops = forward_flops(graph)
    lines = {v: _line(per_vnode[0][v], per_vnode[1][v], m1, m2) for v in per_vnode[0]}
    fixed, per_sample = _line(whole[0], whole[1], m1, m2)
    scale_fixed = fixed / max(sum(o for o, _ in lines.values()), 1e-12)
    scale_sample = per_sample / max(sum(s for _, s in lines.values()), 1e-12)
    nodes = {n.id: n for n in training_nodes(graph)}
    seconds = {k: 0.0 for k in KINDS}
    overhead = {k: 0.0 for k in KINDS}
    work = {k: 0.0 for k in KINDS}
    count = {k: 0 for k in KINDS}
    for v, (o, s) in lines.items():
        kind = op_kind(nodes[v].type, flops[v])
        # structural VNodes have no FLOPs to rate their per-sample time by: it joins the elementwise ops'
        kind_of_time = "elementwise" if kind == "structural" else kind
        seconds[kind_of_time] += s * scale_sample
        overhead[kind] += o * scale_fixed
        work[kind] += 3.0 * flops[v]  # training FLOPs per sample, the cost model's count
        count[kind] += 1
    out = []
    for kind in KINDS:
        if not count[kind] and not (kind == "elementwise" and seconds[kind]):
            continue
        share = None
        if work[kind] > 0:
            share = min(1.0, work[kind] / max(seconds[kind], 1e-15) / peak)
        out.append((kind, KindCost(share, overhead[kind] / max(count[kind], 1))))
    return Efficiency(tuple(out))


def precision_rates(graph: Graph, module: VGraphModule, device: torch.device, m: int) -> dict[str, dict[str, float]]:
    """FLOP/s of the network's matmul and attention VNodes at `m` samples, per precision the device has."""
    flops = forward_flops(graph)
    kind = {n.id: op_kind(n.type, flops[n.id]) for n in training_nodes(graph)}
    rated = {v for v, k in kind.items() if k in RATED_KINDS}
    out: dict[str, dict[str, float]] = {}
    for dtype in supported_precisions(device):
        amp = (lambda d=dtype: torch.autocast(device.type, dtype=d)) if dtype != torch.float32 else nullcontext
        times = vnode_times(graph, module, device, m, amp, rated)
        rates = {}
        for k in RATED_KINDS:
            mine = [v for v in times if kind[v] == k]
            if mine:
                rates[k] = sum(3.0 * flops[v] * m for v in mine) / max(sum(times[v] for v in mine), 1e-15)
        out[str(dtype).replace("torch.", "")] = rates
    return out


def probe(graph: Graph, device: torch.device, micro_batch: int, *, per_precision: bool = True,
          say: Callable[[str], None] = lambda line: None) -> ProbeResult:
    """Measure this machine for `graph` (prepared: the pipeline it trains with) on `device`."""
    from .memory import available_memory

    dtype = compute_dtype(graph)
    amp = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else nullcontext
    module = compile_network(graph, device=device, train=True, seed=0)
    sizes = (1, max(8, micro_batch))  # far enough apart that the per-sample slope stands out of the noise
    say(f"probe: a {1024 if device.type == 'cpu' else 4096}^3 GEMM at {dtype} ...")
    peak = peak_flops(device, dtype)
    say(f"probe: the training program and its {len(training_nodes(graph))} VNodes at micro-batches of {sizes[0]} "
        f"and {sizes[1]} ...")
    whole = tuple(program_time(graph, module, device, m, amp) for m in sizes)
    per_vnode = tuple(vnode_times(graph, module, device, m, amp) for m in sizes)
    efficiency = calibrate(graph, per_vnode, whole, sizes, peak)  # type: ignore[arg-type]
    rates = precision_rates(graph, module, device, sizes[1]) if per_precision else {}
    memory, source = available_memory(device)
    return ProbeResult(peak, str(dtype).replace("torch.", ""), efficiency, rates, memory, source,
                       accelerator_of(device), whole, sizes)  # type: ignore[arg-type]


__all__ = ["ProbeResult", "probe", "peak_flops", "vnode_times", "program_time", "calibrate", "precision_rates",
           "supported_precisions", "accelerator_of", "training_nodes", "timed"]
