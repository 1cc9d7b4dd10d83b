"""One attempt's job: the network placed for it, the world ranks this machine starts, run.json,
placement.json and the job file (job.py) the workers read; `--emit-job DIR` writes that job for torchrun
or srun and trains nothing.

Apart from the attempt loop because it is the launcher's one writer of what a worker is handed: the loop
decides which fleet and plan an attempt gets, this module turns them into files, from the launch's
resolved inputs (inputs.py) alone.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgraph.base.safeio import OutputDir, atomic_write
from vgraph.cost.fleet import Fleet
from vgraph.placement.drift import fleet_file_text
from vgraph.plugins import loaded_files
from vgraph.run.compiled_graph import network_changes, plugin_distributions, weight_keeping_changes
from vgraph.run.files import PLACEMENT_JSON, RUN_JSON
from vgraph.run.step_plan import make_plan

from ...training.config import TrainingError
from ...training.rescue import run_identity
from ..job import JOB_FILE, Job
from ..rendezvous import TOKEN_ENV
from ..runtime.comm_choice import choose_comm
from .inputs import Run
from .placing import Placement, led_by, place

__all__ = ["Attempt", "RankZeroJoined", "rank_zero_elsewhere", "given_placement", "plan", "place_attempt", "emit_job",
           "rescue_inputs"]


@dataclass
class Attempt:
    """One attempt's placement, job and local workers."""

    number: int
    placement: Placement
    job: Job
    job_path: Path
    local: list[int]  # world ranks this machine starts
    threads: int
    comm: Any  # comm_choice.CommChoice
    fleet: Fleet | None = None  # the fleet it was placed on (None: a followed job's, placed again)

    @property
    def ranks(self) -> list[str]:
        return self.job.ranks


def given_placement(run: Run, number: int, shrunk: Any, replanned: bool = False) -> tuple[Any, Any]:
    """(assignment, replica layout) attempt `number` must use, or (None, None): the partition pass decides
    (always after a re-plan boundary: the fleet is no longer the one a given placement was for)."""
    if shrunk is not None:
        return shrunk
    if replanned:
        return None, None
    return run.given if number == 0 or run.on_failure == "restart" else (None, None)


