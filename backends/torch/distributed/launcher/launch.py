"""`vgraph launch`: train a network partitioned over a fleet, one torch.distributed worker per PNode.

    vgraph launch NETWORK.yml --fleet FLEET.yml [train options] [--micro-batches M] [--pipeline 1f1b|gpipe]
                  [--replicas N|auto] [--on-failure restart|repartition|shrink|stop] [--max-restarts N]
                  [--nnodes N --node-rank R --master-addr HOST --master-port PORT] [--bucket-size SIZE]
                  [--emit-job DIR]

The launcher (this module) does what needs doing once: it runs the pass
pipeline with the `partition` pass in it (before the fusions, so fusion
respects the placement), opens the corpus once for everybody (a prepared
directory, or text and the embedded corpus prepared into the cache:
training_data.py) and verifies it, writes the run directory's files as
`vgraph train` does (network.yml, tokenizer.json, run.json, placement.json),
and a job file (run_dir/launch/job-<attempt>.json).  Then it starts one
worker process per PNode that holds VNodes (worker.py) with the
torchrun environment on 127.0.0.1 and a free port (gloo on CPUs, nccl when
every local worker has a GPU of its own, else gloo through host memory).
Workers are forked from a multiprocessing forkserver that imported torch
once, so starting (and restarting) them takes milliseconds, not seconds per
process.  The launcher relays their output prefixed with `[<pnode>]` and
supervises them:

* all exit 0: done;
* one exits 3 (a user-facing error: diverged loss, incompatible resume, an
  input it cannot feed): the others are stopped and the error is raised;
* one dies otherwise (killed, crashed, lost its peer): the others, typically
  blocked in a receive from it, see their peer lost, write their rescue shard
  (the state of the last step they completed: training/rescue.py) and exit,
  or are terminated after 5 s (SIGTERM, then SIGKILL); machine 0 makes a
  checkpoint of the shards when they hold every VNode at one step (failures.py;
  the other machines send theirs over the launchers' channel:
  shard_transfer.py), and the run restarts from the latest checkpoint, with the same
  placement (`--on-failure restart`) or re-partitioned onto the PNodes that
  survived (`--on-failure repartition`: the dead worker's PNode is dropped
  from the fleet).  Checkpoints are in the unfused global layout and the
  data generator state travels in them, so no step is lost or applied twice:
  metrics past the checkpoint are dropped and recomputed.  At most
  `--max-restarts` times.

Replicas (`--replicas N|auto`; the CLI's default is auto, `LaunchConfig`'s 1): the partition pass plans R
copies of an S-stage pipeline (passes/partition_replicas.py) and R x S workers run it: world rank
r x S + s runs stage s of replica r (s in the order of use along the network), point to point inside
its replica, and the S stage groups sum their gradients with bucketed all-reduces on torch's collectives,
overlapped with the last micro-batch's backward (grad_sync.py; `--bucket-size`, default 25 MiB).  Every rank draws the global batch; replica r trains on its `batch_shares[r]` samples
of it, with losses weighted by shares of the global batch and dropout keyed by the global sample index,
so the run is the same training as one process.  Workers count every byte they send, the all-reduce
included, against placement.json's `bytes_per_step`.  `--on-failure shrink` drops the replicas that
lost a worker: the survivors keep their PNodes, share the global batch again by speed
(`vgraph.placement.replica_report.rebalanced_shares`) and resume from the last checkpoint; across machines, a
machine whose launcher falls silent (membership.py) loses all its PNodes.

Several machines (the torchrun way): run the same command on every machine
with `--nnodes N --node-rank R --master-addr <rank-0 machine> --master-port P`.
The placement is computed identically everywhere; machine R hosts ranks
R*k .. R*k+k-1 (k = ceil(ranks / N)), rank r being the r-th PNode in order of
use along the network.  Rank 0 (machine 0) writes metrics and checkpoints and
hands each rank its share of a checkpoint on resume, so only machine 0 needs
the run directory.  A failure restarts every machine's workers from the last
checkpoint (each launcher restarts its own; the rendezvous port moves to
P + attempt; a machine that vanished is re-planned around, its VNodes' state
rescued from a surviving replica when one holds them); `repartition` is
single-machine only.  The launchers keep in
touch through machine 0 on port P - 1 (membership.py): a machine lost with its
link is noticed within --link-timeout, and machine 0 decides for all what the
next attempt is.  With `shrink`, machine 0 itself may be lost: the lowest
surviving machine becomes the coordinator from the history it mirrored
(failures.py, succession.py).  A PNode stays on the machine that ran it first (after a
shrink, the survivors keep theirs).  The worker is a plain
torchrun-style program, so
`torchrun --nnodes N --nproc-per-node k ... -m vgraph.backends.torch.distributed.runtime.worker JOB.json`
from the job file `--emit-job DIR` writes (it prepares the run directory and
trains nothing) also works, and so does `srun` (docs/distributed.md).

Machines that join while the run goes on (`--nnodes MIN:MAX` on the machines the run starts with,
`vgraph launch --join HOST:PORT --pnode PNODE.yml` on a newcomer): machine 0 admits them on the launchers'
channel, decides whether re-planning onto the grown fleet pays (boundaries.py, vgraph/placement/replan.py) and
then asks for a boundary: the workers stop after the current step with a checkpoint and the next attempt
is placed on the grown fleet; the other machines run the jobs machine 0 publishes from then on
(elastic.py).

The launch reads top to bottom in `launch`: its inputs resolved once (inputs.py: settings checked, the
fleet and network read, run directory and data written), then the attempts (attempts.py), each placed and
written (emission.py: placement, run.json, placement.json, the job file: job.py) and supervised (this
machine's workers, supervisor.py); after a failure restarted, re-partitioned or shrunk, rescued, or given up
(failures.py; across machines, machine 0 decides: membership.py); joins and leaves admitted and re-planned
at a boundary (boundaries.py).  This module keeps the command: its options and `launch` itself.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Sequence

from vgraph.base.diagnostics import VGraphError
from vgraph.placement.drift import DEFAULT_DRIFT_STEPS
from vgraph.run.files import RunLock
from vgraph.run.step_plan import PIPELINES

from ...training.interrupt import StopRequest
from ...training.options import add_train_options, print_result, train_settings
from ..rendezvous import check_master_addr, free_port  # noqa: F401 (free_port: tests pick their ports here)
from . import elastic
from .attempts import JoinedSuccession, LaunchResult, micro_per_replica as _micro_per_replica, run_attempts  # noqa: F401
from .emission import emit_job
from .mirror import keep_history
from .inputs import (ON_FAILURE, LaunchConfig, is_elastic, job_folder, read_placement,  # noqa: F401
                     read_placement_layout, resolve_inputs)
from .boundaries import open_admission, serve_channel
from .membership import Machines
from .supervisor import warm
from .placing import Placement, place, shrink as _shrink, split_pipeline  # noqa: F401 (the package API)

__all__ = ["LaunchConfig", "LaunchResult", "launch", "split_pipeline", "place", "read_placement",
           "register_launch", "main"]


def launch(config: LaunchConfig) -> LaunchResult:
    """Partition, start the workers, supervise them through failures; see the module docstring.

    The first Ctrl-C or SIGTERM asks the workers to stop after the current step with a checkpoint
    (a file they poll in their per-step reduction) and raises `Interrupted` saying how to resume;
    a second one stops everything at once.  With `emit_job`, only writes the run directory and the job.
    """
    stop = StopRequest(lambda line: print(line, file=sys.stderr, flush=True))
    leave = config.leaving
    if leave is None and is_elastic(config) and config.node_rank != 0 and config.emit_job is None:
        leave = elastic.Leaving(lambda line: print(line, file=sys.stderr, flush=True))
    # Machine k != 0 of a run that takes joins: SIGTERM is a graceful leave (elastic.Leaving), not a stop.
    restore = leave.install() if leave is not None and config.leaving is None else stop.install()
    machines = Machines()  # several machines: opened by resolve_inputs (membership.py)
    try:
        with RunLock.held():  # machine 0's lock of the run directory (taken in resolve_inputs), held until here
            jobs = job_folder(config) if config.emit_job is not None else None  # refused before any work
            if jobs is None:
                warm()  # the workers' imports beside the placement (supervisor.warm)
            run = resolve_inputs(config, stop, machines)
            if leave is not None:
                run.leave = leave
                leave.attach(machines)
            if run.elastic and run.lead:
                run.admission = open_admission(run)
            if run.lead and machines.active:
                serve_channel(run)
            if run.succeeds and jobs is None:  # the machines next in line keep the coordinator's history
                run.mirror = keep_history(machines, run.run_dir, run.lead, run.admission, run.say)
            if jobs is not None:
                return LaunchResult(run.run_dir, 0, None, None, None, placement=emit_job(run, jobs))
            return run_attempts(run, stop)
    finally:
        if leave is not None:
            leave.close()
        machines.close()
        restore()


# -- the command ------------------------------------------------------------------------------------

def register_launch(subparsers: argparse._SubParsersAction) -> None:
    """Add `launch` to a `vgraph` subparser set (entry point of group `vgraph.commands`).

    Long because it is one `add_argument` per option, in the order `--help` shows them;
    split up, the command's options would no longer read as one list."""
    from vgraph.cli.common import remember_parser
    from vgraph.cli.main import add_plugin_option

    from vgraph.base import options
    from vgraph.base.options import non_negative_int as _non_negative_int, positive_int as _positive_int

    default = {f.name: f.default for f in fields(LaunchConfig)}  # LaunchConfig's, but --replicas: auto

    p = subparsers.add_parser(
        "launch", help="train a network partitioned over a fleet, one torch.distributed worker per PNode",
        description="Partition the network onto the fleet's PNodes and train it with one worker process per "
                    "PNode (torch.distributed; pipelined micro-batches, boundary tensors by send/recv). A "
                    "worker that dies is detected and the run restarts from the last checkpoint. The run "
                    "directory is the one `vgraph train` writes.")
    p.add_argument("network", metavar="FILE", type=options.network_file, nargs="?",
                   help="network YAML, or a shipped network's name (vgraph networks); not with --join")
    p.add_argument("--fleet", metavar="FLEET", type=options.fleet_file,
                   help="fleet spec YAML (PNodes), or a shipped fleet's name (required, except with --join)")
    p.add_argument("--micro-batches", type=_positive_int, metavar="M",
                   help="micro-batches per step, pipelined over the PNodes (default min(batch, 2 x PNodes))")
    p.add_argument("--pipeline", choices=PIPELINES, default=default["pipeline"],
                   help="micro-batch schedule: 1f1b (default; at most min(M, PNodes) micro-batches of activations "
                        "per worker) or gpipe (all forwards, then all backwards)")
    p.add_argument("--placement", metavar="JSON", type=options.path, help="use this placement.json's assignment (VNode -> PNode, "
                   "VNodes as before fusion) instead of running the partition pass")
    p.add_argument("--replicas", type=options.replicas, default="auto", metavar="N|auto",
                   help="data-parallel replicas of the pipeline (default auto: the plan of least predicted step "
                        "time, see `vgraph partition`); each replica's stage groups all-reduce gradients")
    p.add_argument("--on-failure", choices=ON_FAILURE, default=default["on_failure"],
                   help="when a worker dies: restart all on the same placement (default) from the survivors' "
                        "state when a replica of every VNode survived, else from the last checkpoint (the steps "
                        "redone are said; machines that vanished are re-planned around), re-partition onto the "
                        "surviving PNodes, shrink (drop the replicas that lost a worker; the others share the "
                        "global batch), or stop")
    p.add_argument("--max-restarts", type=_non_negative_int, default=default["max_restarts"], metavar="N",
                   help=f"default {default['max_restarts']}")
    p.add_argument("--comm-timeout", type=options.positive_float, default=default["comm_timeout"], metavar="S",
                   help="seconds a worker waits on a peer before failing (default 300)")
    p.add_argument("--bucket-size", type=options.byte_size, default=default["bucket_bytes"], metavar="SIZE",
                   help="gradient bucket of the replicas' all-reduce, e.g. 25M (default 25 MiB, as DDP): a bucket "
                        "is all-reduced as soon as its gradients are final in the last backward")
    p.add_argument("--grad-compress", default=default["grad_compress"], metavar="none|powersgd[:rank=R,start=N]",
                   help="the replicas' gradient all-reduce: none (default) or PowerSGD with error feedback "
                        "(torch's powerSGD_hook; rank R, default 4, after N plain steps, default 2); the planner "
                        "prices it")
    p.add_argument("--link-timeout", type=options.positive_float, default=default["link_timeout"], metavar="S",
                   help="several machines: a machine silent for S seconds is lost (its link or itself); the "
                        "others stop their workers (default 10; see membership.py)")
    p.add_argument("--nnodes", type=options.nnodes, default=(1, 1), metavar="N|MIN:MAX",
                   help="machines taking part (default 1); MIN:MAX: start with MIN, admit joins up to MAX "
                        "(launch --join)")
    p.add_argument("--node-rank", type=_non_negative_int, default=default["node_rank"], help="this machine's index (default 0)")
    p.add_argument("--master-addr", default=default["master_addr"], metavar="HOST",
                   help="address of machine 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=options.port, metavar="PORT",
                   help="rendezvous port on machine 0 (default: free port; 29500 with --nnodes > 1)")
    add_train_options(p, "launch", network=False)  # the training options, as `vgraph train` has them
    p.add_argument("--emit-job", metavar="DIR", type=options.path,
                   help="prepare the run directory and write DIR/job.json, train nothing: start the workers with "
                        "torchrun or srun (docs/distributed.md; the command is printed)")
    # Figures from the run itself (vgraph/placement/drift.py): launch only.
    p.add_argument("--drift-steps", type=_non_negative_int, default=DEFAULT_DRIFT_STEPS, metavar="K",
                   help="report a drift when a PNode's busy time stays more than 25%% off the plan's prediction for "
                        "K steps, and write the run's measured fleet (fleet.measured.yml); 0: never "
                        f"(default {DEFAULT_DRIFT_STEPS})")
    add_plugin_option(p)  # the files travel to the workers in the job file
    # Joining a running run (elastic.py): the only options a volunteer machine gives, with its secret in
    # VGRAPH_LAUNCH_TOKEN; everything else comes from machine 0.
    p.add_argument("--join", metavar="HOST:PORT", type=options.host_port,
                   help="join the run whose machine 0 has --master-addr HOST --master-port PORT and --nnodes "
                        "MIN:MAX (the run's secret in VGRAPH_LAUNCH_TOKEN); needs --pnode. SIGTERM leaves the "
                        "run gracefully (exit 0 once machine 0 releases this machine)")
    p.add_argument("--pnode", metavar="PNODE.yml", type=options.path,
                   help="with --join: this machine's figures (the file `vgraph probe -o` writes)")
    p.add_argument("--join-timeout", type=options.positive_float, default=60.0, metavar="S",
                   help="with --join: seconds to wait for machine 0's admission (default 60)")
    p.set_defaults(func=run_launch)
    remember_parser(p)


