"""No single holder: the run survives the loss of machine 0 (the coordinator) when another replica holds
every VNode (`--on-failure shrink` or `restart`, `--nnodes N`, or `--nnodes MIN:MAX`, MIN = 1 included).

Why: machine 0's launcher serves the launchers' channel, and its rank 0 writes metrics.jsonl and the
checkpoints into ITS run directory.  Everything else a successor needs it already has: the job's settings
(every machine of a static run runs the same command), the prepared corpus (each machine prepares it), the
fleet and the machines' addresses (membership.py: every beat's answer carries them).  What only machine 0 had
is the run's history, so it is mirrored, and the coordinator role moves:

* **Mirror.** The machines next in line (the MIRRORS lowest node ranks after the coordinator) pull, every
  MIRROR_EVERY_S over the sealed channel: the new bytes of metrics.jsonl (from the offset they hold, checked by
  the last bytes they hold, so a restart's rewrite of the file is noticed and the mirror starts over), and,
  when `latest` names a checkpoint they lack, that checkpoint's files in the chunks elastic.py's joins use
  (512 KiB, size and SHA-256 checked).  They land in the follower's own `RUN/launch/mirror/` (a folder per
  checkpoint, renamed into place when complete, then the `latest` pointer; the older one removed).  Two
  machines mirror so that the successor may die during its succession and the next one still has the run.
* **Succession.** When a follower's channel to the coordinator has failed for the rejoin timeout
  (membership.settle's MachineLost), the survivors are the attempt's machines without it; each asks the
  survivors of lower rank, in rank order, for up to ELECT_WINDOW (who serves the channel there?).  The first
  that answers as coordinator is followed: reports and beats go to its address, same port.  When none of
  them answers, this machine takes over: it serves the channel on its own address (membership.take_over),
  collects the survivors' reports, decides the next attempt (the lost coordinator's PNodes lost and `gone`:
  shrink drops its replicas, restart re-plans on the rest), and only then installs the newest state into its own run directory (`install`) and writes
  the run from there on (its rank 0, its metrics.jsonl, its checkpoints).  Ties go by rank: a successor that
  finds a lower-ranked one serving while it collects reports steps down and follows it.
* **Where things are.** Metrics and checkpoints continue in the new coordinator's run directory (its
  `--out`): metrics.jsonl there holds the rows up to the installed checkpoint, and the steps after it are
  redone once (rows machine 0 had logged past it are dropped, as after any restart).  A row of
  `launch/fleet-events.jsonl` there records the succession: the new coordinator, the step resumed from,
  the steps redone, where the state came from.
* **A machine 0 that comes back** (started again with the same command) asks the machines it recorded in
  `launch/machines.json` who coordinates; when one answers with another machine, it refuses to start
  (`superseded`: a VGraphError naming the coordinator, exit 2), so the run is never split in two.

An elastic run (`--nnodes MIN:MAX`) carries more: the machines that joined.  The coordinator's admission
(boundaries.Admission.record: each admitted machine's PNode figures, the machines that left) travels with the
rows (`admission.json` in the mirror), so the successor admits as machine 0 did and knows the machines still
waiting for a boundary; the fleet of the attempt that was running is in its job.  The line of succession is
the lowest surviving machine number, started or joined: a machine that joined has the launch settings its
admission carried (inputs.launch_settings) and the latest job (the training options, network and fleet), and
builds from them the `Run` a started machine has from its command (attempts.JoinedSuccession); joined machines
numbered up to MIRRORS mirror as started ones do.  A joined machine without a job yet (still receiving the
run's files) follows whoever takes the role (`follow_successor`), and a later joiner asks the successor.

The newest state wins (`install`, which reads the mirror and the shards once, and writes the run directory
once): the mirrored checkpoint when it loads whole (one that does not is skipped and said), or, later, the
survivors' rescue shards assembled into a checkpoint (training/rescue.py): each follower sends its own to the
coordinator it follows before its report (`succeed`'s `send`), so the successor holds every survivor's shards
once it has every report, and a replica that survived gives the step the workers reached: 0 steps redone,
provided that step's row was mirrored (the log must hold every step once).

Where: the history's mirror, the machines' record and a returning machine 0's refusal are mirror.py (they run
all along, beside the attempts); this module is the role moving, from the failure that loses the coordinator
(`lost_coordinator`, asked by failures.after_failure; `succeed_followed` for a machine following jobs) through
the election (`succeed`) to the new coordinator's run directory (`install`), so a successor's steps after a
failure are one module's, called one way.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import atomic_write
from vgraph.cost.fleet import Fleet, loads_fleet
from vgraph.run.files import LATEST, LAUNCH_DIR, METRICS_JSONL, NETWORK_YML, TOKENIZER_JSON, RunLock

from ...training import checkpoint as ckpt
from ...training.config import TrainingError
from ...training.rescue import RESCUE_DIR, rescue_saved
from ..job import Job
from .boundaries import record_event, serve_channel, take_admission
from .elastic import TookOver
from .emission import Attempt, plan as placed_as_planned, rescue_inputs
from .inputs import Run
from .membership import (REQUEST_TIMEOUT_S, MachineLost, decide, elect, follow_successor, rival,  # noqa: F401
                         serving)  # (elect, serving, follow_successor: this module's API too)
from .mirror import MIRROR_DIR, serve_history, superseded
from .shard_transfer import send_shards

__all__ = ["elect", "serving", "succeed", "follow_successor", "install", "Installed", "fence", "succeed_followed",
           "lost_coordinator"]


def succeed(machines: Any, lost: int, survivors: set[int], report: dict,
            decide: Callable[[dict[int, dict], list[int]], dict], window: float,
            send: Callable[[], Any] = lambda: None, serve: Callable[[], Any] = lambda: None) -> dict:
    """After this machine lost coordinator `lost`: elect the new one among `survivors` (this machine
    included), follow it or take over, and return the decision for the next attempt (membership.settle's).
    `machines.coordinator` says who won.  A rival of lower rank wins a tie; MachineLost when the coordinator
    followed is lost in turn (the caller elects again without it).

    `send`: a follower's rescue shards to the coordinator it follows, before its report (shard_transfer.py),
    so the successor has every survivor's shards once it has every report; `serve`: the successor answers
    them (and whatever else machine 0's channel answered) from the moment it serves the channel.  The lost
    coordinator's PNodes are `gone` in the decision (vanished machines: `restart` re-plans without them)."""
    from .membership import SteppedDown

    def follow(k: int) -> dict:
        machines.follow(k)
        send()
        return machines.settle(report, lambda reports, missing: {}, wait_for_all=True)

    me = machines.node_rank
    chosen = elect(me, survivors, lambda k: serving(machines, k, window))
    if chosen != me:
        return follow(chosen)
    serve()  # before the channel is up: a follower that finds it serving may send its shards at once
    try:
        machines.take_over(lost, set(survivors))
    except VGraphError:  # the address is taken: a survivor of lower rank serves there after all?
        chosen = elect(me, survivors, lambda k: serving(machines, k, 0.0))
        if chosen == me:
            raise
        return follow(chosen)

    def decide_without_lost(reports: dict[int, dict], missing: list[int]) -> dict:
        plan = decide(reports, missing)  # a survivor that did not report loses its PNodes, and only those count
        if plan.get("error"):
            return plan
        return {**plan, "lost": sorted(set(plan["lost"]) | set(report["lost"])),  # ... and the lost coordinators'
                "gone": sorted(set(plan.get("gone") or []) | set(report["lost"]))}

    machines.superior = rival(machines, set(survivors))
    try:
        return machines.settle(report, decide_without_lost, wait_for_all=True)
    except SteppedDown as down:
        machines.step_down(int(down.args[0]))
        send()
        return machines.settle(report, lambda reports, missing: {}, wait_for_all=True)
    finally:
        machines.superior = None


@dataclass
class Installed:
    step: int  # the step the next attempt resumes from (0: from the start)
    redone: int  # steps the lost coordinator had logged past it, trained again
    source: str  # where the state came from


def _rows(path: Path) -> list[dict]:
    """The complete rows of a mirrored metrics.jsonl (the last line may be cut off mid-row)."""
    rows = []
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def install(run_dir: Path, rescue: dict[str, Any] | None = None, keep: int = 1,
            say: Callable[[str], None] = lambda line: None) -> Installed:
    """Make `run_dir` (the new coordinator's, locked by the caller) hold the run's newest state, from the mirror
    and the survivors' shards read once: the mirrored checkpoint when it loads whole, or, newer, the checkpoint
    the rescue shards of the attempt `rescue` describes (emission.rescue_inputs; RUN/launch/rescue/: this
    machine's own and those the others sent it) add up to (training/rescue.py: a step later than the mirrored
    checkpoint's and no later than the last mirrored row, since a step without its row would be missing from
    the log; shards of another run or attempt, or damaged ones, refused and said); written into `run_dir`
    with its `latest` pointer (`keep` checkpoints kept), and metrics.jsonl with the mirrored rows up to its
    step (the rank 0 of the next attempt resumes there and logs the rest once)."""
    mirror = run_dir / LAUNCH_DIR / MIRROR_DIR
    rows = _rows(mirror / METRICS_JSONL)
    last = max((r["step"] for r in rows), default=0)
    mirrored = ckpt.latest_checkpoint(mirror) if (mirror / LATEST).exists() else None
    chosen = ckpt.newest_loadable([mirrored] if mirrored is not None else [],
                                  lambda path, exc: say(f"launch: not resuming from {path}: {exc}"))
    floor = chosen[1] if chosen is not None else 0  # damaged: the shards then compete with nothing
    found = rescue_saved(run_dir / LAUNCH_DIR / RESCUE_DIR, run_dir, **rescue, floor=floor, logged=last, keep=keep,
                         say=say) if rescue is not None else None
    if found is not None and found.step is None:
        say(f"launch: the survivors' shards give no newer state than the mirrored checkpoint: {found.why}")
    elif found is not None:
        say(f"launch: the survivors hold every VNode at step {found.step} (the shards of ranks {found.ranks}; the "
            f"mirrored checkpoint is step {floor})")
        if found.saved is None:  # a full disk: the mirrored checkpoint is still there
            say(f"launch: the survivors' state at step {found.step} could not be written: {found.unsaved}")
        else:
            chosen = (found.saved, found.step)
    if chosen is None:
        atomic_write(run_dir / METRICS_JSONL, "")
        return Installed(0, last, "none: from the start")
    path, step = chosen
    target = run_dir / path.name
    if path.resolve() != target.resolve():
        staging = run_dir / f".{path.name}.tmp-succession"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(path, staging)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)
    atomic_write(run_dir / LATEST, target.name + "\n")
    atomic_write(run_dir / METRICS_JSONL, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
    source = "mirrored checkpoint" if path == mirrored else f"rescued state {path}"
    return Installed(step, max(0, last - step), source)


def fence(run: Run) -> None:
    """The coordinator, about to go on without machines it lost: stop if one of them coordinates the run now (a
    machine 0 started again within the rejoin timeout heard the others before they took the run over)."""
    from .membership import channel_key

    why = superseded(run.run_dir, channel_key(run.token), run.node_rank) if run.succeeds else None
    if why is not None:
        raise TrainingError(why)


def lost_coordinator(run: Run, report: dict[str, Any], lost: MachineLost, attempt: Attempt) -> dict[str, Any]:
    """This machine lost the coordinator (succession.py) in `attempt`: the lowest surviving machine takes its
    role, the others follow it; the decision for the next attempt, with the lost coordinator's PNodes lost
    (shrink drops its replicas, restart re-plans on the rest).  The followers send their rescue shards of
    `attempt` to it (the successor resumes from the newest consistent state: `install`).  A coordinator followed
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
            plan = succeed(
                machines, old, survivors, report, lambda reports, missing: decide(reports, missing, home, run.on_failure),
                window,
                send=lambda: send_shards(machines.request, run.launch_dir / RESCUE_DIR, attempt.number, run.emit),
                serve=lambda: serve_channel(run))
            break
        except MachineLost as again:
            lost = again
    run.master_addr = machines.addr  # the workers' rendezvous: the coordinator's
    if machines.coordinator == run.node_rank:
        plan = {**plan, "redone": _become_coordinator(run, old, plan, attempt).redone}
    else:
        run.emit(f"launch: machine {machines.coordinator} ({machines.addr}) is the coordinator now; this machine "
                 f"follows it")
    return plan


def _become_coordinator(run: Run, old: int, plan: dict[str, Any], attempt: Attempt) -> Installed:
    """This machine took the coordinator role: its run directory becomes the run's (locked, the newest state
    installed: the mirrored one or the survivors' of `attempt`, network.yml and tokenizer.json written) and it
    serves the history to the next in line."""
    if run.mirror is not None:
        run.mirror.stop()
    # This launcher's own --out (a follower's: its launch/ folder and mirror); open_run_dir would refuse it
    # as not yet a run, and it becomes one here, under the lock.
    lock = RunLock.acquire(run.run_dir, "vgraph launch (the coordinator, after succession)")
    if lock.note:
        run.emit(lock.note)
    rescue = rescue_inputs(attempt, run.steps, run.tokenizer_json, run.micro)  # what the shards are assembled against
    installed = install(run.run_dir, rescue, run.keep_checkpoints, run.emit)
    run.lead = True
    atomic_write(run.run_dir / NETWORK_YML, run.yaml_text)
    atomic_write(run.run_dir / TOKENIZER_JSON, run.tokenizer_json)
    # The history served from here on; an elastic run's admission is taken after this (take_admission).
    serve_history(run.machines, run.run_dir, lambda: run.admission.record() if run.admission is not None else None)
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
    job `number` (elastic.follow_attempts' `lost`): elected as `lost_coordinator` elects.  Following another machine:
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
    plan = lost_coordinator(run, report, why if isinstance(why, MachineLost) else MachineLost(str(why)), followed)
    if not run.lead:
        return plan
    if plan.get("error"):
        raise TrainingError(plan["error"])
    fleet = take_admission(run, fleet.without(list(plan.get("gone") or plan["lost"])))
    run.given = (None, None)
    run.partition = run.partition.with_options("partition", replicas="auto")
    raise TookOver(number, fleet, int(plan.get("redone", 0)))


def _followed(run: Run, job: Job, job_path: Path, fleet: Fleet) -> Attempt:
    """The attempt a follower ran from the coordinator's job, placed again as the job says (its assignment,
    replicas and choices): what a rescue of it is assembled against (emission.rescue_inputs)."""
    size = len(job.plan_ranks)
    layout = ([job.ranks[i:i + size] for i in range(0, len(job.ranks), size)], list(job.batch_shares))
    placement = placed_as_planned(run, fleet, job.assignment, layout, choices=job.plan_choices)
    return Attempt(job.attempt, placement, job, job_path, [], job.train.threads or 1, None)
