"""A machine that JOINED an elastic run takes the coordinator's role (issue 36 item 3, "No single holder", and the
Acceptance's first bullet): a run started with one machine (`--nnodes 1:4`) survives machine 0's loss once a
joined machine holds a replica of every VNode.  attempts.JoinedSuccession, inputs.launch_settings /
read_launch_settings / joined_config, succession.succeed_followed; docs/distributed.md, "Machine 0 is lost in an
elastic run".  Loopback launchers as machines, the tiny network of tests/test_elastic_launch.py."""
from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest

from ports import launch_port
from vgraph.backends.torch.distributed.launcher import elastic
from vgraph.backends.torch.distributed.launcher.attempts import JoinedSuccession, held
from vgraph.backends.torch.distributed.launcher.inputs import (LaunchConfig, SETTINGS_VERSION, is_elastic,
                                                               read_launch_settings, succeeds)
from vgraph.backends.torch.distributed.launcher.membership import Machines

from test_elastic_launch import (LR, PNODE, STEPS, TOKEN, Thread, common, events, files, reference,  # noqa: F401
                                 same_training, wait_for)
from test_succession import KILLED_RUN_COMM_TIMEOUT, in_session, machine_0, start_after_machine_0
from zygote import Child

# Machine 0 in a process of its own session (SIGKILLed with its workers); the test hook's holds as a list of
# (PNode, step, attempt) where one names its attempt (attempts.held).
COORDINATOR = """
import json, sys
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.launcher.supervisor import warm
settings = json.loads(sys.argv[1])
settings["hold"] = [tuple(h) for h in settings["hold"]]
warm(wait=True)
launch(LaunchConfig(**settings))
"""
JOINER = """
import sys
from vgraph.backends.torch.distributed.launcher.launch import main
sys.exit(main(sys.argv[1:]))
"""


def pnode_file(files: Path, pid: str) -> Path:
    path = files / f"{pid}.yml"
    path.write_text(f"name: {pid}\npnodes:\n" + PNODE.format(id=pid, memory="256MiB"))
    return path


