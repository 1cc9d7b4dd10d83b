"""Issue 36's acceptance sequence on the netlab testbed (tools/netlab.py): four hosts, each a network namespace
with its own address, one `vgraph launch` per host and nothing shared but the secret.  The run starts on
machine 0 alone (`--nnodes 1:4`); hosts 1, 2 and 3 join with `launch --join` and their PNode files alone; the
second to join leaves gracefully (SIGTERM), the third is SIGKILLed with everything in its cgroup, then machine 0
is SIGKILLed while the first, machine 1, holds a whole replica: it takes the coordinator's role and the run
completes there, every step logged once, losses and final weights as `vgraph train` with the same global batch.

The same sequence over loopback launchers is tests/test_joined_succession.py (with the successor's own loss);
this one is the machines' own addresses and interfaces (the workers' rendezvous, the launchers' channel, the
joiners' downloads and the mirror across veth links).  Machine 0 trains alone and is held after step 2
(LaunchConfig.hold: no peer waits on it) while the joiners start (torch's import, ~5 CPU-s each) and are
admitted; the run's 24 steps are plenty for the events that follow, each fired once the plan before it
trains."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from test_elastic_launch import PNODE, TOKEN, events, tiny
from test_joined_succession import rows_of as rows_in
from test_succession import KILLED_RUN_COMM_TIMEOUT
from tools.netlab import Testbed
from weights_util import assert_same_weights
import vgraph
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.checkpoint import latest_checkpoint
from vgraph.run.files import RELEASE_FILE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                 reason="the testbed needs root (CI runs as root: there it never skips)")]

VGRAPH = str(Path(sys.executable).with_name("vgraph"))
STEPS, BATCH, MICRO, LR, SEED = 24, 8, 2, 1e-3, 5
PORT = 29500
# --comm-timeout, as tests/test_succession.py derives it: a worker's wait on a peer in a healthy run (no one waits
# on machine 0's held worker: it trains alone then), and the rejoin window the survivors wait out after
# machine 0's kill (+ --link-timeout).
COMM_TIMEOUT = KILLED_RUN_COMM_TIMEOUT
# A started machine's launcher as `vgraph launch` runs it, with the test's hold (machine 0 after step 2) and its
# forkserver warmed first (as a joiner waits for its own: supervisor.warm).
STARTED = """
import json, sys
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.launcher.supervisor import warm
settings = json.loads(sys.argv[1])
settings["hold"] = tuple(settings["hold"]) if settings.get("hold") else None
warm(wait=True)
launch(LaunchConfig(**settings))
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic-testbed")
    vgraph.save(tiny(), d / "net.yml")
    # Slow PNodes (2 MFLOP/s, as test_elastic_launch): a predicted step of seconds, so every join pays for its
    # boundary and the planner takes one replica per host.
    for i in range(4):
        (d / f"h{i}.yml").write_text(f"name: h{i}\npnodes:\n" + PNODE.format(id=f"h{i}", memory="256MiB"))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return d


def settings(files: Path) -> dict:
    """Checkpoints every 2 steps: machine 0's hold (after step 2) makes that step a sync point, and only machine
    0's job says so; at a step the other machines do not sync at, its gather would wait on them forever."""
    return dict(network=str(files / "net.yml"), data=str(files / "corpus.txt"), steps=STEPS, batch=BATCH, lr=LR,
                seed=SEED, val_every=20, checkpoint_every=2, threads=1, progress=False)


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    return train(TrainConfig(**settings(files), out=tmp_path_factory.mktemp("ref") / "run"))


def rows_of(run: Path) -> list[dict]:
    return rows_in(run / "metrics.jsonl")


def admitted(run: Path) -> set[str]:
    return {e["pnode"] for e in events(run) if e["event"] == "join" and e.get("outcome") == "admitted"}


def training(run: Path) -> set[str]:
    """The PNodes of the newest row: the plan that trains now."""
    rows = rows_of(run)
    return set(rows[-1].get("pnodes") or {}) if rows else set()


