"""A machine that vanishes mid-run (training/rescue.py, launch.py's `_rescue`): two launchers on loopback as
two machines, machine 1's whole process group (its launcher, forkserver and workers) SIGKILLed while its worker
holds after step 3.  With 2 replicas, machine 0's worker holds every VNode at step 3: the run is re-planned on
machine 0 alone, resumes at step 3 from the survivor's shard, and 0 steps are redone; with a pipeline over the
two machines, no survivor holds machine 1's VNodes: it resumes from the step-2 checkpoint and says 1 step was
redone.  Both train like `vgraph train` at the same global batch (test_distributed_replicas.same_training:
losses at rtol 1e-5, every step logged once, final weights and optimizer state within weights_util's bound).
Tiny network, 6 steps: these run real worker processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_distributed_replicas import common, files, reference, same_training  # noqa: F401 - fixtures
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, free_port, launch
from vgraph.run.files import FLEET_EVENTS_JSONL

TOKEN = "rescue-test-secret-0123"
KILL_AT = 3  # machine 1's worker holds after this step; checkpoints are every 2 steps (common())
RUNNER = ("import json, sys\n"
          "from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch\n"
          "c = json.loads(sys.argv[1]); c['hold'] = tuple(c['hold'])\n"
          "launch(LaunchConfig(**c))\n")


def kill_machine_1(files_dir: Path, tmp_path: Path, monkeypatch, replicas: int):
    """Machine 0 in a thread, machine 1 a process group of its own; SIGKILL the group once machine 1's worker
    holds after step KILL_AT (machine 0's worker then waits on it in step KILL_AT + 1).  Machine 0's result."""
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", TOKEN)
    base = dict(**common(files_dir), fleet=str(files_dir / "wide2.yml"), micro_batches=2, replicas=replicas,
                nnodes=2, master_port=free_port(), hold=("w1", KILL_AT), link_timeout=2.0, comm_timeout=60.0)
    box: dict = {}

    def machine_0() -> None:
        try:
            box["result"] = launch(LaunchConfig(**base, node_rank=0, out=tmp_path / "node0"))
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=machine_0, daemon=True)
    thread.start()
    with open(tmp_path / "machine1.log", "w") as log:
        other = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps({**base, "node_rank": 1,
                                                                           "out": str(tmp_path / "node1")})],
                                 cwd=str(ROOT), env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        held = tmp_path / "node1" / "launch" / "held-w1"
        deadline = time.monotonic() + 180
        while not held.exists():
            assert other.poll() is None and thread.is_alive() and time.monotonic() < deadline, \
                (box.get("error"), (tmp_path / "machine1.log").read_text())
            time.sleep(0.05)
        time.sleep(0.3)  # machine 0's worker moves on into the next step and waits on machine 1's
        os.killpg(other.pid, signal.SIGKILL)
        assert other.wait(timeout=30) == -signal.SIGKILL
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "machine 0 did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


def rescue_rows(run: Path) -> list[dict]:
    lines = (run / "launch" / FLEET_EVENTS_JSONL).read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["event"] == "rescue"]


def resumed_after(rows: list[dict]) -> int:
    """The step the second attempt resumed from, read from metrics.jsonl: each attempt's rows time from its own
    start (`elapsed_s`), so the first row whose clock went back is the resumed attempt's first step."""
    back = [a["step"] for a, b in zip(rows, rows[1:]) if b["elapsed_s"] < a["elapsed_s"]]
    assert len(back) == 1, [(r["step"], r["elapsed_s"]) for r in rows]
    return back[0]


def first_job(run: Path) -> dict:
    return json.loads((run / "launch" / "job-0.json").read_text())


def test_a_vanished_machine_is_rescued_from_the_surviving_replica(files, reference, tmp_path, monkeypatch):
    result = kill_machine_1(files, tmp_path, monkeypatch, replicas=2)
    run = tmp_path / "node0"
    job = first_job(run)  # the premise: two replicas, and machine 1's w1 ran one, every VNode of it
    assert job["ranks"] == ["w0", "w1"] and job["batch_shares"] == [4, 4]
    assert job["hold"] == {"rank": 1, "step": KILL_AT}
    first, second = result.attempts
    assert not first["ok"] and second["ok"] and second["ranks"] == ["w0"]  # re-planned on machine 0 alone
    assert result.placement["replicas"] == 1 and result.placement["batch_shares"] == [8]
    (row,) = rescue_rows(run)
    assert row["from"] == "replicas" and row["resume_step"] == KILL_AT and row["steps_redone"] == 0
    assert row["lost"] == ["w1"] and row["refused"] == []
    assert result.steps_redone == 0 and resumed_after(result.history) == KILL_AT
    same_training(result.history, reference, run)


def test_a_vanished_pipeline_stage_falls_back_to_the_checkpoint_and_says_the_steps_redone(
        files, reference, tmp_path, monkeypatch):
    result = kill_machine_1(files, tmp_path, monkeypatch, replicas=1)
    run = tmp_path / "node0"
    job = first_job(run)  # the premise: one pipeline, machine 1's w1 held VNodes that no one else held
    assert job["ranks"] == ["w0", "w1"] and job["batch_shares"] == [8]
    assert set(job["final_assignment"].values()) == {"w0", "w1"}
    (row,) = rescue_rows(run)
    assert row["from"] == "checkpoint" and row["resume_step"] == 2 and row["reached"] == KILL_AT
    assert row["steps_redone"] == KILL_AT - 2 == result.steps_redone and "no replica of it survived" in row["why"]
    assert resumed_after(result.history) == 2 and result.attempts[1]["ranks"] == ["w0"]
    same_training(result.history, reference, run)
