"""The one training loop (backends/torch/training/loop.py, issue 40): its cadence, its stop handling, the update
order, and `--log-every`'s one default, which `vgraph train` and `vgraph launch` share.

The loop is driven here with a recording step strategy and output, so each rule is checked on its own; the
trainers it runs (train and launch) are checked bit for bit by tools/same_training.py and the train/launch
tests."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import ROOT, TINY
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig
from vgraph.backends.torch.training import loop
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.loop import (DEFAULT_LOG_EVERY, Cadence, Due, LoopEnd, StepDone, apply_update,
                                                 merge_entries, row_columns, run_loop)
from vgraph.backends.torch.training.metrics_log import MetricsLog
from vgraph.cli.main import build_parser


# -- the cadence -------------------------------------------------------------------------------------------------

def test_count_cadence_validates_saves_and_flushes_where_asked() -> None:
    cadence = Cadence(total=10, val_every=3, checkpoint_every=4, log_every=2)
    dues = {s: cadence.due(s, stop=False, since_flush_s=1e9) for s in range(1, 11)}
    assert [s for s, d in dues.items() if d.validate] == [3, 6, 9, 10]  # every 3 and at the end
    assert [s for s, d in dues.items() if d.save] == [4, 8, 10]  # every 4 and at the end
    # the run's first step, every 2, validations, saves
    assert [s for s, d in dues.items() if d.flush] == [1, 2, 3, 4, 6, 8, 9, 10]
    assert not any(d.clock or d.by_time for d in dues.values())  # counted: the clock plays no part


def test_a_resumed_run_syncs_at_its_own_first_step() -> None:
    """The first step a process runs says the run has started (and how fast), a resumed one too."""
    cadence = Cadence(total=20, val_every=0, checkpoint_every=0, log_every=None, start=12)
    assert cadence.due(13, stop=False, since_flush_s=0.0).flush
    assert not cadence.due(14, stop=False, since_flush_s=0.0).flush
    assert not cadence.due(1, stop=False, since_flush_s=0.0).flush  # not a first step for this run


def test_zero_means_never_validate_and_save_only_at_the_end() -> None:
    cadence = Cadence(total=5, val_every=0, checkpoint_every=0, log_every=5)
    dues = [cadence.due(s, stop=False, since_flush_s=0.0) for s in range(1, 6)]
    assert [d.validate for d in dues] == [False] * 5
    assert [d.save for d in dues] == [False] * 4 + [True]


def test_without_log_every_the_clock_decides(monkeypatch) -> None:
    cadence = Cadence(total=100, val_every=0, checkpoint_every=0, log_every=None)
    assert cadence.log_every is DEFAULT_LOG_EVERY is None
    early = cadence.due(7, stop=False, since_flush_s=loop.FLUSH_SECONDS * 0.5)
    late = cadence.due(7, stop=False, since_flush_s=loop.FLUSH_SECONDS * 1.5)
    assert early.by_time and late.by_time
    assert not early.clock and not early.flush and late.clock
    stop = cadence.due(7, stop=True, since_flush_s=0.0)
    assert stop.stop and not stop.save  # the strategy agrees on a stop first (launch: in the step's reduction)


# -- one default, train and launch ---------------------------------------------------------------------------------

def test_train_and_launch_share_the_one_log_every_default(tmp_path: Path) -> None:
    """The parsers, the configs and the job leave --log-every to the loop, which has one default for every
    device: a default decided anywhere else (before: 1 on CPU and 10 on GPU in train, by time in launch) fails."""
    train_args = build_parser("train").parse_args(["train", str(TINY)])
    launch_args = build_parser("launch").parse_args(["launch", str(TINY), "--fleet", str(tmp_path / "f.yml")])
    assert train_args.log_every is None and launch_args.log_every is None
    assert TrainConfig(network=str(TINY)).log_every is None
    assert LaunchConfig(network=str(TINY), fleet=str(tmp_path / "f.yml")).log_every is None
    cadence = Cadence(10, 0, 0, train_args.log_every)
    assert cadence.log_every == DEFAULT_LOG_EVERY
    assert "device" not in Cadence.__init__.__code__.co_varnames  # nothing per device left to drift


def test_one_loop_over_steps_in_the_backends() -> None:
    """`for step in` / `while step` in backends/: only the loop's (a second trainer's loop fails here)."""
    loops = []
    for path in sorted((ROOT / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            target = (node.target if isinstance(node, ast.For) else node.test if isinstance(node, ast.While)
                      else None)
            if isinstance(target, ast.Name) and target.id == "step":
                loops.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert len(loops) == 1 and loops[0].startswith("backends/torch/training/loop.py:"), loops
    for module in ("vgraph.backends.torch.training.train", "vgraph.backends.torch.distributed.runtime.worker"):
        assert importlib.import_module(module).run_loop is run_loop  # both trainers run it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=30_000)), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("flush_seconds, appends", [(1e9, 2), (0.0, 6)])  # 1e9: the first step and the end
def test_train_without_log_every_writes_rows_by_the_clock(tmp_path, corpus, monkeypatch, flush_seconds,
                                                         appends) -> None:
    """`vgraph train` on a CPU follows the loop's clock (before: every step on a CPU), and every step keeps
    its row with the network's `metrics:` entries however rarely rows are written."""
    monkeypatch.setattr(loop, "FLUSH_SECONDS", flush_seconds)
    calls: list[int] = []
    real = MetricsLog.append
    monkeypatch.setattr(MetricsLog, "append", lambda self, rows: calls.append(len(rows)) or real(self, rows))
    result = train(TrainConfig(network=str(TINY), data=corpus, steps=6, batch=2, val_every=0, checkpoint_every=0,
                               out=tmp_path / "run", progress=False, tensorboard=False, threads=1))
    assert len(calls) == appends and sum(calls) == 6
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(r["loss"], float) and r["learning_rate"] > 0 for r in result.history)


