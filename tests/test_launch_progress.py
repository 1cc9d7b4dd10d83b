"""`vgraph launch` shows a rank-0 progress bar like `vgraph train`'s (issue 25 item 4; progress.py).

Rank 0's events cross the launcher's relay as lines with a prefix no worker writes; the launcher draws
them (tqdm on a terminal, a line every 10 steps when stderr is captured, as `vgraph train`) and never
shows the events themselves.  A malformed event is an ordinary line, not a crash.  End to end: a launch
on stderr shows step, loss, tokens/s and the ETA, and the worker lines stay readable around it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.runtime.progress import (EVENT_PREFIX, LaunchBar, RankZeroProgress,
                                                        progress_mode)


def test_progress_mode_follows_the_launcher() -> None:
    assert progress_mode({}, "vgraph") == "lines"
    assert progress_mode({}, "torchrun") == progress_mode({}, "slurm") == "bar"
    assert progress_mode({"VGRAPH_PROGRESS": "events"}, "vgraph") == "events"
    assert progress_mode({"VGRAPH_PROGRESS": "nonsense"}, "slurm") == "bar"


def test_rank_zero_events_become_the_launchers_bar(capsys) -> None:
    lines: list[str] = []
    bar = LaunchBar(lines.append)
    rank0 = RankZeroProgress("events", 20, 0, "tiny", lambda line: None)
    for step in range(1, 21):
        rank0.report(step, {"loss": 4.0 - step / 100, "tokens_per_s": 1234.5, "lr": 6e-4},
                     3.5 if step == 20 else None)
    events = capsys.readouterr().out.splitlines()
    assert len(events) == 21 and all(e.startswith(EVENT_PREFIX) for e in events)  # a start event, then one per step
    for event in events:
        assert bar.take(event)
    assert not bar.take("[w1] an ordinary line") and not bar.take("step 3/20")
    bar.write("[w0] checkpoint step-20")
    bar.close()
    err = capsys.readouterr().err  # not a terminal here: the bar prints lines, as `vgraph train`'s does
    assert "tiny: step 1/20 (5%) loss=3.9900 tok_s=1,234 lr=6.00e-04" in err
    assert "tiny: step 20/20 (100%) loss=3.8000 tok_s=1,234 lr=6.00e-04 val=3.5000" in err and "eta" in err
    assert "[w0] checkpoint step-20" in err and lines == []  # written above the bar, not as a plain line
    bar.write("after the attempt")
    assert lines == ["after the attempt"]


@pytest.mark.parametrize("payload", ["not json", "{}", '{"step": "x", "steps": 3, "start": 0}', "[1]",
                                     '{"step": 1, "steps": 3, "start": 0, "loss": "high", "tok_s": 1, "lr": 1}'])
def test_a_malformed_event_is_an_ordinary_line(payload: str) -> None:
    bar = LaunchBar(lambda line: None)
    assert not bar.take(EVENT_PREFIX + payload)
    assert bar.bar is None


def test_a_nonfinite_loss_travels_as_null(capsys) -> None:
    RankZeroProgress("events", 3, 0, "t", print).report(1, {"loss": float("nan"), "tokens_per_s": 1.0, "lr": 1.0},
                                                        None)
    last = capsys.readouterr().out.splitlines()[-1]
    assert '"loss": null' in last and "NaN" not in last
    bar = LaunchBar(lambda line: None)
    assert bar.take(last)  # drawn with loss=nan, not refused
    bar.close()


def test_a_launch_on_stderr_shows_the_bar(tmp_path: Path, capfd) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    launch(LaunchConfig(network=str(TINY), fleet=str(fleet), data=str(corpus), steps=4, batch=2, val_every=0,
                        checkpoint_every=4, threads=1, out=tmp_path / "run", replicas=2, progress=True))
    err = capfd.readouterr().err
    assert "launch: step 4/4 (100%) loss=" in err and "tok_s=" in err and "eta" in err
    assert "[w0] checkpoint" in err and "@@vgraph-progress" not in err
