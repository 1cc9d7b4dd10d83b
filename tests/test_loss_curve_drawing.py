"""loss_curve.png is drawn at checkpoints and at the end of a run, never at every validation.

Why: matplotlib takes seconds; in `vgraph launch` rank 0 drawing at each validation held every other worker
(idle time in the per-PNode figures). The file must still be there after a finished or interrupted run.
The draws are counted by spying on MetricsLog.plot: in-process for `train`, and through a `--plugin` file
(which every launch worker imports) for `launch`.
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from conftest import TINY
from hardening_util import signal_after_rows
from vgraph.backends.torch import cli
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import main as launch_main
from vgraph.backends.torch.training.metrics_log import MetricsLog

PNG = b"\x89PNG\r\n\x1a\n"
FLEET = "name: two\npnodes:\n" + "".join(
    f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2))

# Imported by every launch worker (--plugin): records the last logged step each time the PNG is rewritten.
SPY = '''
import json, os
from vgraph.backends.torch.training.metrics_log import MetricsLog

_plot = MetricsLog.plot

def _spy(self, path, title):
    before = os.stat(path).st_ino if path.is_file() else None
    _plot(self, path, title)
    if os.stat(path).st_ino != before:  # an atomic write: a new file, so a real drawing
        with open(RECORD, "a") as f:
            f.write(json.dumps(self.rows[-1]["step"] if self.rows else None) + "\\n")

MetricsLog.plot = _spy
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return str(path)


@pytest.fixture
def draws(monkeypatch) -> list[int]:
    """Steps at which this process really redrew the PNG (a new inode: atomic_write renamed a new file)."""
    seen: list[int] = []
    plot = MetricsLog.plot

    def spy(self, path: Path, title: str) -> None:
        before = path.stat().st_ino if path.is_file() else None
        plot(self, path, title)
        if path.stat().st_ino != before:
            seen.append(self.rows[-1]["step"])

    monkeypatch.setattr(MetricsLog, "plot", spy)
    return seen


def test_train_draws_at_checkpoints_and_the_end_not_at_validations(tmp_path: Path, corpus: str, draws) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), "--steps", "6", "--batch", "2",
                     "--val-every", "1", "--checkpoint-every", "4", "--quiet"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [1, 2, 3, 4, 5, 6]  # six validations...
    assert draws == [4, 6]  # ...two drawings: checkpoint 4, and step 6 (checkpoint and end: drawn once)
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG


def test_train_without_checkpoints_still_leaves_the_curve(tmp_path: Path, corpus: str, draws) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), "--steps", "3", "--batch", "2",
                     "--val-every", "1", "--checkpoint-every", "0", "--quiet"]) == 0
    assert draws == [3]
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG


def test_an_interrupted_train_leaves_the_curve_of_its_last_step(tmp_path: Path, corpus: str, draws) -> None:
    out = tmp_path / "run"
    with signal_after_rows(out / "metrics.jsonl", 2, signal.SIGINT):
        code = cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), "--steps", "1000000", "--batch",
                         "2", "--val-every", "1", "--checkpoint-every", "0", "--log-every", "1", "--quiet"])
    assert code == 130
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert draws == [last]  # drawn once, with the checkpoint the interrupt wrote
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG


def test_launch_rank0_draws_at_checkpoints_and_the_end_not_at_validations(tmp_path: Path, corpus: str,
                                                                        monkeypatch, capsys) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET)
    spy = tmp_path / "spy_plot.py"
    record = tmp_path / "draws.jsonl"
    # The record's path is written into the spy: workers fork from a forkserver that an earlier launch in this
    # process may have started, with that launch's environment.
    spy.write_text(f"RECORD = {str(record)!r}\n" + SPY)
    # The launcher imports the --plugin file in this process too: restore the real plot afterwards (conftest
    # forgets the plugin file itself), or later tests would train through the spy.
    monkeypatch.setattr(MetricsLog, "plot", MetricsLog.plot)
    out = tmp_path / "run"
    code = launch_main(["launch", str(TINY), "--fleet", str(fleet), "--data", corpus, "--steps", "5", "--batch",
                        "2", "--val-every", "1", "--checkpoint-every", "2", "--threads", "1", "--plugin", str(spy), "--replicas", "2",
                        "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    # (the worker's banner, seen here: traffic in whole bytes as the launcher prints it, not "253,696.0")
    assert re.search(r"\[w0\] .*predicted traffic [0-9,]+ bytes/step\n", err), err
    # and the launcher's line says what each replica pipelines (batch 2 over 2 replicas: one sample each),
    # as the worker does, not the --micro-batches default of min(batch, 2 x PNodes)
    assert "1 micro-batch per replica 1f1b" in err and "[w0] tiny-2l: 32 VNodes on 2 worker(s) (2 replica(s)" in err
    assert "1 micro-batch(es) of [1]" in err, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [1, 2, 3, 4, 5]
    assert [json.loads(line) for line in record.read_text().splitlines()] == [2, 4, 5]
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(("micro", "shares", "text"), [
    (4, [2, 2], "2 micro-batches per replica"), (4, [8], "4 micro-batches"), (1, [8], "1 micro-batch"),
    (4, [3, 5], "3 or 4 micro-batches per replica"), (2, [1, 1], "1 micro-batch per replica")])
def test_the_launch_line_counts_the_micro_batches_each_replica_runs(micro: int, shares: list[int], text: str) -> None:
    from vgraph.backends.torch.distributed.launcher.launch import _micro_per_replica

    assert _micro_per_replica(micro, shares) == text
