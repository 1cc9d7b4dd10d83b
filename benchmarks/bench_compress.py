"""Compression on a slow link, measured: step time and loss with and without each kind (issue 22, item 4).

    python benchmarks/bench_compress.py                        # the full run: testbed at 20 Mbit/s (root)
    python benchmarks/bench_compress.py --smoke                # tiny, on loopback, seconds (CI)

Two layouts, each over two hosts of the multi-host testbed (tools/netlab.py: network namespaces, a
`tbf` link rate both ways, a CPU quota each), one `vgraph launch --nnodes 2` launcher per host:

* **pipeline**: a narrow network (dim 32, 256 tokens a sample, batch 16) cut into two stages, one per host:
  the embedder and LM head on host 0, the blocks on host 1, so each step's activations cross the link
  twice and their gradients twice back.  Modes: uncompressed; compress-boundary with fp16; int8
  (activations and gradients, a float32 scale per token); int8 with error feedback.
* **replicas**: a wide network (dim 256, 64 tokens a sample, batch 8), two data-parallel replicas of one
  stage, one per host: each step all-reduces every gradient over the link.  Modes: uncompressed;
  `--grad-compress powersgd:rank=32,start=30` (`POWERSGD` below says why that rank; the timed steps
  come after its plain ones).

Why these networks: at 20 Mbit/s (2.5 MB/s) the cost model predicts the link dominates the step of each
uncompressed layout (the table prints its prediction beside the measurement), so the measured speed-up is
the compression's, not the compute's.  The shapes are chosen from the cost model before running
(`--print-plan` shows it without running anything).

Per mode: the step time on the testbed (a run's figure is the mean of `--steps` steps after `--warmup`,
from its `elapsed_s`, logged every step; every mode runs once in each of `--rounds` rounds, in an order that
turns every round, and the table gives the median over rounds, the speed-up the median of the rounds' own
ratios to the uncompressed mode, as the last line does), the bytes a step put on the wire (the workers' count) against
placement.json's prediction, and the training loss after `--loss-steps` steps of the same run (same seed,
same data) on this machine without the link limit (the numbers do not depend on the link rate), as the
mean of the last 10 steps' losses and relative to the uncompressed mode of its layout.  The acceptance of
issue 22: int8 pipeline >= 2.5x faster a step, PowerSGD replicas >= 2x, each loss within 2%.

Needs root for the testbed (`--no-testbed` runs everything on loopback without a link limit: the step
times then say nothing about links).  A quiet machine: the figures are wall times.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rounds import paired_median, rotated, rounds_note  # noqa: E402

VGRAPH = [sys.executable, "-m", "vgraph"]
TOKEN = "bench-compress-secret-0123456789"
PASSES = "dead-nodes,precision,partition{replicas=1},%s,fuse-heads,fuse-lm-head-ce"
# Rank 32 after 30 plain steps (torch's advice: start at ~10% of the steps): on the wide network the loss
# after 300 steps is within 2% of the uncompressed run's; rank 4 (+8.3%) and rank 16 after 30 (+2.1%) are
# not (docs/benchmarks-history.md, compression).
POWERSGD = "powersgd:rank=32,start=30"


@dataclass
class Layout:
    name: str
    dim: int
    seq: int
    batch: int
    micro: int
    replicas: int
    modes: dict[str, list[str]]  # mode -> extra launch arguments
    network: Path | None = None
    fleet: Path | None = None


@dataclass
class Row:
    layout: str
    mode: str
    predicted_s: float
    step_s: float | None = None
    predicted_bytes: float = 0.0
    bytes: float | None = None
    loss: float | None = None
    extra: dict = field(default_factory=dict)
    rounds_s: list[float] = field(default_factory=list)  # the step seconds of each timed round


def layouts(smoke: bool) -> list[Layout]:
    narrow, wide = (32, 16, 4, 2) if smoke else (32, 256, 16, 4), (32, 16, 4, 2) if smoke else (256, 64, 8, 2)
    pipe = {"none": ["--passes", PASSES % "dead-nodes"],
            "fp16": ["--passes", PASSES % "compress-boundary{activations=fp16,gradients=fp16}"],
            "int8": ["--passes", PASSES % "compress-boundary"],
            "int8+ef": ["--passes", PASSES % "compress-boundary{error_feedback=true}"]}
    reps = {"none": [], "powersgd": ["--grad-compress", POWERSGD]}
    if smoke:  # each mode is a launch (6 CPU-s): the CI setting runs one compressed mode of each kind, compressing
        # at once, and no uncompressed one (launched by many tests; the table then has no speed-up to show)
        pipe = {"int8": pipe["int8"]}
        reps = {"powersgd": ["--grad-compress", "powersgd:rank=2,start=2"]}
    return [Layout("pipeline", *narrow, replicas=1, modes=pipe), Layout("replicas", *wide, replicas=2, modes=reps)]


def write_inputs(layout: Layout, work: Path, rate_bytes: float) -> None:
    """The layout's network and a two-PNode fleet at the link rate (small memory for the pipeline: a cut)."""
    from tools.gen_networks import TransformerSpec, transformer
    from vgraph import save
    from vgraph.cost.costmodel import cost_model

    graph = transformer(TransformerSpec(f"bench-{layout.name}", layers=2, vocab=256, seq_len=layout.seq,
                                        dim=layout.dim, heads=2, ffn=4 * layout.dim, head_up=2 * layout.dim,
                                        precision=None))
    layout.network = work / f"{layout.name}.yml"
    save(graph, layout.network)
    layout.fleet = work / f"{layout.name}-fleet.yml"
    need = cost_model(graph, batch=layout.batch, micro_batches=layout.micro).totals()["memory_bytes"]
    for share in ((0.8, 0.7, 0.6, 0.55, 0.5) if layout.replicas == 1 else (4.0,)):
        memory = int(share * need)  # the pipeline: each host too small for the whole network, so it is cut
        layout.fleet.write_text("name: testbed\npnodes:\n" + "".join(
            f"  - {{id: h{i}, memory: {memory}, flops: 10G, bandwidth: {rate_bytes:.0f}, accelerator: cpu}}\n"
            for i in range(2)))
        if layout.replicas > 1 or _stages(graph, layout) == 2:
            return
    raise SystemExit(f"{layout.name}: found no fleet memory that cuts the network in two stages")


