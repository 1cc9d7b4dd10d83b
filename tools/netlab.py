"""A multi-host testbed on one Linux machine: hosts as network namespaces, each with its own address, link
rate and CPU share, for measuring what vgraph predicts and testing `vgraph launch --nnodes N` for real.

    from tools.netlab import Testbed
    with Testbed(2, rate="20Mbit/s", cpu=0.5) as tb:       # two hosts, 10.213.0.1 and 10.213.0.2
        tb.run(0, ["python", "-c", "print('hello from host 0')"])   # in host 0's namespace and CPU quota
        proc = tb.popen(1, [...])                          # a subprocess.Popen inside host 1
        tb.cut(1); tb.restore(1)                           # pull host 1's cable; plug it back

    python tools/netlab.py check                           # can this machine hold a testbed? (else: why not)
    python tools/netlab.py measure --hosts 2 --rate 20Mbit/s --cpu 0.5   # the rate and the quota, measured
    python tools/netlab.py run --hosts 2 --rate 1Gbit/s --cpu 1 -- CMD   # CMD in every host at once
    python tools/netlab.py sweep                           # remove what testbeds of dead processes left

Why namespaces: a multi-host claim (a pipeline over hosts on a 20 Mbit/s link, a replica lost with its
link) needs several hosts with their own addresses, links of a known rate and a known share of the CPU.
Network namespaces give each host its own interfaces, addresses, routes and ports on one machine; `tc`
gives each link its rate; a cgroup CPU quota gives each host its share of the cores.

Layout (all of it inside namespaces, so nothing is added to the machine's own network and testbeds running
at once never collide, even on the same subnet):

* a switch namespace `<tag>-sw` holds the bridge `br0` and one port `p<i>` per host;
* host i's namespace `<tag>-h<i>` holds `lo` and `eth0`, the veth peer of `p<i>`, with address
  `<subnet>.<i+1>` (default subnet 10.213.0.0/24); `cut(i)` sets `p<i>` down (the cable pulled: host i
  sees no carrier, the others silence), `restore(i)` sets it up again;
* link rate: a `tbf` qdisc on `eth0` (what host i sends) and on `p<i>` (what it receives), so a host's
  rate holds in each direction, like a fleet PNode's `bandwidth`; a transfer from p to q runs at the lower
  of p's and q's rates.  **No latency or loss emulation**: this kernel has no `netem` qdisc (`tc qdisc
  add ... netem` answers "Specified qdisc kind is unknown"), so links have the veth's microseconds of
  latency; a fleet's region latencies cannot be reproduced here;
* CPU share: every host gets a cgroup in the CPU controller, `cpu.cfs_quota_us` = share x
  `cpu.cfs_period_us` (4 to 10 ms, `quota_period_us`) under cgroup v1 (this machine kind: the v1 `cpu` hierarchy at
  /sys/fs/cgroup/cpu, the unified v2 hierarchy holding only hugetlb), or `cpu.max` under cgroup v2 when
  the CPU controller is there instead.  Shares may sum to at most the cores this process may use
  (`sched_getaffinity`).  A host without a share still gets a cgroup (no quota): it is how the testbed finds
  every process it started, to stop them.

Commands run in a host through `sh -c 'echo $$ > <cgroup>/cgroup.procs; exec ip netns exec <ns> CMD'`:
the process enters the cgroup before it becomes CMD, so CMD and everything it starts are in it.  `ip
netns exec` remounts /sys for the namespace, so a command inside a host sees its own /sys/class/net and no
/sys/fs/cgroup; `NETLAB_HOST`, `NETLAB_IP`, `NETLAB_IPS` (comma-separated, host order) and `NETLAB_CPU`
(the share, empty without one) tell it where it is.

Names and clean-up: every name starts with the owner's tag `vgnl-<pid>-<start time>-<n>` (the start
time, from /proc/<pid>/stat, tells a live owner from a reused pid; n counts the testbeds of one process).
`close()` (also on leaving the `with`, on Ctrl-C, on SIGTERM when the testbed was made in the main thread,
at interpreter exit, and when setting up fails half way) kills every process in the hosts' cgroups and
namespaces, deletes the namespaces (their veths, bridge and qdiscs go with them) and removes the cgroups.
After a SIGKILL of the owner nothing runs `close()`: `sweep()`, which every new Testbed calls first and
`python tools/netlab.py sweep` runs, removes whatever carries the tag of a process that is gone.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for namespaces, qdiscs and cgroups), `ip` and `tc`
(iproute2); otherwise `NetlabError` says what is missing.
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

TAG_PREFIX = "vgnl"
DEFAULT_SUBNET = "10.213.0.0/24"
IFACE = "eth0"  # every host's interface, inside its namespace
PERIOD_US = 10_000  # the longest CFS period of a quota: with the kernel's default 100 ms a 0.5-core host ran
# 50 ms flat out, then stopped for 50 ms, and the step that met the stop took 50 ms longer than the one before
MIN_PERIOD_US = 4_000  # the shortest: see quota_period_us
QUOTA_US = 2_000  # the quota a period gives, where the period allows (see quota_period_us)
_TAG = re.compile(rf"^{TAG_PREFIX}-(\d+)-(\d+)-(\d+)(?:-|$)")
_COUNTER = itertools.count()
_SELF = Path(__file__).resolve()


class NetlabError(RuntimeError):
    """The testbed cannot be set up here (not root, no namespaces, no CPU controller) or was misused."""


# -- what this machine offers ---------------------------------------------------------------------------

def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None when no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


@dataclass(frozen=True)
class CpuController:
    """Where CPU quotas are written: cgroup v1's `cpu` hierarchy or a v2 hierarchy with `cpu` enabled."""

    root: Path
    version: int

    def set_quota(self, group: Path, cores: float | None) -> None:
        period = quota_period_us(cores)
        quota = -1 if cores is None else int(round(cores * period))
        if self.version == 1:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {period}")


