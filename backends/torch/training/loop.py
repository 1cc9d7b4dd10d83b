"""The training loop: the one loop over steps that `vgraph train` and every worker of `vgraph launch` run.

Shaped like torchtitan's Trainer: one loop owns the *cadence* — when a step is a
sync point (its losses read back and checked, its metrics rows written), when
it validates, when it saves a checkpoint, when a stop request ends the run —
and the metrics rows' columns, while what differs between a process that
trains alone and a rank of a partitioned run sits behind two small interfaces:

* a **step strategy** (`StepStrategy`): how one step runs forward/backward and
  its update.  `step.LocalStep` (`vgraph train`: one process, autocast,
  gradient accumulation) and `distributed/runtime/pipeline_step.PipelineStep`
  (a schedule round, the replicas' gradient sums, the step's one reduction on
  which every rank agrees, tied-weight sync);
* a **run output** (`RunOutput`): where rows and checkpoints go.
  `run_output.LocalOutput` writes them itself; under launch rank 0 gathers
  everyone's entries and the whole checkpoint and the other ranks send
  theirs (`distributed/runtime/rank_zero.RankOutput`).

The order of an update — unscale, then clip, then step, a non-finite gradient
skipping the step under loss scaling — is `apply_update`'s, whichever
strategy's gradients it updates.

**Sync points** are decided here only: a step validates every `val_every`
steps and at the end, saves every `checkpoint_every` steps, at the end and on
a stop request, and is a sync point then, at the run's first step (its line
says the run has started and how fast: the time to a first step is what a user
waits for), and every `--log-every` steps, or, without `--log-every`
(`DEFAULT_LOG_EVERY`, train and launch alike, on every device), whenever the
last sync point is `FLUSH_SECONDS` old.  Every step has its row either way;
only when it is written changes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from ..lowering.dropout import clear_dropout_key
from .optimizers import lr_factor

__all__ = ["DEFAULT_LOG_EVERY", "FLUSH_SECONDS", "ROW_COLUMNS", "Cadence", "Due", "StepDone", "StepStrategy",
           "RunOutput", "StopSource", "GradientUpdate", "LoopEnd", "apply_update", "row_columns", "merge_entries", "run_loop"]

# Without --log-every: sync points by the clock, about once a second, for `vgraph train` and `vgraph launch`
# on any device.  A sync point reads the losses back (a device sync) and, under launch, gathers rows on rank 0
# (two collectives): once a second costs nothing a user sees, while every step cost launch a quarter of its
# step on the tiny network (issue 42) and every 10 steps on an accelerator left a CPU run's rows unwritten.
DEFAULT_LOG_EVERY: int | None = None
FLUSH_SECONDS = 1.0

# The metrics table's own columns, in order; a strategy adds its own (launch: boundary_bytes, machines: the
# machines that trained the step, runtime/fleet_watch.py), then the network's `metrics:` entries follow.
ROW_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale")


def row_columns(metric_names: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """The columns of metrics.csv: the loop's own, the strategy's `extra`, the network's `metrics:` entries."""
    own = [*ROW_COLUMNS, *extra]
    return [*own, *[name for name in metric_names if name not in own]]


def merge_entries(rows: list[dict[str, Any]], entries: Iterable[tuple[int, dict[str, Any]]]) -> None:
    """Put metrics entries measured at step s (one process's, or every rank's) into step s's row."""
    by_step = {row["step"]: row for row in rows}
    for step, part in entries:
        by_step[step].update(part)


@dataclass
class Due:
    """What a step is asked to do at its end: decided by the cadence, then agreed on by the step strategy
    (under launch every rank must decide alike, so a stop request or the clock's vote travels in the
    step's reduction)."""

    validate: bool = False
    save: bool = False
    flush: bool = False  # a sync point: losses read back, rows written
    stop: bool = False  # a stop request (Ctrl-C/SIGTERM, the launcher's stop file): a sync point, save and end
    clock: bool = False  # this process's clock says a sync point is due (sync points by time only)
    by_time: bool = False  # no --log-every: every step measures its metrics entries, any step may flush


@dataclass
class StepDone:
    """A step as its strategy finished it: the agreed `due` and this process's metrics entries for it."""

    due: Due
    extras: dict[str, Any] = field(default_factory=dict)


class Cadence:
    """Validation, checkpoints and sync points of a run of `total` steps (the module docstring's rules)."""

    def __init__(self, total: int, val_every: int, checkpoint_every: int, log_every: int | None,
                 start: int = 0) -> None:
        self.total, self.val_every, self.checkpoint_every, self.start = total, val_every, checkpoint_every, start
        self.log_every = DEFAULT_LOG_EVERY if log_every is None else log_every

    def due(self, step: int, *, stop: bool, since_flush_s: float) -> Due:
        by_time = self.log_every is None
        validate = self.val_every > 0 and (step % self.val_every == 0 or step == self.total)
        save = step == self.total or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0)
        counted = not by_time and step % self.log_every == 0
        first = step == self.start + 1  # every rank starts at the same step: they agree without a message
        return Due(validate=validate, save=save, flush=save or validate or counted or first, stop=stop,
                   clock=by_time and since_flush_s >= FLUSH_SECONDS, by_time=by_time)


class StepStrategy(Protocol):
    """How one step trains (see the module docstring)."""

    tokens_per_step: int  # tokens of the global batch a step trains on (the rows' tokens_per_s)

    def forward_backward(self, step: int, lr_factor: float) -> None:
        """Read the step's batch, set the learning rate's factor, run forward and backward."""

    def update(self, step: int, due: Due, row: dict[str, Any]) -> StepDone:
        """Agree on `due`, check the losses at a sync point (before the update: a non-finite loss stops the
        run with this step unapplied), apply the update; fill `row` (and, at a sync point, the rows since the
        last one: their losses are read back only then)."""

    def validate(self) -> float:
        """The held-out loss (every rank takes part)."""

    def figures(self) -> Any:
        """This process's measurements since the last sync point, for `RunOutput.gather`."""

    def close(self) -> None:
        """Leave whatever the steps measured with (also after a failed step)."""


