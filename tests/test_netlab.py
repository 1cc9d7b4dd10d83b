"""The multi-host testbed (tools/netlab.py): hosts with their own addresses, a link rate that holds, a CPU
quota that holds, a cable that can be pulled, and nothing left on the machine afterwards, whether the owner
closes it, fails, is interrupted, terminated or killed.  Needs root (CI runs as root on this machine kind);
without root the one thing to check is the refusal, which `test_a_user_without_root_is_refused` does."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT
from tools import netlab
from tools.netlab import NetlabError, Testbed, leftovers, measure_cpu, measure_rate, quota_period_us, sweep

NETLAB = str(ROOT / "tools" / "netlab.py")
root_only = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                               reason="the testbed needs root (CI runs as root: there it never skips)")
pytestmark = root_only
MBIT = 1e6 / 8


def connects(tb: Testbed, src: int, dst: int, port: int = 7000, timeout: float = 2.0) -> bool:
    """Whether host `src` reaches a listener in host `dst` within `timeout` seconds."""
    listener = tb.popen(dst, [sys.executable, "-c", (
        "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('0.0.0.0',{port})); s.listen(1); print('ready', flush=True); c,_=s.accept(); c.sendall(b'hi')")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ready"
        probe = tb.run(src, [sys.executable, "-c", (
            "import socket,sys\ntry:\n"
            f" c=socket.create_connection(('{tb.hosts[dst].ip}',{port}), timeout={timeout}); print(c.recv(2).decode())\n"
            "except OSError as e: print('no', e)")], timeout=timeout + 20)
        return probe.stdout.startswith("hi")
    finally:
        listener.kill()
        listener.wait()


def test_hosts_have_their_own_addresses_and_reach_each_other() -> None:
    with Testbed(3) as tb:
        assert tb.ips == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        for h in tb.hosts:
            shown = tb.run(h.index, ["ip", "-4", "-o", "addr", "show"]).stdout
            assert f"{h.ip}/24" in shown and all(ip not in shown for ip in tb.ips if ip != h.ip)
            env = json.loads(tb.run(h.index, [sys.executable, "-c", "import json,os; print(json.dumps("
                                             "{k: v for k, v in os.environ.items() if k.startswith('NETLAB_')}))"]
                                    ).stdout)
            assert env == {"NETLAB_HOST": str(h.index), "NETLAB_IP": h.ip, "NETLAB_IPS": ",".join(tb.ips),
                           "NETLAB_CPU": ""}
        assert connects(tb, 0, 2) and connects(tb, 2, 1)
        tag = tb.tag
        assert len(leftovers(tag)) == 4 + 3  # 3 hosts + the switch namespace; 3 cgroups
    assert leftovers(tag) == []


def test_the_link_rate_holds_at_20_and_200_mbit() -> None:
    with Testbed(2, rate="20Mbit/s") as tb:
        assert "tbf" in tb.qdiscs(0) and "rate 20Mbit" in tb.qdiscs(0)
        slow = measure_rate(tb, 0, 1, seconds=1.5)
        tb.set_rate(1, 200 * MBIT)  # host 1 at 200 Mbit/s each way; host 0 still sends at 20
        assert "rate 200Mbit" in tb.qdiscs(1)
        into_slow = measure_rate(tb, 1, 0, seconds=1.5)
        tb.set_rate(0, "200Mbit/s")
        fast = measure_rate(tb, 0, 1, seconds=1.5)
        tb.set_rate(0, None)
        assert "tbf" not in tb.qdiscs(0)
    # Goodput over TCP/IP is 95-98% of the wire rate tbf counts (headers); the limit never leaks upward.
    assert 0.85 * 20 * MBIT < slow < 1.02 * 20 * MBIT, slow / MBIT
    assert 0.85 * 20 * MBIT < into_slow < 1.02 * 20 * MBIT, into_slow / MBIT  # the receiver's rate binds too
    assert 0.85 * 200 * MBIT < fast < 1.02 * 200 * MBIT, fast / MBIT


def test_a_quota_period_is_as_short_as_keeps_2_ms_of_quota() -> None:
    assert [quota_period_us(c) for c in (None, 0.1, 0.25, 0.5, 1.0, 2.0)] == [10_000, 10_000, 8_000, 4_000, 4_000,
                                                                             4_000]
    assert quota_period_us(0.1) * 0.1 >= 1_000  # the kernel's least quota


def test_the_cpu_quota_holds() -> None:
    with Testbed(2, cpu=[0.25, None]) as tb:
        group = tb.hosts[0].cgroup
        assert tb.controller.version in (1, 2)
        if tb.controller.version == 1:
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "2000"
            assert (group / "cpu.cfs_period_us").read_text().strip() == "8000"
            assert (tb.hosts[1].cgroup / "cpu.cfs_quota_us").read_text().strip() == "-1"
        got = measure_cpu(tb, 0, seconds=1.5, workers=2)  # two busy processes share a quarter of a core
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    assert got <= 0.25 * 1.15, got
    assert int(stat["nr_throttled"]) > 0  # the quota, not the machine's load, held them back


def test_a_cut_link_carries_nothing_until_it_is_restored() -> None:
    with Testbed(2) as tb:
        assert connects(tb, 0, 1)
        tb.cut(1)
        assert "NO-CARRIER" in tb.run(1, ["ip", "link", "show", "eth0"]).stdout
        assert not connects(tb, 0, 1, timeout=1.0)
        tb.restore(1)
        deadline = time.monotonic() + 10
        while not connects(tb, 0, 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert connects(tb, 0, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(hosts=0), "hosts must be an integer"), (dict(hosts=True), "hosts must be an integer"),
    (dict(hosts=2, rate="fast"), "rate:"), (dict(hosts=2, rate=float("nan")), "rate must be positive"),
    (dict(hosts=2, rate=-5), "rate must be positive"), (dict(hosts=2, rate=float("inf")), "rate must be positive"),
    (dict(hosts=2, rate="1e400Mbit/s"), "rate:"), (dict(hosts=2, rate=[1e6]), "1 values for 2 hosts"),
    (dict(hosts=2, cpu="lots"), "cpu must be a number"), (dict(hosts=2, cpu=-1), "cpu must be between"),
    (dict(hosts=2, cpu=float("nan")), "cpu must be between"), (dict(hosts=2, cpu=1e9), "cpu must be between"),
    (dict(hosts=3, cpu=netlab.usable_cores()), "CPU shares sum to"),
    (dict(hosts=2, subnet="8.8.8.0/24"), "must be private"), (dict(hosts=2, subnet="10.0.0.0/31"), "must be private"),
    (dict(hosts=2, subnet="10.0.0.1/24"), "subnet:"), (dict(hosts=2, subnet="../x"), "subnet:"),
])
def test_bad_settings_are_refused_before_anything_is_made(kwargs, message) -> None:
    mine = f"{netlab.TAG_PREFIX}-{os.getpid()}-"  # other test runs may make and remove testbeds meanwhile
    before = [x for x in leftovers() if mine in x]
    with pytest.raises(NetlabError, match=message):
        Testbed(**kwargs)
    assert [x for x in leftovers() if mine in x] == before


def test_misuse_of_a_testbed_is_an_error() -> None:
    with Testbed(1) as tb:
        for bad in (1, -1, "0", None):
            with pytest.raises(NetlabError, match="no host"):
                tb.command(bad, ["true"])
        with pytest.raises(NetlabError, match="empty command"):
            tb.popen(0, [])
    with pytest.raises(NetlabError, match="closed"):
        tb.popen(0, ["true"])


def test_a_failure_inside_the_testbed_tears_it_down_and_stops_its_processes() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(2) as tb:
            sleeper = tb.popen(1, ["sleep", "600"])
            tag = tb.tag
            raise RuntimeError("boom")
    assert sleeper.poll() == -signal.SIGKILL and leftovers(tag) == []


OWNER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as at a terminal (xdist workers ignore it)
sys.path.insert(0, {root!r})
from tools.netlab import Testbed
tb = Testbed(2, cpu=[0.2, 0.2], rate="100Mbit/s")
sleeper = tb.popen(1, ["sleep", "600"])
print(tb.tag, sleeper.pid, flush=True)
{body}
"""


