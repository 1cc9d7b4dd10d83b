"""The launchers' channel of a multi-machine `vgraph launch` (backends/torch/distributed/launcher/membership.py), over
loopback: machine 0 notices a machine whose beats stop, a machine notices that machine 0 stopped an attempt,
all machines take machine 0's one decision after a failure, a request without the run's secret gets no
answer, and a machine that cannot reach machine 0 gives up within its bound.  The same channel across real
namespace hosts with a cut link: tests/test_launch_testbed.py."""
from __future__ import annotations

import errno
import json
import socket
import threading
import time

import pytest

from ports import launch_port
from vgraph.backends.torch.distributed.launcher.membership import MachineLost, Machines, decide
from vgraph.backends.torch.distributed.rendezvous import RendezvousError, interface_towards

TOKEN = "membership-test-secret"
HOME = {"w0": 0, "w1": 1, "w2": 1, "w3": 2}


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture()
def pair():
    """Machine 0 and machine 1 of a 2-machine run on loopback (link timeout 0.6 s, rejoin timeout 3 s)."""
    port = launch_port()
    m0, m1 = Machines(), Machines()
    m0.open("127.0.0.1", port, TOKEN, 0, 2, link_timeout=0.6, rejoin_timeout=3.0)
    m1.open("127.0.0.1", port, TOKEN, 1, 2, link_timeout=0.6, rejoin_timeout=3.0)
    for m in (m0, m1):
        m.begin(0, {0, 1})
    yield m0, m1, port
    m1.close()
    m0.close()


def test_machine_0_notices_a_machine_whose_beats_stop(pair) -> None:
    m0, m1, _ = pair
    wait_for(lambda: 1 in m0._board.beats, "a first beat")
    assert m0.trouble() is None and m1.trouble() is None
    m1.close()  # no more beats: its machine (or its link) is gone
    wait_for(lambda: m0.trouble() is not None, "machine 0 to notice")
    assert m0.silent() == [1] and "machine(s) 1 silent for 0.6 s" in m0.trouble()


def test_every_machine_takes_machine_0s_decision(pair) -> None:
    m0, m1, _ = pair
    got: dict = {}
    other = threading.Thread(target=lambda: got.update(plan=m1.settle(
        {"lost": ["w1"], "described": "w1 (rank 1, exit -9)", "error": ""}, lambda r, m: {"never": "called"},
        wait_for_all=True)))
    other.start()
    wait_for(lambda: m0.trouble() is not None, "machine 1's report")
    assert "machine(s) 1 reported a failure" in m0.trouble()
    seen = {}

    def decide_here(reports, missing):
        seen.update(reports=reports, missing=missing)
        return decide(reports, missing, {"w0": 0, "w1": 1}, "shrink")

    plan = m0.settle({"lost": [], "described": "", "error": ""}, decide_here, wait_for_all=True)
    other.join(timeout=30)
    assert seen["missing"] == [] and sorted(seen["reports"]) == [0, 1]
    assert plan == got["plan"] == {"lost": ["w1"], "described": "w1 (rank 1, exit -9)", "error": ""}
    wait_for(lambda: m1.trouble() is not None, "machine 1 to hear that attempt 0 was stopped")
    assert m1.trouble() == "machine 0 stopped attempt 0"
    m0.begin(1, {0, 1})
    m1.begin(1, {0, 1})
    assert m0.trouble() is None and m1.trouble() is None  # the next attempt starts clean


def test_shrink_does_not_wait_for_a_silent_machine(pair) -> None:
    m0, m1, _ = pair
    wait_for(lambda: 1 in m0._board.beats, "a first beat")
    m1.close()
    wait_for(lambda: m0.silent() == [1], "silence")
    plan = m0.settle({"lost": [], "described": "", "error": ""},
                     lambda r, m: decide(r, m, {"w0": 0, "w1": 1}, "shrink"), wait_for_all=False)
    assert plan == {"lost": ["w1"], "described": "w1 (machine 1, unreachable)", "error": "", "gone": ["w1"]}


def test_restart_waits_one_link_timeout_more_for_a_silent_machine_then_goes_on_without_it(pair) -> None:
    """--on-failure restart: a vanished machine no longer holds the run for --comm-timeout (rejoin, 3 s here)
    and ends it; after twice the link timeout of silence (1.2 s) it is gone and the run is re-planned without
    it.  The premise: machine 0 saw it beat, and the rejoin timeout is longer than what the decision took."""
    m0, m1, _ = pair
    wait_for(lambda: 1 in m0._board.beats, "a first beat")
    m1.close()
    wait_for(lambda: m0.silent() == [1], "silence")
    began = time.monotonic()
    plan = m0.settle({"lost": [], "described": "", "error": ""},
                     lambda r, m: decide(r, m, {"w0": 0, "w1": 1}, "restart"), wait_for_all=True)
    took = time.monotonic() - began
    assert plan["gone"] == ["w1"] and plan["error"] == ""
    assert took < m0.rejoin_timeout, took  # not the old wait for every machine up to the rejoin timeout
    assert m0.silent(2 * m0.link_timeout) == [1]  # gone only once silent for twice the link timeout