def rows_of(path: Path) -> list[dict]:
    """The complete rows of a metrics.jsonl (a mirror's last line may be cut off mid-row)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def kill(process: Child) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()




# --comm-timeout: test_succession.KILLED_RUN_COMM_TIMEOUT, whose derivation holds here unchanged.  What a worker
# waits on a peer in this run's healthy stretches: the first rendezvous of attempts 1 and 2 (every machine's
# workers' forkserver has its imports before then: machine 0's COORDINATOR waits for its own before its channel
# opens, a joiner for its own before it asks to join, elastic.follow -> supervisor.warm), and j1's hold after
# step 5 (m0 and j2 wait on it until j2 mirrored row 5 and the step-4 checkpoint: one or two of
# mirror.MIRROR_EVERY_S = 1 s).  Machine 0's hold after step 2 has no peer waiting (it trains alone).  What
# the test then waits out is idle (the launchers poll; 2026-12-07, from the run's files): m0's loss to j1's
# succession 14 s (rejoin 12 + link 2), j1's loss to j2 taking the role 20 s, and the successor's attempt that
# places j1 once more (docs/distributed.md) failing at its rendezvous 24 s: wall, not CPU.
@pytest.mark.slow  # five launchers, a boundary, three machines lost, the rejoin timeout waited out twice
def test_a_run_started_with_one_machine_survives_joins_a_leave_kills_and_machine_0s_loss(
        files, reference, tmp_path, monkeypatch):
    """The Acceptance's sequence on loopback, with the successor's own loss: `--nnodes 1:5` on m0 alone (held
    after step 2).  j1 joins (the join pays: a boundary is asked for); j2, j3 and j4 join behind it (queued);
    j4 leaves gracefully (admitted, not yet placed: released at once, it ends as a released machine).  The
    boundary (step 3) places m0, j1, j2 and j3; j3 is SIGKILLed as it receives that job (machine 0 counts it
    gone and re-plans on m0, j1 and j2, a replica each, j1 held after step 5).  Machine 0 is SIGKILLed while j1
    and j2 each hold a replica of every VNode; j1, machine 1, first in line, is SIGKILLed as it begins its
    succession (building its run from the settings and the job); j2, machine 2, next in line (it mirrored the
    run's history as a started machine does; j1, j2 and j3 are the real `vgraph launch --join` command), is
    elected around it, takes the coordinator's role and finishes
    the run in its own run directory: every step logged once there, the rows up to the resumed step machine
    0's own (mirrored, not trained again), losses, final weights and optimizer state as `vgraph train` with
    the same global batch."""
    from weights_util import assert_same_weights

    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", TOKEN)
    port = launch_port()
    node0, dirs = tmp_path / "node0", {j: tmp_path / j for j in ("j1", "j2", "j3", "j4")}
    settings = dict(common(files), fleet=str(files / "one.yml"), nnodes=1, max_nnodes=5, master_port=port,
                    link_timeout=2.0, comm_timeout=KILLED_RUN_COMM_TIMEOUT, on_failure="restart", replicas="auto",
                    out=str(node0), hold=[["m0", 2], ["j1", 5, 2]])
    zero = machine_0(settings, tmp_path / "node0.log", COORDINATOR)  # a zygote child: torch imported once
    said = lambda pid: (tmp_path / f"{pid}.log").read_text(errors="replace")  # noqa: E731
    start_after_machine_0(zero, port, "machine 0's channel", tmp_path / "node0.log")
    lines: list[str] = []
    leaving = elastic.Leaving(lines.append)

    def command(pid: str) -> Child:  # `vgraph launch --join`, as a volunteer types it (a zygote child as m0)
        return in_session(JOINER, ["launch", "--join", f"127.0.0.1:{port}", "--pnode", str(pnode_file(files, pid)),
                                "--out", str(dirs[pid]), "--link-timeout", "2", "--comm-timeout",
                                str(KILLED_RUN_COMM_TIMEOUT)], tmp_path / f"{pid}.log")

    def joiner(pid: str, leave=None) -> Thread:
        return Thread(lambda: elastic.follow("127.0.0.1", port, pnode_file(files, pid), dirs[pid], join_timeout=60,
                                             link_timeout=2, comm_timeout=KILLED_RUN_COMM_TIMEOUT, emit=lines.append,
                                             leave=leave, successor=JoinedSuccession(lines.append)))
    one = two = three = None
    four = joiner("j4", leaving)
    try:
        alive = lambda: zero.poll() is None or pytest.fail(f"machine 0 ended: {said('node0')[-3000:]}")  # noqa: E731
        joined = lambda pid: any(e.get("pnode") == pid and e.get("outcome") == "admitted"  # noqa: E731
                                 for e in events(node0))
        wait_for(lambda: (node0 / "launch" / "held-m0").exists(), "m0 held after step 2", alive)
        one = command("j1")
        wait_for(lambda: any(e.get("chosen") == "new" for e in events(node0)), "j1's join decided", alive)
        two = command("j2")
        wait_for(lambda: joined("j2"), "j2 admitted", alive)
        three = command("j3")
        wait_for(lambda: joined("j3"), "j3 admitted", alive)
        four.start()
        wait_for(lambda: joined("j4"), "j4 admitted", alive)
        leaving.ask("SIGTERM")  # j4: admitted behind the boundary, never placed
        four.join(timeout=60)
        assert four.error is None and four.result.released and four.result.attempts == [], (four.error, lines[-20:])
        (node0 / "launch" / "release").write_text("go\n")
        wait_for(lambda: (dirs["j3"] / "launch" / "job-1.json").is_file(), "j3 to receive attempt 1's job", alive)
        boundary = next(e for e in events(node0) if e["event"] == "boundary")
        assert boundary["pnodes"] == ["j1", "j2", "j3", "m0"] and boundary["step"] == 3, boundary  # the premise
        os.killpg(three.pid, signal.SIGKILL)
        assert three.wait(timeout=30) == -signal.SIGKILL
        mirror = dirs["j2"] / "launch" / "mirror"
        wait_for(lambda: (dirs["j1"] / "launch" / "held-j1").exists()
                 and (mirror / "latest").is_file() and (mirror / "latest").read_text().strip() == "step-00000004"
                 and 5 in [r.get("step") for r in rows_of(mirror / "metrics.jsonl")],
                 "attempt 2 on m0, j1 and j2, j1 held after step 5, j2's mirror at the step-4 checkpoint and row 5",
                 alive)
        placed = json.loads((node0 / "placement.json").read_text())
        assert sorted(placed["replica_pnodes"]) == [["j1"], ["j2"], ["m0"]], placed  # the premise: whole replicas
        kill(zero)
        assert zero.returncode == -signal.SIGKILL
        wait_for(lambda: (dirs["j1"] / "launch" / "network.yml").is_file(), "j1 to begin its succession",
                 lambda: one.poll() is None or pytest.fail(f"j1 ended: {said('j1')[-3000:]}"))
        kill(one)  # first in line, lost during its own succession
        assert one.returncode == -signal.SIGKILL
        assert two.wait(timeout=240) == 0, said("j2")[-3000:]  # the real command, which took the role, exits 0
    finally:
        for process in (zero, one, two, three):
            if process is not None:
                kill(process)
        four.join(timeout=10)

    rows = events(node0)  # every event really happened, machine 0 said so
    assert [(e["pnode"], e["queued"]) for e in rows if e["event"] == "join"] == [
        ("j1", False), ("j2", True), ("j3", True), ("j4", True)]
    assert [(e["machine"], e["outcome"]) for e in rows if e["event"] == "leave"] == [(4, "released")]
    (lost,) = [e for e in rows if e["event"] == "rescue"]
    assert lost["lost"] == ["j3"] and lost["attempt"] == 1, lost
    assert "machine 1, joined) is in the line of succession" in said("j1")  # it had begun its succession

    run, out = dirs["j2"], said("j2")
    assert "admitted as machine 2 with PNode j2" in out and "launch: attempt 2: j2" in out, out[-3000:]
    assert f"{run}: step {STEPS}, loss" in out and "restart(s)" in out, out[-3000:]  # the run's result, printed there
    (moved,) = [e for e in events(run) if e["event"] == "succession"]
    assert moved["coordinator"] == 2 and moved["lost"] == 0 and moved["pnodes_lost"] == ["j1", "m0"], moved
    mirrored = [r["step"] for r in rows_of(mirror / "metrics.jsonl")]
    assert moved["resume_step"] >= 4 and moved["steps_redone"] == max(mirrored) - moved["resume_step"], moved
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))  # every step once, in the successor's run
    theirs = {r["step"]: r for r in rows_of(node0 / "metrics.jsonl")}
    assert all(r == theirs[r["step"]] for r in logged if r["step"] <= moved["resume_step"])  # not trained again
    same_training(logged, reference)
    # The successor's attempts: machine 0's PNode never again; j1, missing from the decision like a machine whose
    # report came late, may be placed once more (docs/distributed.md): that attempt fails at its rendezvous and
    # the next runs without it.
    placed = json.loads((run / "placement.json").read_text())
    assert placed["replica_pnodes"] == [["j2"]], placed
    assert all(set(json.loads(job.read_text())["ranks"]) <= {"j1", "j2"}
               for job in (run / "launch").glob("job-*.json") if int(job.stem[4:]) > 2)
    final = f"step-{STEPS:08d}"
    assert_same_weights(run / final, reference.run_dir / final, steps=STEPS, lr=LR)
    assert f"machine 2 is the coordinator now (machine 0 lost): the run goes on in {run}" in out, out[-3000:]


# -- the settings a joined machine takes the role with --------------------------------------------------

GOOD = {"version": SETTINGS_VERSION, "on_failure": "restart", "max_restarts": 3, "nnodes": 1, "max_nnodes": 4,
        "link_timeout": 2.0, "comm": "auto", "replan_overhead_s": 1.5}


def test_the_launch_settings_read_back():
    assert read_launch_settings(json.loads(json.dumps(GOOD))) == GOOD


@pytest.mark.parametrize("change,says", [
    ({"version": 2}, "version '2'"),
    ({"version": None}, "version"),
    ({"on_failure": "repair"}, "on_failure must be one of"),
    ({"comm": ["gloo"]}, "comm must be one of"),
    ({"nnodes": 0}, "nnodes must be at least 1"),
    ({"nnodes": True}, "nnodes must be an integer, got true/false"),
    ({"max_nnodes": 0}, "max_nnodes must be at least 1"),
    ({"max_nnodes": 10**400}, "max_nnodes must be at most"),
    ({"max_restarts": -1}, "max_restarts must be at least 0"),
    ({"max_restarts": "3"}, "max_restarts must be an integer"),
    ({"link_timeout": math.nan}, "link_timeout must be finite"),
    ({"link_timeout": math.inf}, "link_timeout must be finite"),
    ({"link_timeout": 0}, "link_timeout must be at least"),
    ({"replan_overhead_s": 1e9}, "replan_overhead_s must be at most"),
    ({"../x": 1}, "unknown field '../x'"),
    ({"on_failure\n": "x"}, "unknown field"),
])
def test_damaged_launch_settings_refuse_the_join_naming_the_field(change, says):
    with pytest.raises(elastic.JoinRefused, match="the coordinator's launch settings") as err:
        read_launch_settings({**GOOD, **change})
    assert says in str(err.value)


@pytest.mark.parametrize("record", [[], "settings", 0, {"version": 1}, {"version": 1, "on_failure": "restart"}])
def test_incomplete_launch_settings_refuse_the_join(record):
    with pytest.raises(elastic.JoinRefused, match="could not take the coordinator's role"):
        read_launch_settings(record)


@pytest.mark.parametrize("sent", [None, {}])
def test_a_coordinator_that_sends_no_settings_is_followed_never_succeeded(tmp_path, sent):
    """A coordinator of an earlier vgraph sends none: this machine joins, says it never takes the role, and
    its loss hook is the follower's whatever job it holds."""
    said: list[str] = []
    followed: list[tuple] = []
    chosen = JoinedSuccession(said.append)
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "job-0.json").write_text("{}")
    lost = chosen.bind(Machines(), {"machine": 1, **({"settings": sent} if sent is not None else {})}, tmp_path,
                       tmp_path, 2, None, lambda *a: followed.append(a) or {})
    assert any("never takes the role" in line for line in said) and chosen.mirror is None
    assert lost(RuntimeError("gone"), 0, None) == {} and chosen.run is None and len(followed) == 1


