"""The launch's attempt loop: attempt after attempt (placed and written by emission.py, this machine's
workers supervised by supervisor.py) until the workers finish, fail for good, or a stop is asked for; after a
re-plan boundary (boundaries.py) the next attempt on the new fleet; after a failure, what failures.py decides
(restart, re-partition or shrink, or give up); at the end, the run's rows and last checkpoint as the
`LaunchResult`.

Every step takes the launch's resolved inputs and the state the attempts change as they go (inputs.`Run`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vgraph.run.files import LAUNCH_DIR, METRICS_JSONL, WORKERS_JSON, RunLock

from ...training import checkpoint as ckpt
from ...training.interrupt import StopRequest
from ...training.metrics_log import read_rows
from . import elastic
from .boundaries import boundary, watching
from .emission import Attempt, RankZeroJoined, given_placement, place_attempt
from .failures import after_failure
from ..job import Job
from .inputs import Run, joined_config, read_launch_settings, resolve_inputs
from .mirror import MIRRORS, Mirror, pull_history
from .succession import succeed_followed
from .supervisor import Supervisor

__all__ = ["LaunchResult", "run_attempts", "collect", "micro_per_replica", "JoinedSuccession"]


@dataclass
class LaunchResult:
    run_dir: Path
    step: int
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    restarts: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # per attempt: ranks, exit codes, outcome
    placement: dict[str, Any] = field(default_factory=dict)  # placement_report of the last attempt
    steps_redone: int = 0  # machine 0: steps trained again after failures (0 when every rescue found its step)


def run_attempts(run: Run, stop: StopRequest, took: elastic.TookOver | None = None) -> LaunchResult:
    """Attempt after attempt until the workers finish, fail for good, or a stop is asked for; after `took` (a
    machine that joined took the coordinator's role: `JoinedSuccession`), from the attempt after the one it
    followed, on the fleet its succession decided.  The run's result (`collect`); when it ends in an error,
    the machines that joined hear why first, instead of waiting on silence."""
    try:
        return collect(run, _attempts(run, stop, took))
    except BaseException as exc:
        if run.admission is not None:
            run.admission.finish(error=str(exc) or type(exc).__name__)
            run.admission.wait_told(min(run.link_timeout, 5.0))
        raise


@dataclass(frozen=True)
class NextAttempt:
    """The attempt the loop places next, as the one place that decided it left it: the start (or a successor's
    `took`), a re-plan boundary, a followed run handing over (`_follow`), or a failure (failures.py).  One value
    rather than loose variables, so that each branch states the whole of the next attempt (loose, a field a
    branch did not reassign silently carried over).

    `fleet`: the PNodes it is placed on.  `number`: its number (job-N.json, the rendezvous port's offset, the
    attempt a hold names).  `shrunk`: the (assignment, replica layout) a shrink decided, which it must use;
    None lets the partition pass or --placement decide.  `replanned`: the fleet is no longer the one --placement
    was for (after a boundary, or once this machine took the coordinator's role), so the partition pass places
    it; a failure's restart keeps the previous attempt's, its fleet being that one's again.  `first`: this
    machine's first attempt of the run it started, the one a (PNode, step) hold stops (`held`); never a
    successor's."""

    fleet: Any
    number: int
    shrunk: tuple[dict[str, str], tuple[list[list[str]], list[int]]] | None = None
    replanned: bool = False
    first: bool = False


def _attempts(run: Run, stop: StopRequest, took: elastic.TookOver | None) -> LaunchResult:
    result = LaunchResult(run.run_dir, 0, None, None, None)
    n = NextAttempt(run.fleet, 0, first=run.hold is not None)
    if took is not None:
        n = NextAttempt(took.fleet, took.next_attempt, replanned=True)
        result.restarts, result.steps_redone = 1, took.redone
    while True:
        if stop.requested:
            raise stop.interrupted(f"{run.run_dir}: stopped before attempt {n.number} started; continue with: "
                                   f"{run.continue_with}")
        holding = held(run.hold, n.number, n.first)
        given = given_placement(run, n.number, n.shrunk, n.replanned)
        fleet = n.fleet  # this attempt's, less the joined machines that must wait when rank 0 would land there
        try:
            attempt = place_attempt(run, fleet, n.number, *given, holding)
        except RankZeroJoined as exc:
            waiting = sorted(set(run.admission.home()) & set(fleet.ids))
            run.admission.event({"event": "placement", "attempt": n.number, "waiting": waiting,
                                 "reason": f"the plan puts rank 0 on joined PNode {exc}: machine 0 keeps it"})
            fleet = fleet.without(waiting)
            attempt = place_attempt(run, fleet, n.number, *given, holding)
        if attempt is None:
            return result
        record = supervise(run, attempt)  # machine 0 of a run that takes joins publishes its job (watching)
        result.attempts.append(record)
        result.placement = attempt.placement.report
        grown = boundary(run, fleet) if record["ok"] and run.admission is not None and not stop.requested else None
        if grown is not None:
            n = NextAttempt(grown, n.number + 1, replanned=True)  # the planner places it now
            continue
        if run.elastic and not run.lead and not stop.requested:  # only machine 0 knows the grown fleet
            n = _follow(run, attempt, record, result, fleet)
            if n is None:
                return result
            continue
        if stop.requested:
            where = ckpt.latest_checkpoint(run.run_dir) if run.lead else None
            raise stop.interrupted(f"{run.run_dir}: stopped as asked{'' if record['ok'] else ' (a worker failed on the way)'}; "
                                   f"checkpoint {where or 'on machine 0'}. Continue with: "
                                   f"{run.continue_with}")
        if record["ok"]:
            if run.admission is not None:
                run.admission.finish()
                run.admission.wait_told(run.link_timeout)
            return result
        fleet, shrunk, redone = after_failure(run, attempt, record, result.restarts, fleet)
        result.restarts, result.steps_redone = result.restarts + 1, result.steps_redone + redone
        n = NextAttempt(fleet, n.number + 1, shrunk, replanned=n.replanned)


def held(hold: Any, number: int, first: bool) -> tuple[str, int] | None:
    """The test hook's hold in attempt `number` (LaunchConfig.hold): (PNode, step) holds this machine's first
    attempt (`first`); a list of (PNode, step, attempt) holds each in the attempt it names, so a test can stop
    the run at a step of any attempt (a later event's premise) whoever's worker it is."""
    specs = hold if isinstance(hold, list) else [hold] if hold else []
    for spec in specs:
        if (len(spec) == 2 and first) or (len(spec) == 3 and spec[2] == number):
            return str(spec[0]), int(spec[1])
    return None


def _follow(run: Run, attempt: Attempt, record: dict[str, Any], result: LaunchResult, fleet: Any
            ) -> NextAttempt | None:
    """A machine an elastic run started with, after its first attempt: report a failure, then run the
    coordinator's jobs (elastic.follow_attempts) until the run ends (None), or until this machine takes the
    coordinator's role (succession.py): then its first attempt as coordinator, placed by the partition pass
    unless a shrink decided it."""
    if not record["ok"]:
        fleet, shrunk, redone = after_failure(run, attempt, record, result.restarts, fleet)  # its report
        if run.lead:  # it took the role (and machine 0's admission): the loop goes on here as the coordinator
            result.restarts, result.steps_redone = result.restarts + 1, result.steps_redone + redone
            return NextAttempt(fleet, attempt.number + 1, shrunk, replanned=shrunk is None)
    followed = elastic.Joined(run.node_rank, "", run.run_dir)
    try:
        elastic.follow_attempts(run.machines, run.token, run.master_addr, run.base_port, run.run_dir,
                                Path(run.data_dir), run.tokenizer, attempt.number + 1,
                                run.comm_timeout + run.link_timeout, run.emit, followed, run.leave,
                                (lambda why, n, report: succeed_followed(run, why, n, report))
                                if run.succeeds else None)
    except elastic.TookOver as took:
        result.attempts += [{"attempt": a, "followed": True} for a in followed.attempts]
        result.restarts, result.steps_redone = result.restarts + 1, result.steps_redone + took.redone
        return NextAttempt(took.fleet, took.next_attempt, replanned=True)
    result.attempts += [{"attempt": a, "followed": True} for a in followed.attempts]
    if followed.released:
        result.attempts.append({"released": True})
    return None


class JoinedSuccession:
    """A machine that joined (`launch --join`) in the line of succession: the coordinator's role moves to the
    lowest surviving machine number, started or joined (issue 36 item 3: a run started with one machine has a
    successor once a machine joined).

    At its admission (`bind`): the launch settings the admission carried (inputs.launch_settings), checked as
    any input (a JoinRefused: it does not join rather than fail at the loss), and, when its machine number is
    among the MIRRORS next in line, the run's history mirrored as a started machine mirrors it.
    When the coordinator is lost (`lost`: elastic.follow_attempts' hook), the `Run` a started machine has from
    its command line is built from those settings, the job of the attempt it ran or waited on (the training
    options, network and fleet, job.py) and the corpus it received; then it is elected as a started machine is
    (succession.succeed_followed).  Elected, it raises elastic.TookOver, and `coordinate` runs the attempt loop
    from the next attempt, the run going on in this machine's run directory (its --out, runs/join-PNODE by
    default).  Before it holds a job (still receiving the run's files) it only follows (`fallback`)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.run: Run | None = None
        self.mirror: Mirror | None = None
        self.stop = StopRequest(emit)  # the run's stop once this machine coordinates (`coordinate`)

    def bind(self, machines: Any, admitted: dict[str, Any], run_dir: Path, corpus: Path, master_port: int,
             leave: Any, fallback: Callable[[Exception, int, dict | None], dict]
             ) -> Callable[[Exception, int, dict | None], dict]:
        """This machine was admitted: the settings checked, the mirror started when it is next in line; the
        hook `follow_attempts` calls when the coordinator is lost."""
        sent = admitted.get("settings")
        self.settings = None if sent is None or sent == {} else read_launch_settings(sent)
        self.machines, self.machine, self.run_dir, self.corpus = machines, int(admitted["machine"]), run_dir, corpus
        self.port, self.leave, self.fallback = master_port, leave, fallback
        if self.settings is None:  # a coordinator of an earlier vgraph: this machine joins as a follower only
            self.emit("launch --join: the coordinator sent no launch settings (an earlier vgraph?): this machine "
                      "follows whoever coordinates and never takes the role itself")
        self.succeeds = self.settings is not None and self.settings["on_failure"] in ("shrink", "restart")
        if self.succeeds and self.machine <= MIRRORS:
            self.mirror = pull_history(machines, run_dir / LAUNCH_DIR, self.emit)
        return self.lost

    def lost(self, why: Exception, number: int, report: dict | None) -> dict:
        """The coordinator is lost while this machine ran (or waited for) job `number`: elected as a started
        machine (its Run built once, the first time), or only following (no job, no settings, or a run whose
        --on-failure moves no role); the decision for the next attempt, or elastic.TookOver."""
        job_path = self.run_dir / LAUNCH_DIR / f"job-{number}.json"
        if not self.succeeds or number < 0 or not job_path.is_file():
            return self.fallback(why, number, report)
        if self.run is None:
            self.emit(f"launch: the coordinator is lost ({why}); this machine (machine {self.machine}, joined) is in "
                      f"the line of succession: its run from the launch settings and {job_path.name}")
            job = Job.read(job_path)
            cfg = joined_config(self.settings, job, machine=self.machine, corpus=self.corpus, run_dir=self.run_dir,
                                master_addr=self.machines.addr, master_port=self.port, log=self.emit)
            self.run = resolve_inputs(cfg, self.stop, self.machines)
            self.run.run_info = dict(job.run_info)  # the run's own (its data's description is machine 0's)
            self.run.mirror, self.run.leave = self.mirror, self.leave
        return succeed_followed(self.run, why, number, report)

    def coordinate(self, took: elastic.TookOver) -> LaunchResult:
        """This machine took the coordinator's role: the attempts from there on, as machine 0 ran them.  A
        SIGTERM or Ctrl-C is now machine 0's stop (the workers stop after the step with a checkpoint), no
        longer this machine's leave: the coordinator holds the run and has nobody to hand it to."""
        run = self.run
        assert run is not None and run.lead, "TookOver comes only from succeed_followed on this machine's Run"
        if self.leave is not None:
            self.leave.close()
        with self.stop.installed():
            return run_attempts(run, self.stop, took)


def supervise(run: Run, attempt: Attempt) -> dict[str, Any]:
    """Start this machine's workers of `attempt`, relay their output, wait for the outcome (its record).

    The rendezvous port: --master-port (29500 across machines) moved up by the attempt's number, else a free
    one (supervisor.Supervisor.start)."""
    placement = attempt.placement
    run.say(f"launch: {run.source.name} on {len(attempt.ranks)} worker(s) {', '.join(attempt.ranks)} of fleet "
            f"{run.fleet.name!r} ({len(placement.rows)} replica(s), batch shares {placement.shares}; "
            f"{attempt.comm.describe()}, {micro_per_replica(run.micro, placement.shares)} {run.pipeline}, predicted "
            f"traffic {placement.report['bytes_per_step']:,.0f} bytes/step, all-reduce included); attempt "
            f"{attempt.number}")
    lock = RunLock.of(run.run_dir)  # machine 0's; its rank 0 writes the run under it
    try:
        with watching(run, attempt) as trouble:  # the boundaries' side while the workers run
            supervisor = Supervisor(run.emit, run.token, take=run.bar.take if run.bar is not None else None,
                                    lock_key=lock.key if lock is not None else "")
            ok, codes, lost = supervisor.run(attempt.job_path, attempt.local, attempt.ranks, run.master_addr,
                                             run.base_port + attempt.number if run.base_port else None,
                                             attempt.threads, hosts=run.lead, trouble=trouble,
                                             pids=(run.launch_dir / WORKERS_JSON, attempt.number))
    finally:
        if run.bar is not None:
            run.bar.close()  # the attempt's bar ends; a restart draws its own from the resumed step
    ranks = attempt.ranks
    return {"attempt": attempt.number, "ranks": ranks, "exit_codes": {ranks[r]: c for r, c in codes.items()},
            "lost": [ranks[r] for r in lost], "ok": ok, "codes": codes, "lost_ranks": lost}


def collect(run: Run, result: LaunchResult) -> LaunchResult:
    """Machine 0: the run's rows (metrics.jsonl) and last checkpoint into the result."""
    if run.lead:
        rows = read_rows(run.run_dir / METRICS_JSONL)
        result.history = rows
        if rows:
            result.step = rows[-1]["step"]
            result.loss = rows[-1]["loss"]
        result.val_loss = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
        result.checkpoint = ckpt.latest_checkpoint(run.run_dir)
    return result


def micro_per_replica(micro: int, shares: list[int]) -> str:
    """What each replica pipelines: --micro-batches caps it, a replica's batch share bounds it (as the worker)."""
    counts = sorted({min(micro, share) for share in shares} or {micro})
    text = " or ".join(str(c) for c in counts)  # unequal shares can leave a small replica fewer
    return f"{text} micro-batch{'es' if counts != [1] else ''}" + (" per replica" if len(shares) > 1 else "")