def run_launch(args: argparse.Namespace) -> int:
    from vgraph.placement.replica_report import step_prediction_gap

    if args.join is not None or args.pnode is not None:
        return _run_join(args)
    if args.network is None or args.fleet is None:
        raise VGraphError("vgraph launch needs a network FILE and --fleet FLEET (or, to join a running run, "
                          "--join HOST:PORT --pnode PNODE.yml)")
    train = train_settings(args, "launch")
    # A pipeline's micro-batches are gradient accumulation: K x --batch samples a step, in at least K of them.
    accum = train.pop("grad_accum")
    train["batch"] *= accum
    config = LaunchConfig(
        **train, fleet=args.fleet,
        micro_batches=(args.micro_batches if accum == 1 else max(args.micro_batches or 1, accum)),
        pipeline=args.pipeline, placement=args.placement, on_failure=args.on_failure, max_restarts=args.max_restarts,
        replicas=int(args.replicas) if args.replicas != "auto" else "auto",
        comm_timeout=args.comm_timeout, bucket_bytes=args.bucket_size, link_timeout=args.link_timeout,
        grad_compress=args.grad_compress, nnodes=args.nnodes[0], max_nnodes=args.nnodes[1], node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, drift_steps=args.drift_steps,
        emit_job=args.emit_job, log=None if not args.emit_job else (lambda line: print(line, flush=True)))

    result = launch(config)
    if not args.emit_job:
        print_result(result, f"{result.restarts} restart(s)" if result.restarts else None,
                     f"{result.steps_redone} step(s) redone" if result.restarts else None)
        gap = step_prediction_gap(result.placement or {}, result.history)
        if gap and not args.quiet:
            print(f"note: prediction off: {gap}", file=sys.stderr)
    return 0


