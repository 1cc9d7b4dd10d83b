"""A stop request at any moment of the training loop ends with a checkpoint of the last finished step
(issue 21, defect 3 and the acceptance's "Ctrl-C at a random moment of 20 short runs").

Defect 3: the loop decided whether to save before it validated and logged, so a Ctrl-C or SIGTERM that
arrived during validation or logging stopped with "checkpoint None" and lost every step since the last
checkpoint (up to 499 with the defaults).  Here a seeded schedule sends SIGINT to this process from
inside one of the loop's phases (the step's forward and backward, the update, validation, logging, the
checkpoint, the loss-curve drawing), before or after the phase's work, in 20 short runs of the tiny
network; each must exit 130 with a checkpoint at the last step it finished and logged, say how to
resume, and resume to the end with every step logged exactly once.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import shlex
import signal
from pathlib import Path

import pytest

from conftest import TINY
from hardening_util import signal_after_rows, small_corpus
from vgraph.backends.torch.training import checkpoint as ckpt
from vgraph.backends.torch import cli
from vgraph.backends.torch.training.metrics_log import MetricsLog
from vgraph.backends.torch.training.step import TrainStep

train_module = importlib.import_module("vgraph.backends.torch.training.train")  # the module: the package exports train()
STEPS = 6
RUN = ["--steps", str(STEPS), "--batch", "2", "--val-every", "2", "--val-batches", "1", "--checkpoint-every", "4",
       "--log-every", "3", "--quiet", "--threads", "1", "--no-tensorboard"]
# Where a stop can land: (owner, attribute) of each phase the loop calls, and how often one run calls it.
PHASES = {"step": (TrainStep, "forward_backward", STEPS), "update": (TrainStep, "update", STEPS),
          "validation": (train_module, "validation_loss", 3), "logging": (MetricsLog, "append", 4),
          "checkpoint": (train_module, "save_run_checkpoint", 2), "drawing": (MetricsLog, "plot", 3)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("data"))


def schedule(seed: int = 21, runs: int = 20) -> list[tuple[str, int, str]]:
    """(phase, which call of it, before or after its work) per run: every phase, the rest drawn."""
    rng = random.Random(seed)
    names = list(PHASES) + [rng.choice(list(PHASES)) for _ in range(runs - len(PHASES))]
    return [(name, rng.randint(1, PHASES[name][2]), rng.choice(["before", "after"])) for name in names]


def _interrupt_in(monkeypatch, phase: str, call: int, when: str) -> None:
    """SIGINT to this process from inside the `call`-th call of `phase`, before or after its work."""
    owner, attr, _ = PHASES[phase]
    real = getattr(owner, attr)
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call and when == "before":
            os.kill(os.getpid(), signal.SIGINT)
        result = real(*args, **kwargs)
        if calls == call and when == "after":
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(owner, attr, wrapped)


def _logged_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("phase,call,when", schedule(), ids=lambda v: str(v))
def test_a_stop_anywhere_saves_the_last_finished_step_and_resumes(phase: str, call: int, when: str, corpus: str,
                                                                  tmp_path: Path, monkeypatch, capsys) -> None:
    run = tmp_path / "run"
    argv = ["train", str(TINY), "--data", corpus, "--out", str(run), *RUN]
    with monkeypatch.context() as patch:
        _interrupt_in(patch, phase, call, when)
        code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None, f"no checkpoint after a stop in {phase}: {err[-500:]}"
    saved = ckpt.load_checkpoint(latest).step
    logged = _logged_steps(run)
    assert logged == list(range(1, saved + 1)), f"logged {logged}, checkpoint at {saved}"  # nothing finished lost
    resume = argv + ["--resume"]
    if code == 130:
        assert f"stopped at step {saved} of {STEPS}; checkpoint {latest}" in err
        # the hint is the command to copy: this one's options, the run as --out, --resume; it is what resumes
        hint = shlex.split(err.split("Continue with: ", 1)[1].splitlines()[0])
        resume = hint[hint.index("train"):]
        assert resume[:2] == ["train", str(TINY)] and "--resume" in resume, hint
        assert {"--data", corpus, "--out", str(run)} <= set(resume), hint
    else:  # the signal came after the last step's checkpoint: the run had finished
        assert code == 0 and saved == STEPS
    assert cli.main(resume) == 0
    assert _logged_steps(run) == list(range(1, STEPS + 1))  # every step logged exactly once
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run)).step == STEPS


@pytest.mark.slow
def test_a_launch_stopped_while_validating_saves_its_last_step_and_resumes(corpus: str, tmp_path: Path,
                                                                          capsys) -> None:
    """The launch workers decide to stop in each step's reduction, so a stop that reaches them during
    validation or logging is carried into the next step's reduction, which checkpoints: validation every
    step makes the stop land there."""
    from vgraph.backends.torch.distributed.launcher.launch import main as launch_main

    fleet = tmp_path / "fleet.yml"
    fleet.write_text("pnodes:\n" + "".join(f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, "
                                              f"accelerator: cpu}}\n" for i in range(2)))
    out = tmp_path / "run"
    args = ["launch", str(TINY), "--fleet", str(fleet), "--data", corpus, "--batch", "2", "--val-every", "1",
            "--val-batches", "1", "--checkpoint-every", "0", "--threads", "1", "--out", str(out), "--quiet",
            "--no-tensorboard"]
    with signal_after_rows(out / "metrics.jsonl", 2, signal.SIGINT):
        code = launch_main([*args, "--steps", "1000000"])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err, err[-2000:]
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(out)).step
    assert _logged_steps(out) == list(range(1, saved + 1))
    assert launch_main([*args, "--steps", str(saved + 2), "--resume"]) == 0
    assert _logged_steps(out) == list(range(1, saved + 3))
