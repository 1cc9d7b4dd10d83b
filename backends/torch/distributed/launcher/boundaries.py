"""Machine 0's side of a run that takes joins: the admission opened (what it offers a joined machine, a join
or a leave turned into a re-plan decision) and the channel's answers besides heartbeats and decisions (the
other machines' rescue shards: shard_transfer.py, the joiners' requests: elastic.py); the one re-plan decision
of a join, a leave and a drift (`replan`, priced by vgraph/placement/replan.py), the workers asked to stop after
the current step with a checkpoint, the boundary taken when every worker is done (`boundary`: the admitted
machines' homes, the leaving ones released), and the move measured from the stop request to the next
attempt's first logged step (`moved`, fleet-events.jsonl).

Apart from the attempt loop because it runs beside it: the decisions come on the admission's and the drift
watch's threads, and what they leave for the loop is the boundary (elastic.Admission's fields).  The run's
logged steps are read here from metrics.jsonl's tail (`last_step`), without reading a long run's whole log.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from vgraph.base.diagnostics import VGraphError
from vgraph.base.numbers import number_or_none
from vgraph.cost.fleet import Fleet
from vgraph.run.files import MEASURED_FLEET, METRICS_JSONL

from ...training.rescue import RESCUE_DIR
from . import elastic, succession
from .inputs import Run, launch_settings
from .emission import plan, rank_zero_elsewhere
from .placing import Placement
from .shard_transfer import ShardReceiver

__all__ = ["MOVE_POLL_S", "open_admission", "take_admission", "serve_channel", "last_step", "trained_after_request",
           "last_drift", "overhead_s", "replan", "watch_drift", "boundary", "watch_move", "move_measured"]

MOVE_POLL_S = 0.1  # how often the launcher looks for the first step after a boundary (metrics.jsonl's tail)


def open_admission(run: Run) -> elastic.Admission:
    """Machine 0 of a run that takes joins: what it offers a joined machine (the prepared corpus's files,
    by the names its manifest gives) and how it decides on a join, served on the launchers' channel."""
    from vgraph.data.shards import MANIFEST, SPLITS, TOKENIZER_FILE, open_prepared

    admission = elastic.Admission(run.run_dir, run.fleet, run.source, run.max_nnodes, run.nnodes,
                                  step=lambda: last_step(run.run_dir), on_join=lambda adm, joined: _on_join(run, joined),
                                  on_leave=lambda adm, machine, pnodes, step: _on_leave(run, machine, pnodes, step),
                                  homes=lambda: {**(run.home or {}), **admission.home()},
                                  successors=list(range(run.node_rank + 1, run.nnodes)) if run.succeeds else [],
                                  settings=launch_settings(run))
    corpus = Path(run.data_dir)
    splits = open_prepared(corpus, verify="size").manifest["splits"]  # checked: names inside the directory
    for name in (MANIFEST, TOKENIZER_FILE):
        admission.serve(name, corpus / name)
    for shard in (shard for split in SPLITS for shard in splits[split]["shards"]):
        for key in ("bin", "idx"):  # the manifest's SHA-256 of each: a large corpus is not read again here
            admission.serve(shard[key], corpus / shard[key], shard[f"{key}_sha256"])
    return admission


def take_admission(run: Run) -> None:
    """An elastic run's successor: the admission machine 0 held, served from here (later joiners ask this
    machine; the channel's address moved with the role), with the machines it had admitted, released or was
    releasing, from the record this machine mirrored (succession.mirrored_admission)."""
    run.admission = open_admission(run)
    run.admission.me = run.node_rank
    run.admission.restore(succession.mirrored_admission(run.run_dir), run.emit)
    run.home = {**(run.home or {}), **run.admission.home()}  # where the admitted machines' PNodes run


def serve_channel(run: Run) -> None:
    """Machine 0: what its channel answers besides heartbeats and decisions: the other machines' rescue shards
    (shard_transfer.py) and, in a run that takes joins, the joiners' requests (elastic.py)."""
    receiver = ShardReceiver(run.launch_dir / RESCUE_DIR)

    def answer(request: dict) -> dict:
        if str(request.get("op", "")).startswith("rescue-"):
            return receiver.answer(request)
        if run.admission is not None:
            return run.admission.answer(request)
        if run.elastic:  # a successor taking the run over: its admission opens once it decided (failures.py)
            return {"wait": "the coordinator is being taken over"}
        return {"error": "this run takes no joins (--nnodes MIN:MAX)"}

    run.machines.serve_extra(answer)