def quota_period_us(cores: float | None) -> int:
    """The CFS period of a host's quota: as short as keeps the quota at QUOTA_US, within MIN_PERIOD_US and
    PERIOD_US (0.5 core: 2 ms every 4 ms; 0.25 core: 2 ms every 8 ms; 0.1 core: 1 ms every 10 ms, the
    kernel's least quota).

    A host under a quota runs flat out until the period's quota is spent, then stops until the period
    ends.  A pipeline's step is a chain of short ops across hosts, and a stop on the chain delays all of
    it: over a 10 ms period (a 5 ms stop) tb-medium's 4-stage pipeline on 0.5-core hosts took 50-60 ms or
    95-120 ms a step, in runs of one or the other, medians 65 to 105 ms between runs of the same plan;
    with no quota, 45-58 ms every step; over 4 ms, 45-85 ms every step (medians 64-76 in three runs);
    over 8 ms, 64 ms in one run and 116 ms in the next quiet one.  Shorter periods lose share when every
    host is busy, which a host probed alone does not see (a GEMM loop in each of 4 hosts of 0.5 core:
    over 2 ms 0.39 of a core, over 4 ms 0.43-0.46, over 8 and 10 ms 0.49-0.50): 4 ms is the compromise."""
    if cores is None:
        return PERIOD_US
    return int(min(PERIOD_US, max(MIN_PERIOD_US, math.ceil(QUOTA_US / cores))))


