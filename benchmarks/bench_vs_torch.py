"""`vgraph launch` side by side with what a PyTorch user would pick instead: DDP for replicas,
torch.distributed.pipelining for stages (issue 42).

    .venv/bin/python benchmarks/bench_vs_torch.py [--network 6|tiny] [--procs 2,4] [--batch 8]
        [--micro-batches 4] [--schedule 1f1b|gpipe] [--steps 6] [--warmup 2] [--rounds 3] [--data PATH]
        [--uneven | --no-uneven] [--smoke]

The same network (the 6-layer production network, or tests/fixtures' tiny_2l with --smoke), the same
global batch of the same tokens (the corpus `vgraph launch` prepares, step s's samples drawn from
(seed, s) by both sides), the same initial weights (vgraph's seed-0 initialisation copied into
benchmarks/handwritten_model.py's hand-written model), the same Adam (fused), the same processes (gloo on
the CPU, one thread each, P processes), three ways:

* replicas: `vgraph launch` with P replicas of the whole network (its buckets, 25 MiB) against the
  hand-written model in `DistributedDataParallel` (bucket_cap_mb 25), each process a 1/P share of the batch;
* stages: `vgraph launch` with the network cut into P contiguous stages (the cut the cost model balances,
  forced with --placement) and M micro-batches, against `torch.distributed.pipelining`: one manual
  `PipelineStage` per process holding the same blocks, `Schedule1F1B` (or `ScheduleGPipe`), the same M;
* unequal hosts (--uneven, root only): two hosts of tools/netlab.py, one with a full core and one with half
  a core (cgroup CPU quotas): `vgraph launch --replicas 2` with the planner's batch shares (from the
  hosts' `vgraph probe` figures) against DDP's equal split; the planner's predicted margin (its price of
  the equal split over its price of its own shares) against the measured one (DDP's step over vgraph's).

Two changes to the network, the same on both sides: dropout 0 (vgraph keys its masks by (seed, step,
VNode, sample), torch draws them from its generator: with dropout the two would not train alike) and, for
the stages only, the LM head in a colocation group of its own (the production network keeps it with the
embedder, which makes vgraph's pipeline go embedder -> blocks -> head on the first PNode; a pipeline of
single `PipelineStage`s must run in a line, so both cut the network in a line, the tied embedding shared by
the first and the last stage: vgraph's tie_sync against an all-reduce of the two copies' gradients, as
Megatron does).  float32.

Every round runs every way once, in an order that rotates from round to round; a way's figure in a round
is its median step time after `--warmup` steps (vgraph: metrics.jsonl `elapsed_s`, every step logged, as
`vgraph launch` does on the CPU; torch: rank 0's wall time per step, its loss gathered after the last
step).  A ratio is the median over rounds of that round's ratio.  The last loss of the three agrees (checked
to 1e-3 relative; Adam's first steps amplify the float rounding of a different summation order).  The last
line is `launch/DDP: X; launch/pipelining: Y` on equal hosts, at the largest process count, with the
rounds counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rounds import paired_median, rotated, rounds_note  # noqa: E402

HEAD = ("final_norm", "head_up", "head_swiglu", "head_down", "lm_head", "loss")
LR = 6e-4
BUCKET_MIB = 25  # DDP's bucket_cap_mb default, and vgraph launch's --bucket-size default
LOSS_RTOL = 1e-3


def spec_of(key: str):
    from tools.gen_networks import PRODUCTION, TINY

    spec = {"6": PRODUCTION["distributed_attention_example_6_swiglu_head.yml"], "tiny": TINY["tiny_2l.yml"]}[key]
    return dataclasses.replace(spec, dropout=0.0, precision=None)


def write_networks(key: str, work: Path) -> tuple[Path, Path]:
    """(the network for the replicas, the same with the LM head in a colocation group of its own)."""
    import vgraph
    from tools.gen_networks import transformer

    graph = transformer(spec_of(key))
    replicas = work / "replicas.yml"
    vgraph.save(graph, replicas)
    for node_id in HEAD:
        graph.node(node_id).set_config(colocate_group="lm_head")
    stages = work / "stages.yml"
    vgraph.save(graph, stages)
    return replicas, stages


def fleet_file(work: Path, hosts: int) -> Path:
    """Equal CPU PNodes h0.. (the forced placements below only need them priced alike)."""
    path = work / f"fleet{hosts}.yml"
    path.write_text(f"name: eq{hosts}\npnodes:\n" + "".join(
        f"  - {{id: h{i}, memory: 8GiB, flops: 40G, bandwidth: 5GB/s, accelerator: cpu}}\n" for i in range(hosts)))
    return path


def torch_split(layout: dict, layers: int, stages: int) -> list[tuple[int, int]]:
    """Per stage, the blocks [lo, hi) the forced vgraph placement gives it; the embedder must be on the first
    stage and the head on the last (a line), which `forced_placement`'s contiguous cut guarantees."""
    assignment = layout["assignment"]
    stage_of = {f"h{s}": s for s in range(stages)}
    of_block = [stage_of[assignment[f"block{i}_ln1"]] for i in range(layers)]
    if stage_of[assignment["embedder"]] != 0 or stage_of[assignment["lm_head"]] != stages - 1 \
            or of_block != sorted(of_block):
        raise SystemExit(f"bench_vs_torch: the placement is not a line of {stages} stages: {layout}")
    bounds, lo = [], 0
    for s in range(stages):
        bounds.append((lo, lo + of_block.count(s)))
        lo += of_block.count(s)
    return bounds