# -- the loop, driven by recording strategies ----------------------------------------------------------------------

class _Steps:
    tokens_per_step = 10

    def __init__(self, log: list, stop_at: int | None = None) -> None:
        self.log, self.stop_at = log, stop_at

    def forward_backward(self, step: int, lr_factor: float) -> None:
        self.log.append(("fb", step))

    def update(self, step: int, due: Due, row: dict[str, Any]) -> StepDone:
        row["loss"] = float(step)
        flush = due.flush or due.stop
        return StepDone(Due(due.validate, due.save, flush, due.stop, due.clock, due.by_time), {"m": step * 10})

    def validate(self) -> float:
        self.log.append(("validate",))
        return 0.5

    def figures(self) -> Any:
        return "figures"

    def close(self) -> None:
        self.log.append(("close",))


class _Out:
    def __init__(self, log: list, on_write=None) -> None:
        self.log, self.rows, self.on_write = log, [], on_write

    def gather(self, extras, figures):
        return extras, figures

    def write(self, step, rows, gathered, val_loss):
        merge_entries(rows, gathered[0])
        self.rows.extend(rows)
        self.log.append(("write", step, [r["step"] for r in rows], val_loss))
        if self.on_write:
            self.on_write(step)

    def save(self, step):
        self.log.append(("save", step))
        return Path(f"step-{step}")

    def step_done(self, step):
        pass

    def finish(self):
        self.log.append(("finish",))

    def close(self):
        self.log.append(("close-out",))

    def unwritten(self, rows):
        self.log.append(("unwritten", [r["step"] for r in rows]))


class _Stop:
    def __init__(self, late_requests: bool) -> None:
        self.requested, self.late_requests = False, late_requests


def _cfg(**kw) -> SimpleNamespace:
    base = dict(steps=7, val_every=3, checkpoint_every=4, log_every=2, lr=1.0, warmup=0, schedule="constant",
                min_lr_ratio=0.1)
    return SimpleNamespace(**{**base, **kw})


def test_the_loop_writes_every_row_once_and_saves_on_its_cadence() -> None:
    log: list = []
    out = _Out(log)
    end = run_loop(_Steps(log), out, _Stop(True), _cfg(), start=0)
    writes = [e for e in log if e[0] == "write"]
    assert [w[1] for w in writes] == [1, 2, 3, 4, 6, 7] and [w[3] for w in writes] == [None, None, 0.5, None, 0.5, 0.5]
    assert [r["step"] for r in out.rows] == list(range(1, 8))  # each step once, in order
    assert all(r["m"] == r["step"] * 10 and r["tokens_per_s"] > 0 and r["lr"] == 1.0 for r in out.rows)
    assert [r.get("val_loss") for r in out.rows] == [None, None, 0.5, None, None, 0.5, 0.5]  # on its step's row
    assert [e[1] for e in log if e[0] == "save"] == [4, 7]
    assert log[-3:] == [("finish",), ("close",), ("close-out",)]
    assert end == LoopEnd(step=7, loss=7.0, val_loss=0.5, checkpoint=Path("step-7"), stopped=False)