class Hosts:
    """The testbed's four hosts and what runs on each: its launcher's process group, its log."""

    def __init__(self, tb: Testbed, files: Path, work: Path) -> None:
        self.tb, self.files, self.work, self.procs = tb, files, work, {}
        self.env = dict(os.environ, VGRAPH_LAUNCH_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher finds the interface towards machine 0 itself

    def _start(self, i: int, argv: list[str]) -> None:
        with (self.work / f"host{i}.log").open("w") as log:
            self.procs[i] = self.tb.popen(i, argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=str(ROOT), start_new_session=True)

    def machine_0(self, **extra) -> None:
        s = dict(settings(self.files), fleet=str(self.files / "h0.yml"), micro_batches=MICRO, nnodes=1,
                 max_nnodes=4, master_addr=self.tb.ips[0], master_port=PORT, link_timeout=2.0,
                 comm_timeout=COMM_TIMEOUT, on_failure="shrink", replicas="auto", out=str(self.work / "node0"),
                 **extra)
        self._start(0, [sys.executable, "-c", STARTED, json.dumps(s)])

    def joiner(self, i: int) -> None:
        self._start(i, [VGRAPH, "launch", "--join", f"{self.tb.ips[0]}:{PORT}", "--pnode",
                        str(self.files / f"h{i}.yml"), "--out", str(self.work / f"node{i}"), "--link-timeout", "2",
                        "--comm-timeout", str(COMM_TIMEOUT)])

    def kill(self, i: int) -> None:
        """Host i dies: everything in its cgroup (its launcher, forkserver and workers)."""
        self.tb.kill(i)
        self.procs[i].wait(timeout=30)

    def log(self, i: int) -> str:
        return (self.work / f"host{i}.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def wait_for(condition, what: str, hosts: Hosts, watched: tuple[int, ...], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for i in watched:
            if hosts.procs[i].poll() is not None:
                pytest.fail(f"waiting for {what}: host {i}'s launcher exited {hosts.procs[i].returncode}:\n"
                            f"{hosts.log(i)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{hosts.log(0)}"
        time.sleep(0.05)


def test_one_machine_then_joins_a_leave_and_two_kills_machine_0_included_over_namespace_hosts(
        files, reference, tmp_path):
    node0 = tmp_path / "node0"
    with Testbed(4) as tb:
        hosts = Hosts(tb, files, tmp_path)
        try:
            hosts.machine_0(hold=["h0", 2])
            wait_for(lambda: (node0 / "launch" / "held-h0").exists(), "machine 0 held after step 2", hosts, (0,))
            for i in (1, 2, 3):
                hosts.joiner(i)
            wait_for(lambda: admitted(node0) == {"h1", "h2", "h3"}, "the three joiners admitted", hosts, (0, 1, 2, 3))
            # Their machine numbers come in the order their joins arrived: the first (machine 1, next in line)
            # is the one that stays and takes the role, the second leaves, the third is SIGKILLed.
            number = {int(e["pnode"][1:]): e["machine"] for e in events(node0) if e["event"] == "join"}
            stays, leaves, dies = sorted(number, key=number.get)
            assert [number[h] for h in (stays, leaves, dies)] == [1, 2, 3], number  # the premise
            successor = tmp_path / f"node{stays}"
            (node0 / "launch" / RELEASE_FILE).write_text("go\n")
            wait_for(lambda: training(node0) == {"h0", "h1", "h2", "h3"}, "the plan on all four hosts to train",
                     hosts, (0, 1, 2, 3))
            hosts.procs[leaves].send_signal(signal.SIGTERM)  # a graceful leave
            assert hosts.procs[leaves].wait(timeout=120) == 0, hosts.log(leaves)
            wait_for(lambda: training(node0) == {"h0", f"h{stays}", f"h{dies}"}, "the plan without the leaver to "
                     "train", hosts, (0, stays, dies))
            hosts.kill(dies)
            wait_for(lambda: training(node0) == {"h0", f"h{stays}"}, "the plan without the killed host to train",
                     hosts, (0, stays))
            placed = json.loads((node0 / "placement.json").read_text())
            # The premise of machine 0's loss: the joined machine 1 holds a whole replica, every VNode.
            assert sorted(placed["replica_pnodes"]) == sorted([["h0"], [f"h{stays}"]]), placed["replica_pnodes"]
            step_at_kill = rows_of(node0)[-1]["step"]
            assert step_at_kill < STEPS - 2, "the run trained past the kill's moment: nothing would be tested"
            hosts.kill(0)
            assert hosts.procs[stays].wait(timeout=240) == 0, hosts.log(stays)  # it took the role and finished
        finally:
            hosts.close()
    rows = rows_of(successor)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once, in the successor's log
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in reference.history], dtype=torch.float64),
                               rtol=1e-5, atol=0)  # the suite's bound for replicas (test_distributed_replicas.py)
    assert_same_weights(latest_checkpoint(successor), latest_checkpoint(reference.run_dir), steps=STEPS, lr=LR)
    leaving = [e for e in events(node0) if e["event"] == "leave"]
    assert [e["pnodes"] for e in leaving] == [[f"h{leaves}"]], leaving  # the premise: that one left
    after = events(successor)
    (moved,) = [e for e in after if e["event"] == "succession"]
    assert moved["coordinator"] == 1 and moved["lost"] == 0 and moved["resume_step"] >= step_at_kill - 4, moved
    theirs = {r["step"]: r for r in rows_of(node0)}
    assert all(r == theirs[r["step"]] for r in rows if r["step"] <= moved["resume_step"])  # mirrored, not retrained
    # The successor placed no machine that was gone before machine 0 (one vanished, one released): no attempt
    # of its own failed (each waited out the rendezvous for the dead host and was rescued around it, until
    # 2026-12-07).
    assert not [e for e in after if e["event"] == "rescue" and e["time"] > moved["time"]], after