def _run_join(args: argparse.Namespace) -> int:
    """`vgraph launch --join HOST:PORT --pnode PNODE.yml`: this machine takes part in a running run
    (elastic.py).  Everything but --out, --link-timeout, --comm-timeout and --quiet comes from machine 0."""
    if args.join is None or args.pnode is None:
        raise VGraphError("--join HOST:PORT and --pnode PNODE.yml go together: a machine joins with its own figures")
    if args.network is not None or args.fleet is not None:
        raise VGraphError("a joining machine gives no network or fleet: machine 0 sends the run's (drop "
                          f"{'FILE' if args.network is not None else '--fleet'})")
    host, port = args.join
    check_master_addr(host)
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    emit = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    leave = elastic.Leaving(emit)  # SIGTERM, or a first Ctrl-C: leave gracefully (docs/distributed.md)
    restore = leave.install()
    try:
        joined = elastic.follow(host, port, args.pnode, args.out, join_timeout=args.join_timeout,
                                link_timeout=args.link_timeout, comm_timeout=args.comm_timeout, emit=emit,
                                leave=leave, successor=JoinedSuccession(emit))  # JoinRefused: exit 2
    finally:
        restore()
    if joined.coordinated is not None:  # it took the coordinator's role: the run's result is here
        result = joined.coordinated
        print_result(result, f"{result.restarts} restart(s)", f"{result.steps_redone} step(s) redone")
    say(f"launch --join: done: machine {joined.machine} (PNode {joined.pnode}) ran in attempt(s) "
        f"{', '.join(map(str, joined.attempts)) or 'none'}{'; released: it left the run' if joined.released else ''}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.distributed.launcher.launch launch ...` (before the entry point is installed)."""
    from vgraph.cli.main import run_commands

    return run_commands([register_launch], argv, prog="python -m vgraph.backends.torch.distributed.launcher.launch")


if __name__ == "__main__":
    sys.exit(main())