def test_a_stop_request_saves_the_step_and_ends() -> None:
    log: list = []
    stop = _Stop(True)
    steps = _Steps(log)
    real = steps.forward_backward

    def forward_backward(step, factor):
        real(step, factor)
        stop.requested = step == 5

    steps.forward_backward = forward_backward
    end = run_loop(steps, _Out(log), stop, _cfg(), start=0)
    assert end.stopped and end.step == 5 and end.checkpoint == Path("step-5")
    assert ("fb", 6) not in log and ("save", 5) in log


@pytest.mark.parametrize("late_requests, stopped_at", [(True, 2), (False, 3)])
def test_a_request_during_logging_stops_one_process_there_and_launch_at_the_next_step(
        late_requests, stopped_at) -> None:
    """One process stops at the step whose rows were being written; under launch the request is only acted on
    once agreed, which is the next step's reduction (this recording strategy agrees on what it is told)."""
    log: list = []
    stop = _Stop(late_requests)

    def on_write(step):
        stop.requested = stop.requested or step == 2  # arrives while step 2's rows are written

    end = run_loop(_Steps(log), _Out(log, on_write), stop, _cfg(), start=0)
    assert end.stopped and end.step == stopped_at and end.checkpoint == Path(f"step-{stopped_at}")
    assert [e[1] for e in log if e[0] == "save"] == [stopped_at]
    assert ("fb", stopped_at + 1) not in log


def test_a_failed_step_still_closes_the_logs() -> None:
    log: list = []
    steps = _Steps(log)

    def update(step, due, row):
        raise RuntimeError("boom")

    steps.update = update
    with pytest.raises(RuntimeError):
        run_loop(steps, _Out(log), _Stop(True), _cfg(), start=0)
    assert ("close",) in log and ("close-out",) in log and ("finish",) not in log


def test_a_failure_hands_the_rows_since_the_last_sync_point_to_the_output() -> None:
    """A launch's rank 0 writes them (rescue.py may resume after them): with log_every 2 and a failure in step
    5's update, steps 3 and 4 were written at step 4, and nothing since; a failure in step 4 leaves step 3."""
    for failing, pending in ((5, []), (4, [3])):
        log: list = []
        steps = _Steps(log)
        update = steps.update

        def failing_update(step, due, row, update=update, failing=failing):
            if step == failing:
                raise RuntimeError("peer lost")
            return update(step, due, row)

        steps.update = failing_update
        with pytest.raises(RuntimeError):
            run_loop(steps, _Out(log), _Stop(True), _cfg(val_every=0, checkpoint_every=0), start=0)
        writes = [e[2] for e in log if e[0] == "write"]
        assert ("unwritten", pending) in log and writes and writes[-1][-1] == (4 if failing == 5 else 2)


# -- the update order and the rows' columns ------------------------------------------------------------------------

class _Update:
    def __init__(self, non_finite: bool) -> None:
        self.non_finite, self.calls = non_finite, []

    def unscale(self) -> bool:
        self.calls.append("unscale")
        return self.non_finite

    def clip(self, max_norm: float) -> None:
        self.calls.append(f"clip {max_norm}")

    def step(self, skip: bool) -> None:
        self.calls.append(f"step skip={skip}")

    def zero_grad(self) -> None:
        self.calls.append("zero")


@pytest.mark.parametrize("non_finite, clip, calls", [
    (False, 1.0, ["unscale", "clip 1.0", "step skip=False", "zero"]),
    (False, None, ["unscale", "step skip=False", "zero"]),
    (True, 1.0, ["unscale", "step skip=True", "zero"]),  # a non-finite gradient is never clipped, only skipped
])
def test_the_update_order(non_finite, clip, calls) -> None:
    update = _Update(non_finite)
    apply_update(update, clip)
    assert update.calls == calls


def test_row_columns_put_the_loops_own_first_without_repeats() -> None:
    assert row_columns(["loss", "ffn_norm", "lr"], extra=("boundary_bytes",)) == [
        "step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale", "boundary_bytes", "ffn_norm"]
    rows = [{"step": 3}, {"step": 4}]
    merge_entries(rows, [(4, {"a": 1}), (3, {"b": 2})])
    assert rows == [{"step": 3, "b": 2}, {"step": 4, "a": 1}]