def place_attempt(run: Run, fleet: Fleet, number: int, given: Any, layout: Any, hold: tuple[str, int] | None
                  ) -> Attempt | None:
    """Place the network for attempt `number`, write run.json, placement.json and the attempt's job file.
    None when no worker of this machine is left in the run (across machines, after a shrink)."""
    placement = plan(run, fleet, given, layout, run.home)
    changes = network_changes(placement.graph)  # passes that keep every weight aside: checkpoints stay true
    if changes:  # checkpoints carry the network as given: training another function would make them lie
        raise TrainingError(f"{', '.join(changes)} changes what the network computes, and vgraph launch "
                            f"stores the network as given: write the changed network first (vgraph optimize "
                            f"{run.network_file} --passes '{run.passes}' -o NEW.yml) and launch NEW.yml")
    compression = weight_keeping_changes(placement.graph)
    distributions = plugin_distributions(run.source, placement.graph)
    ranks = placement.world
    local = _local_ranks(run, ranks, number)
    if not local:  # shrunk away: this machine's PNodes are all in dropped replicas
        run.emit(f"launch: no worker of this machine (node rank {run.node_rank}) is left in the run; it goes on "
                 f"without it")
        return None
    gpus = sorted({p.accelerator for p in fleet if (p.accelerator or "").startswith("cuda") and p.id in ranks})
    if number == 0 and run.device.type == "cpu" and gpus:  # the plan's figures are the GPUs', not this CPU's
        run.say(f"launch: note: fleet {fleet.name!r} describes {', '.join(gpus)} PNodes and this run is on the CPU: "
                f"the placement and its predicted step are for those GPUs (a CPU fleet: --fleet cpu2, or one "
                f"measured with vgraph probe)")
    threads = run.threads or max(1, (os.cpu_count() or 1) // max(1, len(local)))
    info = dict(run.run_info, precision=dict(placement.graph.meta.get("precision") or {}), compression=compression,
                plugin_distributions=distributions,
                launch={"fleet": fleet.name, "pnodes": ranks, "micro_batches": run.micro, "attempt": number})
    job, comm = _job(run, placement, info, number, local, threads, hold, fleet=fleet)
    if run.lead:
        atomic_write(run.run_dir / RUN_JSON, json.dumps(info, indent=2, default=str) + "\n")
        atomic_write(run.run_dir / PLACEMENT_JSON, json.dumps(placement.report, indent=2) + "\n")
    job_path = job.write(run.launch_dir / f"job-{number}.json")
    return Attempt(number, placement, job, job_path, local, threads, comm, fleet)


def plan(run: Run, fleet: Fleet, given: dict[str, str] | None = None, layout: Any = None,
         homes: dict[str, int] | None = None, choices: dict[str, Any] | None = None) -> Placement:
    """The placement on `fleet`: the partition pass's plan, or `given` with its replica `layout` (and the
    partition's `choices` it was made with, a job's placed again); across
    machines, once `homes` (PNode -> machine) are known, with world rank 0 on a PNode of the coordinator's
    machine (`placing.led_by`), priced as it will run.  The attempt and the re-plan decision place through
    here, so the plan a decision priced is the plan the next attempt runs."""
    def placed(assignment: dict[str, str] | None, replicas: Any, choices: dict[str, Any] | None = None) -> Placement:
        return place(run.source, fleet, before=run.before, partition=run.partition, after=run.after,
                     target=run.target, batch=run.batch, micro_batches=run.micro, assignment=assignment,
                     replicas=replicas, grad_compress=run.grad_compress, pipeline=run.pipeline, choices=choices)

    placement = placed(given, layout, choices)
    if homes is None or not run.machines.active:
        return placement
    leads = {p for p in fleet.ids if homes.get(p, 0) == run.machines.coordinator}
    led = led_by(placement, fleet, leads) if leads else None
    if led is None:
        return placement
    moved = placed(*led, placement.choices)
    if not all(info.get("fits", True) for info in moved.report["pnodes"].values()):
        return placement  # the coordinator's PNode cannot hold rank 0's stage: refused where rank 0 is checked
    return moved


class RankZeroJoined(Exception):
    """A plan that puts rank 0 on a joined machine: machine 0 holds the run (its metrics, checkpoints and
    rank 0) until the coordinator can move (issue 36), so such a plan is not run; the joined PNodes wait."""


def rank_zero_elsewhere(pnode: str, homes: dict[str, int], coordinator: int) -> str | None:
    """Why a plan whose rank 0 is `pnode` cannot run now, or None: the coordinator's machine holds the run (its
    metrics, checkpoints and rank 0: `_local_ranks` stops a run whose rank 0 lands elsewhere).  The plan
    (`plan`) already moves rank 0 onto a PNode of the coordinator's machine when one can hold rank 0's
    stage; a plan still putting it elsewhere is refused at the decision rather than stopping the run at its
    boundary.  A PNode with no home yet runs on machine 0, as `_local_ranks` places it."""
    machine = homes.get(pnode, 0)
    if machine == coordinator:
        return None
    return (f"the planner's plan puts rank 0 on {pnode} (machine {machine}), and the coordinator, machine "
            f"{coordinator}, keeps rank 0 (it holds the run)")


def _local_ranks(run: Run, ranks: list[str], number: int) -> list[int]:
    """The world ranks this machine starts: a PNode stays on the machine that ran it first (machines
    k = ceil(ranks / N) consecutive ranks each at the first attempt); across machines, attempt `number`
    begins on the launchers' channel (membership.py)."""
    if run.home is None:
        per_node = math.ceil(len(ranks) / run.nnodes)
        run.home = {p: r // per_node for r, p in enumerate(ranks)}
    home = run.home
    if run.admission is not None and ranks[0] in run.admission.home():
        raise RankZeroJoined(ranks[0])
    if run.machines.active and home.get(ranks[0], 0) != run.machines.coordinator:
        who = run.machines.coordinator
        raise TrainingError(f"the replica of machine {who} was dropped: machine {who}, the coordinator, holds the run "
                            f"and its rank 0, so the run stops here; continue it with --resume")
    run.machines.begin(number, {home.get(p, 0) for p in ranks})
    return [r for r, p in enumerate(ranks) if home.get(p, 0) == run.node_rank]


def _job(run: Run, placement: Placement, info: dict[str, Any], number: int, local: list[int], threads: int,
         hold: tuple[str, int] | None, run_dir: str = "..", fleet: Fleet | None = None) -> tuple[Job, Any]:
    """The job file's content (job.py), with the transport this machine's `local` workers use (comm_choice.py);
    `run_dir` relative to the folder the job is written to; `fleet`: the attempt's, for rank 0's measured
    figures (vgraph/placement/drift.py)."""
    import torch  # loaded already: `run.device` is a torch.device (inputs.resolve_inputs)

    comm = choose_comm(run.device.type, len(local), torch.cuda.device_count() if run.device.type == "cuda" else 0,
                       torch.distributed.is_nccl_available(), run.comm)
    train = dataclasses.replace(run.train, threads=threads)
    ranks = placement.world
    return Job(
        run_dir=run_dir, network_yaml=run.yaml_text, network_file=run.network_file,
        pipeline_before=str(run.before), pipeline_after=str(run.after), target=run.target,
        assignment=placement.assignment, final_assignment=placement.final, ranks=ranks,
        plan_ranks=placement.ranks, batch_shares=placement.shares,
        predicted_bytes=float(placement.report["bytes_per_step"]),
        predicted_cut_bytes=float(placement.report["cut_bytes_per_step"]),
        device=comm.device, backend=comm.backend, stage_through_cpu=comm.stage_through_cpu,
        control_group=comm.control_group, data_dir=run.data_dir, data_digest=run.data_digest,
        tokenizer=run.tokenizer,
        run_info=json.loads(json.dumps(info, default=str)), attempt=number, train=train,
        micro_batches=run.micro, pipeline=run.pipeline, comm_timeout=float(run.comm_timeout),
        bucket_bytes=run.bucket_bytes, plugins=loaded_files(),  # every worker loads the launcher's plugin files
        grad_compress=run.grad_compress, plan_choices=placement.choices,
        hold={"rank": ranks.index(hold[0]), "step": int(hold[1])} if hold and hold[0] in ranks else None,
        fleet_yaml=fleet_file_text(fleet) if fleet is not None else "",
        fleet_file=os.path.realpath(fleet.source) if fleet is not None and fleet.source else "",
        drift_steps=run.drift_steps,
        machines={p: (run.home or {}).get(p, 0) for p in ranks}), comm


def emit_job(run: Run, folder: OutputDir) -> dict[str, Any]:
    """--emit-job DIR: place, write DIR/job.json (its run directory relative to DIR, the files in it relative
    to the run directory, and DIR's real path, from which a copy of the job finds its run: job.py) and say
    how to start it under torchrun or srun; trains nothing: the placement report (the result's).

    The torchrun command carries `--max-restarts` (launch's own, default 3): torchrun's default, 0, ends the
    job at the first dead worker, while each restart resumes from the run's latest checkpoint (worker.py), so
    a few restarts cost at most a few checkpoint intervals and a fault that recurs still ends the job after a
    handful of tries instead of looping."""
    attempt = place_attempt(run, run.fleet, 0, *run.given, run.hold)
    folder.path.mkdir(parents=True, exist_ok=True)
    attempt.job.run_dir = os.path.relpath(run.run_dir.absolute(), folder.path.absolute())
    path = attempt.job.write(folder.check(JOB_FILE))
    folder.wrote(JOB_FILE)
    world, per_node = len(attempt.ranks), len(attempt.local)
    module = "vgraph.backends.torch.distributed.runtime.worker"
    run.emit(f"launch: wrote {path} ({world} worker(s) {', '.join(attempt.ranks)}; {attempt.comm.describe()}); "
             f"start it with\n"
             f"  torchrun --nnodes {run.nnodes} --nproc-per-node {per_node} --max-restarts {run.max_restarts} "
             f"--rdzv-backend c10d --rdzv-endpoint {run.master_addr}:{run.base_port or 29500} -m {module} {path}\n"
             f"    (--max-restarts {run.max_restarts}: without it one dead worker ends the job; with it torchrun "
             f"starts the worker set again, which resumes from the latest checkpoint; SIGTERM or Ctrl-C: the "
             f"workers finish the step and save a checkpoint first)\n"
             f"  srun --ntasks {world} --ntasks-per-node {per_node} python -m {module} {path}   "
             f"(with {TOKEN_ENV} exported)")
    return attempt.placement.report


def rescue_inputs(attempt: Attempt, steps: int, tokenizer_json: str, micro: int) -> dict[str, Any]:
    """What a rescue of `attempt` is assembled against (training/rescue.py): the run's identity, the network's
    parameter keys, whether state is each rank's own, and what its checkpoint carries besides the shards'."""
    job, graph = attempt.job, attempt.placement.graph
    plan = make_plan(graph, attempt.placement.final, list(attempt.placement.ranks))
    compressing = job.grad_compress != "none" or graph.nodes_of_type("compress")
    return {"run": run_identity(job.network_yaml, job.run_info), "attempt": attempt.number, "ceiling": steps,
            "keys": set().union(*(plan.param_keys(r) for r in range(plan.world_size))),
            "per_rank_state": "the run compresses with error feedback, whose buffers are each rank's own"
                              if compressing else "",
            "extra": {"layout": "unfused", "run": json.loads(json.dumps(job.run_info, default=str)),
                      "network_yaml": job.network_yaml,
                      "tokenizer_json": tokenizer_json,
                      "launch": {"ranks": job.ranks, "assignment": job.final_assignment, "micro_batches": micro,
                                 "attempt": attempt.number}}}