def test_a_joined_machine_with_damaged_settings_does_not_join(files, tmp_path):
    """`bind` at the admission: a damaged record stops the join before any file is fetched or mirror started."""
    chosen = JoinedSuccession(lambda line: None)
    m = Machines()
    with pytest.raises(elastic.JoinRefused, match="link_timeout must be finite"):
        chosen.bind(m, {"machine": 1, "settings": {**GOOD, "link_timeout": math.nan}}, tmp_path, tmp_path, 2,
                    None, lambda *a: {})
    assert chosen.mirror is None and not (tmp_path / "launch").exists()


def test_min_1_succeeds_only_with_shrink_or_restart():
    def config(**kw) -> LaunchConfig:
        return LaunchConfig(network="n.yml", fleet="f.yml", **kw)

    assert succeeds(config(nnodes=1, max_nnodes=4, on_failure="restart"))
    assert succeeds(config(nnodes=1, max_nnodes=4, on_failure="shrink"))
    assert not succeeds(config(nnodes=1, max_nnodes=4, on_failure="stop"))  # the role never moves
    assert not succeeds(config(nnodes=1, on_failure="restart")) and not is_elastic(config(nnodes=1))


def test_a_joined_machine_of_a_stop_run_only_follows(tmp_path):
    """--on-failure stop: a joined machine next in line never builds a Run nor takes the role; its loss hook
    is the follower's (which, nobody serving, ends the run with the reason)."""
    followed: list[tuple] = []
    chosen = JoinedSuccession(lambda line: None)
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "job-0.json").write_text("{}")  # a job it would otherwise build the Run from
    lost = chosen.bind(Machines(), {"machine": 1, "settings": {**GOOD, "on_failure": "stop"}}, tmp_path, tmp_path, 2,
                       None, lambda *a: followed.append(a) or {"followed": True})
    assert chosen.mirror is None  # no history to keep: nobody takes the role
    assert lost(RuntimeError("gone"), 0, None) == {"followed": True} and chosen.run is None and len(followed) == 1


