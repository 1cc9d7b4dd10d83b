"""Churn: machines join, leave and die while a run trains, three ways (issue 36's acceptance).

    .venv/bin/python benchmarks/bench_churn.py                  # the testbed run (root; ~15-25 min on 2 cores)
    .venv/bin/python benchmarks/bench_churn.py --smoke          # the suite's setting: loopback, one join
    .venv/bin/python benchmarks/bench_churn.py --modes elastic --workdir DIR   # one way, its logs kept in DIR

The schedule (steps are machine 0's, read from its metrics.jsonl as it trains): 2 hosts at the start, host 2
joins at step 60, host 3 at 120, host 2 leaves gracefully at 180 (SIGTERM to its `vgraph launch`), host 3
is SIGKILLed at 240 (its whole process group: launcher, forkserver, workers), 300 steps.  The hosts are the
namespaces of tools/netlab.py with links and CPU shares as in bench_testbed.py (0.35 of a core each, 1 Gbit/s;
its `tb-small` network), each host's PNode file from `vgraph probe -o` run inside that host.  The leave and
the kill fall on the joined hosts, so the static plan's hosts 0 and 1 never change.

The three ways, run one after the other on the same testbed:

* **elastic**: `vgraph launch --nnodes 2:4` on hosts 0 and 1; a joiner runs `vgraph launch --join
  HOST:PORT --pnode FILE` and nothing else; the leave and the kill are signals, as a volunteer's machine gets
  them.  What the run does with them is vgraph's (`--on-failure`, default `shrink`: today's nearest to
  "re-plan around the lost machine"; `restart` stops a run whose machine does not come back);
* **restart-all**: what torchrun's elastic agent does.  At every membership change every launcher is killed
  (the agent stops the worker group; work since the last checkpoint is lost) and the run starts again on
  the new set of hosts with `--resume` from the last periodic checkpoint, re-planned for that set.  The
  change is acted on the moment machine 0 logs the trigger step: no heartbeat timeout is charged, which
  favours restart-all over torchrun;
* **static**: the plan on the 2 starting hosts for all 300 steps, joins ignored.

All three checkpoint every `--checkpoint-every` steps (default 25: a torchrun user's choice by Young's rule,
interval = sqrt(2 x checkpoint cost x time between failures): membership changes every 60 steps here, and a
checkpoint of tb-small cost 1.35 s on the testbed, 6.7 steps of 0.2 s (2026-12-07, the static way's rows), so
sqrt(2 x 6.7 x 60) = 28 steps; 25 rather than 30 so that the four changes fall 10, 20, 5 and 15 steps after a
checkpoint, N/2 on average as for a machine arriving at a random moment, not all on a checkpoint's step;
fewer checkpoints redo more steps at each change, more cost 1.35 s each) and log every step's row
(`--log-every 1`), so the triggers are exact and every redone step is seen.

Measured per way: wall (first launcher started to machine 0's exit), goodput (steps / wall), steps redone
(rows of machine 0's metrics.jsonl that were logged again after a restart dropped them), and for each attempt
the run made (`Watch.measure`): the predicted step (placement.json's `step_seconds` when its first row appeared)
against the measured one (median of the per-step `elapsed_s` differences of that attempt's steps, its first
`WARM` steps and its last left out).  The last line: `goodput vs restart-all: X; vs static: Y; steps redone: Z;
re-plan predicted/measured: W` (X, Y: elastic's goodput over the other way's; Z elastic's steps redone; W: of
the elastic run's attempts after its first, the predicted/measured farthest from 1).  Issue 36's goals:
X >= 1.3, Y >= 1.2, Z = 0, W within 0.75-1.25.

--smoke runs every event once on loopback (no root), the elastic way only (each `vgraph launch` imports torch
twice, launcher and forkserver, ~3 CPU-s each: three ways would cost the suite ~40 CPU-s): the tiny network at
batch 3 (a sample for each of 3 machines, one micro-batch: a step is 15-40 ms), 1 machine, then 2 joiners started
as soon as machine 0 has placed its first plan; the first leaves and the second is SIGKILLed, each once it trains in
the running plan and the one before it is out of it, and machine 0 is stopped (SIGTERM: it saves and exits 143)
once the plan after the kill trains (`Watch.ready`).  By events, not steps: a joiner takes ~5 CPU-s to start, which
machine 0 spends training, 115-150 of these steps on this 2-core VM at load 4 and some 500 on an idle one; the
2,000 steps are a bound.  --link-timeout 2 s, as the launch tests (a beat every 0.5 s).  PNode figures written
slow so that a join pays for its boundary.  A way whose events did not all happen is reported failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_testbed import CPU, TOKEN, network_file  # noqa: E402
from tools.netlab import NetlabError, Testbed, check_available  # noqa: E402

VGRAPH = str(Path(sys.executable).with_name("vgraph"))
MODES = ("elastic", "restart-all", "static")
HOST_MEMORY = 2 << 30  # each host's memory in its PNode file (probe_hosts): tb-small's plans need tens of MiB
WARM = 3  # steps after a plan starts left out of its measured step (the first step's compile, the re-plan's
# first batches); the plan's last step too (its checkpoint at the end)


@dataclass(frozen=True)
class Schedule:
    hosts: int  # hosts in the testbed
    start: int  # hosts 0 .. start-1 start the run
    steps: int
    events: tuple[tuple[int, str, int], ...]  # (step, "join" | "leave" | "kill" | "stop", host; 0 for a stop)
    wait_for_hosts: bool = False  # a leave or a kill also waits for its host to train (Watch.ready)


# The issue's schedule: each event at its step, as a volunteer's machine leaves or dies whether or not the plan
# placed it (run 8, 2026-12-07: with the smoke's wait the kill of host 3, whose join the planner declined, never
# came and the elastic way was reported failed).
FULL = Schedule(4, 2, 300, ((60, "join", 2), (120, "join", 3), (180, "leave", 2), (240, "kill", 3)))
# Both joiners as soon as machine 0 placed its first plan; the leave and the kill once their host trains in the
# running plan, then machine 0 stopped (SIGTERM) once the plan after the kill trains (Watch.ready): at most 2,000
# steps, however fast this machine trains while the joiners start
SMOKE = Schedule(3, 1, 2000, ((0, "join", 1), (0, "join", 2), (0, "leave", 1), (0, "kill", 2), (0, "stop", 0)),
                 wait_for_hosts=True)


# -- hosts: namespaces of the testbed, or processes on loopback --------------------------------------------

class Loopback:
    """Every host is this machine (--smoke): its launchers talk over 127.0.0.1, no root needed."""

    def __init__(self, hosts: int, ports: int) -> None:
        self.ips = ["127.0.0.1"] * hosts
        self.procs: list[subprocess.Popen] = []
        self.port = _free_span(ports)

    def popen(self, i: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(log.parent),
                                    start_new_session=True)  # its own process group: the SIGKILL takes all of it
        self.procs.append(proc)
        return proc

    def kill_host(self, i: int, proc: subprocess.Popen) -> None:
        _killpg(proc)

    def close(self) -> None:
        for proc in self.procs:
            _killpg(proc)


class Namespaces:
    """Host i is namespace i of a netlab Testbed, in its CPU quota behind its link."""

    def __init__(self, tb: Testbed) -> None:
        self.tb, self.ips, self.port = tb, tb.ips, 29500

    def popen(self, i: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            return self.tb.popen(i, argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(log.parent),
                                 start_new_session=True)

    def kill_host(self, i: int, proc: subprocess.Popen) -> None:
        """The whole host dies: its launcher's process group, then whatever else runs in its cgroup."""
        _killpg(proc)
        self.tb.kill(i)

    def close(self) -> None:
        pass  # the Testbed stops everything it started when it closes