def test_a_machine_that_cannot_reach_machine_0_gives_up(pair) -> None:
    m0, m1, _ = pair
    m0.close()
    wait_for(lambda: m1.trouble() is not None, "machine 1 to notice")
    assert "no answer from machine 0 for 0.6 s" in m1.trouble()
    m1.rejoin_timeout = 0.5
    with pytest.raises(MachineLost, match="lost contact with machine 0"):
        m1.settle({"lost": [], "described": "", "error": ""}, decide, wait_for_all=True)
    late = Machines()
    with pytest.raises(MachineLost, match="same VGRAPH_LAUNCH_TOKEN"):
        late.open("127.0.0.1", launch_port(), TOKEN, 1, 2, link_timeout=1.0, rejoin_timeout=0.5)


def test_requests_without_the_secret_or_malformed_get_no_answer(pair) -> None:
    m0, _, port = pair
    for payload in (b"not json\n", b"[1, 2]\n", json.dumps({"op": "beat", "machine": 5}).encode() + b"\n",
                    json.dumps({"key": "wrong", "op": "plan", "attempt": 1}).encode() + b"\n",
                    b"x" * (2 << 20) + b"\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            try:
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)
                assert conn.makefile("rb").readline() == b""
            except OSError as exc:  # the server closed on an over-long line before reading it all: the send
                # is reset or its pipe broken, or (when the close won the race) the shutdown finds no connection
                assert len(payload) > 1 << 20 and exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN), exc
    assert 5 not in m0._board.beats
    intruder = Machines()
    with pytest.raises(MachineLost, match="same VGRAPH_LAUNCH_TOKEN"):
        intruder.open("127.0.0.1", port, "another-runs-secret", 1, 2, link_timeout=1.0, rejoin_timeout=0.5)
    with pytest.raises(RendezvousError, match="--master-port - 1"):
        Machines().open("127.0.0.1", 0, TOKEN, 0, 2, link_timeout=1.0, rejoin_timeout=1.0)
    with pytest.raises(RendezvousError, match="cannot listen"):
        Machines().open("127.0.0.1", port, TOKEN, 0, 2, link_timeout=1.0, rejoin_timeout=1.0)  # in use


def test_decisions() -> None:
    ok = {"lost": [], "described": "", "error": ""}
    # A user-facing error anywhere stops everybody with it.
    assert decide({0: ok, 1: {**ok, "error": "diverged"}, 2: {**ok, "error": "later"}}, [], HOME, "shrink")["error"] \
        == "diverged"
    # Machines that did not report lose all their PNodes, and only those count.
    plan = decide({0: {**ok, "lost": ["w0"]}}, [1], HOME, "shrink")
    assert plan["lost"] == ["w1", "w2"] and plan["error"] == "" and "w1 (machine 1, unreachable)" in plan["described"]
    # With restart too: the machines that vanished are gone, and the run is re-planned around them (a machine
    # that merely reported is not: its workers restart where they were).
    plan = decide({0: ok}, [1, 2], HOME, "restart")
    assert plan["error"] == "" and plan["gone"] == plan["lost"] == ["w1", "w2", "w3"], plan
    assert decide({0: ok, 1: {**ok, "lost": ["w1"]}}, [], HOME, "restart").get("gone") is None
    # Everybody reported: the PNodes whose workers died, wherever.
    plan = decide({0: {**ok, "lost": ["w0"], "described": "w0 (rank 0, exit -9)"},
                   2: {**ok, "lost": ["w3"], "described": "w3 (rank 3, exit -9)"}}, [], HOME, "shrink")
    assert plan == {"lost": ["w0", "w3"], "described": "w0 (rank 0, exit -9); w3 (rank 3, exit -9)", "error": ""}


def test_gloo_is_pointed_at_the_interface_towards_the_master_only_off_loopback() -> None:
    assert interface_towards("127.0.0.1") is None and interface_towards("::1") is None
    assert interface_towards("not an address") is None


def test_a_join_before_machine_0_answers_joins_is_told_to_wait_not_refused(pair, tmp_path) -> None:
    """A volunteer that arrives while machine 0 still prepares the run (its channel open, the run not placed):
    "wait", and `join_run` asks again until machine 0's answer to joins is installed (the netlab run of
    2026-12-07 refused both joiners started beside machine 0 with "unknown request 'join'")."""
    from vgraph.backends.torch.distributed.launcher import elastic

    m0, _, port = pair
    pnode = tmp_path / "j.yml"
    pnode.write_text("name: j\npnodes:\n  - {id: j, memory: 256MiB, flops: 2M, bandwidth: 1GB/s, accelerator: cpu}\n")
    asked: list[dict] = []

    def admit(request: dict) -> dict:
        asked.append(request)
        return {"admitted": True, "machine": 2}

    assert m0._board.answer({"op": "nonsense"}) == {"error": "unknown request 'nonsense'"}  # only joins wait
    timer = threading.Timer(1.2, lambda: m0.serve_extra(admit))  # machine 0 placed its first plan
    timer.start()
    try:
        reply = elastic.join_run("127.0.0.1", port, TOKEN, pnode, timeout=20)
    finally:
        timer.cancel()
    assert reply["admitted"] and reply["machine"] == 2 and [r["op"] for r in asked] == ["join"]