def test_before_it_holds_a_job_a_joined_machine_only_follows(tmp_path):
    followed: list[tuple] = []
    chosen = JoinedSuccession(lambda line: None)
    lost = chosen.bind(Machines(), {"machine": 3, "settings": GOOD}, tmp_path, tmp_path, 2, None,
                       lambda *a: followed.append(a) or {})
    assert chosen.mirror is None  # machine 3 is not among the MIRRORS next in line
    assert lost(RuntimeError("gone"), -1, None) == {} and lost(RuntimeError("gone"), 4, None) == {}
    assert chosen.run is None and len(followed) == 2


def test_holds_name_their_attempt():
    assert held(("m0", 2), 0, True) == ("m0", 2) and held(("m0", 2), 1, False) is None
    specs = [("m0", 2), ("j1", 5, 2)]
    assert held(specs, 0, True) == ("m0", 2) and held(specs, 1, False) is None and held(specs, 2, False) == ("j1", 5)
    assert held(None, 0, True) is None


def test_a_joined_machine_builds_its_settings_from_the_record_and_the_job(files, tmp_path):
    """joined_config: the launch-only settings from the admission's record, the training options, network and
    fleet from the job (declared once: job.py), this machine's copies of them as files in its launch folder
    (the command that continues the run names files it has), its node rank its machine number."""
    from vgraph.backends.torch.distributed.job import Job
    from vgraph.backends.torch.distributed.launcher.inputs import _check, _continue_with, joined_config
    from vgraph.backends.torch.distributed.launcher.launch import launch as run_launch
    from vgraph.base.diagnostics import VGraphError

    run_launch(LaunchConfig(**common(files), fleet=str(files / "one.yml"), out=tmp_path / "run",
                            emit_job=tmp_path / "job", log=lambda line: None))
    job = Job.read(tmp_path / "job" / "job.json")
    mine = tmp_path / "joiner"
    cfg = joined_config({**GOOD, "on_failure": "shrink", "max_restarts": 5}, job, machine=3,
                        corpus=mine / "launch" / "corpus", run_dir=mine, master_addr="127.0.0.1", master_port=2950,
                        log=lambda line: None)
    assert (cfg.on_failure, cfg.max_restarts, cfg.nnodes, cfg.max_nnodes, cfg.link_timeout) == ("shrink", 5, 1, 4, 2.0)
    assert (cfg.steps, cfg.batch, cfg.lr, cfg.seed, cfg.micro_batches) == (STEPS, 8, LR, 7, 2)  # the job's
    assert cfg.node_rank == 3 and cfg.joined and cfg.replicas == "auto" and cfg.out == mine and not cfg.resume
    assert Path(cfg.network).read_text() == job.network_yaml and Path(cfg.fleet).read_text() == job.fleet_yaml
    assert cfg.data == str(mine / "launch" / "corpus")
    _check(cfg)  # a node rank past --nnodes MIN is a joined machine's own
    assert f"--fleet {mine / 'launch' / 'fleet.yml'} --out {mine}" in _continue_with(cfg, mine)
    cfg.joined = False
    with pytest.raises(VGraphError, match="--node-rank must be in 0..0"):
        _check(cfg)  # a started machine's is still held to MIN