def cpu_controller() -> CpuController | None:
    """The mounted CPU controller, v1 preferred (on a hybrid machine the v2 tree cannot have it too)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in mounts:
        _, where, kind, opts, *_ = line.split()
        if kind == "cgroup" and "cpu" in opts.split(","):
            return CpuController(Path(where), 1)
        if kind == "cgroup2" and v2 is None:
            controllers = Path(where, "cgroup.controllers")
            if controllers.is_file() and "cpu" in controllers.read_text().split():
                v2 = CpuController(Path(where), 2)
    return v2


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_available(need_cpu: bool = True) -> CpuController | None:
    """The CPU controller to use; NetlabError saying what is missing when a testbed cannot be made here."""
    if not sys.platform.startswith("linux"):
        raise NetlabError("the testbed needs Linux (network namespaces, tc, cgroups)")
    if os.geteuid() != 0:
        raise NetlabError("the testbed needs root: network namespaces, tc qdiscs and cgroups are root's "
                          "(run as root, e.g. with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetlabError(f"the testbed needs iproute2's {' and '.join(missing)} on PATH (apt-get install iproute2)")
    if not Path("/proc/self/ns/net").exists():
        raise NetlabError("this kernel has no network namespaces (/proc/self/ns/net is missing)")
    controller = cpu_controller()
    if controller is None and need_cpu:
        raise NetlabError("no cgroup CPU controller is mounted (neither cgroup v1's 'cpu' hierarchy nor a "
                          "cgroup v2 hierarchy with 'cpu' in cgroup.controllers): host CPU shares need one")
    return controller


def _sh(argv: Sequence[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetlabError(f"{what} failed: {' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _netns_names() -> list[str]:
    proc = _sh(["ip", "netns", "list"], "listing namespaces", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


# -- rates ----------------------------------------------------------------------------------------------

def rate_bytes(rate: float | str | None) -> float | None:
    """Bytes per second from a number (bytes/s) or a fleet bandwidth text ('20Mbit/s', '1Gbps', '125MB/s')."""
    if rate is None:
        return None
    if isinstance(rate, str):
        from vgraph.cost.fleet import parse_bandwidth  # the fleet's units, so a PNode's `bandwidth` reads as is

        try:
            value = parse_bandwidth(rate)
        except ValueError as exc:
            raise NetlabError(f"rate: {exc}") from None
    else:
        value = float(rate)
    if not (value > 0 and value < 1e12):
        raise NetlabError(f"rate must be positive and below 8 Tbit/s, got {rate!r}")
    return value


def _tbf(rate: float) -> list[str]:
    """tbf arguments for `rate` bytes/s.  The bucket holds 2 ms at the rate, at least 16 KiB: a larger one lets
    a burst through at line speed after a pause (a 128 KiB bucket passed a pipeline step's ~128 KB of
    activations at once, so a 20 Mbit/s link carried a step's traffic in less time than 20 Mbit/s allows).
    tbf splits the veth's 64 KiB GSO segments when the bucket is smaller than one, at little cost (measured,
    sustained TCP: 19.2 against 19.6 Mbit/s at 20 Mbit/s, 945 against 958 at 1 Gbit/s, with a 128 KiB
    bucket).  The queue holds 100 ms at the rate (at least 256 KiB) so TCP finds the rate without drops."""
    burst = max(16 * 1024, int(rate * 0.002))
    limit = max(256 * 1024, int(rate * 0.1)) + burst
    return ["tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst), "limit", str(limit)]


# -- the testbed ----------------------------------------------------------------------------------------

@dataclass
class Host:
    index: int
    netns: str
    ip: str
    port: str  # its bridge port in the switch namespace
    cgroup: Path | None
    cpu: float | None  # cores, None: no quota
    rate: float | None  # bytes/s each way, None: unlimited

    @property
    def iface(self) -> str:
        return IFACE


def _per_host(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise NetlabError(f"{what}: {len(value)} values for {n} hosts")
        return list(value)
    return [value] * n


class Testbed:
    """N hosts on one bridge; see the module docstring.  Use as a context manager (or call close())."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, hosts: int, *, rate: float | str | Sequence[float | str | None] | None = None,
                 cpu: float | Sequence[float | None] | None = None, subnet: str = DEFAULT_SUBNET) -> None:
        if not isinstance(hosts, int) or isinstance(hosts, bool) or not 1 <= hosts <= 250:
            raise NetlabError(f"hosts must be an integer from 1 to 250, got {hosts!r}")
        rates = [rate_bytes(r) for r in _per_host(rate, hosts, "rate")]
        cpus = [self._cores(c) for c in _per_host(cpu, hosts, "cpu")]
        if sum(c for c in cpus if c) > usable_cores() + 1e-9:
            raise NetlabError(f"CPU shares sum to {sum(c for c in cpus if c):g} cores, more than the "
                              f"{usable_cores()} this machine lets this process use")
        net = self._subnet(subnet, hosts)
        self.controller = check_available(need_cpu=True)
        sweep()
        pid = os.getpid()
        self.tag = f"{TAG_PREFIX}-{pid}-{_start_time(pid)}-{next(_COUNTER)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(i, f"{self.tag}-h{i}", str(net[i + 1]), f"p{i}", None, cpus[i], rates[i])
                      for i in range(hosts)]
        self.prefixlen = net.prefixlen
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._restore_signal: Callable[[], None] | None = None
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _cores(value: float | None) -> float | None:
        if value is None:
            return None
        try:
            cores = float(value)
        except (TypeError, ValueError):
            raise NetlabError(f"cpu must be a number of cores, got {value!r}") from None
        if not (0.1 <= cores <= usable_cores()):  # the kernel's least quota is 1 ms of the 10 ms period
            raise NetlabError(f"cpu must be between 0.1 and {usable_cores()} cores, got {value!r}")
        return cores

    @staticmethod
    def _subnet(text: str, hosts: int) -> ipaddress.IPv4Network:
        try:
            net = ipaddress.IPv4Network(text, strict=True)
        except (ValueError, TypeError) as exc:
            raise NetlabError(f"subnet: {exc}") from None
        if not net.is_private or net.num_addresses < hosts + 2:
            raise NetlabError(f"subnet {text} must be private and hold {hosts} hosts")
        return net

    # -- building and tearing down ------------------------------------------------------------------
    def _build(self) -> None:
        _sh(["ip", "netns", "add", self.switch], "creating the switch namespace")
        sw = ["ip", "-n", self.switch]
        _sh([*sw, "link", "add", "br0", "type", "bridge"], "creating the bridge")
        _sh([*sw, "link", "set", "br0", "up"], "bringing the bridge up")
        for h in self.hosts:
            _sh(["ip", "netns", "add", h.netns], f"creating host {h.index}'s namespace")
            _sh(["ip", "link", "add", h.port, "netns", self.switch, "type", "veth", "peer", "name", IFACE,
                 "netns", h.netns], f"creating host {h.index}'s link")
            _sh([*sw, "link", "set", h.port, "master", "br0", "up"], f"plugging host {h.index} into the bridge")
            ns = ["ip", "-n", h.netns]
            _sh([*ns, "addr", "add", f"{h.ip}/{self.prefixlen}", "dev", IFACE], f"addressing host {h.index}")
            _sh([*ns, "link", "set", IFACE, "up"], f"bringing host {h.index}'s link up")
            _sh([*ns, "link", "set", "lo", "up"], f"bringing host {h.index}'s loopback up")
            self.set_rate(h.index, h.rate)
            h.cgroup = self.controller.root / h.netns
            h.cgroup.mkdir()
            self.controller.set_quota(h.cgroup, h.cpu)
        self._catch_sigterm()

    def _catch_sigterm(self) -> None:
        """SIGTERM ends the owner through Python's exit path (so `close` runs), when this is the main thread
        and nobody else handles SIGTERM; close() puts the default back if the handler is still this one."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return

        def on_term(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)

        def restore() -> None:
            if signal.getsignal(signal.SIGTERM) is on_term:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

        self._restore_signal = restore

    def close(self) -> None:
        """Stop every process in the hosts, delete the namespaces (links, bridge, qdiscs with them) and the
        cgroups.  Safe to call twice; best effort on every item, then NetlabError if something stayed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._restore_signal is not None and threading.current_thread() is threading.main_thread():
            self._restore_signal()
        left = _remove(self.tag + "-", self._procs)
        if left:
            raise NetlabError(f"testbed {self.tag}: could not remove {', '.join(left)}")

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- using it -----------------------------------------------------------------------------------
    @property
    def ips(self) -> list[str]:
        return [h.ip for h in self.hosts]

    def kill(self, i: int, timeout: float = 10.0) -> None:
        """Host i dies as a machine does: every process in its cgroup SIGKILLed (what it started, whatever its
        session or process group), until none is left or `timeout` s have passed; the host stays up."""
        _kill_cgroup(self._host(i).cgroup, time.monotonic() + timeout)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside host i: its cgroup first, then its namespace."""
        h = self._host(i)
        if not argv:
            raise NetlabError("an empty command")
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" || exit 125; ns=$1; shift; exec ip netns exec "$ns" "$@"',
                str(h.cgroup), h.netns, *map(str, argv)]

    def environment(self, i: int, env: dict[str, str] | None = None) -> dict[str, str]:
        h = self._host(i)
        out = dict(os.environ if env is None else env)
        out.update(NETLAB_HOST=str(i), NETLAB_IP=h.ip, NETLAB_IPS=",".join(self.ips),
                   NETLAB_CPU="" if h.cpu is None else f"{h.cpu:g}")
        return out

    def popen(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen of `argv` inside host i (kwargs as Popen's); stopped at close() if still running."""
        if self._closed:
            raise NetlabError("the testbed is closed")
        proc = subprocess.Popen(self.command(i, argv), env=self.environment(i, env), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = None,
            input: str | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run of `argv` inside host i, its output captured as text unless kwargs say otherwise."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        proc = self.popen(i, argv, env, **kwargs)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run_all(self, commands: Sequence[Sequence[str] | None], env: dict[str, str] | None = None,
                timeout: float | None = None) -> list[subprocess.CompletedProcess | None]:
        """commands[i] in host i, all at once (None: nothing in that host); each one's output (stdout and
        stderr together, as text).  After `timeout` seconds every command still running is killed and
        subprocess.TimeoutExpired raised."""
        procs = [None if argv is None else self.popen(i, argv, env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True)
                 for i, argv in enumerate(commands)]
        outputs: dict[int, str] = {}
        readers = [threading.Thread(target=lambda i=i, p=p: outputs.__setitem__(i, p.stdout.read()), daemon=True)
                   for i, p in enumerate(procs) if p is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for p in procs:
                if p is not None:
                    p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p is not None and p.poll() is None:
                    p.kill()
            raise
        finally:
            for reader in readers:
                reader.join(timeout=10)
        return [None if p is None else subprocess.CompletedProcess(p.args, p.returncode, outputs.get(i, ""))
                for i, p in enumerate(procs)]

    def set_rate(self, i: int, rate: float | str | None) -> None:
        """Host i's link rate each way (bytes/s or a fleet bandwidth text); None lifts the limit."""
        h = self._host(i)
        value = rate_bytes(rate)
        for ns, dev in ((h.netns, IFACE), (self.switch, h.port)):
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], "clearing a qdisc",
                check=False)
            if value is not None:
                _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *_tbf(value)],
                    f"limiting host {i}'s link")
        h.rate = value

    def qdiscs(self, i: int) -> str:
        """`tc qdisc show` of host i's interface and of its bridge port (what limits it now)."""
        h = self._host(i)
        return "".join(_sh(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], "showing qdiscs").stdout
                       for ns, dev in ((h.netns, IFACE), (self.switch, h.port)))

    def cut(self, i: int) -> None:
        """Pull host i's cable: its bridge port goes down (host i sees no carrier; its peers hear nothing)."""
        _sh(["ip", "-n", self.switch, "link", "set", self._host(i).port, "down"], f"cutting host {i}'s link")

    def restore(self, i: int) -> None:
        """Plug host i's cable back in."""
        _sh(["ip", "-n", self.switch, "link", "set", self._host(i).port, "up"], f"restoring host {i}'s link")

    def _host(self, i: int) -> Host:
        if not isinstance(i, int) or not 0 <= i < len(self.hosts):
            raise NetlabError(f"no host {i!r} (hosts 0..{len(self.hosts) - 1})")
        return self.hosts[i]