class RunOutput(Protocol):
    """Where rows and checkpoints go (see the module docstring)."""

    def gather(self, extras: list[tuple[int, dict[str, Any]]], figures: Any) -> Any:
        """Bring this process's metrics entries (by step) and figures where rows are written (a collective
        under launch, before validation)."""

    def write(self, step: int, rows: list[dict[str, Any]], gathered: Any, val_loss: float | None) -> None:
        """Add what was gathered to the rows since the last sync point (the loop filled in the rest) and append
        them where they are written; show progress (`val_loss`: this sync point's validation, if any)."""

    def save(self, step: int) -> Path | None:
        """Write checkpoint `step` (every rank takes part); its path where it is written."""

    def step_done(self, step: int) -> None:
        """After a sync point's rows and checkpoint are out (the launcher's test hold stops a rank here)."""

    def finish(self) -> None:
        """The run reached its end or a stop: draw what is drawn once (the loss curve)."""

    def close(self) -> None:
        """Close the logs and the progress display (also after a failure)."""

    def unwritten(self, rows: list[dict[str, Any]]) -> None:
        """The loop failed with `rows` (steps finished since the last sync point) not written yet: a launch's
        rank 0 writes them, since a rescue (rescue.py) may resume after them; one process drops them."""


class StopSource(Protocol):
    """A stop request: `requested` is polled once per step, after its forward/backward."""

    @property
    def requested(self) -> bool: ...

    # One process may also stop on a request that arrived after its step's decision (during the update,
    # validation or logging): that step is finished and logged, and going on would lose it.  Under launch
    # a request is only acted on once every rank agreed on it, in the next step's reduction.
    late_requests: bool


class GradientUpdate(Protocol):
    """A step's gradients, as `apply_update` updates them."""

    def unscale(self) -> bool:
        """Divide the gradients by the loss scale; True when one is not finite (the step is skipped then)."""

    def clip(self, max_norm: float) -> None:
        """Scale the gradients to a global norm of at most `max_norm`."""

    def step(self, skip: bool) -> None:
        """Step the optimizers (not when `skip`) and update the loss scale."""

    def zero_grad(self) -> None: ...


def apply_update(update: GradientUpdate, grad_clip: float | None) -> None:
    """The one order of an update: unscale, then (finite gradients only) clip and step, then zero."""
    skip = update.unscale()
    if grad_clip and not skip:
        update.clip(grad_clip)
    update.step(skip)
    update.zero_grad()


@dataclass
class LoopEnd:
    """Where the loop stopped."""

    step: int
    loss: float | None = None  # the last row's loss
    val_loss: float | None = None  # the last validation's
    checkpoint: Path | None = None  # the last checkpoint written here (None on ranks that do not write)
    stopped: bool = False  # a stop request ended it


def run_loop(steps: StepStrategy, out: RunOutput, stop: StopSource, cfg: Any, start: int) -> LoopEnd:
    """Train steps `start + 1 ..= cfg.steps` (`cfg`: a TrainConfig) on the cadence of the module docstring.

    The one place a reader follows a step from its batch to its checkpoint: the stop handling (a request
    seen at any point saves the last finished step) needs all of it in view."""
    cadence = Cadence(cfg.steps, cfg.val_every, cfg.checkpoint_every, cfg.log_every, start)
    end = LoopEnd(start)
    rows: list[dict[str, Any]] = []  # the steps since the last sync point
    extras: list[tuple[int, dict[str, Any]]] = []  # this process's metrics entries for them
    started = last_flush = time.perf_counter()
    try:
        for step in range(start + 1, cfg.steps + 1):
            factor = lr_factor(step, cfg)
            steps.forward_backward(step, factor)
            due = cadence.due(step, stop=stop.requested, since_flush_s=time.perf_counter() - last_flush)
            row: dict[str, Any] = {"step": step, "loss": None, "lr": cfg.lr * factor}
            done = steps.update(step, due, row)
            row["elapsed_s"] = time.perf_counter() - started
            end.step = step
            rows.append(row)
            if done.extras:
                extras.append((step, done.extras))
            if not done.due.flush:
                continue
            gathered = out.gather(extras, steps.figures())
            now = time.perf_counter()  # training's throughput: validation's time is not in it
            val_loss = steps.validate() if done.due.validate else None
            for r in rows:
                r["tokens_per_s"] = steps.tokens_per_step * len(rows) / max(now - last_flush, 1e-9)
            if val_loss is not None:
                rows[-1]["val_loss"] = val_loss
            out.write(step, rows, gathered, val_loss)
            end.loss = rows[-1]["loss"]
            end.val_loss = val_loss if val_loss is not None else end.val_loss
            rows, extras = [], []
            last_flush = time.perf_counter()
            stopping = done.due.stop or (stop.late_requests and stop.requested)
            if done.due.save or stopping:
                # Checkpoints draw the loss curve too (matplotlib's seconds: not at every validation).
                end.checkpoint = out.save(step) or end.checkpoint
                last_flush = time.perf_counter()
            out.step_done(step)
            if stopping:
                end.stopped = True
                break
        out.finish()
    except BaseException:
        out.unwritten(rows)
        raise
    finally:
        steps.close()
        out.close()
        clear_dropout_key()
    return end