def test_a_machine_that_vanished_is_never_placed_again_nor_by_a_successor(files, tmp_path):
    """Admission.vanished (a decision's `gone`): a joined machine SIGKILLed is left out of every later fleet, and
    the mirrored record says so, so a successor's admission leaves it out too (its missing workers would stall
    the rendezvous of every attempt it is placed in)."""
    from test_elastic_launch import admission, join, pnode_text

    zero = admission(files, tmp_path, max_machines=4)
    assert join(zero, pnode_text("j1"))["machine"] == 1 and join(zero, pnode_text("j2"))["machine"] == 2
    assert zero.grown_fleet(zero.fleet).ids == ["m0", "j1", "j2"]  # the premise
    zero.vanished(["j2"])
    assert zero.grown_fleet(zero.fleet).ids == ["m0", "j1"]
    (tmp_path / "next").mkdir()
    successor = admission(files, tmp_path / "next", max_machines=4)
    successor.restore(json.loads(json.dumps(zero.record())), lambda line: None)
    assert successor.grown_fleet(successor.fleet).ids == ["m0", "j1"]
    # A successor's fleet is its last job's, which still names j2 (placed there, the netlab run of 2026-12-07
    # waited out the 40 s rendezvous for the dead machine): left out all the same.
    from vgraph.cost.fleet import Fleet

    last_job = Fleet.of("last job", *zero.fleet.pnodes, *zero.pnodes)
    assert "j2" in last_job.ids and successor.grown_fleet(last_job).ids == ["m0", "j1"]


def test_a_joined_coordinators_own_pnode_is_not_a_followers(files, tmp_path):
    """Admission.home on a joined machine that took the role (`me`): its own PNode is not a follower's, so the
    plan keeping rank 0 there is not refused as "rank 0 on a joined machine" (emission.RankZeroJoined)."""
    from test_elastic_launch import admission, join, pnode_text

    adm = admission(files, tmp_path, max_machines=4)
    join(adm, pnode_text("j1"))
    join(adm, pnode_text("j2"))
    assert adm.home() == {"j1": 1, "j2": 2}
    adm.me = 1
    assert adm.home() == {"j2": 2} and [p.id for p in adm.pnodes] == ["j1", "j2"]  # still admitted, still placed