def _stages(graph, layout: Layout) -> int:
    from vgraph.cost.fleet import load_fleet
    from vgraph.transform.pipeline import run_pipeline
    from vgraph.transform.pass_api import PassError

    placed = graph.copy()
    try:
        run_pipeline(placed, f"partition{{batch={layout.batch},micro_batches={layout.micro},replicas=1}}",
                     data={"fleet": load_fleet(layout.fleet)})
    except (PassError, ValueError, Exception):  # noqa: BLE001 - does not fit: try the next size
        return 0
    return len({n.meta["pnode"] for n in placed.nodes})


def launch_argv(layout: Layout, mode: str, out: Path, data: Path, steps: int) -> list[str]:
    return [*VGRAPH, "launch", str(layout.network), "--fleet", str(layout.fleet), "--data", str(data),
            "--steps", str(steps), "--batch", str(layout.batch), "--micro-batches", str(layout.micro),
            "--replicas", str(layout.replicas), "--lr", "1e-3", "--seed", "1", "--val-every", "0",
            "--checkpoint-every", "0", "--log-every", "1", "--threads", "1", "--no-tensorboard", "--quiet",
            "--out", str(out), *layout.modes[mode]]


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def timed(layout: Layout, mode: str, work: Path, data: Path, args: argparse.Namespace, round_: int = 0
          ) -> tuple[float, float, float, float]:
    """(measured step seconds, bytes a step, predicted step seconds, predicted bytes) over the testbed."""
    from tools.netlab import Testbed

    out = work / f"timed-{layout.name}-{mode}-r{round_}"
    warmup = _warmup(layout, mode, args.warmup)
    steps = warmup + args.steps
    env = dict(os.environ, VGRAPH_LAUNCH_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher finds the interface towards the master itself
    with Testbed(2, rate=args.rate, cpu=args.cpu) as tb:
        procs = []
        for i in range(2):
            argv = launch_argv(layout, mode, out / f"host{i}", data, steps) + [
                "--nnodes", "2", "--node-rank", str(i), "--master-addr", tb.ips[0], "--master-port", "29500"]
            log = (work / f"{out.name}-host{i}.log").open("w")
            procs.append(tb.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT)))
        codes = [p.wait(timeout=args.timeout) for p in procs]
    if codes != [0, 0]:
        raise SystemExit(f"{layout.name}/{mode} on the testbed exited {codes}: see {work}/{out.name}-host*.log")
    return summary(out / "host0", warmup, args.steps)