def _on_join(run: Run, joined: Any) -> None:
    """A machine was admitted (its own thread): re-plan onto the grown fleet when it pays (`replan`)."""
    replan(run, "join", joined.step, run.admission.grown_fleet,
            {"pnode": joined.pnode.id, "machine": joined.machine}, label=f"join {joined.pnode.id}")


def _on_leave(run: Run, machine: int, pnodes: list[str], step: int) -> None:
    """Machine `machine` said it leaves (its own thread): the running plan cannot go on without its PNodes,
    so the boundary is taken whatever the price; the decision's figures say what the next plan predicts."""
    replan(run, "leave", step, run.admission.grown_fleet, {"pnodes": pnodes, "machine": machine},
            label=f"leave {', '.join(pnodes)} (machine {machine})", gone=pnodes)


def last_step(run_dir: Path) -> int:
    """The run's last logged step (rank 0 writes metrics.jsonl about once a second)."""
    rows = _tail_rows(run_dir)
    return max(0, rows[-1]["step"]) if rows else 0


def _tail_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The complete rows in the last 64 KiB of metrics.jsonl, in order: a join or a drift watch must not
    wait for a read of a long run's whole log."""
    from vgraph.base.jsonio import loads

    path = run_dir / METRICS_JSONL
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read()
    except OSError:
        return []
    rows = []
    for line in tail.split(b"\n")[1:] if len(tail) == 65536 else tail.split(b"\n"):
        try:
            row = loads(line, str(path)) if line.strip() else None
        except VGraphError:
            continue  # a line being written
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
    return rows


def replan(run: Run, trigger: str, step: int, target_of: Callable[[Fleet], Fleet], fields_: dict[str, Any], *,
            label: str, gone: Sequence[str] = (), measured: Fleet | None = None, why: str = "",
            uncertainty: float = 0.0) -> None:
    """The one re-plan decision of a join, a leave and a drift (vgraph/placement/replan.py): the planner's plan
    on `target_of(the running attempt's fleet)` priced against the running plan over the steps left; when it
    pays (a leave: always, the running plan loses `gone`), ask the workers for a boundary: they stop after the
    current step with a checkpoint and the next attempt runs on that fleet (`boundary`).  A drift prices the
    running plan on the `measured` fleet too, so both steps come from the same figures.  Every decision is a
    `replan` row of fleet-events.jsonl and one line.  `uncertainty`: a drift's spread (`_spread`), priced as
    the margin a gain must clear besides the change's cost."""
    admission = run.admission
    row: dict[str, Any] = {"event": "replan", "kind": trigger, "step": step, **fields_}
    try:
        placement, fleet = _running(admission, wait_s=run.comm_timeout if gone else 0.0)
        target = target_of(fleet)
        decision, machines, handed = _decision(run, placement, target, step, gone, measured is not None, uncertainty)
    except Exception as exc:  # in its own thread: whatever went wrong is said and recorded, the run goes on
        said = str(exc) if isinstance(exc, VGraphError) else f"{type(exc).__name__}: {exc}"
        admission.event({**row, "chosen": "new" if gone else "keep", "reason": said})
        run.emit(f"launch: {label} at step {step}: {'boundary all the same' if gone else 'no re-plan now'}: {said}")
        if gone:
            admission.ask_boundary()
        return
    if gone and machines < run.nnodes:  # documented: the run goes on below MIN (docs/distributed.md)
        row["below_min"] = machines
        run.emit(f"launch: warning: after {label} the run has {machines} machine(s), fewer than --nnodes MIN "
                 f"{run.nnodes}; it goes on with them")
    row.update(decision.to_json())
    if gone:  # what only the leaving machine held: its VNodes' state, through the boundary's checkpoint
        row["checkpoint_bytes"] = handed
    if why:
        why = f"{why}; the planner's plan predicts {decision.new_step:.3g} s a step"
        row["reason"] = f"{why}; {decision.reason}"
    admission.event(row)
    run.say(f"launch: {label} at step {step}: {why + '; ' if why else ''}{decision.describe()}")
    if decision.chosen == "new":
        if measured is not None:
            with admission.lock:
                admission.next_fleet = measured
        admission.ask_boundary()


def _running(admission: elastic.Admission, wait_s: float) -> tuple[Any, Fleet]:
    """The running attempt's (placement, fleet); a leave before the first attempt is placed waits for it."""
    deadline = time.monotonic() + wait_s
    while True:
        with admission.lock:
            current = admission.current
        if current is not None:
            return current
        if time.monotonic() >= deadline:
            raise VGraphError("no attempt is running yet: the change takes effect at the first boundary")
        time.sleep(0.1)


