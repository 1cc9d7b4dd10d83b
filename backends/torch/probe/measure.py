"""What this machine delivers for a network: the measurements behind `vgraph probe` (probe_cli.py).

A fleet's figures were guesses (a two-worker launch was predicted at 0.016 s a step and measured at 0.142 s);
a PNode entry from a probe is measured, with the engine that will train:

* `peak`: the sustained FLOP/s of a large GEMM at the network's compute precision (what a fleet's `flops`
  has always meant: the rate the other figures are shares of);
* per VNode of the network's training program, forward + backward time at two micro-batch sizes, each
  VNode run eagerly through the torch backend's own lowering rule (ops.py) on inputs of its real shapes:
  a line `overhead + m x per-sample` per VNode;
* the whole training program (the compiled forward and its backward, as `vgraph train` and every launch
  worker run it) at micro-batches of 1, 2, 4 and 8 samples (and the `--batch` given), and the line
  `fixed + m x per-sample` closest to them in relative terms.  The time is not linear in m: on the
  testbed's tb-small in a 0.5-core host 8.1, 10.2 and 17.1 ms at 1, 2 and 8 samples, so the line through
  1 and 8 alone, as this probe drew it first, put 2 samples (what the plans run) 8% low.  Isolated VNodes
  miss what the whole program adds (the autograd engine walking the graph, the fx module's own calls):
  the per-VNode lines are scaled, overheads and per-sample costs separately, so that their sums are the
  whole program's line.  Per op kind (vgraph/cost/op_kinds.py) that gives the share of the peak its FLOPs
  reach and its overhead per VNode and micro-batch: the figures the cost model prices a stage with;
* the rank's own work each step beyond the program (`update`, vgraph/cost/update.py): drawing its batch
  from a token shard (backends/torch/training/batches.py) and the optimizer step over its parameters
  (node_optimizers.py), as a launch worker does them (right after a run of the program, which leaves the
  caches cold: `update_costs`), over all the network's parameters and over its smallest tensor alone: a
  fixed time and a time per parameter.  An instrumented one-host tb-small worker
  spent 3.4 ms of a 26.5 ms step outside the program (batch 0.7 ms, Adam 0.6 ms, the control collectives
  and the metrics row 1.4 ms: the fleet's `collectives` table, probe_collectives.py; a world of one now
  answers its collectives locally), 9.7 ms of 51 ms in a 0.5-core host; the batch and the update were
  priced nowhere;
* per precision the device supports (CPU: float32, bfloat16; CUDA: float32, float16, and bfloat16 from
  compute capability 8.0), the FLOP/s the network's own matmul and attention VNodes reach;
* the memory the device can still give and the accelerator (`cpu`, `cuda-smXY`).

Timings are medians of repeated runs, each repetition at least MIN_REPEAT_S long (a loop of calls), with
CUDA synchronised.  The whole program, the figure every prediction scales to, is timed in repetitions of
PROGRAM_REPEAT_S, its sizes in turn round by round, so that a slow spell of the machine falls on all of
them: inside a CPU quota a 20 ms repetition sees a whole number of the quota's periods, and its times
came 10% apart.  They measure this machine as it is now: on a machine busy with other work, probe when
it is quiet, and inside the CPU share (cgroup quota) its workers will have.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from vgraph.cost.costmodel import cost_model
from vgraph.cost.cpu_quota import CpuBurst, burst_seconds
from vgraph.cost.op_kinds import KINDS, Efficiency, KindCost, op_kind
from vgraph.cost.update import Update
from vgraph.ir.graph import Graph

from ..lowering.dropout import dropout_key
from ..lowering.lower import VGraphModule, compile_network, compute_dtype
from ..lowering.ops import LowerCtx, get_lowering

MIN_REPEAT_S = 0.02  # one timed repetition lasts at least this long (a loop of calls)
PROGRAM_REPEAT_S = 0.1  # the same for the whole program, the figure every prediction scales to
REPEATS = 5
PROGRAM_SIZES = (1, 2, 4, 8)  # the micro-batch sizes the whole program is timed at
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
    update: Update | None = None  # the rank's own work each step beyond the program
    cpu_burst: CpuBurst | None = None  # a CPU quota's speed after idling (None: no quota seen)


@contextmanager
def quick_timings() -> Iterator[None]:
    """Every timing one repetition of a few milliseconds (`vgraph probe --quick`): the probe's code runs
    whole, in a fraction of the time, for tests and smoke runs; its figures are noise."""
    global REPEATS, MIN_REPEAT_S, PROGRAM_REPEAT_S
    saved = REPEATS, MIN_REPEAT_S, PROGRAM_REPEAT_S
    REPEATS, MIN_REPEAT_S, PROGRAM_REPEAT_S = 1, 0.002, 0.002
    try:
        yield
    finally:
        REPEATS, MIN_REPEAT_S, PROGRAM_REPEAT_S = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int | None = None) -> float:
    """Median seconds of one call of `fn`: each of REPEATS repetitions loops until MIN_REPEAT_S has passed."""
    return timed_in_turn([fn], device, repeats)[0]


def timed_in_turn(fns: Sequence[Callable[[], Any]], device: torch.device, repeats: int | None = None,
                  least: float | None = None) -> list[float]:
    """Median seconds of one call of each of `fns`, their repetitions (each at least `least`, default
    MIN_REPEAT_S, long) taken in turn: a slow spell of the machine falls on all of them alike."""
    least = MIN_REPEAT_S if least is None else least
    for fn in fns:
        fn()  # warm up (allocations, lazy initialisation)
    _sync(device)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats or REPEATS):
        for fn, mine in zip(fns, samples):
            calls, start = 0, time.perf_counter()
            while True:
                fn()
                calls += 1
                _sync(device)
                elapsed = time.perf_counter() - start
                if elapsed >= least:
                    break
            mine.append(elapsed / calls)
    return [statistics.median(mine) for mine in samples]


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


def _program_run(graph: Graph, module: VGraphModule, device: torch.device, m: int,
                 amp: Callable[[], Any]) -> Callable[[], None]:
    """The whole training program (compiled forward of every cost, its backward) at `m` samples, as a call
    that leaves its gradients in place."""
    costs = tuple(module.cost_names)
    program = module.program_for(costs, training=True)
    ids, targets = _feeds(graph, m, device)
    args = [ids if name.startswith("embedder") else targets for name in program.feeds]

    def run() -> None:
        with dropout_key(0, 1), amp():
            result = program.module(*args)
            loss = sum(result[c] for c in costs)
        loss.backward()

    return run


def program_step(graph: Graph, module: VGraphModule, device: torch.device, m: int,
                 amp: Callable[[], Any]) -> Callable[[], None]:
    """One run of the whole training program at `m` samples, its gradients dropped after (as a step's
    backward finds them: `vgraph train` and the workers zero them with set_to_none)."""
    run = _program_run(graph, module, device, m, amp)

    def step() -> None:
        run()
        module.zero_grad(set_to_none=True)

    return step


def program_line(graph: Graph, module: VGraphModule, device: torch.device, sizes: Sequence[int],
                 amp: Callable[[], Any]) -> tuple[tuple[float, float], list[float]]:
    """The whole program's (fixed, per sample) seconds per micro-batch, fitted to its times at `sizes`
    (timed in turn, PROGRAM_REPEAT_S a repetition), and those times."""
    steps = [program_step(graph, module, device, m, amp) for m in sizes]
    times = timed_in_turn(steps, device, least=PROGRAM_REPEAT_S)
    return fit_line(sizes, times), times


def fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """(fixed, per sample) of the line `fixed + m x per-sample` with the least squared relative error over
    the points (m, t) (both clamped at zero): the micro-batches a plan runs are priced off by a few percent
    each, rather than the small ones by much where the times bend."""
    m = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(m) < 2 or len(set(m.tolist())) < 2 or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"a line needs positive times at two or more sizes, got {list(zip(sizes, times))}")
    w = 1.0 / t
    fixed, slope = np.linalg.lstsq(np.stack([w, m * w], axis=1), np.ones_like(t), rcond=None)[0]
    if slope < 0:  # no per-sample cost to see: the mean time is all fixed
        return float(np.sum(w) / np.sum(w * w)), 0.0
    if fixed < 0:  # a line through the origin
        return 0.0, float(np.sum(w * w * m * t) / np.sum(w * w * m * m))
    return float(fixed), float(slope)


# -- the rank's own work each step -------------------------------------------------------------------

def update_costs(graph: Graph, module: VGraphModule, device: torch.device, amp: Callable[[], Any],
                 batch: int) -> Update:
    """What a launch worker does each step besides the program, timed where it does it: right after the
    program's forward and backward, draw its batch of `batch` samples (TokenShards over a shard file of random
    tokens) and step the network's optimizers (NodeOptimizers: fused Adam, one per setting); the same with
    Adam over the smallest parameter tensor alone gives the fixed part and the time per parameter.  The
    program alone, timed in the same turns, is taken off both.

    Why after the program: timed in a loop of its own, tb-small's draw and update took 0.69-0.76 ms; right
    after a program run 0.91-1.48 ms, and 1.27 ms in an instrumented launch worker (full core): the program
    leaves the caches to whatever comes next, and a loop of the update alone never pays for that."""
    from ..training.optimizers import NodeOptimizers, make_adam

    optims = NodeOptimizers(module, 1e-3)
    params = optims.trainable
    if not params:
        return Update(0.0, 0.0)
    program = _program_run(graph, module, device, 1, amp)  # its gradients stay for the optimizers (accumulating)
    program()
    smallest = min((p for p in params if p.grad is not None), key=lambda p: p.numel())
    alone = make_adam([{"params": [smallest], "lr": 1e-3}])
    with tempfile.TemporaryDirectory(prefix="vgraph-probe-") as tmp:
        draw = _batch_draw(graph, Path(tmp), batch)
        steps = iter(range(1, 1 << 62))

        def update_all() -> None:  # the worker's update: every optimizer over all the parameters
            draw(next(steps))
            for opt in optims.optimizers:
                opt.step()

        def update_one() -> None:  # Adam over the smallest tensor alone
            draw(next(steps))
            alone.step()

        def after_program(update: Callable[[], None]) -> Callable[[], None]:
            return lambda: (program(), update())

        t_program, t_all, t_one, floor_all, floor_one = timed_in_turn(
            [program, after_program(update_all), after_program(update_one), update_all, update_one], device)
    # A difference of two timings can come out at or below zero when the machine is busy (a --quick probe
    # under the test suite wrote `fixed: 0, per_param: 0`); the same work in a loop of its own is never
    # dearer than after a program (see above), so it is the floor.
    t_all, t_one = max(floor_all, t_all - t_program), max(floor_one, t_one - t_program)
    total = sum(p.numel() for p in params)
    per_param = max(0.0, (t_all - t_one) / max(total - smallest.numel(), 1))
    module.zero_grad(set_to_none=True)
    return Update(max(0.0, t_one - per_param * smallest.numel()), per_param)


def _batch_draw(graph: Graph, where: Path, batch: int) -> Callable[[int], Any]:
    """A worker's batch draw (TokenShards.batch) for `graph`, from a shard of random tokens in `where`."""
    from vgraph.data.shards import PreparedCorpus, ShardFile, TokenStream

    from ..training.batches import TokenShards

    embed = graph.nodes_of_type("embedder")[0].cfg
    vocab, seq = int(embed["vocab_size"]), int(embed["seq_len"])
    tokens = max(64 * batch, 8) * (seq + 1)  # a few hundred windows: reads land apart, as in a corpus
    path = where / "train.bin"
    np.random.default_rng(0).integers(0, vocab, tokens, dtype=np.int64).astype(np.uint32).tofile(path)
    stream = TokenStream((ShardFile(path, np.dtype(np.uint32)),), np.array([0, tokens]), 1, (path.name,))
    corpus = PreparedCorpus(where, {"vocab_size": vocab}, "", stream, stream)
    shards = TokenShards(corpus, seq_len=seq, vocab=vocab, seed=0)
    return lambda step: shards.batch(step, batch)


