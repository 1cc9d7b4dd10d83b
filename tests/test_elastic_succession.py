"""Machine 0's loss in an elastic run (issue 36 item 3, `--nnodes MIN:MAX`; succession.py, elastic.py): the
successor must know the grown fleet (the admitted machines' figures, mirrored), serve the admission (a joined
machine asks it for its jobs), and the run goes on there like `vgraph train`.  Around it, on the admission
alone: its record's round trip and the hostile records a successor may be handed."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ports import launch_port
from vgraph.backends.torch.distributed.launcher import elastic, mirror as mirroring, succession
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.launcher.membership import Machines, MachineLost

from test_elastic_launch import (PNODE, TOKEN, Thread, admission, common, events, files, join, pnode_text,  # noqa: F401
                                 reference, same_training, wait_for)
from test_succession import KILLED_RUN_COMM_TIMEOUT, log_tail, machine_0, start_after_machine_0


def machines_0_and_1(files: Path, tmp_path: Path, port: int, **options):
    """A `--nnodes 2:3` run on m0 and m1: machine 0 a process of its own session (to be SIGKILLed), held after
    step 2; machine 1 a launch in a thread (its Thread, and the list its lines go to), started once machine 0
    serves (test_succession.start_after_machine_0: --comm-timeout without a start-up margin)."""
    fleet = files / "two-wide.yml"
    fleet.write_text("name: two\npnodes:\n" + PNODE.format(id="m0", memory="256MiB")
                     + PNODE.format(id="m1", memory="256MiB"))
    settings = dict(common(files), fleet=str(fleet), nnodes=2, max_nnodes=3, master_port=port, link_timeout=2.0,
                    comm_timeout=KILLED_RUN_COMM_TIMEOUT, **options)
    log = tmp_path / "node0.log"
    zero = machine_0({**settings, "node_rank": 0, "hold": ["m0", 2], "out": str(tmp_path / "node0")}, log)
    start_after_machine_0(zero, port, "machine 0's channel", log)
    lines: list[str] = []
    one = Thread(lambda: launch(LaunchConfig(**settings, node_rank=1, out=tmp_path / "node1", log=lines.append)))
    one.start()
    return zero, one, lines


def wind_down(zero, one, joiner) -> None:
    """Machine 0 killed if it still runs (a failed wait), machine 1 and the joiner waited for."""
    if zero.poll() is None:
        os.killpg(zero.pid, signal.SIGKILL)
        zero.wait()
    one.join(timeout=240)
    if joiner is not None:
        joiner.join(timeout=60)


@pytest.mark.slow  # three launchers and the rejoin timeout (--comm-timeout + --link-timeout) waited out
def test_machine_0_of_an_elastic_run_is_sigkilled_and_the_successor_places_the_joined_machine(
        files, reference, tmp_path, monkeypatch):
    """--nnodes 2:3, machines 0 and 1 each a replica, m0's worker held after step 2; j1 joins machine 0 and is
    admitted (the join pays: a boundary is asked for, which the held step keeps from coming).  Machine 0 is
    SIGKILLed with its workers once machine 1 mirrored the admission record, the step-2 row and checkpoint.
    Machine 1 takes over from the mirrored step-2 checkpoint (0 steps redone), admits as machine 0 did (j1's
    figures came in the record: machine 1's own fleet file has only m0 and m1) and places the next attempt on
    m1 and j1, rank 0 on itself; j1 runs it from machine 1's job.  Every step once, losses as `vgraph train`."""
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", TOKEN)
    port = launch_port()
    zero, one, lines = machines_0_and_1(files, tmp_path, port, replicas=2, on_failure="restart")
    joiner = None
    try:
        alive = lambda: zero.poll() is None or pytest.fail(f"machine 0 ended: {log_tail(tmp_path / 'node0.log')}")
        wait_for(lambda: (tmp_path / "node0" / "launch" / "held-m0").exists(), "m0 held after step 2", alive)
        joiner = Thread(lambda: elastic.follow("127.0.0.1", port, files / "j1.yml", tmp_path / "joiner",
                                               join_timeout=60, link_timeout=2, comm_timeout=120, emit=lines.append))
        joiner.start()
        mirror = tmp_path / "node1" / "launch" / "mirror"
        # j1 holds the run's files before the kill: a joiner still fetching them from machine 0 fails with the
        # reset (`cannot write: Connection reset by peer`, one run of eight at load 5-7), not a succession
        record = mirror / mirroring.ADMISSION_JSON
        wait_for(lambda: record.is_file() and "j1" in record.read_text()
                 and (mirror / "latest").is_file() and (mirror / "latest").read_text().strip() == "step-00000002"
                 and any("received the run's corpus" in line for line in lines),
                 "machine 1 to mirror the admission of j1 and the step-2 checkpoint, j1 to hold the files", alive)
        assert [r["pnode"] for r in events(tmp_path / "node0") if r["event"] == "join"] == ["j1"]
        os.killpg(zero.pid, signal.SIGKILL)  # the launcher and its workers: the whole machine
        assert zero.wait(timeout=30) == -signal.SIGKILL
    finally:
        wind_down(zero, one, joiner)
    assert one.error is None and joiner.error is None, (one.error, joiner.error, lines[-30:])
    result, joined = one.result, joiner.result
    run = tmp_path / "node1"
    same_training(result.history, reference)  # steps 1..8 once each, the losses of `vgraph train`
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))
    rows = events(run)
    (moved,) = [e for e in rows if e["event"] == "succession"]
    assert moved["coordinator"] == 1 and moved["lost"] == 0 and moved["resume_step"] == 2
    # The survivors' shards are of step 2, the step of the mirrored checkpoint: that one is installed.
    assert moved["steps_redone"] == 0 and moved["state"] == "mirrored checkpoint", moved
    last = result.attempts[-1]
    assert last["ok"] and last["ranks"][0] == "m1" and sorted(last["ranks"]) == ["j1", "m1"], result.attempts
    assert joined.machine == 2 and joined.attempts == [1] and result.steps_redone == 0
    assert not (tmp_path / "joiner" / "metrics.jsonl").exists()  # the run's rows are machine 1's alone