def _decision(run: Run, placement: Placement, target: Fleet, step: int, gone: Sequence[str], reprice: bool,
              uncertainty: float = 0.0) -> tuple[Any, int, float]:
    """(replan.Replan, machines left on `target`, state bytes of the VNodes only `gone` held): the planner's
    plan on `target` against `placement` (`reprice`: the running plan's step priced on `target` as well, a
    drift's measured figures)."""
    from vgraph.placement.replan import PlanView, decide, state_bytes

    admission = run.admission
    homes = {**(run.home or {}), **admission.home()}  # what run.home is after the boundary
    new = plan(run, target, homes=homes)
    refusal = rank_zero_elsewhere(new.world[0], homes, run.machines.coordinator)
    if refusal is not None:
        raise VGraphError(refusal)
    old = placement
    if reprice:
        layout = (placement.rows, placement.shares) if len(placement.rows) > 1 else None
        old = plan(run, target, placement.assignment, layout)
    views = [PlanView.of(p.assignment, p.rows, p.report.get("step_seconds", p.report["bottleneck_seconds"]))
             for p in (old, new)]
    sizes = state_bytes(new.assigned)  # the VNodes as plans assign them; their state is what moves
    gone = sorted(set(gone) | admission.departing())  # another leave at the same step: no sender either
    decision = decide(*views, sizes, target, max(0, run.steps - step), gone=gone, overhead_s=overhead_s(run),
                      uncertainty=uncertainty)
    handed = sum(sizes.get(v, 0.0) for v in decision.move.from_checkpoint)
    return decision, len({homes.get(p, 0) for p in target.ids}), handed


def overhead_s(run: Run) -> float:
    """What a boundary costs besides moving state, for the next decision: this run's last boundary as measured
    (its `moved` row's `lost_s`: stop request to the next attempt's first step, less the steps trained in
    between: `trained_after_request`), else the launch's setting
    (replan.DEFAULT_REPLAN_OVERHEAD_S, measured on a loopback run).  Why the run's own figure: a boundary
    costs what this fleet's slowest machine takes to stop, place and start again, 2-3 s on loopback and 20 s at
    0.35 of a core (bench_churn, 2026-12-07); a decision priced with the loopback figure takes changes that do
    not pay."""
    return run.moved_s if run.moved_s is not None else run.replan_overhead_s


def watch_drift(run: Run, start: int, ended: threading.Event) -> None:
    """Machine 0, while an attempt runs (its own thread): a drift rank 0 reported in this attempt's rows (a
    metrics row with `drift`, at a step after `start`) is a re-plan decision on the measured fleet
    (fleet.measured.yml) through `replan`.  Fresh evidence only: the rows of this attempt, whose rank 0 watches
    its own plan's prediction from its own warm-up (so a re-plan's next one needs K steps measured under the
    new plan), and once a drift re-plan is chosen this watch ends.  A report whose figures the last decision
    already priced (within the drift band: placement/drift.new_evidence) is not decided again."""
    from dataclasses import replace

    from vgraph.cost.fleet import load_fleet
    from vgraph.placement.drift import new_evidence

    seen, decided = start, None
    while not ended.wait(0.5):
        row = last_drift(run.run_dir, seen)
        if row is None:
            continue
        seen = row["step"]
        try:  # the file rank 0 wrote with the row; not the fleet's own file: a boundary's fleet is this one
            measured = replace(load_fleet(run.run_dir / MEASURED_FLEET), source=None)
        except VGraphError as exc:
            run.emit(f"launch: drift at step {seen}: no re-plan: {exc}")
            continue
        pnodes = row["drift"].get("pnodes")
        figures = {pid: float(p["measured_s"]) for pid, p in (pnodes if isinstance(pnodes, dict) else {}).items()
                   if isinstance(p, dict) and isinstance(p.get("measured_s"), (int, float))}
        if not new_evidence(figures, decided):
            continue
        decided = figures
        why = "drift: " + ", ".join(
            f"{pid} measured {p['measured_s']:.3g} s vs predicted {p['predicted_s']:.3g} s busy for "
            f"{run.drift_steps} steps" for pid, p in sorted((pnodes if isinstance(pnodes, dict) else {}).items())
            if isinstance(p, dict) and all(isinstance(p.get(k), (int, float)) for k in ("measured_s", "predicted_s")))
        replan(run, "drift", seen, lambda fleet: run.admission.grown_fleet(measured), {"drift": row["drift"]},
                label="drift", measured=measured, why=why, uncertainty=_spread(pnodes))
        with run.admission.lock:
            if run.admission.next_fleet is not None:
                return


