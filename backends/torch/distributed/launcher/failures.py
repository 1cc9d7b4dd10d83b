"""After a failed attempt: what the machines decide (membership.py; machine 0 for all), the survivors' state
rescued into a checkpoint when they hold every VNode at one step (training/rescue.py), and, when machine 0
itself is lost under `--on-failure shrink` or `restart`, the coordinator role moved to the lowest survivor
from the history it mirrored and the survivors' rescue shards (succession.py: `mirror`, `fence`).

Apart from the attempt loop because the loop only asks "what is the next attempt's fleet and plan, or does the
run stop?"; the answer's many cases (restart, re-partition, shrink, machines gone, a succession) are here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vgraph.base.safeio import atomic_write, read_input
from vgraph.cost.fleet import Fleet, loads_fleet
from vgraph.run.files import NETWORK_YML, TOKENIZER_JSON, RunLock, error_name
from vgraph.run.step_plan import make_plan

from ...training import checkpoint as ckpt
from ...training.config import TrainingError
from ...training.rescue import RESCUE_DIR, clear_rescue, rescue_saved, run_identity
from ..job import EXIT_USER_ERROR, Job
from . import succession
from .boundaries import last_step, record_event, serve_channel, take_admission
from .elastic import TookOver
from .emission import Attempt, plan as placed_as_planned
from .inputs import Run
from .membership import REQUEST_TIMEOUT_S, MachineLost, decide
from .placing import shrink
from .shard_transfer import send_shards

__all__ = ["after_failure", "fence", "mirror", "succeed_followed"]


def fence(run: Run) -> None:
    """The coordinator, about to go on without machines it lost: stop if one of them coordinates the run now (a
    machine 0 started again within the rejoin timeout heard the others before they took the run over)."""
    from .membership import channel_key

    why = succession.superseded(run.run_dir, channel_key(run.token), run.node_rank) if run.succeeds else None
    if why is not None:
        raise TrainingError(why)


def mirror(run: Run) -> None:
    """The coordinator serves the run's history and records where the machines are; the machines next in
    line (succession.MIRRORS of them) pull it into RUN/launch/mirror/."""
    machines = run.machines
    if run.lead:
        machines.serve_mirror(succession.MirrorSource(
            run.run_dir, lambda: run.admission.record() if run.admission is not None else None).answer)
        port = machines.port
        machines.on_addresses(lambda addrs: succession.record_machines(run.run_dir, port, addrs))
    elif run.node_rank <= succession.MIRRORS:
        run.mirror = succession.Mirror(machines.request, run.launch_dir / succession.MIRROR_DIR, run.say,
                                       active=lambda: machines.coordinator != machines.node_rank,
                                       over=lambda: not machines.active).start()


def after_failure(run: Run, attempt: Attempt, record: dict[str, Any], restarts: int, fleet: Fleet
                  ) -> tuple[Fleet, Any, int]:
    """A failed attempt (after `restarts` restarts): raise when it must not restart; else the fleet (and shrunk
    plan) of the next one, and the steps it will train again (machine 0's rescue)."""
    codes, lost = record.pop("codes"), record.pop("lost_ranks")
    errors = _user_errors(run.launch_dir)
    if not errors and any(c == EXIT_USER_ERROR for c in codes.values()):
        errors = "a worker stopped with an error (see its output above)"
    ranks = attempt.ranks
    lost_pnodes = [ranks[r] for r in lost]
    described = ", ".join(f"{ranks[r]} (rank {r}, exit {codes[r]})" for r in lost)
    if run.machines.active:  # every machine reports; machine 0 decides for all (membership.py)
        if not run.lead:  # this machine's survivors' shards first: machine 0 decides once it has every report
            send_shards(run.machines.request, run.launch_dir / RESCUE_DIR, attempt.number, run.emit)
            run.rescued = lambda: succession.rescued_state(run.run_dir, **_rescue_inputs(run, attempt),
                                                           keep=run.keep_checkpoints, say=run.emit)  # a successor's
        report = {"lost": lost_pnodes, "described": described, "error": errors}
        try:
            plan = run.machines.settle(report,
                                       lambda reports, missing: decide(reports, missing, run.home, run.on_failure),
                                       wait_for_all=run.on_failure == "restart")
        except MachineLost as exc:
            plan = _succeed(run, report, exc, attempt.number)  # the coordinator is lost: a survivor takes its
            # role, or the run stops
        if run.lead and plan["lost"]:
            fence(run)  # before going on without machines: none of them took this run over meanwhile
        lost_pnodes, described, errors = plan["lost"], plan["described"] or "on another machine", plan["error"]
        gone = list(plan.get("gone") or [])
        if run.admission is not None and gone:
            run.admission.vanished(gone)
    else:
        gone = []
    if errors:
        raise TrainingError(errors)
    redone = 0
    if run.lead:  # before any refusal to restart: a later --resume starts from the rescued step too
        redone = _rescue(run, attempt, lost_pnodes)
    if run.on_failure == "stop" or restarts >= run.max_restarts:
        raise TrainingError(f"worker {described} failed; not restarting "
                            f"({'--on-failure stop' if run.on_failure == 'stop' else f'{restarts} restarts'})."
                            f" Continue the run with --resume.")
    shrunk = None
    if run.on_failure == "repartition":
        if not any(p.id not in lost_pnodes for p in fleet):
            raise TrainingError(f"worker {described} failed and no PNode is left to re-partition onto")
        fleet = fleet.without(lost_pnodes)
    if run.on_failure == "shrink":
        shrunk = shrink(attempt.placement, fleet, lost_pnodes, described, run.batch, run.micro)
    if run.on_failure == "restart" and gone:  # machines that vanished: re-planned around (the partition pass)
        fleet = fleet.without(gone)
        run.given = (None, None)  # a given placement names the lost PNodes
        run.partition = run.partition.with_options("partition", replicas="auto")  # as many as the rest holds
    where = ckpt.latest_checkpoint(run.run_dir) if run.lead else None
    run.emit(f"launch: worker {described} failed; restarting from {where or 'the last checkpoint'}"
             f"{' on ' + ', '.join(fleet.ids) if run.on_failure == 'repartition' or gone else ''}"
             f"{f' with {len(shrunk[1][0])} replica(s), batch shares {shrunk[1][1]}' if shrunk else ''}")
    return fleet, shrunk, redone


def _user_errors(launch_dir: Path) -> str:
    """The workers' user-facing errors (error-<rank>.txt), each text once."""
    texts = [read_input(p, what="worker error file").strip() for p in sorted(launch_dir.glob(error_name("*")))]
    return "\n".join(dict.fromkeys(t for t in texts if t))


def _rescue(run: Run, attempt: Attempt, lost: list[str]) -> int:
    """Machine 0 after a failed attempt: a checkpoint from the survivors' rescue shards when they hold every
    VNode at one step later than the last checkpoint (training/rescue.py), else the last checkpoint; either
    way the steps redone are said (the launcher's line, a fleet-events.jsonl row, the final summary)."""
    folder = run.launch_dir / RESCUE_DIR
    latest = ckpt.latest_checkpoint(run.run_dir)
    floor = ckpt.checkpoint_step(latest) if latest is not None else 0
    logged = last_step(run.run_dir)
    found = rescue_saved(folder, run.run_dir, **_rescue_inputs(run, attempt), floor=floor, logged=logged,
                         keep=run.keep_checkpoints, say=run.emit)
    if found.unsaved:  # a full disk: the run still has its last checkpoint
        found.why, found.step = f"its checkpoint could not be written: {found.unsaved}", None
    if found.step is not None:
        resume, source = found.step, "replicas"
        said = (f"the survivors hold every VNode at step {found.step} (ranks {found.ranks}): checkpoint "
                f"{found.saved}")
    else:
        resume, source = floor, "checkpoint"
        said = f"no rescue ({found.why}); resuming from {latest or 'the start'}"
    redone = max(0, found.reached - resume)
    run.emit(f"launch: {said}; {redone} step(s) redone")
    record_event(run.run_dir, {"event": "rescue", "step": logged, "attempt": attempt.number, "lost": lost,
                               "from": source,
                               "resume_step": resume, "reached": found.reached, "steps_redone": redone,
                               "why": found.why if found.step is None else "", "refused": found.refused})
    clear_rescue(folder)
    return redone


def _rescue_inputs(run: Run, attempt: Attempt) -> dict[str, Any]:
    """What a rescue of `attempt` is assembled against (training/rescue.py): the run's identity, the network's
    parameter keys, whether state is each rank's own, and what its checkpoint carries besides the shards'."""
    job, graph = attempt.job, attempt.placement.graph
    plan = make_plan(graph, attempt.placement.final, list(attempt.placement.ranks))
    compressing = job.grad_compress != "none" or graph.nodes_of_type("compress")
    return {"run": run_identity(job.network_yaml, job.run_info), "attempt": attempt.number, "ceiling": run.steps,
            "keys": set().union(*(plan.param_keys(r) for r in range(plan.world_size))),
            "per_rank_state": "the run compresses with error feedback, whose buffers are each rank's own"
                              if compressing else "",
            "extra": {"layout": "unfused", "run": json.loads(json.dumps(job.run_info, default=str)),
                      "network_yaml": job.network_yaml,
                      "tokenizer_json": run.tokenizer_json,
                      "launch": {"ranks": job.ranks, "assignment": job.final_assignment, "micro_batches": run.micro,
                                 "attempt": attempt.number}}}


def _succeed(run: Run, report: dict[str, Any], lost: MachineLost, attempt: int) -> dict[str, Any]:
    """This machine lost the coordinator (succession.py): the lowest surviving machine takes its role, the
    others follow it; the decision for the next attempt, with the lost coordinator's PNodes lost (shrink
    drops its replicas, restart re-plans on the rest).  The followers send their rescue shards of `attempt`
    to it (the successor resumes from the newest consistent state: `Run.rescued`).  A coordinator followed
    and lost in turn is elected around the same way.  The run stops (TrainingError) when the coordinator role
    cannot move: another --on-failure, or nobody left."""
    machines = run.machines
    if not run.succeeds or run.lead:
        raise TrainingError(str(lost)) from None
    home = run.home or {}
    survivors = set(home.values()) | {run.node_rank}
    window = 2 * (run.link_timeout + REQUEST_TIMEOUT_S)  # a lower-ranked survivor noticed the loss by then
    gone: set[str] = set()
    dead: set[int] = set()
    while True:
        old = machines.coordinator
        survivors.discard(old)
        gone.update(p for p, m in home.items() if m == old)
        # Only the lost machines' PNodes count (as membership.decide rules for a missing machine): the workers
        # here failed because of them.
        report = {**report, "lost": sorted(gone), "described": f"{', '.join(sorted(gone))} (machine(s) "
                                                              f"{', '.join(map(str, sorted(dead | {old})))} lost)"}
        dead.add(old)
        run.emit(f"launch: machine {old} (the coordinator) is lost: {lost}; electing a successor among machine(s) "
                 f"{', '.join(map(str, sorted(survivors)))}")
        try:
            plan = succession.succeed(
                machines, old, survivors, report, lambda reports, missing: decide(reports, missing, home, run.on_failure),
                window, send=lambda: send_shards(machines.request, run.launch_dir / RESCUE_DIR, attempt, run.emit),
                serve=lambda: serve_channel(run))
            break
        except MachineLost as again:
            lost = again
    run.master_addr = machines.addr  # the workers' rendezvous: the coordinator's
    if machines.coordinator == run.node_rank:
        plan = {**plan, "redone": _become_coordinator(run, old, plan).redone}
    else:
        run.emit(f"launch: machine {machines.coordinator} ({machines.addr}) is the coordinator now; this machine "
                 f"follows it")
    return plan


def _become_coordinator(run: Run, old: int, plan: dict[str, Any]) -> succession.Installed:
    """This machine took the coordinator role: its run directory becomes the run's (locked, the newest state
    installed, network.yml and tokenizer.json written) and it serves the history to the next in line."""
    if run.mirror is not None:
        run.mirror.stop()
    # This launcher's own --out (a follower's: its launch/ folder and mirror); open_run_dir would refuse it
    # as not yet a run, and it becomes one here, under the lock.
    lock = RunLock.acquire(run.run_dir, "vgraph launch (the coordinator, after succession)")
    if lock.note:
        run.emit(lock.note)
    installed = succession.install(run.run_dir, run.rescued(), run.emit)
    run.lead = True
    atomic_write(run.run_dir / NETWORK_YML, run.yaml_text)
    atomic_write(run.run_dir / TOKENIZER_JSON, run.tokenizer_json)
    mirror(run)
    row = {"event": "succession", "step": installed.step, "coordinator": run.node_rank, "lost": old,
           "address": run.machines.addr,
           "resume_step": installed.step, "steps_redone": installed.redone, "state": installed.source,
           "pnodes_lost": plan.get("lost", [])}
    record_event(run.run_dir, row)
    run.emit(f"launch: machine {run.node_rank} is the coordinator now (machine {old} lost): the run goes on in "
             f"{run.run_dir} from step {installed.step} ({installed.source}; {installed.redone} step(s) redone)")
    return installed


def succeed_followed(run: Run, why: Exception, number: int, report: dict[str, Any] | None) -> dict[str, Any]:
    """A machine an elastic run started with lost the coordinator while it ran (or waited for) the coordinator's
    job `number` (elastic.follow_attempts' `lost`): elected as `_succeed` elects.  Following another machine:
    that one's decision.  Taking the role: elastic.TookOver with the next attempt's fleet: the job's fleet
    (the grown one: every joined PNode's figures travel in it) without the lost machines' PNodes, with the
    admitted machines that waited, re-planned by the partition pass (as `restart` re-plans around a machine
    that vanished, whichever of shrink or restart the run has: the job's replicas are not this machine's to
    shrink)."""
    report = report or {"lost": [], "described": "", "error": ""}  # waiting for a job: nothing of its own lost
    job_path = run.launch_dir / f"job-{number}.json"
    job = Job.read(job_path)
    fleet = loads_fleet(job.fleet_yaml, f"{job_path} (its fleet)")
    run.home = {**(run.home or {}), **job.machines}
    followed = _followed(run, job, job_path, fleet)
    run.rescued = lambda: succession.rescued_state(run.run_dir, **_rescue_inputs(run, followed),
                                                   keep=run.keep_checkpoints, say=run.emit)
    plan = _succeed(run, report, why if isinstance(why, MachineLost) else MachineLost(str(why)), number)
    if not run.lead:
        return plan
    if plan.get("error"):
        raise TrainingError(plan["error"])
    take_admission(run)
    run.given = (None, None)
    run.partition = run.partition.with_options("partition", replicas="auto")
    raise TookOver(number, run.admission.grown_fleet(fleet.without(list(plan.get("gone") or plan["lost"]))),
                   int(plan.get("redone", 0)))


def _followed(run: Run, job: Job, job_path: Path, fleet: Fleet) -> Attempt:
    """The attempt a follower ran from the coordinator's job, placed again as the job says (its assignment,
    replicas and choices): what a rescue of it is assembled against (`_rescue_inputs`)."""
    size = len(job.plan_ranks)
    layout = ([job.ranks[i:i + size] for i in range(0, len(job.ranks), size)], list(job.batch_shares))
    placement = placed_as_planned(run, fleet, job.assignment, layout, choices=job.plan_choices)
    return Attempt(job.attempt, placement, job, job_path, [], job.train.threads or 1, None)