# -- clean-up -------------------------------------------------------------------------------------------

def _cgroup_dirs() -> list[Path]:
    controller = cpu_controller()
    if controller is None:
        return []
    return [p for p in controller.root.iterdir() if p.is_dir() and _TAG.match(p.name)]


def leftovers(tag: str | None = None) -> list[str]:
    """Namespaces and cgroups of testbeds now on this machine: of `tag`, or of every testbed."""
    prefix = f"{tag}-" if tag else f"{TAG_PREFIX}-"
    names = [f"netns {n}" for n in _netns_names() if n.startswith(prefix) and _TAG.match(n)]
    return names + [f"cgroup {p}" for p in _cgroup_dirs() if p.name.startswith(prefix)]


def _kill_cgroup(group: Path, deadline: float) -> None:
    procs = group / "cgroup.procs"
    while time.monotonic() < deadline:
        try:
            pids = [int(x) for x in procs.read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove(tag: str, procs: Sequence[subprocess.Popen] = ()) -> list[str]:
    """Remove everything carrying `tag`; what could not be removed."""
    deadline = time.monotonic() + 10
    groups = [p for p in _cgroup_dirs() if p.name.startswith(tag)]
    spaces = [n for n in _netns_names() if n.startswith(tag)]
    for proc in procs:  # our own first: one may not have entered its cgroup yet
        if proc.poll() is None:
            proc.kill()
    for group in groups:
        _kill_cgroup(group, deadline)
    for ns in spaces:  # anything that entered a namespace some other way than popen()
        for pid in _sh(["ip", "netns", "pids", ns], "listing a namespace's processes", check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for proc in procs:  # reap our own children, so that no zombie keeps a cgroup busy
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10
    left = []
    for ns in sorted(spaces, key=lambda n: n.endswith("-sw")):  # hosts first, then the switch
        if _sh(["ip", "netns", "del", ns], "deleting a namespace", check=False).returncode != 0 and \
                ns in _netns_names():
            left.append(f"netns {ns}")
    for group in groups:
        while True:
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    left.append(f"cgroup {group}")
                    break
                _kill_cgroup(group, deadline)
                time.sleep(0.05)
    return left


def _owner_alive(name: str) -> bool:
    m = _TAG.match(name)
    return bool(m) and _start_time(int(m.group(1))) == int(m.group(2))


def sweep() -> list[str]:
    """Remove the namespaces and cgroups of testbeds whose owning process is gone (killed before close());
    the tags removed.  Testbeds of live processes are left alone."""
    names = [n for n in _netns_names() if _TAG.match(n)] + [p.name for p in _cgroup_dirs()]
    dead = sorted({_TAG.match(n).group(0).rstrip("-") for n in names if not _owner_alive(n)})
    for tag in dead:
        _remove(tag + "-")
    return dead


# -- measuring ------------------------------------------------------------------------------------------

def measure_rate(tb: Testbed, src: int, dst: int, seconds: float = 2.0, port: int = 5201) -> float:
    """Bytes per second a TCP stream from host `src` to host `dst` sustains (counted at the receiver, from its
    first byte to its last), with plain Python sockets: an iperf-like check that a rate limit holds."""
    sink = tb.popen(dst, [sys.executable, str(_SELF), "_sink", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        ready = sink.stdout.readline()
        if ready.strip() != "ready":
            raise NetlabError(f"the receiver in host {dst} did not start: {ready!r}")
        source = tb.run(src, [sys.executable, str(_SELF), "_source", tb.hosts[dst].ip, str(port), str(seconds)],
                        timeout=seconds + 30)
        if source.returncode != 0:
            raise NetlabError(f"the sender in host {src} failed: {source.stderr.strip()}")
        out, _ = sink.communicate(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    result = json.loads(out)
    return result["bytes"] / result["seconds"]


def measure_cpu(tb: Testbed, i: int, seconds: float = 2.0, workers: int | None = None) -> float:
    """Cores host i gets: `workers` busy processes (default: every core) spin for `seconds`; their CPU time
    over the wall time.  Checks that a quota holds (and, without one, what a host may use)."""
    n = workers or usable_cores()
    proc = tb.run(i, [sys.executable, str(_SELF), "_spin", str(n), str(seconds)], timeout=seconds + 30)
    if proc.returncode != 0:
        raise NetlabError(f"the CPU check in host {i} failed: {proc.stderr.strip()}")
    return float(json.loads(proc.stdout)["cores"])


def _sink(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(1)
        print("ready", flush=True)
        conn, _ = srv.accept()
        total, first, last = 0, None, None
        buf = bytearray(1 << 20)
        with conn:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                last = time.perf_counter()
                if first is None:
                    first = last
                total += n
    print(json.dumps({"bytes": total, "seconds": max((last or 0) - (first or 0), 1e-9)}), flush=True)


def _source(host: str, port: int, seconds: float) -> None:
    payload = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=30) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)


def _spin(workers: int, seconds: float) -> None:
    import resource

    start = time.perf_counter()
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            end = time.perf_counter() + seconds
            x = 0
            while time.perf_counter() < end:
                x += 1
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    wall = time.perf_counter() - start
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"cores": (use.ru_utime + use.ru_stime) / wall}))


# -- command line ---------------------------------------------------------------------------------------

def _host_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=2, help="hosts (default 2)")
    p.add_argument("--rate", help="each host's link rate each way, e.g. 20Mbit/s, 1Gbit/s (default: unlimited)")
    p.add_argument("--cpu", type=float, help="each host's CPU share in cores, e.g. 0.5 (default: no quota)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/netlab.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether this machine can hold a testbed")
    sub.add_parser("sweep", help="remove the testbeds of processes that are gone")
    sub.add_parser("list", help="list the testbeds' namespaces and cgroups on this machine")
    m = sub.add_parser("measure", help="measure each host's rate (host i to host i+1) and CPU share")
    _host_options(m)
    m.add_argument("--seconds", type=float, default=2.0)
    r = sub.add_parser("run", help="run a command in every host at once; exit status: the worst of theirs")
    _host_options(r)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS (NETLAB_HOST, NETLAB_IPS are set)")
    for name, args in (("_sink", ["port"]), ("_source", ["host", "port", "seconds"]), ("_spin", ["workers", "seconds"])):
        s = sub.add_parser(name)
        for a in args:
            s.add_argument(a)
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except NetlabError as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "_sink":
        _sink(int(args.port))
    elif args.cmd == "_source":
        _source(args.host, int(args.port), float(args.seconds))
    elif args.cmd == "_spin":
        _spin(int(args.workers), float(args.seconds))
    elif args.cmd == "check":
        print(_check())
    elif args.cmd == "sweep":
        removed = sweep()
        print("\n".join(f"removed {t}" for t in removed) or "nothing to remove")
    elif args.cmd == "list":
        print("\n".join(leftovers()) or "no testbed on this machine")
    elif args.cmd == "measure":
        with Testbed(args.hosts, rate=args.rate, cpu=args.cpu, subnet=args.subnet) as tb:
            print("host  ip            rate set        measured to next host   cpu set  measured cores")
            for h in tb.hosts:
                peer = (h.index + 1) % len(tb.hosts)
                got = measure_rate(tb, h.index, peer, args.seconds) if peer != h.index else float("nan")
                cores = measure_cpu(tb, h.index, args.seconds)
                print(f"{h.index:<5} {h.ip:<13} {_mbit(h.rate):<15} {_mbit(got):<23} "
                      f"{'-' if h.cpu is None else f'{h.cpu:g}':<8} {cores:.3f}")
    elif args.cmd == "run":
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        with Testbed(args.hosts, rate=args.rate, cpu=args.cpu, subnet=args.subnet) as tb:
            procs = [tb.popen(i, cmd) for i in range(len(tb.hosts))]
            return max(abs(p.wait()) for p in procs)
    return 0


def _check() -> str:
    """What `check` prints: a one-host testbed is built and torn down, and netem tried inside it."""
    with Testbed(1) as tb:
        netem = _sh(["ip", "netns", "exec", tb.hosts[0].netns, "tc", "qdisc", "add", "dev", IFACE, "root", "netem",
                     "delay", "1ms"], "netem", check=False).returncode == 0
        controller = tb.controller
    return (f"ok: root, iproute2, network namespaces, cgroup v{controller.version} CPU controller at "
            f"{controller.root}, {usable_cores()} cores for quotas; "
            + ("netem present (not used)" if netem else "no netem qdisc: link latency cannot be emulated"))


def _mbit(rate: float | None) -> str:
    return "unlimited" if rate is None else f"{rate * 8 / 1e6:.1f} Mbit/s"


if __name__ == "__main__":
    sys.exit(main())