@pytest.fixture()
def owner():
    """Starts a process that owns a testbed (2 hosts, a sleeper in host 1) and then runs `body`:
    (process, its testbed's tag, the sleeper's pid).  Whatever the test does, the owner is gone after it."""
    started: list[subprocess.Popen] = []

    def start(body: str = "time.sleep(600)") -> tuple[subprocess.Popen, str, int]:
        proc = subprocess.Popen([sys.executable, "-c", OWNER.format(root=str(ROOT), body=body)],
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        tag, pid = proc.stdout.readline().split()
        return proc, tag, int(pid)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
    sweep()


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_an_owner_stopped_by_sigterm_or_ctrl_c_tears_down(how, owner) -> None:
    proc, tag, sleeper = owner()
    assert len(leftovers(tag)) == 5
    proc.send_signal(how)
    assert proc.wait(timeout=30) != 0
    assert leftovers(tag) == [] and gone(sleeper)


def test_an_owner_exiting_without_close_tears_down_at_exit(owner) -> None:
    proc, tag, sleeper = owner(body="sys.exit(0)")
    assert proc.wait(timeout=30) == 0
    assert leftovers(tag) == [] and gone(sleeper)


def test_the_sweeper_removes_what_a_killed_owner_left_and_spares_live_ones(owner) -> None:
    with Testbed(1) as mine:
        proc, tag, sleeper = owner()
        proc.kill()
        proc.wait()
        assert len(leftovers(tag)) == 5 and not gone(sleeper)  # SIGKILL: nobody cleaned up
        assert tag in sweep()
        assert leftovers(tag) == [] and gone(sleeper)
        assert len(leftovers(mine.tag)) == 3  # a live owner's testbed is not touched
    assert leftovers(mine.tag) == []


def test_killing_a_host_takes_everything_it_runs_and_only_that() -> None:
    """Testbed.kill: a machine that dies, whatever its processes' sessions (a launcher in a session of its own
    and the processes it started); the other host's process lives on, and the host can run commands again."""
    script = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)'], " \
             "start_new_session=True); time.sleep(60)"
    with Testbed(2) as tb:
        dies = tb.popen(0, [sys.executable, "-c", script], start_new_session=True)
        lives = tb.popen(1, [sys.executable, "-c", script])
        procs = tb.hosts[0].cgroup / "cgroup.procs"
        deadline = time.monotonic() + 30
        while len(procs.read_text().split()) < 2:  # the python (sh and ip exec into it), its child elsewhere
            assert time.monotonic() < deadline, procs.read_text()
            time.sleep(0.05)
        tb.kill(0)
        assert dies.wait(timeout=30) == -signal.SIGKILL and procs.read_text().split() == []
        assert lives.poll() is None
        assert tb.run(0, ["true"]).returncode == 0
        lives.kill()
        lives.wait(timeout=30)