# -- the torch side: one process per rank ---------------------------------------------------------------

def _stage_module(full, lo: int, hi: int, first: bool, last: bool):
    """The hand-written model's embedder (first), blocks lo..hi-1 and head (last) as one pipeline stage.  The
    last stage holds its own copy of the tied embedding (the first's, when it is not itself the first)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = full.embed if first else None
            self.blocks = nn.ModuleList(full.blocks[lo:hi])
            self.register_buffer("cos", full.cos, persistent=False)
            self.register_buffer("sin", full.sin, persistent=False)
            if last:
                self.final_norm, self.head_up, self.head_down = full.final_norm, full.head_up, full.head_down
                self.tied = full.embed.weight if first else nn.Parameter(full.embed.weight.detach().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.embed is not None:
                x = self.embed(x)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            if not last:
                return x
            value, gate = self.head_up(self.final_norm(x)).chunk(2, dim=-1)
            return F.linear(self.head_down(value * F.silu(gate)), self.tied)

    return Stage()


def train_torch(spec: dict, rank: int, world: int) -> dict | None:
    """One rank of the DDP or pipelining run `spec` describes, in a process group already joined; rank 0
    returns {"times": seconds per step, "losses": the global batch's loss per step}."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from handwritten_model import HandwrittenConfig, HandwrittenTransformer, load_vgraph_state
    from vgraph.backends.torch.training.batches import TokenShards
    from vgraph.backends.torch.training.optimizers import make_adam
    from vgraph.data.shards import open_prepared

    cfg = HandwrittenConfig(**spec["cfg"])
    data = TokenShards(open_prepared(spec["data"], verify="size"), seq_len=cfg.seq_len, vocab=cfg.vocab, seed=0)
    full = HandwrittenTransformer(cfg)
    load_vgraph_state(full, torch.load(spec["init"]))
    batch, steps = spec["batch"], spec["steps"]
    losses, stamps = [], [time.perf_counter()]
    if spec["mode"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        lo, hi = rank * batch // world, (rank + 1) * batch // world
        model = DDP(full, bucket_cap_mb=BUCKET_MIB)
        opt = make_adam([{"params": list(model.parameters()), "lr": LR}])
        for step in range(1, steps + 1):
            ids, targets = data.batch(step, batch, lo, hi)
            loss = model(ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            stamps.append(time.perf_counter())
        mine = torch.stack(losses) * ((hi - lo) / batch)
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        lo, hi = spec["split"][rank]
        first, last = rank == 0, rank == world - 1
        module = _stage_module(full, lo, hi, first, last)
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        kind = Schedule1F1B if spec["schedule"] == "1f1b" else ScheduleGPipe
        schedule = kind(stage, n_microbatches=spec["micro"],
                        loss_fn=lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), t.reshape(-1)))
        tie = dist.new_group([0, world - 1])  # the tied embedding's two copies (every rank creates the group)
        opt = make_adam([{"params": list(module.parameters()), "lr": LR}])
        for step in range(1, steps + 1):
            ids, targets = data.batch(step, batch)
            micro: list = []
            if first:
                schedule.step(ids)
            elif last:
                schedule.step(target=targets, losses=micro)
            else:
                schedule.step()
            if first or last:
                weight = module.embed.weight if first else module.tied
                dist.all_reduce(weight.grad, group=tie)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(torch.stack(micro).mean().detach() if last else torch.zeros(()))
            stamps.append(time.perf_counter())
        mine = torch.stack(losses)
    dist.all_reduce(mine)  # DDP: the shares' weighted losses; pipelining: the last stage's
    if rank != 0:
        return None
    return {"times": [b - a for a, b in zip(stamps, stamps[1:])], "losses": mine.tolist()}


def torch_worker(spec_path: str) -> int:
    """A testbed host's rank (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 writes spec["out"]."""
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = train_torch(spec, rank, world)
        if result is not None:
            Path(spec["out"]).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


def _torch_member(rank: int, world: int, port: int, spec: dict, out) -> None:
    """A rank on this machine, forked by bench_grad_sync's forkserver (`_spawn`): no torch import per run."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank,
                            world_size=world)
    try:
        out.put((rank, train_torch(spec, rank, world)))
    finally:
        dist.destroy_process_group()


def run_torch(spec: dict, work: Path, name: str, hosts=None, port: int = 0) -> tuple[list[float], float]:
    """(step times, last loss) of one torch run: P processes on this machine, or one per testbed host."""
    if hosts is None:
        from bench_grad_sync import _spawn

        result = _spawn(_torch_member, spec["world"], spec)[0]
        return result["times"], result["losses"][-1]
    spec = dict(spec, out=str(work / f"{name}.out.json"))
    path = work / f"{name}.json"
    path.write_text(json.dumps(spec))
    world = spec["world"]
    argv = [sys.executable, str(Path(__file__).resolve()), "--torch-worker", str(path)]
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR=hosts.ips[0], MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
    procs = [hosts.popen(r, argv, env=dict(env, RANK=str(r))) for r in range(world)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"bench_vs_torch: a {spec['mode']} process exited with {codes} (its traceback above)")
    result = json.loads(Path(spec["out"]).read_text())
    return result["times"], result["losses"][-1]


# -- the vgraph side ------------------------------------------------------------------------------------

def run_launch(network: Path, fleet: Path, placement: Path, corpus: Path, work: Path, name: str, args,
               micro: int) -> tuple[list[float], float]:
    from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch

    result = launch(LaunchConfig(network=str(network), data=str(corpus), steps=args.steps, batch=args.batch, lr=LR,
                                 seed=0, val_every=0, checkpoint_every=0, progress=False, tensorboard=False,
                                 out=work / name, fleet=str(fleet), placement=str(placement), micro_batches=micro,
                                 pipeline=args.schedule, threads=1, log=lambda line: None))
    rows = result.history
    return [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])], rows[-1]["loss"]


def after_warmup(times: list[float], warmup: int, vgraph_rows: bool) -> list[float]:
    """Step times of steps warmup+1.. (vgraph's rows give differences from step 2 on, torch's from step 1)."""
    return times[max(0, warmup - 1):] if vgraph_rows else times[warmup:]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--torch-worker"]:
        return torch_worker(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=("6", "tiny"), default="6")
    ap.add_argument("--procs", default="2,4", help="process counts (default 2,4)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches of the stages (default 4)")
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    ap.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included (default 6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=None, help="training text (default: the embedded corpus)")
    ap.add_argument("--uneven", action=argparse.BooleanOptionalAction, default=None,
                    help="also the unequal hosts (netlab testbed; default: when root)")
    ap.add_argument("--equal", action=argparse.BooleanOptionalAction, default=True,
                    help="the equal hosts' rounds (default; --no-equal with --uneven: the unequal hosts alone)")
    ap.add_argument("--smoke", action="store_true", help="the suite's setting: tiny network, 2 processes, 1 round")
    args = ap.parse_args(argv)
    if not args.equal and args.uneven is not True:
        ap.error("--no-equal leaves only the unequal hosts: give --uneven too")
    if args.smoke:
        args.network, args.procs, args.steps, args.warmup, args.rounds, args.uneven = "tiny", "2", 3, 1, 1, False
        args.batch, args.micro_batches = 4, 2
    try:
        procs = [int(p) for p in args.procs.split(",")]
    except ValueError:
        ap.error(f"--procs takes process counts separated by commas, got {args.procs!r}")
    if not procs or min(procs) < 2 or max(procs) > 64:
        ap.error(f"--procs: each count must be 2 to 64 (a DDP or a pipeline of one process compares nothing), "
                 f"got {args.procs!r}")
    for P in procs:
        if args.batch < 1 or args.batch % P or args.batch % args.micro_batches or args.micro_batches < 1:
            ap.error(f"--batch {args.batch} must split evenly into {P} processes and {args.micro_batches} "
                     f"micro-batches (unequal pieces would weight the two sides' losses differently)")
    if args.rounds < 1 or args.warmup < 0 or args.steps <= args.warmup + 1:
        ap.error("--rounds must be at least 1 and --steps exceed --warmup by at least 2 (step times are differences)")
    if args.uneven is not False:
        from tools.netlab import NetlabError, check_available

        try:
            check_available()
            args.uneven = True
        except NetlabError as exc:
            if args.uneven:
                ap.error(f"--uneven needs the netlab testbed: {exc}")
            args.uneven = False
    return run(args)


def run(args) -> int:
    import torch

    from bench_testbed import forced_placement
    from handwritten_model import HandwrittenConfig
    from vgraph.backends.torch import compile_network, prepare_graph
    from vgraph.backends.torch.training.config import TrainConfig
    from vgraph.backends.torch.training.corpus import prepare_data
    import vgraph

    spec = spec_of(args.network)
    cfg = HandwrittenConfig.from_spec(spec)
    procs = [int(p) for p in args.procs.split(",")] if args.equal else []
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="bench_vs_torch_") as tmp:
        work = Path(tmp)
        replicas_net, stages_net = write_networks(args.network, work)
        corpus = prepare_data(TrainConfig(network=str(replicas_net), data=args.data, seed=0), cfg.vocab,
                              cfg.seq_len).dataset.corpus.root
        init = work / "init.pt"
        torch.save(compile_network(prepare_graph(vgraph.load(replicas_net), fuse=False, target="cpu"),
                                   seed=0).unfused_state_dict(), init)
        common = dict(cfg=dataclasses.asdict(cfg), data=str(corpus), init=str(init), batch=args.batch,
                      steps=args.steps, micro=args.micro_batches, schedule=args.schedule)
        ways = {}  # name -> (kind, procs, run())
        for P in procs:
            fleet = fleet_file(work, P)
            rep = work / f"replicas{P}.json"
            forced_placement(replicas_net, fleet, 1, P, args.batch, 1, rep)
            stg = work / f"stages{P}.json"
            split = torch_split(forced_placement(stages_net, fleet, P, 1, args.batch, args.micro_batches, stg),
                                cfg.layers, P)
            ways[f"launch replicas {P}"] = ("vgraph", lambda n, f=fleet, p=rep: run_launch(
                replicas_net, f, p, corpus, work, n, args, 1))
            ways[f"DDP {P}"] = ("torch", lambda n, P=P: run_torch(dict(common, mode="ddp", world=P), work, n))
            ways[f"launch stages {P}"] = ("vgraph", lambda n, f=fleet, p=stg: run_launch(
                stages_net, f, p, corpus, work, n, args, args.micro_batches))
            ways[f"pipelining {P}"] = ("torch", lambda n, P=P, s=split: run_torch(
                dict(common, mode="pipe", world=P, split=s), work, n))
        medians: dict[str, list[float]] = {name: [] for name in ways}
        last_loss: dict[str, float] = {}
        names = list(ways)
        for r in range(args.rounds):
            for name in rotated(names, r):
                kind, go = ways[name]
                t0 = time.perf_counter()
                times, loss = go(f"r{r}-{name.replace(' ', '_')}")
                medians[name].append(statistics.median(after_warmup(times, args.warmup, kind == "vgraph")))
                last_loss[name] = loss
                print(f"round {r + 1}/{args.rounds}: {name}: {medians[name][-1] * 1e3:.1f} ms/step, loss {loss:.6f} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        uneven = uneven_hosts(args, replicas_net, corpus, common, work) if args.uneven else None
    report(args, cfg, procs, medians, last_loss, uneven, load, started)
    return 0


def paired(medians: dict[str, list[float]], a: str, b: str) -> float:
    return paired_median(medians[a], medians[b])


def report(args, cfg, procs, medians, last_loss, uneven, load, started) -> None:
    import torch

    if not procs:  # --no-equal: the unequal hosts alone
        name = "tiny_2l" if args.network == "tiny" else f"{args.network}-layer"
        print(f"bench_vs_torch: {name} network (dim {cfg.dim}, {cfg.layers} blocks), global batch "
              f"{args.batch}, gloo on CPU, torch {torch.__version__}, {os.cpu_count()} cores; started {started}, "
              f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; unequal hosts only (--no-equal)")
        print()
        print(uneven)
        load = os.getloadavg()
        print(f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
        return
    ref = last_loss[next(iter(last_loss))]
    spread = max(abs(v - ref) / abs(ref) for v in last_loss.values())
    print(f"bench_vs_torch: {args.network}-layer network" if args.network != "tiny" else
          "bench_vs_torch: tiny_2l network", f"(dim {cfg.dim}, {cfg.layers} blocks, vocab {cfg.vocab}, seq "
          f"{cfg.seq_len}; dropout 0, float32), global batch {args.batch}, {args.micro_batches} micro-batches "
          f"({args.schedule}) for the stages, gloo on CPU, 1 thread per process, torch {torch.__version__}, "
          f"{os.cpu_count()} cores; started {started}, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"{args.rounds} alternated rounds of {args.steps} steps, the first {args.warmup} of each run left out")
    print()
    print("| way | processes | step ms (median of rounds) | min-max of rounds | launch / torch (median of rounds) "
          "| last loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for P in procs:
        for mine, theirs in ((f"launch replicas {P}", f"DDP {P}"), (f"launch stages {P}", f"pipelining {P}")):
            for name in (mine, theirs):
                m = medians[name]
                ratio = f"{paired(medians, mine, theirs):.3f}" if name == mine else "1"
                print(f"| {name.rsplit(' ', 1)[0]} | {P} | {statistics.median(m) * 1e3:.1f} | "
                      f"{min(m) * 1e3:.1f}-{max(m) * 1e3:.1f} | {ratio} | {last_loss[name]:.6f} |")
    print()
    print(f"last losses agree to {spread:.1e} (relative; checked against {LOSS_RTOL:g})")
    if uneven is not None:
        print()
        print(uneven)
    load = os.getloadavg()
    print(f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    if spread > LOSS_RTOL:
        raise SystemExit(f"bench_vs_torch: the last losses differ by {spread:.1e} (> {LOSS_RTOL:g}): not the same "
                         f"training")
    P = max(procs)
    print(f"launch/DDP: {paired(medians, f'launch replicas {P}', f'DDP {P}'):.3f}; launch/pipelining: "
          f"{paired(medians, f'launch stages {P}', f'pipelining {P}'):.3f} ({P} processes, "
          f"{rounds_note(args.rounds)})")


def uneven_hosts(args, network: Path, corpus: Path, common: dict, work: Path) -> str:
    """Two testbed hosts, one core and half a core: `vgraph launch --replicas 2` on the probed fleet (the
    planner's shares) against DDP's equal split, alternated; the planner's predicted margin against the
    measured one.  Returns the table."""
    from bench_testbed import host_pricer, probe_hosts
    from tools.netlab import Testbed
    from vgraph.backends.torch.distributed.launcher.launch import place, split_pipeline
    from vgraph.cost.fleet import load_fleet
    from vgraph.transform.pipeline import run_pipeline
    import vgraph

    vg = str(Path(sys.executable).with_name("vgraph"))
    token = dict(os.environ, VGRAPH_LAUNCH_TOKEN="bench-vs-torch-secret-0123456789", OMP_NUM_THREADS="1")
    cores = (1.0, 0.5)
    times: dict[str, list[float]] = {"launch": [], "DDP": []}
    losses: dict[str, float] = {}  # each way's last loss: the planner's shares train the same global batch
    with Testbed(2, cpu=list(cores)) as tb:
        fleet = work / "fleet-uneven.yml"
        # bench_testbed's probes: each host inside its quota, its link measured to the other, then the
        # collectives table of both (the full run: each host twice, one at a time, a third where they disagree)
        probe_hosts(tb, network, fleet, 2.0, rounds=50, smoke=args.network == "tiny", batch=args.batch, micro=1)
        for r in range(args.rounds):
            for way in rotated(("launch", "DDP"), r):
                port = 29600 + 10 * (2 * r + (way == "DDP"))
                if way == "DDP":
                    steps, losses[way] = run_torch(dict(common, mode="ddp", world=2), work, f"uneven-r{r}",
                                                   hosts=tb, port=port)
                    times[way].append(statistics.median(after_warmup(steps, args.warmup, False)))
                    continue
                where = work / f"uneven-r{r}"
                argvs = [[vg, "launch", str(network), "--fleet", str(fleet), "--replicas", "2", "--data", str(corpus),
                          "--steps", str(args.steps), "--batch", str(args.batch), "--micro-batches", "1",
                          "--threads", "1", "--val-every", "0", "--checkpoint-every", "0", "--no-tensorboard",
                          "--quiet", "--seed", "0", "--lr", str(LR), "--master-addr", tb.ips[0], "--master-port",
                          str(port), "--nnodes", "2", "--node-rank", str(i), "--out", str(where / f"node{i}")]
                         for i in range(2)]
                done = tb.run_all(argvs, env=token, timeout=1800)
                for i, d in enumerate(done):
                    if d.returncode != 0:
                        raise SystemExit(f"bench_vs_torch: launch on host {i} failed:\n{d.stdout[-3000:]}")
                rows = [json.loads(line) for line in (where / "node0" / "metrics.jsonl").read_text().splitlines()
                        if line.strip()]
                steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
                times[way].append(statistics.median(after_warmup(steps, args.warmup, True)))
                losses[way] = float(rows[-1]["loss"])
                planned = json.loads((where / "node0" / "placement.json").read_text())
            print(f"uneven round {r + 1}/{args.rounds}: launch {times['launch'][-1] * 1e3:.1f} ms, DDP "
                  f"{times['DDP'][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    shares = planned["batch_shares"]
    price = host_pricer(network, args.batch, 1)
    alone = ", ".join(f"{p.id} {price(p) * 1e3:.1f} ms" for p in load_fleet(fleet).pnodes)
    graph = vgraph.load(network)
    before, partition, after = split_pipeline(None, True, {})
    seen = graph.copy()
    run_pipeline(seen, before, target="cpu")
    equal = place(graph, load_fleet(fleet), before=before, partition=partition, after=after, target="cpu",
                  batch=args.batch, micro_batches=1, assignment={n.id: "h0" for n in seen.nodes},
                  replicas=([["h0"], ["h1"]], [args.batch // 2, args.batch - args.batch // 2])).report
    predicted = equal["step_seconds"] / planned["step_seconds"]
    measured = paired_median(times["DDP"], times["launch"])
    apart = abs(losses["launch"] - losses["DDP"]) / abs(losses["DDP"])
    if apart > LOSS_RTOL:
        raise SystemExit(f"bench_vs_torch: on the unequal hosts the last losses differ by {apart:.1e} (> "
                         f"{LOSS_RTOL:g}): not the same training")
    return "\n".join([
        f"Unequal hosts (netlab: host h0 {cores[0]:g} core, h1 {cores[1]:g} core, cgroup quotas; fleet probed "
        f"inside them: the whole step alone priced at {alone}), 2 processes, batch {args.batch}, "
        f"{args.rounds} alternated rounds:", "",
        "| way | batch shares | predicted step ms | measured step ms (median of rounds) |",
        "|---|---|---:|---:|",
        f"| vgraph launch --replicas 2 (planner) | {shares} | {planned['step_seconds'] * 1e3:.1f} | "
        f"{statistics.median(times['launch']) * 1e3:.1f} |",
        f"| DDP (equal split) | {[args.batch // 2, args.batch - args.batch // 2]} | {equal['step_seconds'] * 1e3:.1f} "
        f"(vgraph's price of it) | {statistics.median(times['DDP']) * 1e3:.1f} |", "",
        f"last losses agree to {apart:.1e} (relative; checked against {LOSS_RTOL:g})", "",
        f"DDP / launch on unequal hosts: measured {measured:.2f}x, predicted {predicted:.2f}x "
        f"(measured / predicted {measured / predicted:.2f}; {rounds_note(args.rounds)})"])


if __name__ == "__main__":
    sys.exit(main())
