"""Checkpoints and the event files beside them against a full disk, damage and a changed network (issue 21).

Regression tests: a full disk during training exited 1 with a SafetensorError traceback, and on resume
TensorBoard's writer thread printed its own OSError traceback; `train --resume --accept-network-change`
onto weights of other shapes was a "size mismatch" traceback; a checkpoint whose step is 10**30 or -1 was
accepted; TensorBoard showed steps twice after a resume that found no checkpoint (no purge at step 0).
"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from conftest import TINY
from hardening_util import file_size_limit, small_corpus, widened_head
from vgraph.backends.torch.training import checkpoint as ckpt
from vgraph.backends.torch import cli
from vgraph.backends.torch.training.tensorboard_log import TensorBoardLog

QUICK = ["--batch", "2", "--val-every", "0", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus: str) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), "--steps", "2", *QUICK,
                     "--no-tensorboard"]) == 0
    return out


# -- a full disk ---------------------------------------------------------------------------------------------

def test_a_full_disk_while_checkpointing_is_a_diagnostic(tmp_path: Path, corpus: str, capsys) -> None:
    """Weights are 130 KB: with every file capped at 60 KB (as on a full disk) the checkpoint cannot be written."""
    with file_size_limit(60_000):
        code = cli.main(["train", str(TINY), "--data", corpus, "--out", str(tmp_path / "full"), "--steps", "2",
                         *QUICK, "--no-tensorboard"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert "model.safetensors" in err and "cannot write" in err
    assert ckpt.latest_checkpoint(tmp_path / "full") is None  # no half checkpoint, no pointer to one
    assert not list((tmp_path / "full").glob(".step-*"))  # nor its temporary


@pytest.fixture()
def thread_failures(monkeypatch) -> list:
    """What reaches `threading.excepthook` (a thread's traceback is printed from there)."""
    seen: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append((args.thread, args.exc_value)))
    return seen


def test_a_full_disk_on_resume_with_tensorboard_prints_no_thread_traceback(tmp_path: Path, corpus: str,
                                                                          trained: Path, capfd,
                                                                          thread_failures: list) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    capfd.readouterr()
    with file_size_limit(20_000):  # network.yml and run.json fit; the event file's network image does not
        code = cli.main(["train", str(TINY), "--data", corpus, "--out", str(run), "--steps", "4", *QUICK,
                         "--resume"])
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    assert thread_failures == []  # TensorBoard's writer thread had nothing printed
    assert "File too large" in err
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run)).step == 2  # the last good checkpoint stays


def test_a_writer_thread_failure_surfaces_once_in_the_training_thread(tmp_path: Path, capfd,
                                                                     thread_failures: list) -> None:
    sink = TensorBoardLog(tmp_path, settings={"steps": 50})
    sink.restart(0)
    with pytest.raises(OSError):
        with file_size_limit(2_000):
            for step in range(1, 51):
                sink.write([{"step": step, "loss": 1.0, "lr": 1e-3, "note_" + "x" * 200: float(step)}])
            sink._writer.flush()
    with pytest.raises(OSError):
        sink.close()
    assert "Traceback" not in capfd.readouterr().err and thread_failures == []


# -- a changed network with other shapes ------------------------------------------------------------------------

def test_accepting_a_network_change_onto_other_shapes_is_a_diagnostic(tmp_path: Path, corpus: str, trained: Path,
                                                                     capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    wider = tmp_path / "wider.yml"
    wider.write_text(widened_head(TINY.read_text()))
    code = cli.main(["train", str(wider), "--data", corpus, "--out", str(run), "--steps", "3", *QUICK,
                     "--resume", "--accept-network-change", "--no-tensorboard"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "size mismatch" not in err, err[-2000:]
    assert "does not fit network" in err and "head_up.weight [64, 32] (the network's is [96, 32])" in err
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run)).step == 2


# -- a damaged step ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [10**30, -1, 2.0, "2", True, None, 2**62 + 1])
def test_a_checkpoint_step_out_of_range_or_of_another_type_is_refused(step, tmp_path: Path, trained: Path,
                                                                      capsys) -> None:
    copy = tmp_path / "step"
    shutil.copytree(ckpt.latest_checkpoint(trained), copy)
    state = json.loads((copy / ckpt.STATE_JSON_FILE).read_text())
    state["step"] = step
    (copy / ckpt.STATE_JSON_FILE).write_text(json.dumps(state))
    with pytest.raises(ckpt.CheckpointError, match="step"):
        ckpt.load_checkpoint(copy)
    assert cli.main(["generate", str(copy), "--max-new-tokens", "1"]) == 2
    assert "Traceback" not in capsys.readouterr().err


# -- TensorBoard after a resume without a checkpoint -----------------------------------------------------------------

def _steps(run: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _values(run: Path, tag: str = "train/loss") -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars(tag)


def test_a_restart_from_step_0_over_a_killed_session_shows_each_step_once(tmp_path: Path) -> None:
    first = TensorBoardLog(tmp_path, settings={"steps": 5})
    first.restart(0)
    first.write([{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)])
    first.close()  # killed before its first checkpoint: the events stay
    second = TensorBoardLog(tmp_path, settings={"steps": 5})
    second.restart(0)  # the resume found no checkpoint
    second.write([{"step": s, "loss": 4.0 - s} for s in (1, 2, 3, 4, 5)])
    second.close()
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]
    assert [e.value for e in _values(tmp_path)] == [3.0, 2.0, 1.0, 0.0, -1.0]  # the second session's


def test_a_fresh_run_needs_no_purge(tmp_path: Path) -> None:
    sink = TensorBoardLog(tmp_path, settings={"steps": 2})
    assert sink._purge_step() is None
    sink.restart(0)
    sink.write([{"step": 1, "loss": 1.0}])
    sink.close()
    assert _steps(tmp_path) == [1]