def test_the_command_line_measures_and_runs_in_every_host() -> None:
    out = subprocess.run([sys.executable, NETLAB, "run", "--hosts", "2", "--cpu", "0.5", "--", "sh", "-c",
                          'echo "$NETLAB_HOST $NETLAB_IP $NETLAB_CPU"'], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and sorted(out.stdout.split("\n")[:2]) == ["0 10.213.0.1 0.5", "1 10.213.0.2 0.5"]
    check = subprocess.run([sys.executable, NETLAB, "check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout.startswith("ok: root") and "cgroup v" in check.stdout
    bad = subprocess.run([sys.executable, NETLAB, "run", "--hosts", "2", "--rate", "nope", "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "netlab: rate:" in bad.stderr and "Traceback" not in bad.stderr


def test_a_user_without_root_is_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetlabError, match="needs root"):
        netlab.check_available()
    with pytest.raises(NetlabError, match="needs root"):
        Testbed(2)
    monkeypatch.undo()
    # For real, as user nobody: the system's python3 (the venv's may sit under root's home) on a copy of
    # netlab.py that nobody can read.
    python = next((p for p in ("/usr/bin/python3", "/bin/python3") if os.access(p, os.X_OK)), None)
    if os.geteuid() != 0 or python is None:
        return
    where = Path(tempfile.mkdtemp(prefix="netlab-nobody-"))
    try:
        where.chmod(0o755)
        shutil.copy(NETLAB, where / "netlab.py")
        (where / "netlab.py").chmod(0o644)
        out = subprocess.run([python, str(where / "netlab.py"), "check"], capture_output=True, text=True,
                             timeout=60, preexec_fn=lambda: os.setuid(65534), cwd="/")
    finally:
        shutil.rmtree(where)
    assert out.returncode == 2 and "needs root" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_rates_read_like_a_fleet_bandwidth() -> None:
    assert netlab.rate_bytes("20Mbit/s") == 2.5e6 and netlab.rate_bytes("1Gbps") == 1.25e8
    assert netlab.rate_bytes(1e6) == 1e6 and netlab.rate_bytes(None) is None
    burst_20 = netlab._tbf(2.5e6)
    assert burst_20[:3] == ["tbf", "rate", "20000000bit"] and int(burst_20[4]) == 16 * 1024
    assert int(netlab._tbf(1.25e8)[4]) == 250_000  # 2 ms at 1 Gbit/s
    assert not math.isnan(netlab.rate_bytes("0.5Mbit/s"))