@pytest.mark.slow  # three launchers and the rejoin timeout waited out
def test_machine_0_killed_after_a_boundary_the_follower_takes_over_with_the_grown_fleet(
        files, reference, tmp_path, monkeypatch):
    """The same run, j1's join taken at a boundary (m0 released after step 2: the workers stop after step 3 with
    a checkpoint) and attempt 1 placed by machine 0 on m0, m1 and j1.  Machine 0 is SIGKILLed once machine 1
    runs attempt 1 from machine 0's job and mirrored the boundary's checkpoint: machine 1 was following jobs,
    so it takes over from there (the job's fleet holds j1's figures), j1 follows it, and the run completes on
    m1 and j1: every step once, the losses of `vgraph train`, the steps redone those rows machine 0 logged
    past the state installed."""
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", TOKEN)
    port = launch_port()
    # replicas auto: the planner may take a third replica at the join (a fixed --replicas 2 keeps the plan)
    zero, one, lines = machines_0_and_1(files, tmp_path, port, replicas="auto", on_failure="shrink")
    joiner = None
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    try:
        alive = lambda: zero.poll() is None or pytest.fail(f"machine 0 ended: {log_tail(tmp_path / 'node0.log')}")
        wait_for(lambda: (node0 / "launch" / "held-m0").exists(), "m0 held after step 2", alive)
        joiner = Thread(lambda: elastic.follow("127.0.0.1", port, files / "j1.yml", tmp_path / "joiner",
                                               join_timeout=60, link_timeout=2, comm_timeout=120, emit=lines.append))
        joiner.start()
        wait_for(lambda: any(e.get("chosen") == "new" for e in events(node0)), "the join's decision", alive)
        (node0 / "launch" / "release").write_text("go\n")
        mirror = node1 / "launch" / "mirror"
        wait_for(lambda: (node1 / "launch" / "job-1.json").is_file() and (mirror / "latest").is_file()
                 and (mirror / "latest").read_text().strip() == "step-00000003"
                 and any(line.startswith("launch: attempt 1: j1") for line in lines),
                 "machines 1 and 2 to run attempt 1 and machine 1 to mirror the boundary's checkpoint", alive)
        placed = json.loads((node0 / "placement.json").read_text())
        rows = placed["replica_pnodes"]  # the premise: each machine holds a whole replica
        assert sorted(rows) == [["j1"], ["m0"], ["m1"]] and rows[0] == ["m0"], rows
        os.killpg(zero.pid, signal.SIGKILL)
        assert zero.wait(timeout=30) == -signal.SIGKILL
    finally:
        wind_down(zero, one, joiner)
    assert one.error is None and joiner.error is None, (one.error, joiner.error, lines[-30:])
    boundary = next(e for e in events(node0) if e["event"] == "boundary")
    assert boundary["step"] == 3 and boundary["pnodes"] == ["j1", "m0", "m1"], boundary  # the premise
    result, joined = one.result, joiner.result
    same_training(result.history, reference)
    assert [json.loads(line)["step"] for line in (node1 / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 9))
    (moved,) = [e for e in events(node1) if e["event"] == "succession"]
    assert moved["coordinator"] == 1 and moved["lost"] == 0 and moved["resume_step"] >= 3, moved
    # Machine 0's PNode is lost; j1 too for this attempt when its report reached machine 1 after the decision
    # (its worker still in attempt 1's rendezvous at the kill, or its launcher slower to find the successor:
    # about half the runs on this VM, 2026-12-07).  Either way j1 follows machine 1 and is placed again: the
    # last attempt's ranks below (docs/distributed.md, "Machine 0 is lost in an elastic run").
    assert moved["pnodes_lost"] in (["m0"], ["j1", "m0"]), moved
    mirrored = [json.loads(line)["step"] for line in (node1 / "launch" / "mirror" / "metrics.jsonl").read_text()
                .splitlines() if line.endswith("}")]  # the rows machine 1 held of machine 0's log
    assert moved["steps_redone"] == max(mirrored) - moved["resume_step"]
    assert result.steps_redone >= moved["steps_redone"]
    assert {"attempt": 1, "followed": True} in result.attempts, result.attempts  # it ran machine 0's job first
    last = result.attempts[-1]
    assert last["ok"] and last["ranks"][0] == "m1" and sorted(last["ranks"]) == ["j1", "m1"], result.attempts
    assert joined.attempts[0] == 1 and joined.attempts[-1] == last["attempt"], joined.attempts