# -- a CPU quota's burst ------------------------------------------------------------------------------

BURST_IDLE_S = 0.12  # idle before a timed burst: longer than the kernel's default CFS period (100 ms)
BURST_LONG_S = 0.03  # the longest run timed after idling: past any quota's burst (netlab: 2 ms a period)
BURST_MIN_SPEEDUP = 1.15  # below this the CPU computes as fast after idling as continuously: no quota seen
BURST_SPEEDUPS = np.linspace(1.0, 8.0, 351)  # the fit's grid (a quota of 1/8 core runs 8x faster after idling)
BURST_BUCKETS = np.geomspace(2e-5, 2e-2, 121)  # seconds of work at the CPU's own speed: 20 us to 20 ms


def _small_ops() -> Callable[[], None]:
    """A block of a transformer at a micro-batch of 2 and width 64, forward and backward: a few ops of tens of
    microseconds each, bound by each op's overhead as a network's ops are at a small micro-batch.  Why not a
    GEMM: under a quota the two pay a throttle differently (measured in one 0.35-core testbed host,
    2026-12-07: a 128^3 GEMM ran 1.7x faster after idling, these ops 3x, the first call included), and a
    pipeline stage of tb-small ran 1.9x faster than the probe's figures while it waited half of each step."""
    x = torch.randn(2, 32, 64)
    w = torch.randn(64, 64, requires_grad=True)

    def call() -> None:
        y = torch.nn.functional.layer_norm(torch.nn.functional.gelu(x @ w), (64,))
        y.sum().backward()
        w.grad = None

    return call