def _spread(pnodes: Any) -> float:
    """The uncertainty a drift's decision prices (replan.decide): the widest relative spread of the drifting
    PNodes' busy times (placement/drift.relative_spread), from rank 0's row; a figure that is missing or not a
    finite number from 0 to 10 counts as 0 (the decision then prices the figures as exact, as before)."""
    spreads = [number_or_none(p.get("spread"), low=0, high=10)
               for p in (pnodes.values() if isinstance(pnodes, dict) else ()) if isinstance(p, dict)]
    return max([float(x) for x in spreads if x is not None] or [0.0])


def last_drift(run_dir: Path, after: int) -> dict[str, Any] | None:
    """The last metrics row with a drift report at a step after `after`, or None (read from the log's tail)."""
    for row in reversed(_tail_rows(run_dir)):
        if isinstance(row.get("drift"), dict) and row["step"] > after:
            return row
    return None


def boundary(run: Run) -> bool:
    """Machine 0, every worker done: was it a re-plan boundary (`replan`: a join, a leave, a drift) with steps
    left?  Then the admitted machines get their PNodes' homes, the leaving ones are released (the boundary's
    checkpoint holds what they held), and the next attempt is placed on the fleet without them."""
    step = last_step(run.run_dir)
    taken = run.admission.close_boundary(step, run.steps)
    if taken is None:
        return False
    run.home = {**(run.home or {}), **run.admission.home()}
    run.moving = (taken.step, taken.requested, trained_after_request(_tail_rows(run.run_dir), taken.asked, taken.step))
    run.say(f"launch: re-plan boundary after step {taken.step}: the next attempt runs on {', '.join(taken.pnodes)}"
            f"{f'; machine(s) {taken.released} released' if taken.released else ''}")
    return True


def trained_after_request(rows: Sequence[dict[str, Any]], asked: int | None, boundary: int) -> float:
    """Seconds of a boundary's wall that were training, not the boundary's cost: the steps logged after the
    stop request (`asked`: the last logged step then) up to the boundary, and the next attempt's first step,
    each at the old attempt's median step (its rows' `elapsed_s` differences, a restart's reset left out).

    Why: the workers finish the step they are in and agree on the stop at a sync point, so steps go on after
    the request; bench_churn run 7's first drift boundary came 7 steps (1.7 s) after it, and its 5.6 s from
    request to first step priced the next decisions' boundary a quarter too dear.  0 when the rows or the
    request's step are unknown (the whole wall is priced, as before)."""
    if asked is None or boundary < asked:
        return 0.0
    kept = [r for r in rows if r["step"] <= boundary and number_or_none(r.get("elapsed_s")) is not None]
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(kept[-11:], kept[-10:]) if b["step"] == a["step"] + 1]
    gaps = [g for g in gaps if g > 0]
    return (boundary - asked + 1) * statistics.median(gaps) if gaps else 0.0


def watch_move(run: Run, attempt: int) -> Callable[[], str | None]:
    """The supervisor's `trouble` poll, which also measures a boundary's move (`move_measured`) every
    MOVE_POLL_S while one is pending: the seconds a re-plan took, from its stop request to this attempt's
    first logged step (rank 0 logs a resumed attempt's first step at once: training/loop.py)."""
    trouble, due = run.machines.trouble, [0.0]

    def poll() -> str | None:
        if run.moving is not None and time.monotonic() >= due[0]:
            due[0] = time.monotonic() + MOVE_POLL_S
            move_measured(run, attempt)
        return trouble()
    return poll


def move_measured(run: Run, attempt: int) -> None:
    """When the attempt after a boundary has logged a step: its `moved` row (fleet-events.jsonl) and a line."""
    if run.moving is None or run.admission is None:
        return
    step, requested, training = run.moving
    first = last_step(run.run_dir)
    if first <= step:
        return
    run.moving = None
    seconds = max(0.0, time.time() - requested)
    run.moved_s = max(0.0, seconds - training)
    run.admission.event({"event": "moved", "step": step, "first_step": first, "attempt": attempt,
                         "seconds": round(seconds, 3), "lost_s": round(run.moved_s, 3)})
    run.say(f"launch: the re-plan at step {step} took {seconds:.1f} s, from the stop request to attempt {attempt}'s "
            f"first step ({run.moved_s:.1f} s of it not training)")
