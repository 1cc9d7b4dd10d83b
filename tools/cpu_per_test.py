"""CPU seconds of every test of a suite run, its child processes included: where a CPU-bound suite's time goes.

    bash tools/test.sh -p tools.cpu_per_test --cpu-per-test /tmp/cpu   # as root: writes /tmp/cpu.<worker>.json
    .venv/bin/python tools/cpu_per_test.py /tmp/cpu                    # the tests and modules that cost most

Why: the suite is CPU-bound (TESTING.md), and most of its CPU is spent in processes its tests start
(launchers, forkservers, workers, CLI commands).  Wall-clock `--durations` mix in the other xdist worker's
load, and `/usr/bin/time` never sees a forkserver (nobody waits for it).  Here each test runs in a cgroup v1
`cpuacct` group of its own: its pytest worker and that worker's living descendants are moved in (a
forkserver an earlier test started forks this test's workers), and a process started there stays there, so
its CPU counts to the test that started it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from vgraph.base.safeio import atomic_write

CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1's cpuacct hierarchy (this machine kind)
GROUP = "vgraph-cpu-per-test"


def check_available(root: Path = CPUACCT) -> None:
    """Refuse, with what to do, where per-test groups cannot be made (not root, no cgroup v1 cpuacct)."""
    if not (root / "cpuacct.usage").is_file():
        raise RuntimeError(f"{root}: no cgroup v1 cpuacct hierarchy here; --cpu-per-test needs one")
    if not os.access(root / "cgroup.procs", os.W_OK):
        raise RuntimeError(f"{root}: cannot move processes between cgroups (run as root)")


def _descendants(pid: int) -> list[int]:
    """The living descendants of `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _move_here_and_below(group: Path) -> None:
    for pid in (os.getpid(), *_descendants(os.getpid())):
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:
            pass  # exited meanwhile


# -- the pytest plugin ---------------------------------------------------------------------------------------

def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-per-test", metavar="PATH",
                     help="write the CPU seconds of every test, child processes included, to PATH.<worker>.json "
                          "(root; tools/cpu_per_test.py)")


def pytest_configure(config) -> None:
    if config.getoption("--cpu-per-test"):
        try:
            check_available()
        except RuntimeError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.pluginmanager.register(_PerTest(Path(config.getoption("--cpu-per-test"))), "cpu-per-test-recorder")


class _PerTest:
    def __init__(self, out: Path) -> None:
        self.out, self.rows, self.count = out, {}, 0
        self.base = CPUACCT / GROUP
        self.base.mkdir(exist_ok=True)
        for group in self.base.iterdir():  # a killed run's groups: their pytest process is gone
            if group.is_dir() and not Path(f"/proc/{group.name.split('-')[0]}").exists():
                _release(group)

    def _record(self, item, group: Path, start: float) -> None:
        _move_here_and_below(CPUACCT)
        used = int((group / "cpuacct.usage").read_text()) / 1e9
        self.rows[item.nodeid] = [round(used, 3), round(time.perf_counter() - start, 3)]
        try:
            group.rmdir()
        except OSError:
            pass  # a process of the test still lives there: its CPU so far is counted

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.count += 1
        group = self.base / f"{os.getpid()}-{self.count}"
        group.mkdir()
        _move_here_and_below(group)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._record(item, group, start)

    def pytest_sessionfinish(self, session) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        path = self.out.with_name(f"{self.out.name}.{worker}.json")
        atomic_write(path, json.dumps(self.rows, indent=0) + "\n", make_parents=False, durable=False)
        for group in self.base.glob(f"{os.getpid()}-*"):  # a test's process that outlived it (tests/zygote.py's
            _release(group)                                 # forkserver lives to the session's end)
        try:
            self.base.rmdir()  # the last worker to finish leaves no group behind
        except OSError:
            pass  # another worker's groups are still in it


def _release(group: Path) -> None:
    """Remove `group`, its processes moved back to the root group first (a cgroup with tasks cannot go)."""
    try:
        for pid in (group / "tasks").read_text().split():
            try:
                (CPUACCT / "tasks").write_text(pid)
            except OSError:
                pass  # it exited meanwhile
        group.rmdir()
    except OSError:
        pass  # gone already, or a process was forked into it meanwhile: left for the next run's sweep


# -- the summary ---------------------------------------------------------------------------------------------

def read(prefix: Path) -> dict[str, tuple[float, float]]:
    """node id -> (CPU seconds, wall seconds) from every PREFIX.<worker>.json."""
    rows: dict[str, tuple[float, float]] = {}
    for path in sorted(prefix.parent.glob(f"{prefix.name}.*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not all(isinstance(v, list) and len(v) == 2 and all(
                isinstance(x, (int, float)) for x in v) for v in data.values()):
            raise ValueError(f"{path}: not a file of tools/cpu_per_test.py")
        rows.update({k: (float(v[0]), float(v[1])) for k, v in data.items()})
    return rows


def summary(rows: dict[str, tuple[float, float]], top: int) -> str:
    total = sum(c for c, _ in rows.values())
    modules: Counter = Counter()
    for node, (cpu, _) in rows.items():
        modules[node.split("::")[0]] += cpu
    wall = sum(w for _, w in rows.values())
    lines = [f"{len(rows)} tests, {total:.0f} CPU-s (children included), {wall:.0f} s of test wall time", "",
             "| module | CPU s | share |", "|---|---:|---:|"]
    lines += [f"| {m} | {c:.1f} | {c / max(total, 1e-9):.0%} |" for m, c in modules.most_common(top)]
    lines += ["", "| test | CPU s | wall s |", "|---|---:|---:|"]
    lines += [f"| {k} | {c:.1f} | {w:.1f} |" for k, (c, w) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prefix", type=Path, help="the --cpu-per-test PATH of the run")
    ap.add_argument("--top", type=int, default=30, help="rows of each table (default 30)")
    args = ap.parse_args(argv)
    try:
        rows = read(args.prefix)
    except (OSError, ValueError) as exc:
        print(f"cpu_per_test: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"cpu_per_test: no {args.prefix}.<worker>.json here: run the suite with --cpu-per-test {args.prefix}",
              file=sys.stderr)
        return 2
    print(summary(rows, max(1, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
