"""The fleet over time read from a run (vgraph/run/fleet_events.py), from hand-made files: a decision joined to
its boundary and measured move, any kind of decision with the common fields, and hostile files (missing,
torn, NaN/inf, wrong types, huge numbers, a step beyond the run, control characters, rows out of order).
The same history in TensorBoard (the sink on its own) and on the progress line; the report's section is
tests/test_report.py's."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vgraph.run.fleet_events import FLEET_EVENTS_PATH, fleet_history, machine_spans, read_fleet
from vgraph.run.files import RunReader

JOIN = {"event": "join", "pnode": "j1", "machine": 1, "step": 2, "outcome": "admitted", "queued": False, "time": 10.0}
DECISION = {"event": "replan", "kind": "join", "pnode": "j1", "machine": 1, "step": 2, "chosen": "new",
            "reason": "the new plan saves 9.1 s over 6 steps", "old_step_s": 2.4, "new_step_s": 1.2, "steps_left": 6,
            "bytes_moved": 52_000, "move_s": 0.01, "overhead_s": 3.0, "gain_s": 7.2, "time": 10.5}
BOUNDARY = {"event": "boundary", "step": 3, "pnodes": ["j1", "m0"], "requested": 10.5, "queued": [], "time": 12.0}
MOVED = {"event": "moved", "step": 3, "first_step": 4, "attempt": 1, "seconds": 4.25, "time": 14.75}


def write(tmp_path: Path, *lines: object) -> RunReader:
    path = tmp_path / FLEET_EVENTS_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return RunReader(tmp_path)


def test_a_decision_its_boundary_and_its_measured_move_are_one_replan(tmp_path: Path) -> None:
    reader = write(tmp_path, JOIN, DECISION, BOUNDARY, MOVED)
    history = read_fleet(reader, 8)
    assert reader.notes == [] and history.rows == 4
    (r,) = history.replans
    assert (r.step, r.kind, r.pnode, r.chosen, r.boundary, r.pnodes) == (2, "join", "j1", "new", 3, ["j1", "m0"])
    assert (r.old_step_s, r.new_step_s, r.bytes_moved, r.seconds) == (2.4, 1.2, 52_000, 4.25)
    assert r.predicted_s == pytest.approx(3.01)
    assert history.counts == {"join admitted": 1, "replan": 1, "boundary": 1, "moved": 1}
    assert r.brief() == "re-plan @3 join j1: 2.4->1.2 s/step, 50.8 KiB, moved in 4.2 s"
    assert history.latest is r
    assert r.lost_s is None  # a row of a launch before lost_s was written: the wall alone


def test_the_part_of_the_move_that_was_not_training_is_read_and_shown(tmp_path: Path) -> None:
    """`lost_s` (boundaries.trained_after_request: the steps after the stop request left out) beside the wall;
    one that is not a number >= 0 is left out, never an error."""
    history = read_fleet(write(tmp_path, DECISION, BOUNDARY, {**MOVED, "lost_s": 3.1}), 8)
    (r,) = history.replans
    assert (r.seconds, r.lost_s) == (4.25, 3.1)
    assert r.brief() == "re-plan @3 join j1: 2.4->1.2 s/step, 50.8 KiB, moved in 4.2 s (3.1 s not training)"
    for bad in (-1, "3", float("nan"), None, [1]):
        (r,) = read_fleet(write(tmp_path, DECISION, BOUNDARY, {**MOVED, "lost_s": bad}), 8).replans
        assert r.seconds == 4.25 and r.lost_s is None and "not training" not in r.brief()


def test_until_the_move_is_measured_the_seconds_are_unknown(tmp_path: Path) -> None:
    history = read_fleet(write(tmp_path, DECISION, BOUNDARY), 8)
    assert history.replans[0].boundary == 3 and history.replans[0].seconds is None
    assert history.replans[0].brief() == "re-plan @3 join j1: 2.4->1.2 s/step, 50.8 KiB"
    assert read_fleet(write(tmp_path, DECISION), 8).replans[0].brief().startswith("re-plan asked @2 join j1")


@pytest.mark.parametrize("kind", ["leave", "lost", "drift", "something-new"])
def test_any_kind_of_decision_with_the_common_fields_is_read(tmp_path: Path, kind: str) -> None:
    """Other writers (a leave, a lost machine, a drift) use the same event writer and fields."""
    row = {k: v for k, v in DECISION.items() if k not in ("kind", "pnode", "machine")}
    history = read_fleet(write(tmp_path, {**row, "event": kind}, BOUNDARY, MOVED), 8)
    (r,) = history.replans
    assert r.kind == kind and r.pnode == "" and r.boundary == 3 and r.seconds == 4.25


def test_a_kept_plan_is_a_decision_without_a_boundary(tmp_path: Path) -> None:
    keep = {**DECISION, "chosen": "keep", "step": 7}
    history = read_fleet(write(tmp_path, DECISION, BOUNDARY, MOVED, keep), 8)
    assert [r.chosen for r in history.replans] == ["new", "keep"]
    assert history.replans[1].boundary is None and history.latest is history.replans[0]  # the latest change
    assert history.replans[1].brief().startswith("kept plan @7 join j1")


def test_a_missing_file_is_an_empty_history_without_a_note(tmp_path: Path) -> None:
    reader = RunReader(tmp_path)
    history = read_fleet(reader, 8)
    assert history.rows == 0 and history.replans == [] and history.latest is None and reader.notes == []


def test_a_directory_in_its_place_is_a_note(tmp_path: Path) -> None:
    (tmp_path / FLEET_EVENTS_PATH).mkdir(parents=True)
    reader = RunReader(tmp_path)
    assert read_fleet(reader, 8).rows == 0 and reader.notes


def test_rows_out_of_order_are_taken_in_step_order(tmp_path: Path) -> None:
    history = read_fleet(write(tmp_path, MOVED, BOUNDARY, DECISION), 8)
    (r,) = history.replans
    assert r.boundary == 3 and r.seconds == 4.25


def test_torn_and_damaged_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    reader = write(tmp_path, "not json", [1, 2], {"step": 1}, {"event": 5, "step": 1}, {"event": "x", "step": "3"},
                   {"event": "x", "step": 2.0}, {"event": "x", "step": True}, {"event": "x", "step": -1},
                   DECISION, BOUNDARY, json.dumps(MOVED)[:30])
    history = read_fleet(reader, 8)
    assert history.rows == 2 and history.replans[0].boundary == 3 and history.replans[0].seconds is None
    assert any("9 line(s) that are not fleet events" in n for n in reader.notes), reader.notes


def test_a_step_beyond_the_run_is_left_out(tmp_path: Path) -> None:
    reader = write(tmp_path, DECISION, {**BOUNDARY, "step": 9}, {**MOVED, "step": 10**30})
    history = read_fleet(reader, 8)
    assert history.rows == 1 and history.replans[0].boundary is None
    assert any("beyond the run's 8" in n for n in reader.notes)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e999", "-5", '"12"', "true", "[]", "{}",
                                 "1" + "0" * 400])
def test_a_figure_that_is_not_a_finite_nonnegative_number_is_unknown(tmp_path: Path, bad: str) -> None:
    line = json.dumps({**DECISION, "old_step_s": 0, "bytes_moved": 0}).replace('"old_step_s": 0',
                                                                              f'"old_step_s": {bad}')
    line = line.replace('"bytes_moved": 0', f'"bytes_moved": {bad}')
    moved = json.dumps(MOVED).replace('"seconds": 4.25', f'"seconds": {bad}')
    reader = write(tmp_path, line, BOUNDARY, moved)
    (r,) = read_fleet(reader, 8).replans
    assert r.old_step_s is None and r.bytes_moved is None and r.seconds is None and r.new_step_s == 1.2
    assert "?->1.2 s/step" in r.brief()


def test_huge_numbers_are_kept_when_they_are_numbers(tmp_path: Path) -> None:
    (r,) = read_fleet(write(tmp_path, {**DECISION, "bytes_moved": 1.5e300}), 8).replans
    assert r.bytes_moved == 1.5e300 and math.isfinite(r.bytes_moved)
    assert "1.36e+288 TiB" in r.brief() and len(r.brief()) < 80


def test_control_characters_in_names_and_reasons_are_escaped(tmp_path: Path) -> None:
    hostile = "j\x1b[31m1\n<script>"
    row = {**DECISION, "pnode": hostile, "kind": "jo\rin", "reason": "x\x07" * 1000}
    (r,) = read_fleet(write(tmp_path, row, {**BOUNDARY, "pnodes": [hostile, 5, "m0"]}), 8).replans
    assert all(c.isprintable() for c in r.pnode + r.kind + r.reason + "".join(r.pnodes))
    assert "\\x1b" in r.pnode and r.pnodes == sorted([r.pnode, "m0"]) and len(r.reason) < 400


def test_a_boundary_without_a_decision_is_counted_not_a_replan() -> None:
    history = fleet_history([{"event": "boundary", "step": 3, "pnodes": ["m0"]}])
    assert history.replans == [] and history.counts == {"boundary": 1}


def test_machines_per_step_become_spans() -> None:
    rows = [{"step": 1, "machines": 1, "pnodes": {"m0": {}}}, {"step": 2, "machines": 1, "pnodes": {"m0": {}}},
            {"step": 3, "loss": 1.0}, {"step": 4, "machines": 2, "pnodes": {"m0": {}, "j\x1b": {}}},
            {"step": 5, "machines": 2, "pnodes": {"m0": {}, "j\x1b": {}}}, {"step": 6, "machines": 0},
            {"step": 7, "machines": 2.5}, {"step": 8, "machines": True}]
    spans = machine_spans(rows)
    assert [(s.first, s.last, s.machines) for s in spans] == [(1, 2, 1), (4, 5, 2)]
    assert spans[1].pnodes == ("j\\x1b", "m0")


# -- the same history on the progress line and in TensorBoard --------------------------------------------

def test_the_progress_line_shows_the_machines_and_the_latest_replan(capsys) -> None:
    from vgraph.backends.torch.distributed.runtime.progress import LaunchBar, RankZeroProgress

    history = fleet_history([DECISION, BOUNDARY, MOVED])
    note = history.latest.brief()
    said: list[str] = []
    RankZeroProgress("lines", 8, 3, "t", said.append).report(
        8, {"loss": 2.0, "tokens_per_s": 10.0, "lr": 1e-3, "machines": 2}, None, note)
    assert said == ["step 8/8 loss 2.0000 tok/s 10 lr 1.00e-03 machines 2 (re-plan @3 join j1: 2.4->1.2 s/step, "
                    "50.8 KiB, moved in 4.2 s)"]
    RankZeroProgress("events", 8, 3, "t", print).report(
        4, {"loss": 2.0, "tokens_per_s": 10.0, "lr": 1e-3, "machines": 2}, None, note + "\x1b[2J")
    event = capsys.readouterr().out.splitlines()[-1]
    bar = LaunchBar(lambda line: None)
    assert bar.take(event)
    bar.close()
    err = capsys.readouterr().err
    assert "machines=2 fleet=re-plan @3 join j1" in err and "\x1b" not in err  # a hostile note is escaped


@pytest.mark.parametrize("machines", [None, 0, -1, True, 2.5, "2", 2**40])
def test_a_machine_count_that_is_not_one_is_not_shown(machines) -> None:
    from vgraph.backends.torch.distributed.runtime.progress import _fleet

    assert "machines" not in _fleet({"machines": machines})


def read_tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_machines_per_step_and_each_replan_at_its_boundary(tmp_path: Path) -> None:
    from vgraph.backends.torch.training.tensorboard_log import TensorBoardLog

    sink = TensorBoardLog(tmp_path, settings={"steps": 8})
    sink.restart(3)  # the attempt after the boundary resumes from its checkpoint
    sink.write([{"step": 4, "loss": 1.0, "machines": 2}, {"step": 5, "loss": 1.0, "machines": 2}])
    hostile = {**DECISION, "pnode": "j\x1b<b>1"}
    sink.replans(fleet_history([hostile, BOUNDARY]).replans)  # the move not measured yet
    sink.replans(fleet_history([hostile, BOUNDARY, MOVED]).replans)  # now it is: only the seconds are new
    sink.replans(fleet_history([{**DECISION, "step": 0}, {**BOUNDARY, "step": 1}]).replans)  # before this session
    sink.close()
    acc = read_tensorboard(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("fleet/machines")] == [(4, 2.0), (5, 2.0)]
    for tag, value in (("fleet/replan_predicted_before_s", 2.4), ("fleet/replan_predicted_after_s", 1.2),
                       ("fleet/replan_bytes_moved", 52_000), ("fleet/replan_seconds", 4.25)):
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(3, pytest.approx(value))], tag
    (text,) = acc.Tensors("fleet/replan/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert text.step == 3 and "join" in shown and "the new plan saves" in shown
    assert "\x1b" not in shown and "<b>" not in shown  # escaped for TensorBoard's Markdown


def test_rank_zero_stamps_machines_and_rereads_the_events_only_when_they_change(tmp_path: Path, monkeypatch) -> None:
    from vgraph.backends.torch.distributed.runtime import fleet_watch

    reads: list[int] = []
    real = fleet_watch.read_fleet
    monkeypatch.setattr(fleet_watch, "read_fleet", lambda reader, steps: reads.append(steps) or real(reader, steps))

    class Sink:
        got: list = []

        def replans(self, replans) -> None:
            self.got.append([(r.boundary, r.seconds) for r in replans])

    watch = fleet_watch.FleetWatch(tmp_path, 2, 8, Sink())
    assert watch.note == "" and reads == []  # no events file: nothing read
    write(tmp_path, DECISION, BOUNDARY)
    rows = [{"step": 4}, {"step": 5}]
    watch.rows(rows)
    watch.rows([{"step": 6}])
    assert [r["machines"] for r in rows] == [2, 2] and reads == [8]  # read once: the file did not change
    write(tmp_path, DECISION, BOUNDARY, MOVED)
    watch.rows([{"step": 7}])
    assert reads == [8, 8] and Sink.got == [[(3, None)], [(3, 4.25)]]
    assert watch.note.startswith("re-plan @3 join j1") and "moved in 4.2 s" in watch.note
    older = fleet_watch.FleetWatch(tmp_path, None, 8)  # a job of an older vgraph: no machine count
    unstamped = [{"step": 4}]
    older.rows(unstamped)
    assert unstamped == [{"step": 4}]