def test_the_admission_record_round_trips_to_a_successor(files, tmp_path):
    """What machine 0 admitted, released and is releasing, read back by a successor's admission: the joined
    PNode's figures (not only its id), its machine number (the next joiner is numbered after it), the leaves."""
    zero = admission(files, tmp_path, max_machines=4)
    assert join(zero, pnode_text("j1", "200MiB"))["machine"] == 1
    assert join(zero, pnode_text("j2"))["machine"] == 2
    zero.released.add(2)
    zero.left.add("j2")
    zero.leaving[1] = 4  # j1 said it leaves; no boundary released it yet
    record = json.loads(json.dumps(zero.record()))  # what the mirror carries: JSON
    (tmp_path / "next").mkdir()
    successor = admission(files, tmp_path / "next", max_machines=4)
    successor.restore(record, lambda line: None)
    assert {m: (j.pnode.id, j.pnode.memory) for m, j in successor.joined.items()} == {
        1: ("j1", 200 * 2**20), 2: ("j2", 256 * 2**20)}
    assert successor.released == {1, 2} and successor.left == {"j2"} and successor.leaving == {1: 4}
    assert successor.departing() == {"j1", "j2"}  # neither is placed again
    assert successor.answer({"op": "job", "machine": 1, "attempt": 3})["released"] is True  # j1 exits 0
    assert join(successor, pnode_text("j3"))["machine"] == 3
    assert join(successor, pnode_text("j1"))["admitted"] is False  # its id is taken: the record said so