def untimed(layout: Layout, mode: str, work: Path, data: Path, args: argparse.Namespace
            ) -> tuple[list[dict], tuple[float, float, float, float]]:
    """A launch on this machine without a link limit, long enough for the loss and the timed steps: its rows
    and `summary` of its timed steps (loopback: they say nothing of links)."""
    out = work / f"loss-{layout.name}-{mode}"
    warmup = _warmup(layout, mode, args.warmup)
    steps = max(args.loss_steps, warmup + args.steps)
    done = subprocess.run(launch_argv(layout, mode, out, data, steps), cwd=str(ROOT), capture_output=True,
                          text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{layout.name}/{mode} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return rows_of(out)[:args.loss_steps], summary(out, warmup, args.steps)


def _warmup(layout: Layout, mode: str, warmup: int) -> int:
    """Steps before the timed ones: at least PowerSGD's plain steps and one more (its first compressed step
    allocates the factors), so that the timed steps are what every later step costs."""
    extra = layout.modes[mode]
    if "--grad-compress" in extra:
        from vgraph.cost.grad_compression import parse_grad_compress

        return max(warmup, parse_grad_compress(extra[extra.index("--grad-compress") + 1]).start + 1)
    return warmup


def summary(run: Path, warmup: int, timed_steps: int) -> tuple[float, float, float, float]:
    """(mean seconds of steps warmup+1 .. warmup+timed_steps, bytes the last of them sent, placement.json's
    predicted step seconds and bytes)."""
    rows = {r["step"]: r for r in rows_of(run)}
    last = warmup + timed_steps
    start = rows[warmup]["elapsed_s"] if warmup else 0.0
    placement = json.loads((run / "placement.json").read_text())
    return ((rows[last]["elapsed_s"] - start) / timed_steps, float(rows[last]["boundary_bytes"]),
            float(placement["step_seconds"]), float(placement["bytes_per_step"]))


def final_loss(rows: list[dict], last: int = 10) -> float:
    tail = [r["loss"] for r in rows[-last:]]
    return sum(tail) / len(tail)


def run(args: argparse.Namespace) -> list[Row]:
    from tools.netlab import rate_bytes
    from vgraph.backends.torch.training.batches import default_corpus_documents

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-compress-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "corpus.txt"
    data.write_text("\n\n".join(default_corpus_documents(max_bytes=400_000 if not args.smoke else 30_000)),
                    encoding="utf-8")
    rate = rate_bytes(args.rate)
    out: list[Row] = []
    for layout in layouts(args.smoke):
        if layout.name not in args.layouts:
            continue
        write_inputs(layout, work, rate)
        rows: dict[str, list[dict]] = {mode: [] for mode in layout.modes}
        figures: dict[str, list[tuple]] = {mode: [] for mode in layout.modes}
        if args.only != "time" or not args.testbed:  # the loss runs (on loopback they give the times too)
            for mode in layout.modes:
                found, timing = untimed(layout, mode, work, data, args)
                rows[mode] = found if args.only != "time" else []
                figures[mode].append(timing)
        if args.testbed and args.only != "loss":  # every mode once a round, in an order that turns
            figures = {mode: [] for mode in layout.modes}
            for r in range(args.rounds):
                for mode in rotated(list(layout.modes), r):
                    figures[mode].append(timed(layout, mode, work, data, args, r))
        for mode in layout.modes:
            steps = [f[0] for f in figures[mode]]
            _, sent, predicted, predicted_bytes = figures[mode][-1]
            out.append(Row(layout.name, mode, predicted, statistics.median(steps) if args.only != "loss" else None,
                           predicted_bytes, sent, final_loss(rows[mode]) if rows[mode] else None, rounds_s=steps))
            print(f"  {layout.name:9s} {mode:9s} {_f(out[-1].step_s, '.3f')} s a step (predicted {predicted:.3f} s), "
                  f"{sent:,.0f} B/step, loss {_f(out[-1].loss, '.4f')}", file=sys.stderr, flush=True)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return out


def table(rows: list[Row], args: argparse.Namespace) -> str:
    base = {r.layout: r for r in rows if r.mode == "none"}
    lines = ["| layout | mode | predicted step s | measured step s | speed-up | predicted B/step | measured B/step "
             f"| loss after {args.loss_steps} | vs uncompressed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get(r.layout)  # none where the uncompressed mode did not run (--smoke)
        speed = f"{speed_up(b, r):.2f}x" if b is not None and b.step_s and r.step_s else "-"
        versus = f"{100 * (r.loss / b.loss - 1):+.2f}%" if b is not None and b.loss and r.loss is not None else "-"
        lines.append(f"| {r.layout} | {r.mode} | {r.predicted_s:.3f} | {_f(r.step_s, '.3f')} | {speed} | "
                     f"{r.predicted_bytes:,.0f} | {r.bytes:,.0f} | {_f(r.loss, '.4f')} | {versus} |")
    return "\n".join(lines)


def speed_up(base: Row, row: Row) -> float:
    """The uncompressed step over this mode's: the median of the rounds' own ratios (the two ran in each)."""
    return paired_median(base.rounds_s, row.rounds_s)


def summary_line(rows: list[Row], rounds: int) -> str:
    """The last line: each compressed mode's speed-up a step, and how many rounds it rests on."""
    base = {r.layout: r for r in rows if r.mode == "none"}
    ups = [f"{r.layout} {r.mode} {speed_up(base[r.layout], r):.2f}x" for r in rows
           if r.mode != "none" and r.layout in base and base[r.layout].step_s and r.step_s]
    if not ups:
        return "speed-up a step: none measured (no uncompressed mode ran beside a compressed one)"
    return f"speed-up a step: {'; '.join(ups)} ({rounds_note(rounds)})"


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_plan(args: argparse.Namespace) -> None:
    """The cost model's step for every layout and mode, without running anything."""
    from tools.netlab import rate_bytes
    from vgraph import load
    from vgraph.cost.grad_compression import parse_grad_compress
    from vgraph.cost.fleet import load_fleet
    from vgraph.placement.export import placement_report
    from vgraph.transform.pipeline import run_pipeline

    work = Path(tempfile.mkdtemp(prefix="bench-compress-plan-"))
    print("| layout | mode | predicted step s | predicted B/step |\n|---|---|---:|---:|")
    for layout in layouts(args.smoke):
        write_inputs(layout, work, rate_bytes(args.rate))
        for mode, extra in layout.modes.items():
            graph, fleet = load(layout.network), load_fleet(layout.fleet)
            passes = extra[1] if extra[:1] == ["--passes"] else PASSES % "dead-nodes"
            grad = parse_grad_compress(extra[1] if extra[:1] == ["--grad-compress"] else "none").text()
            spec = passes.replace("partition{replicas=1}", f"partition{{batch={layout.batch},micro_batches="
                                  f"{layout.micro},replicas={layout.replicas},grad_compress={grad}}}")
            run_pipeline(graph, spec, data={"fleet": fleet})
            report = placement_report(graph, fleet)
            print(f"| {layout.name} | {mode} | {report['step_seconds']:.3f} | {report['bytes_per_step']:,.0f} |")
    shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="20Mbit/s", help="each host's link rate both ways (default 20Mbit/s)")
    p.add_argument("--cpu", type=float, default=1.0, help="CPU cores per host (cgroup quota, default 1)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode (default 8)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed runs of every mode on the testbed, alternated (default 3; loopback times: 1)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps before the timed ones (default 3: PowerSGD all-reduces plainly for its first 2)")
    p.add_argument("--loss-steps", type=int, default=300, help="steps of the loss comparison (default 300)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a launch may take (default 1800)")
    p.add_argument("--workdir", help="keep networks, runs and logs here (default: a temporary directory)")
    p.add_argument("--no-testbed", dest="testbed", action="store_false",
                   help="time on loopback without a link limit (no root needed; the times say nothing of links)")
    p.add_argument("--print-plan", action="store_true", help="print the cost model's prediction and stop")
    p.add_argument("--layouts", default="pipeline,replicas", type=lambda t: t.split(","),
                   help="which layouts to run (default pipeline,replicas)")
    p.add_argument("--only", choices=("loss", "time"),
                   help="loss: only the loss runs (wall times not needed: any machine); time: only the timed runs")
    p.add_argument("--smoke", action="store_true",
                   help="tiny networks, 2 timed steps, 3 loss steps, on loopback, the compressed modes int8 and "
                   "PowerSGD only: the CI setting")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.smoke:
        args.steps, args.warmup, args.loss_steps, args.testbed = 2, 1, 3, False
    if not args.testbed or args.only == "loss":
        args.rounds = 1  # the loss runs' own steps are the times
    if args.only == "loss":
        args.testbed = False
    if args.print_plan:
        print_plan(args)
        return 0
    if min(args.steps, args.loss_steps) < 1 or args.warmup < 0 or not args.cpu > 0:
        p.error("--steps and --loss-steps must be at least 1, --warmup at least 0, --cpu above 0")
    if args.testbed and os.geteuid() != 0:
        p.error("the testbed needs root (tools/netlab.py); --no-testbed times on loopback instead")
    load = os.getloadavg()[0]
    start = time.time()
    rows = run(args)
    print(f"bench_compress: rate {args.rate if args.testbed else 'loopback (no limit)'}, {args.cpu} core(s) per host, "
          f"{args.steps} timed steps after {args.warmup}, loss over {args.loss_steps} steps; load {load:.2f} at the "
          f"start, {os.getloadavg()[0]:.2f} at the end; {time.time() - start:.0f} s")
    print(table(rows, args))
    print(summary_line(rows, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