def _killpg(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


def _free_span(width: int) -> int:
    """A loopback port p with p-1 .. p+width free now (the channel is on p-1, attempt n's rendezvous on p+n)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base < 1025 or base + width > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base - 1, base + width):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no span of free loopback ports")


# -- watching machine 0's run directory -------------------------------------------------------------------

@dataclass
class Plan:
    """One attempt of the run, from the step after `start` on: the plan it ran and what it measured."""
    predicted: float | None
    start: int
    pnodes: list[str] = field(default_factory=list)
    measured: float | None = None


@dataclass
class Watch:
    """What machine 0's run directory said while it trained, polled: the highest step logged, the rows logged
    again after a restart dropped them, and the plan (placement.json's `step_seconds`) current when each row
    was first seen: a launch writes placement.json before its workers start."""
    run_dir: Path
    top: int = 0
    redone: int = 0
    rows: dict[int, tuple] = field(default_factory=dict)  # step -> its row's (loss, elapsed_s) as last seen
    redone_steps: list[int] = field(default_factory=list)
    priced: dict[int, float | None] = field(default_factory=dict)  # step -> the plan's step_seconds then
    plans: list[Plan] = field(default_factory=list)
    _current: float | None = None
    placed: bool = False  # a placement.json seen: the first plan's workers are starting
    training: set[str] = field(default_factory=set)  # the PNodes of the newest row's `pnodes`: the running plan's
    gone: set[str] = field(default_factory=set)  # the hosts' PNodes a leave or kill was sent to

    def poll(self) -> int:
        with contextlib.suppress(ValueError, KeyError, TypeError):  # being written: read again at the next poll
            self._current = float(json.loads(_read(self.run_dir / "placement.json"))["step_seconds"])
            self.placed = True
        text = _read(self.run_dir / "metrics.jsonl")
        for line in text.split("\n")[:-1]:  # the last piece may be a line being written
            try:
                row = json.loads(line)
                step, key = row["step"], (row["loss"], row["elapsed_s"])  # a step run again differs in both
                pnodes = set(row.get("pnodes") or ())
            except (ValueError, KeyError, TypeError):
                continue
            if self.rows.get(step) == key:
                continue
            if step in self.rows or step <= self.top:
                self.redone += 1  # logged before, dropped by a restart's resume, logged again
                self.redone_steps.append(step)
            self.rows[step], self.priced[step] = key, self._current
            if step >= self.top:
                self.training = pnodes
            self.top = max(self.top, step)
        return self.top

    def ready(self, what: str, host: int) -> bool:
        """Whether an event may fire now (its step reached, the first plan placed).  A join: yes.  A leave or kill:
        once its host trains in the running plan and no host that left or died before still does (that one's
        boundary taken): sent earlier, a leave hits a joiner still importing, and a kill before a leave's
        boundary is a race of its own (a leave's departing PNode in the failed attempt's shrink).  A stop: once a
        plan without them trains."""
        if what == "join":
            return True
        return bool(self.training) and not self.gone & self.training and (what == "stop" or f"h{host}" in self.training)

    def measure(self) -> None:
        """The run's attempts, from its final metrics.jsonl (a step's row is the one of the attempt that ran it
        last): a new attempt's workers start their clock again (`elapsed_s` falls) or run on other PNodes.
        Each one's measured step: the median of its rows' `elapsed_s` differences, its first WARM and its
        last (the end's checkpoint) left out."""
        final = []
        for line in _read(self.run_dir / "metrics.jsonl").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                row = json.loads(line)
                final.append((row["step"], float(row["elapsed_s"]), sorted(row.get("pnodes") or {})))
        attempts: list[list[tuple[int, float, list[str]]]] = []
        for row in final:
            if not attempts or row[1] < attempts[-1][-1][1] or row[2] != attempts[-1][-1][2]:
                attempts.append([])
            attempts[-1].append(row)
        self.plans = []
        for rows in attempts:
            gaps = [b[1] - a[1] for a, b in zip(rows[WARM:-1], rows[WARM + 1:-1])]
            self.plans.append(Plan(self.priced.get(rows[0][0]), rows[0][0] - 1, rows[0][2],
                                   statistics.median(gaps) if gaps else None))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


# -- the three ways ---------------------------------------------------------------------------------------

@dataclass
class Outcome:
    mode: str
    wall: float = 0.0
    steps: int = 0
    redone: int = 0
    plans: list[Plan] = field(default_factory=list)
    error: str = ""
    redone_steps: list[int] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        return self.steps / self.wall if self.wall > 0 and not self.error else None


class Driver:
    """Starts launchers on hosts, watches machine 0 and fires the schedule's events by step."""

    def __init__(self, hosts, schedule: Schedule, files: dict[str, Path], work: Path, args: argparse.Namespace
                 ) -> None:
        self.hosts, self.schedule, self.files, self.work, self.args = hosts, schedule, files, work, args
        self.env = dict(os.environ, VGRAPH_LAUNCH_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher finds the interface towards machine 0 itself

    def common(self, steps: int) -> list[str]:
        a = self.args
        return ["--data", str(self.files["corpus"]), "--steps", str(steps), "--batch", str(a.batch),
                "--micro-batches", str(a.micro_batches), "--threads", "1", "--val-every", "0", "--checkpoint-every",
                str(a.checkpoint_every), "--log-every", "1", "--no-tensorboard", "--quiet", "--seed", "0",
                "--link-timeout", str(a.link_timeout)]

    def launcher(self, where: Path, host: int, rank: int, nnodes: str, fleet: Path, port: int, *extra: str
                 ) -> subprocess.Popen:
        argv = [VGRAPH, "launch", str(self.files["network"]), "--fleet", str(fleet), *self.common(self.schedule.steps),
                "--nnodes", nnodes, "--node-rank", str(rank), "--master-addr", self.hosts.ips[0], "--master-port",
                str(port), "--out", str(where / f"node{host}"), *extra]
        return self.hosts.popen(host, argv, self.env, where / f"host{host}.log")

    def joiner(self, where: Path, host: int, port: int) -> subprocess.Popen:
        argv = [VGRAPH, "launch", "--join", f"{self.hosts.ips[0]}:{port}", "--pnode", str(self.files[f"h{host}"]),
                "--out", str(where / f"node{host}"), "--quiet"]
        return self.hosts.popen(host, argv, self.env, where / f"host{host}.log")

    def fleet(self, hosts: list[int], where: Path) -> Path:
        from vgraph.cost.fleet import fleet_text, load_fleet

        path = where / f"fleet-{'-'.join(map(str, hosts))}.yml"
        path.write_text(fleet_text(path.stem, [load_fleet(self.files[f"h{h}"]).pnodes[0] for h in hosts],
                                   "the hosts' own PNode files"))
        return path

    def run(self, mode: str, port: int) -> Outcome:
        self.stopped = False  # a stop event was sent: machine 0 ends before the schedule's steps, by design
        where = self.work / mode
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        watch, out = Watch(where / "node0"), Outcome(mode)
        started = time.monotonic()
        try:
            getattr(self, mode.replace("-", "_"))(where, port, watch, started)
        except RuntimeError as exc:
            out.error = str(exc)
        out.wall = time.monotonic() - started  # a failed way's too: how long it ran before it failed
        watch.poll()
        watch.measure()
        out.steps, out.redone, out.plans, out.redone_steps = watch.top, watch.redone, watch.plans, watch.redone_steps
        if not out.error and out.steps != self.schedule.steps and not self.stopped:
            out.error = f"machine 0 logged {out.steps} of {self.schedule.steps} steps"
        if out.error:
            print(f"{mode}: {out.error}; machine 0's log ends:\n{_read(where / 'host0.log')[-3000:]}", file=sys.stderr)
        return out

    def wait(self, lead: subprocess.Popen, watch: Watch, started: float, on_step=None) -> None:
        """Until machine 0's launcher exits (RuntimeError when it fails or runs past --timeout), calling
        `on_step(step)` as the steps it logged grow."""
        while lead.poll() is None:
            if time.monotonic() - started > self.args.timeout:
                raise RuntimeError(f"still running after --timeout {self.args.timeout:g} s")
            step = watch.poll()
            if on_step is not None:
                on_step(step)
            time.sleep(0.05)
        if lead.returncode != (128 + signal.SIGTERM if self.stopped else 0):  # stopped: it saved and says so
            raise RuntimeError(f"machine 0's launcher exited {lead.returncode}")

    def static(self, where: Path, port: int, watch: Watch, started: float) -> None:
        first = list(range(self.schedule.start))
        fleet, n = self.fleet(first, where), str(len(first))
        procs = [self.launcher(where, h, h, n, fleet, port) for h in first]
        self.wait(procs[0], watch, started)
        _settle(procs[1:], self.hosts)

    def elastic(self, where: Path, port: int, watch: Watch, started: float) -> None:
        s = self.schedule
        first = list(range(s.start))
        fleet, nnodes = self.fleet(first, where), f"{s.start}:{s.hosts}"
        procs = {h: self.launcher(where, h, h, nnodes, fleet, port, "--on-failure", self.args.on_failure)
                 for h in first}
        pending = list(s.events)

        def on_step(step: int) -> None:  # step 0: the first plan's workers start
            while (pending and watch.placed and step >= pending[0][0]
                   and (not s.wait_for_hosts or watch.ready(*pending[0][1:]))):
                _, what, host = pending.pop(0)
                if what == "join":
                    procs[host] = self.joiner(where, host, port)
                elif what == "stop":  # the run's end, once the churn is over: machine 0 saves and exits 143
                    procs[0].send_signal(signal.SIGTERM)
                    self.stopped = True
                elif what == "leave":
                    procs[host].send_signal(signal.SIGTERM)  # the launcher: a volunteer's machine shutting down
                else:
                    self.hosts.kill_host(host, procs[host])
                if what in ("leave", "kill"):
                    watch.gone.add(f"h{host}")
                print(f"  elastic: {what} host {host} at step {step}", file=sys.stderr, flush=True)

        self.wait(procs[0], watch, started, on_step)
        _settle([p for h, p in procs.items() if h], self.hosts)
        if pending:  # the run ended first: a row without them would say nothing about churn
            left = ", ".join(f"{w} host {h} (from step {s})" for s, w, h in pending)
            raise RuntimeError(f"the run ended before {left}")

    def restart_all(self, where: Path, port: int, watch: Watch, started: float) -> None:
        """Segment after segment: the hosts of the moment, `--resume`; every change kills them all."""
        s = self.schedule
        members = list(range(s.start))
        for k, until in enumerate([*(e[0] for e in s.events), None]):
            fleet, base = self.fleet(members, where), port + 20 * k
            procs = [self.launcher(where, h, rank, str(len(members)), fleet, base, "--resume")
                     for rank, h in enumerate(members)]
            if until is None:
                self.wait(procs[0], watch, started)
                _settle(procs[1:], self.hosts)
                return
            while watch.poll() < until:
                if procs[0].poll() is not None:
                    raise RuntimeError(f"machine 0's launcher exited {procs[0].returncode} before step {until}")
                if time.monotonic() - started > self.args.timeout:
                    raise RuntimeError(f"still running after --timeout {self.args.timeout:g} s")
                time.sleep(0.05)
            for h, proc in zip(members, procs):  # the agent stops the whole worker group
                self.hosts.kill_host(h, proc)
            _, what, host = s.events[k]
            members = sorted({*members, host}) if what == "join" else [h for h in members if h != host]
            print(f"  restart-all: {what} host {host} at step {watch.top}: all restart on hosts {members}",
                  file=sys.stderr, flush=True)


def _settle(procs: list[subprocess.Popen], hosts) -> None:
    """The other launchers, after machine 0's: each gets a minute to finish, then its process group is killed."""
    deadline = time.monotonic() + 60
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        _killpg(proc)


# -- PNode files -------------------------------------------------------------------------------------------

def probe_hosts(hosts: Namespaces, files: dict[str, Path], work: Path, rate: str, args: argparse.Namespace) -> None:
    """Each host's PNode file from `vgraph probe -o` inside its quota, one host at a time (the figures of a host
    probed while the others spin are not its own: bench_testbed.py), its link stated at the testbed's rate.

    The memory a probe records is the machine's MemAvailable, shared by the 4 hosts and by whatever else runs:
    a joiner whose file claims more than is available when it joins is refused (a file that lies), and on this
    shared machine it dropped by a GiB within minutes.  So each host states HOST_MEMORY, its share."""
    import dataclasses

    from vgraph.cost.fleet import fleet_text, load_fleet

    for i in range(len(hosts.ips)):
        files[f"h{i}"] = work / f"h{i}.yml"
        done = hosts.tb.run(i, [VGRAPH, "probe", str(files["network"]), "--id", f"h{i}", "--bandwidth", rate,
                                "--threads", "1", "--no-precisions", "--batch", str(args.batch), "-o",
                                str(files[f"h{i}"])], timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"probe of host {i} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        pnode = load_fleet(files[f"h{i}"]).pnodes[0]
        files[f"h{i}"].write_text(fleet_text(f"h{i}", [dataclasses.replace(pnode, memory=HOST_MEMORY)],
                                             f"vgraph probe -o inside host {i}, its memory its share"))


def written_pnodes(files: dict[str, Path], work: Path, hosts: int) -> None:
    """--smoke: PNodes of 2 MFLOP/s, so that a plan's predicted step is seconds and a join pays for its
    boundary at once (tests/test_elastic_launch.py's figures); the figures are not the point there."""
    for i in range(hosts):
        files[f"h{i}"] = work / f"h{i}.yml"
        files[f"h{i}"].write_text(f"name: h{i}\npnodes:\n  - {{id: h{i}, memory: 256MiB, flops: 2M, bandwidth: 1GB/s, "
                                  f"accelerator: cpu}}\n")


def corpus_text(smoke: bool) -> str:
    """The training text: the embedded corpus (as bench_testbed.py), or for --smoke this checkout's
    docs/distributed.md, so that the driver itself does not import torch (~4 CPU-s) for 8 steps' text."""
    if smoke:
        return (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    from vgraph.backends.torch.training.batches import default_corpus_documents

    return "\n\n".join(default_corpus_documents(max_bytes=200_000))


# -- the report ------------------------------------------------------------------------------------------

def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(outcomes: list[Outcome]) -> str:
    out = ["| way | wall s | steps/s | steps redone (which) | plans: from step, PNodes, predicted / measured s (ratio) |",
           "|---|---:|---:|---:|---|"]
    for o in outcomes:
        plans = "; ".join(f"{p.start}: {','.join(p.pnodes) or '?'} {_f(p.predicted, '.4f')} / {_f(p.measured, '.4f')}"
                          f" ({_f(p.measured and p.predicted and p.predicted / p.measured, '.2f')})" for p in o.plans)
        failed = f" (failed: {o.error})" if o.error else ""
        out.append(f"| {o.mode}{failed} | {o.wall:.1f} | {_f(o.goodput, '.3f')} | {o.redone}{spans(o.redone_steps)} "
                   f"| {plans or '-'} |")
    return "\n".join(out)


def spans(steps: list[int]) -> str:
    """' (51-60, 111-118)': the steps redone as runs, in the order they were logged again; '' for none."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return f" ({', '.join(f'{a}-{b}' if a != b else str(a) for a, b in runs)})" if runs else ""


def summary(outcomes: list[Outcome]) -> str:
    """The last line.  W: of the elastic run's plans after its first (each one a re-plan), the ratio of
    predicted to measured step farthest from 1."""
    by = {o.mode: o for o in outcomes}
    el = by.get("elastic")
    mine = el.goodput if el else None

    def vs(mode: str) -> str:
        other = by[mode].goodput if mode in by else None
        return "n/a" if mine is None or not other else f"{mine / other:.2f}"

    ratios = [p.predicted / p.measured for p in (el.plans[1:] if el else []) if p.measured and p.predicted]
    worst = max(ratios, key=lambda r: abs(math.log(r))) if ratios else None
    redone = "n/a" if el is None else str(el.redone)
    return (f"goodput vs restart-all: {vs('restart-all')}; vs static: {vs('static')}; steps redone: {redone}; "
            f"re-plan predicted/measured: {_f(worst, '.2f')}")


def ceiling(outcomes: list[Outcome], schedule: Schedule) -> str:
    """What the schedule lets any elastic run reach against static on these hosts: the goodput vs static of a
    run whose changes cost nothing and take effect at their step, each segment of the schedule trained at the
    step restart-all measured on that segment's hosts (its plan k is segment k's), scaled to static's 2-host step
    (the two ways ran minutes apart and this machine drifts: only restart-all's speed-ups are used), and the
    rest of static's wall (start, checkpoints, the end) the same.

    Why print it: a goal of Y = 1.2 is met by no implementation when this ceiling is below it; run 7's
    (2026-12-07, tb-small, batch 8) was about 1.1, the extra hosts there only 60% of the schedule and 2 to 4
    hosts 1.4x faster at best.  The same bound at the planner's own speed-ups (restart-all's predicted steps)
    follows: it says whether a goal is out of reach by the model too, and it is known before any run
    (`vgraph partition` of each segment's fleet), so a configuration can be chosen that lets Y be measured."""
    by = {o.mode: o for o in outcomes}
    static, everyone = by.get("static"), by.get("restart-all")
    bounds = [0, *(e[0] for e in schedule.events), schedule.steps]
    segments = [b - a for a, b in zip(bounds, bounds[1:])]
    if (static is None or everyone is None or static.error or everyone.error or len(static.plans) != 1
            or len(everyone.plans) != len(segments) or not all(p.measured for p in [*static.plans, *everyone.plans])):
        return "elastic's ceiling vs static: n/a (needs static and restart-all, each plan measured)"
    base = static.plans[0].measured
    rest = static.wall - schedule.steps * base

    def bound(step: Callable[[Plan], float | None]) -> tuple[float, list[float]] | None:
        steps = [step(p) for p in everyone.plans]
        if not all(steps):
            return None
        ups = [steps[0] / s for s in steps]
        return static.wall / (rest + sum(n * base / up for n, up in zip(segments, ups))), ups

    measured, planned = bound(lambda p: p.measured), bound(lambda p: p.predicted)
    planner = "n/a" if planned is None else (f"{planned[0]:.2f} at the planner's own speed-ups "
                                             f"{', '.join(f'{u:.2f}' for u in planned[1])}")
    return (f"elastic's ceiling vs static: {measured[0]:.2f} (changes free and at their step; "
            f"restart-all's speed-ups {', '.join(f'{u:.2f}' for u in measured[1])} over "
            f"{', '.join(map(str, segments))} steps; {rest:.1f} s of static's {static.wall:.1f} s not training); "
            f"{planner}")


def refusal(args: argparse.Namespace, modes: list[str]) -> str | None:
    """Why these settings cannot run (before any testbed or launcher), or None."""
    if not modes or any(m not in MODES for m in modes):
        return f"--modes takes {', '.join(MODES)} separated by commas, got {args.modes!r}"
    if args.smoke and modes != ["elastic"]:
        return f"--smoke runs the elastic way only (its schedule ends in a stop), got --modes {args.modes!r}"
    for name in ("batch", "micro_batches", "checkpoint_every"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if not all(math.isfinite(t) and t > 0 for t in (args.timeout, args.link_timeout, args.cpu)):
        return "--timeout, --link-timeout and --cpu must be finite positive numbers"
    if args.workdir and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        return f"--workdir {args.workdir!r} is not a directory"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="loopback, the tiny network at batch 3 (1 micro-batch), 2 "
                    "joins, a leave and a kill (each once its host trains), then machine 0 stopped; --link-timeout 2; "
                    "elastic only")
    ap.add_argument("--modes", default=None, help=f"ways to run, comma-separated (default: {','.join(MODES)}; "
                    "--smoke: elastic)")
    ap.add_argument("--network", default="tb-small", help="tb-small (default), tb-medium or tiny")
    ap.add_argument("--rate", default="1Gbit/s", help="every host's link each way")
    ap.add_argument("--cpu", type=float, default=CPU, help=f"cores per host (default {CPU}, as bench_testbed.py)")
    ap.add_argument("--batch", type=int, help="global batch (default 8; --smoke: 3)")
    ap.add_argument("--micro-batches", type=int, help="default 4; --smoke: 1")
    ap.add_argument("--checkpoint-every", type=int, default=25, help="every way's periodic checkpoint (default 25: "
                    "see the docstring)")
    ap.add_argument("--on-failure", default="shrink", choices=("restart", "shrink"),
                    help="the elastic run's --on-failure (default shrink)")
    ap.add_argument("--link-timeout", type=float, help="launch's --link-timeout (default 5 s; --smoke: 2 s)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one way may take before it is stopped")
    ap.add_argument("--workdir", help="keep the runs and their logs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    for name, full, smoke in (("batch", 8, 3), ("micro_batches", 4, 1), ("link_timeout", 5.0, 2.0)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    modes = (("elastic" if args.smoke else ",".join(MODES)) if args.modes is None else args.modes).split(",")
    refused = refusal(args, modes)
    if refused:
        print(f"bench_churn: {refused}", file=sys.stderr)
        return 2
    schedule = SMOKE if args.smoke else FULL
    if not args.smoke:
        try:
            check_available()
        except NetlabError as exc:
            print(f"bench_churn: {exc}", file=sys.stderr)
            return 2
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    print(f"load before: {os.getloadavg()[0]:.2f}; {schedule.hosts} hosts"
          f"{' on loopback' if args.smoke else f' of {args.cpu:g} core(s) at {args.rate}'}; {schedule.steps} steps; "
          f"events {', '.join(f'{w} host {h} at {s}' for s, w, h in schedule.events)}; ways {', '.join(modes)}",
          flush=True)
    with (contextlib.nullcontext(args.workdir) if args.workdir else
          tempfile.TemporaryDirectory(prefix="bench-churn-")) as tmp:
        work = Path(tmp).resolve()
        files = {"network": network_file("tiny" if args.smoke else args.network, work), "corpus": work / "corpus.txt"}
        files["corpus"].write_text(corpus_text(args.smoke), encoding="utf-8")
        with (contextlib.nullcontext() if args.smoke else Testbed(schedule.hosts, rate=args.rate, cpu=args.cpu)) as tb:
            # each way's ports: restart-all's launches take 20 each (the channel below, attempts above)
            spacing = 20 * (len(schedule.events) + 2)
            hosts = Loopback(schedule.hosts, spacing * len(modes)) if args.smoke else Namespaces(tb)
            try:
                if args.smoke:
                    written_pnodes(files, work, schedule.hosts)
                else:
                    probe_hosts(hosts, files, work, args.rate, args)
                driver = Driver(hosts, schedule, files, work, args)
                outcomes = []
                for k, mode in enumerate(modes):
                    outcomes.append(driver.run(mode, hosts.port + spacing * k))
                    print(f"  {mode}: {outcomes[-1].wall:.1f} s, {outcomes[-1].steps} steps, "
                          f"{outcomes[-1].redone} redone", file=sys.stderr, flush=True)
            finally:
                hosts.close()
    print(table(outcomes))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(ceiling(outcomes, schedule))
    print(summary(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