@pytest.mark.parametrize("record,says", [
    ({"joined": {"1": {"pnode": "pnodes: [[[", "step": 1}}}, "machine '1' is left out"),
    ({"joined": {"x": {"pnode": "", "step": 1}}}, "machine 'x' is left out"),
    ({"joined": {"0": {"pnode": None, "step": 1}}}, "machine '0' is left out"),
    ({"joined": {"2000000": {"pnode": "name: a\npnodes:\n" + PNODE.format(id="j9", memory="1GiB"), "step": 1}}},
     "machine '2000000' is left out"),  # past boundaries.MAX_MACHINE_NUMBER (numbers past MAX are a run's own)
    ({"joined": "everything", "left": [1, None], "released": ["a"], "leaving": {"..": "x"}}, None),
    ([], None),
    (None, None),
])
def test_a_damaged_admission_record_leaves_out_what_does_not_read(files, tmp_path, record, says):
    successor = admission(files, tmp_path, max_machines=3)
    said: list[str] = []
    successor.restore(record, said.append)
    assert successor.joined == {} and successor.released == set() and successor.left == set()
    assert successor.leaving == {}
    assert (says is None and not said) or (says is not None and any(says in s for s in said)), said


def test_a_follower_that_cannot_take_the_role_says_when_nobody_does():
    """follow_successor: a joined machine that holds no job yet (or of a run whose --on-failure moves no role)
    asks the machines that may take the role; when none serves, it stops with the reason instead of waiting on
    silence."""
    m = Machines()
    m.node_rank, m.coordinator, m.addrs, m.port, m.key = 3, 0, {0: "127.0.0.1", 3: "127.0.0.1"}, launch_port(), "k"
    with pytest.raises(MachineLost, match="no machine that may take its role .none: no other machine is in the run"):
        succession.follow_successor(m, [], {"lost": []}, 0.1)
    with pytest.raises(MachineLost, match=r"\(1, 2\) serves"):
        succession.follow_successor(m, [2, 1], {"lost": []}, 0.1)  # nobody listens on the port
    assert m.coordinator == 0  # it followed nobody


def test_a_join_that_arrives_while_the_successor_takes_over_waits_and_is_admitted(files, tmp_path, monkeypatch):
    """The successor serves the channel before it has decided; until its admission is open a join is told to
    wait (joins.serve_channel), and the joiner asks again instead of taking that for a refusal."""
    from types import SimpleNamespace

    from vgraph.backends.torch.distributed.launcher.boundaries import serve_channel

    port = launch_port()
    successor = Machines()
    successor.open("127.0.0.1", port - 1, TOKEN, 0, 2, 2.0, 5.0)
    run = SimpleNamespace(launch_dir=tmp_path / "launch", admission=None, elastic=True, machines=successor)
    serve_channel(run)
    admitting = admission(files, tmp_path, max_machines=3)
    served, answers = successor._board.extra, []

    def answer(request: dict) -> dict:  # the admission opens once a join has been told to wait
        reply = served(request)
        answers.append(reply)
        if "wait" in reply:
            run.admission = admitting
        return reply

    successor.serve_extra(answer)
    (tmp_path / "j1.yml").write_text(pnode_text("j1"))
    try:
        reply = elastic.join_run("127.0.0.1", port - 1, TOKEN, tmp_path / "j1.yml", 30, available=(None, ""))
    finally:
        successor.close()
    assert answers[0] == {"wait": "the coordinator is being taken over"}  # the premise: it was told to wait
    assert reply["admitted"] and reply["machine"] == 1 and len(answers) == 2
    assert [e["event"] for e in events(tmp_path)] == ["join"]  # one admission, nothing refused on the way


def test_a_join_told_to_wait_for_longer_than_its_timeout_says_why(files, tmp_path):
    from types import SimpleNamespace

    from vgraph.backends.torch.distributed.launcher.boundaries import serve_channel

    port = launch_port()
    successor = Machines()
    successor.open("127.0.0.1", port - 1, TOKEN, 0, 2, 2.0, 5.0)
    serve_channel(SimpleNamespace(launch_dir=tmp_path, admission=None, elastic=True, machines=successor))
    (tmp_path / "j1.yml").write_text(pnode_text("j1"))
    try:
        with pytest.raises(elastic.JoinRefused, match="within 1 s .the coordinator is being taken over"):
            elastic.join_run("127.0.0.1", port - 1, TOKEN, tmp_path / "j1.yml", 1, available=(None, ""))
    finally:
        successor.close()
