"""After a failed attempt: what the machines decide (membership.py; machine 0 for all), the survivors' state
rescued into a checkpoint when they hold every VNode at one step (training/rescue.py), and the next attempt's
fleet and plan (restart, re-partition, shrink, machines gone).  When the coordinator itself is lost under
`--on-failure shrink` or `restart`, the decision is the successor's (succession.lost_coordinator).

Apart from the attempt loop because the loop only asks "what is the next attempt's fleet and plan, or does the
run stop?"; the answer's many cases are here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from vgraph.base.safeio import read_input
from vgraph.cost.fleet import Fleet
from vgraph.run.files import error_name

from ...training import checkpoint as ckpt
from ...training.config import TrainingError
from ...training.rescue import RESCUE_DIR, clear_rescue, rescue_saved
from ..job import EXIT_USER_ERROR
from . import succession
from .boundaries import last_step, record_event, take_admission
from .emission import Attempt, rescue_inputs
from .inputs import Run
from .membership import MachineLost, decide
from .placing import shrink
from .shard_transfer import send_shards

__all__ = ["after_failure"]


def after_failure(run: Run, attempt: Attempt, record: dict[str, Any], restarts: int, fleet: Fleet
                  ) -> tuple[Fleet, Any, int]:
    """A failed attempt (after `restarts` restarts): raise when it must not restart; else the fleet (and shrunk
    plan) of the next one, and the steps it will train again (machine 0's rescue).  In a run that takes joins
    the next attempt is a boundary too: the admitted machines take part (the admission's fleet and homes), and
    a machine that took the coordinator's role here takes machine 0's admission with it (take_admission)."""
    was_lead = run.lead
    if run.admission is not None:
        fleet = run.admission.grown_fleet(fleet)
        run.home = {**(run.home or {}), **run.admission.home()}
    fleet, shrunk, redone = _next_attempt(run, attempt, record, restarts, fleet)
    if run.lead and not was_lead and run.elastic:
        fleet = take_admission(run, fleet)
    return fleet, shrunk, redone


def _next_attempt(run: Run, attempt: Attempt, record: dict[str, Any], restarts: int, fleet: Fleet
                  ) -> tuple[Fleet, Any, int]:
    """What the machines decide after the failure (machine 0 for all; a successor when it is lost), the
    survivors' state rescued, and the next attempt's fleet and plan from the decision."""
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
        report = {"lost": lost_pnodes, "described": described, "error": errors}
        try:
            plan = run.machines.settle(report,
                                       lambda reports, missing: decide(reports, missing, run.home, run.on_failure),
                                       wait_for_all=run.on_failure == "restart")
        except MachineLost as exc:
            # The coordinator is lost: a survivor takes its role, or the run stops.
            plan = succession.lost_coordinator(run, report, exc, attempt)
        if run.lead and plan["lost"]:
            succession.fence(run)  # before going on without machines: none of them took this run over meanwhile
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
    found = rescue_saved(folder, run.run_dir, **rescue_inputs(attempt, run.steps, run.tokenizer_json, run.micro),
                         floor=floor, logged=logged, keep=run.keep_checkpoints, say=run.emit)
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


