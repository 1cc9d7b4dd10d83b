"""tests/zygote.py answers as a fresh interpreter does: the suite's commands that run there (benchmark smokes, the
installed `vgraph` script with a plugin, `python -m` workers) check a process's exit status, stdout and stderr,
so each way a Python process can end is compared here with `subprocess.run([sys.executable, ...])`."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zygote import STDOUT, popen, run_python

SCRIPT = '''
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "mark": os.environ.get("MARK"),
                  "in_path": os.environ.get("EXTRA", "-") in sys.path, "main": __name__,
                  "stdin": sys.stdin.read()}))
how = sys.argv[1]
if how == "interrupt":
    raise KeyboardInterrupt
if how == "message":
    sys.exit("refused: a message")
if how == "raise":
    raise RuntimeError("an uncaught error")
if how == "none":
    sys.exit()
sys.exit(int(how))
'''


@pytest.mark.parametrize("how", ["0", "3", "256", "none", "message", "raise", "interrupt"])
def test_a_forked_command_ends_as_a_fresh_interpreter_does(how: str, tmp_path: Path) -> None:
    script = tmp_path / "cmd.py"
    script.write_text(SCRIPT)
    extra = tmp_path / "extra"
    extra.mkdir()
    env = dict(os.environ, MARK="m\u00e9", EXTRA=str(extra), PYTHONPATH=str(extra))
    fresh = subprocess.run([sys.executable, str(script), how], cwd=tmp_path, env=env, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
    forked = run_python([script, how], cwd=tmp_path, env=env, timeout=60)
    assert fresh.stdout.count("\n") == 3, fresh  # the premise: the row, the joined thread, atexit
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    assert ("Traceback" in forked.stderr) == ("Traceback" in fresh.stderr)


def test_a_module_runs_with_the_working_directory_first_on_its_path(tmp_path: Path) -> None:
    (tmp_path / "here_only.py").write_text("import sys, os\nprint(sys.argv[0], sys.path[0] == os.getcwd())\n")
    done = run_python(["-m", "here_only", "x"], cwd=tmp_path, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"{tmp_path / 'here_only.py'} True\n"), done.stderr


def test_siblings_draw_their_own_random_numbers(tmp_path: Path) -> None:
    """The zygote imported numpy (and random): a fork would otherwise repeat its generators' state."""
    script = tmp_path / "draw.py"
    script.write_text("import random, numpy\nprint(random.random(), numpy.random.random())\n")
    a, b = (run_python([script], cwd=tmp_path, timeout=60).stdout.split() for _ in range(2))
    assert len(a) == len(b) == 2 and a[0] != b[0] and a[1] != b[1]


def test_a_command_past_its_timeout_is_killed_and_said(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_python([script], cwd=tmp_path, timeout=1)
    pid = int(caught.value.output.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped by the zygote


def test_children_that_end_together_are_each_seen_to_end(tmp_path: Path) -> None:
    """Their exits reach the test in one read of the zygote's pipe; a reader that buffered the later ones where
    select() cannot see them waited out its timeout (the probe's two ranks, ending on one collective)."""
    script = tmp_path / "at.py"
    script.write_text("import sys, time\ntime.sleep(max(0.0, float(sys.argv[1]) - time.time()))\n")
    at = time.time() + 1.5
    children = [popen([script, str(at)], cwd=tmp_path) for _ in range(6)]
    assert [child.wait(timeout=30) for child in reversed(children)] == [0] * 6
    assert all(child.communicate() == ("", "") for child in children)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_command_in_a_session_of_its_own_is_killed_with_its_children(tmp_path: Path) -> None:
    """start_new_session, as Popen's: the launcher a test SIGKILLs as a lost machine takes its forkserver and
    workers with it (os.killpg); without it the command shares the zygote's session and group."""
    import signal

    script = tmp_path / "parent.py"
    script.write_text("import os, subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "print(os.getsid(0), os.getpgid(0), child.pid, flush=True)\n"
                      "time.sleep(60)\n")
    out = tmp_path / "out"
    said = lambda path: path.read_text().split() if path.exists() else []  # noqa: E731 (the child opens it)
    own = popen([script], stdout=out, stderr=STDOUT, start_new_session=True)
    shared = popen([script], stdout=tmp_path / "out2", stderr=STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(said(out)) < 3 or len(said(tmp_path / "out2")) < 3:
            assert time.monotonic() < deadline, (said(out), own.poll())
            time.sleep(0.05)
        sid, pgid, grandchild = map(int, out.read_text().split())
        assert sid == pgid == own.pid  # a session and process group of its own
        assert int((tmp_path / "out2").read_text().split()[0]) != shared.pid  # the premise: not without it
        os.killpg(own.pid, signal.SIGKILL)
        assert own.wait(timeout=30) == -signal.SIGKILL
        while _alive(grandchild):
            assert time.monotonic() < deadline, "the command's own child outlived the group's SIGKILL"
            time.sleep(0.05)
    finally:
        for child in (own, shared):
            child.kill()
            child.wait(timeout=30)
        shared_child = said(tmp_path / "out2")
        if len(shared_child) == 3:
            try:
                os.kill(int(shared_child[2]), signal.SIGKILL)
            except ProcessLookupError:
                pass
