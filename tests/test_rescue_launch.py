"""A machine that vanishes mid-run (training/rescue.py, failures.py's `_rescue`): two launchers on loopback as
two machines, machine 1's whole process group (its launcher, forkserver and workers) SIGKILLed while its worker
holds after step 3.  With 2 replicas, machine 0's worker holds every VNode at step 3: the run is re-planned on
machine 0 alone, resumes at step 3 from the survivor's shard, and 0 steps are redone; with a pipeline over the
two machines, no survivor holds machine 1's VNodes: it resumes from the step-2 checkpoint and says 1 step was
redone; with four machines the lost stage's state comes from machine 3's shard, sent over the launchers'
channel.  All train like `vgraph train` at the same global batch (test_distributed_replicas.same_training:
losses at rtol 1e-5, every step logged once, final weights and optimizer state within weights_util's bound).
Tiny network, 6 steps: these run real worker processes."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_distributed_replicas import common, files, reference, same_training  # noqa: F401 - fixtures
from zygote import STDOUT, popen
from ports import launch_port
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.training import checkpoint as ckpt
from vgraph.run.files import FLEET_EVENTS_JSONL

pytestmark = pytest.mark.slow  # real launchers and workers: about a minute each on the 2-core VM under load
TOKEN = "rescue-test-secret-0123"
KILL_AT = 3  # machine 1's worker holds after this step; checkpoints are every 2 steps (common())
RUNNER = ("import json, sys\n"
          "from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch\n"
          "c = json.loads(sys.argv[1]); c['hold'] = tuple(c['hold'])\n"
          "launch(LaunchConfig(**c))\n")


def kill_machine_1(files_dir: Path, tmp_path: Path, monkeypatch, replicas: int, fleet: str = "wide2.yml",
                   victim: str = "w1", nnodes: int = 2, micro: int = 2, sig: int = signal.SIGKILL):
    """Machine 0 (and machines 2 .. nnodes - 1) in threads, machine 1 a process group of its own; SIGKILL the
    group once machine 1's worker (`victim`) holds after step KILL_AT (the others then wait on it in step
    KILL_AT + 1).  Machine 0's result.  `sig` SIGSTOP: machine 1 goes dark instead, its connections open (a
    lost link, a frozen host), until the others have finished; then it is killed."""
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", TOKEN)
    base = dict(**common(files_dir), fleet=str(files_dir / fleet), micro_batches=micro, replicas=replicas,
                nnodes=nnodes, master_port=launch_port(), hold=(victim, KILL_AT), link_timeout=2.0, comm_timeout=60.0)
    box: dict = {}

    def machine(rank: int) -> None:
        try:
            box[rank] = launch(LaunchConfig(**base, node_rank=rank, out=tmp_path / f"node{rank}"))
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    threads = [threading.Thread(target=machine, args=(r,), daemon=True) for r in (0, *range(2, nnodes))]
    for t in threads:
        t.start()
    thread = threads[0]
    runner = tmp_path / "machine1.py"
    runner.write_text(RUNNER)
    # A child of the tests' zygote (torch imported once, tests/zygote.py) in a session of its own: the signal
    # takes its forkserver and workers with it
    other = popen([runner, json.dumps({**base, "node_rank": 1, "out": str(tmp_path / "node1")})], cwd=ROOT,
                  env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=tmp_path / "machine1.log", stderr=STDOUT,
                  start_new_session=True)
    try:
        held = tmp_path / "node1" / "launch" / f"held-{victim}"
        deadline = time.monotonic() + 180
        while not held.exists():
            assert other.poll() is None and thread.is_alive() and time.monotonic() < deadline, \
                (box.get("error"), (tmp_path / "machine1.log").read_text())
            time.sleep(0.05)
        time.sleep(0.3)  # machine 0's worker moves on into the next step and waits on machine 1's
        os.killpg(other.pid, sig)
        if sig == signal.SIGKILL:
            assert other.wait(timeout=30) == -signal.SIGKILL
        for t in threads:
            t.join(timeout=300)
            assert not t.is_alive(), "a machine did not finish"
        assert sig == signal.SIGKILL or other.poll() is None  # the premise: dark all along, nothing closed
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
            other.wait(timeout=30)
    if "error" in box:
        raise box["error"]
    return box[0]


def rescue_rows(run: Path) -> list[dict]:
    lines = (run / "launch" / FLEET_EVENTS_JSONL).read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["event"] == "rescue"]


def resumed_after(rows: list[dict]) -> int:
    """The step the second attempt resumed from, read from metrics.jsonl: the first attempt's rows name both
    machines' PNodes (`pnodes`: every PNode that trained the step), the resumed one's w0 alone.  Not the clock
    (`elapsed_s` times each attempt from its own start): it goes back at the resumed step only when the new
    attempt's first step is quicker than the old one's run to it (the full suite of 2026-12-07: 0.311 s after
    0.303 s, and the test failed on a correct run)."""
    trained = [(r["step"], sorted(r.get("pnodes") or {})) for r in rows]
    changed = [a[0] for a, b in zip(trained, trained[1:]) if a[1] != b[1]]
    assert len(changed) == 1 and trained[0][1] == ["w0", "w1"] and trained[-1][1] == ["w0"], trained
    return changed[0]


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


def test_a_machine_that_goes_dark_is_rescued_from_the_surviving_replica(files, reference, tmp_path, monkeypatch):
    """Machine 1 frozen (SIGSTOP: its sockets stay open, as when a host loses its link): machine 0's worker
    waits in its collective, where no error will come before --comm-timeout.  Machine 0's launcher hears no
    heartbeat for --link-timeout and asks its worker for its rescue shard (supervisor.ask_rescue; the
    worker's rescue watch writes it while the main thread waits): 0 steps redone, where the run used to stop
    the waiting worker and fall back to the step-2 checkpoint (1 step redone)."""
    result = kill_machine_1(files, tmp_path, monkeypatch, replicas=2, sig=signal.SIGSTOP)
    run = tmp_path / "node0"
    assert first_job(run)["ranks"] == ["w0", "w1"]  # the premise: machine 1's replica holds every VNode too
    first, second = result.attempts
    assert not first["ok"] and second["ok"] and second["ranks"] == ["w0"]
    (row,) = rescue_rows(run)
    assert row["from"] == "replicas" and row["resume_step"] == KILL_AT and row["steps_redone"] == 0
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


def test_the_other_survivors_send_their_shards_to_machine_0(files, reference, tmp_path, monkeypatch):
    """Four machines, one worker each: 2 stages x 2 replicas, world [w0, w2, w1, w3] (replica 0: w0, w2), so
    machine 1 runs w2, replica 0's second stage.  When it is killed, the second stage survives only on machine
    3 (w3): the rescue at step 3 needs machine 3's shard, which comes over the launchers' channel; the run goes
    on as one pipeline on w0, w1, w3."""
    result = kill_machine_1(files, tmp_path, monkeypatch, replicas=2, fleet="fleet4.yml", victim="w2", nnodes=4,
                            micro=8)
    run = tmp_path / "node0"
    job = first_job(run)  # the premise: machine 1's w2 held the second stage, which machine 0 does not hold
    assert job["ranks"] == ["w0", "w2", "w1", "w3"] and job["batch_shares"] == [4, 4]
    assert set(job["final_assignment"].values()) == {"w0", "w2"}
    (row,) = rescue_rows(run)
    assert row["from"] == "replicas" and row["resume_step"] == KILL_AT and row["steps_redone"] == 0
    checkpoint = ckpt.load_checkpoint(run / f"step-{KILL_AT:08d}")
    assert 3 in checkpoint.extra["rescued_from"]  # machine 3's rank, sent over
    assert result.attempts[1]["ranks"] == ["w0", "w1", "w3"] and result.steps_redone == 0
    same_training(result.history, reference, run)
