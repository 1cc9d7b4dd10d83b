"""The TensorBoard sink on its own: which rows become which scalars, what is never written, and a missing dot.

(tests/test_watch_run.py checks it inside real `vgraph train` / `vgraph launch` runs.)
"""
from __future__ import annotations

import math
from pathlib import Path

from conftest import TINY
from vgraph import load
from vgraph.backends.torch.training.tensorboard_log import TensorBoardLog, settings_markdown


def read(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_rows_become_tagged_scalars_and_non_numbers_are_skipped(tmp_path: Path) -> None:
    sink = TensorBoardLog(tmp_path, settings={"steps": 3, "lr": 1e-3})
    sink.restart(0)
    sink.write([
        {"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "elapsed_s": 1.0, "grad/norm x\x1b": 0.5,
         "pnodes": {"w/0": {"step_s": 0.2, "idle_s": 0.05, "bytes_sent": 64}}},
        {"step": 2, "loss": math.nan, "lr": 1e-3, "loss_scale": 65536.0, "val_loss": math.inf, "note": "text",
         "flag": True},
        {"step": "3", "loss": 1.0},  # not a step: skipped
    ])
    sink.close()
    acc = read(tmp_path)
    scalars = acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("train/loss")] == [1]  # NaN never reaches a curve
    assert "val/loss" not in scalars and "metrics/note" not in scalars and "metrics/flag" not in scalars
    assert [e.value for e in acc.Scalars("train/loss_scale")] == [65536.0]
    assert "metrics/grad_norm_x_" in scalars  # one safe tag level from a hostile name
    assert "pnode/w_0/step_time_s" in scalars and "pnode/w_0/idle_s" in scalars
    assert "metrics/elapsed_s" not in scalars
    assert acc.Tags()["images"] == []  # no graph given: no drawing


def test_without_graphviz_there_is_a_note_and_no_image(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    said: list[str] = []
    sink = TensorBoardLog(tmp_path, settings={"steps": 1}, graph=load(TINY), say=said.append)
    sink.restart(0)
    sink.write([{"step": 1, "loss": 1.0}])
    sink.close()
    assert said and "no network image" in said[0] and "Graphviz" in said[0]
    acc = read(tmp_path)
    assert acc.Tags()["images"] == [] and [e.step for e in acc.Scalars("train/loss")] == [1]


def test_a_finished_run_opens_no_writer(tmp_path: Path) -> None:
    sink = TensorBoardLog(tmp_path, settings={"steps": 5})
    sink.restart(5)
    sink.close()
    assert list(tmp_path.iterdir()) == []


def test_settings_table_escapes_cells() -> None:
    text = settings_markdown({"a|b": "<script>x</script>\x1b[2J", "n": {"k": [1, 2]}})
    assert "a\\|b" in text and "&lt;script&gt;" in text and "\x1b" not in text and '{"k": [1, 2]}' in text