def fit_cpu_burst(continuous: float, chunks: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(speedup, bucket) whose `burst_seconds` curve is nearest (in log time) to `seconds`, the time `chunks[i]`
    calls took right after idling, each call `continuous` seconds at the quota's average rate: the model's
    own two figures fitted to the model's own curve, over a grid."""
    work = np.asarray(chunks, dtype=float) * continuous
    s = BURST_SPEEDUPS[:, None, None]
    b = BURST_BUCKETS[None, :, None]
    predicted, _ = burst_seconds(work[None, None, :], np.broadcast_to(b, (len(BURST_SPEEDUPS), len(BURST_BUCKETS),
                                                                          len(work))), s)
    error = ((np.log(predicted) - np.log(np.maximum(np.asarray(seconds, dtype=float), 1e-12))) ** 2).sum(axis=2)
    i, j = np.unravel_index(int(np.argmin(error)), error.shape)
    return float(BURST_SPEEDUPS[i]), float(BURST_BUCKETS[j])


def cold_caches(one_call: float, two_calls: float) -> float:
    """What the first call after idling pays for its cold caches: its time over the second call's (the run of
    two less the run of one), 0 where the runs do not say (two calls no longer than one: a hiccup)."""
    second = two_calls - one_call
    return max(0.0, one_call - second) if second > 0 else 0.0


def cpu_burst(repeats: int | None = None) -> CpuBurst | None:
    """A CPU quota's burst (vgraph/cost/cpu_quota.py): small ops (`_small_ops`) timed continuously (the rate
    every other figure is taken at), then runs of 1 call up to BURST_LONG_S of calls, each right after
    idling; `fit_cpu_burst` reads the speedup and the bucket off the runs' times (medians of `repeats`,
    default REPEATS).  None where the fitted speedup is under BURST_MIN_SPEEDUP.

    Why runs of several lengths: the first call after idling also pays cold caches (taken off every run as
    the first call's time over the second's: the model has no term for it), so one call alone under-reads
    the speed (the GEMM this replaced read 1.46x where a pipeline stage ran 1.9x), and runs past the bucket
    say how long the speed lasts.  Why measured and not read from the cgroup: inside a network namespace
    host (tools/netlab.py) /sys is the namespace's and the quota's files are not there, a container's limit
    may be set where it cannot read, and a throttle costs more than the time it takes away (cold caches
    after each), which no setting says."""
    call = _small_ops()
    one = timed_in_turn([call], torch.device("cpu"), least=3 * BURST_LONG_S)[0]  # the quota's average rate
    longest = max(2, round(BURST_LONG_S / max(one, 1e-9)))
    chunks = sorted({1, 2, *(max(1, round(longest ** (k / 5))) for k in range(6))})
    taken: list[list[float]] = [[] for _ in chunks]
    for _ in range(repeats or REPEATS):
        for n, mine in zip(chunks, taken):
            time.sleep(BURST_IDLE_S)
            start = time.perf_counter()
            for _ in range(n):
                call()
            mine.append(time.perf_counter() - start)
    runs = [statistics.median(t) for t in taken]
    cold = cold_caches(runs[0], runs[1])
    speedup, bucket = fit_cpu_burst(one, chunks, [max(t - cold, 1e-9) for t in runs])
    if not speedup >= BURST_MIN_SPEEDUP:
        return None
    return CpuBurst(speedup, bucket)


# -- from timings to the fleet entry's figures ------------------------------------------------------

def _line(t1: float, t2: float, m1: int, m2: int) -> tuple[float, float]:
    """(fixed, per sample) of the line through (m1, t1) and (m2, t2), both clamped at zero."""
    slope = max(0.0, (t2 - t1) / (m2 - m1))
    return max(0.0, t1 - slope * m1), slope


def calibrate(graph: Graph, per_vnode: tuple[dict[str, float], dict[str, float]],
              whole: tuple[float, float], sizes: tuple[int, int], peak: float) -> Efficiency:
    """Per op kind: (share of `peak`, overhead per VNode and micro-batch), from per-VNode times at the two
    micro-batch `sizes` scaled so that their lines add up to the whole program's line `whole` (fixed, per
    sample; see the module docstring)."""
    m1, m2 = sizes
    flops = forward_flops(graph)
    lines = {v: _line(per_vnode[0][v], per_vnode[1][v], m1, m2) for v in per_vnode[0]}
    fixed, per_sample = whole
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
          say: Callable[[str], None] = lambda line: None, cpu_quota: bool = False) -> ProbeResult:
    """Measure this machine for `graph` (prepared: the pipeline it trains with) on `device`; `cpu_quota`: also
    a CPU quota's burst (`cpu_burst`, on a CPU)."""
    from ..training.memory import available_memory

    dtype = compute_dtype(graph)
    amp = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else nullcontext
    module = compile_network(graph, device=device, train=True, seed=0)
    sizes = (1, max(8, micro_batch))  # far enough apart that the per-sample slope stands out of the noise
    say(f"probe: a {1024 if device.type == 'cpu' else 4096}^3 GEMM at {dtype} ...")
    peak = peak_flops(device, dtype)
    say(f"probe: the training program and its {len(training_nodes(graph))} VNodes at micro-batches of {sizes[0]} "
        f"and {sizes[1]} ...")
    program_sizes = sorted(set(PROGRAM_SIZES) | {max(1, micro_batch)})
    whole, times = program_line(graph, module, device, program_sizes, amp)
    say("probe: the whole program " + ", ".join(f"{t * 1e3:.3g} ms at {m}" for m, t in zip(program_sizes, times))
        + f": {whole[0] * 1e3:.3g} ms + {whole[1] * 1e3:.3g} ms a sample")
    per_vnode = tuple(vnode_times(graph, module, device, m, amp) for m in sizes)
    efficiency = calibrate(graph, per_vnode, whole, sizes, peak)  # type: ignore[arg-type]
    say(f"probe: a step's batch draw and optimizer update at a batch of {max(1, micro_batch)} ...")
    update = update_costs(graph, module, device, amp, max(1, micro_batch))
    rates = precision_rates(graph, module, device, sizes[1]) if per_precision else {}
    burst = None
    if cpu_quota and device.type == "cpu":
        say("probe: the CPU's speed right after idling (a CPU quota's burst) ...")
        burst = cpu_burst()
    memory, source = available_memory(device)
    return ProbeResult(peak, str(dtype).replace("torch.", ""), efficiency, rates, memory, source,
                       accelerator_of(device), whole, update, burst)


__all__ = ["ProbeResult", "probe", "peak_flops", "vnode_times", "program_line", "fit_line",
           "update_costs", "cpu_burst", "cold_caches", "fit_cpu_burst",
           "calibrate", "precision_rates", "supported_precisions", "accelerator_of",
           "training_nodes", "timed", "timed_in_turn", "quick_timings"]
