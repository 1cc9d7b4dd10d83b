"""Fresh Python processes for the suite's commands, forked from one that has already imported torch.

    from zygote import STDOUT, popen, run_python
    done = run_python([script, *args], cwd=..., env=..., timeout=600)   # as subprocess.run(capture_output=True)
    proc = popen(["-m", module, *args], env=..., stdout=log, stderr=STDOUT)   # as subprocess.Popen; several at once

Why: the suite is CPU-bound, and most of its CPU is Python starting the same third-party libraries again
(`import torch` ~2.5 CPU-s on the CI machine kind, `torch._dynamo`, which every first `Adam.step` imports, ~3
more).  A test that runs a benchmark script, the installed `vgraph` script or `python -m MODULE` needs a real
process (its own exit status, stdout and stderr, its own registries, entry points found on its own `sys.path`),
not a fresh import of torch.  Here a command runs in a child forked from a zygote: a Python process that imported
the third-party libraries below and nothing of this checkout, so every vgraph, passes, backends, plugin and
benchmark module, every registry and every entry point is loaded in the child as in a fresh interpreter.

What the child gets as a fresh `python ARGV` would: `sys.argv`, `sys.path` (the script's folder, or the working
directory for `-m`, then PYTHONPATH's entries), `os.environ`, the working directory, stdin from /dev/null,
stdout and stderr to files (buffered as PYTHONUNBUFFERED says), `__main__` run by runpy, and the interpreter's
exit: the status of a SystemExit, the traceback and status 1 of an uncaught exception, death by SIGINT after a
KeyboardInterrupt, non-daemon threads joined, atexit handlers run, the streams flushed (then os._exit: module
teardown is skipped).  What it shares with its siblings: the preloaded libraries' state from their import (the
thread settings torch read from OMP_NUM_THREADS; so zygotes are kept per value of the variables read at import,
`IMPORT_TIME_ENV`) and the string hash seed.  Python's `random` re-seeds itself in a fork; numpy's global
generator is re-seeded here.  The zygote's objects are frozen out of the garbage collector (`gc.freeze`): a
child's collections would otherwise write to every page of them (copy-on-write), 1.3 CPU-s a child here.

Not for a test that needs what a fresh interpreter does before the first line of its script (a crash in
torch's import, interpreter flags) or a command whose process is the thing under test at start-up.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: What the zygote imports (third-party only: nothing whose registries or entry points the commands load).  Not
#: onnxruntime: its thread pool, started at import, is not fork-safe (a forked child hung in its exit handlers).
#: matplotlib's figure and Agg canvas and TensorBoard's writer: every training command draws its loss curve and
#: logs to TensorBoard (~1.1 CPU-s of imports a child), as the launch's forkserver preloads them for its workers.
PRELOAD = ("numpy", "yaml", "torch", "torch._dynamo", "onnx", "matplotlib.figure", "matplotlib.backends.backend_agg",
           "torch.utils.tensorboard")
#: Variables the preloaded libraries read at their import: a command whose values differ gets another zygote
#: (matplotlib reads its configuration directory, MPLCONFIGDIR or under HOME and XDG_*, at import).
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "LD_", "ORT_",
                   "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE",
                   "MPL", "HOME", "XDG_")

_ZYGOTES: dict[tuple, "_Zygote"] = {}


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))


class _Zygote:
    """The test process's end of one zygote: requests in, the children's pids and exit statuses out."""

    def __init__(self, env: dict[str, str]) -> None:
        zenv = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=zenv, cwd="/", text=True, bufsize=1)
        self.exits: dict[int, int] = {}
        self.pending = b""
        try:
            ready = self._next(None)
        except RuntimeError:
            ready = None
        if ready != "ready":
            raise RuntimeError(f"the zygote did not start (said {ready!r}, exit {self.proc.poll()})")

    def _next(self, deadline: float | None) -> dict | None:
        """The zygote's next message, or None at the deadline.  Read from the pipe's descriptor into a buffer of
        our own: a buffered reader takes several messages at once, and select() then waits on an empty pipe
        while the next message sits read (two children ending together timed out so)."""
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"the zygote exited ({self.proc.poll()}) with commands of it running")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        message = json.loads(line)
        if isinstance(message, dict) and "exited" in message:
            self.exits[message["exited"]] = message["returncode"]
        if isinstance(message, dict) and "started" in message:
            self.exits.pop(message["started"], None)  # a reused pid: the earlier child's end is not this one's
        return message

    def start(self, request: dict) -> int:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while True:
            message = self._next(None)
            if "started" in message:
                return message["started"]

    def wait(self, pid: int, deadline: float | None) -> int | None:
        while pid not in self.exits:
            if self._next(deadline) is None:
                return None
        return self.exits[pid]


def _zygote(env: dict[str, str]) -> _Zygote:
    key = _key(env)
    zygote = _ZYGOTES.get(key)
    if zygote is None or zygote.proc.poll() is not None:
        zygote = _ZYGOTES[key] = _Zygote(env)
    return zygote


class Child:
    """What subprocess.Popen gives a test, for a command running in a child of the zygote: its pid, poll, wait,
    signals, and (for the streams it was not given files for) communicate."""

    def __init__(self, argv: list, cwd: str | Path | None, env: dict[str, str] | None,
                 stdout: str | Path | None, stderr: str | Path | None, start_new_session: bool = False) -> None:
        self.args = [sys.executable, *[str(a) for a in argv]]
        env = dict(os.environ if env is None else env)
        self._zygote = _zygote(env)
        stem = _scratch() / f"{time.monotonic_ns()}"
        self._own = [p for p, given in ((Path(f"{stem}.out"), stdout), (Path(f"{stem}.err"), stderr)) if given is None]
        self.stdout_path = Path(stdout) if stdout is not None else Path(f"{stem}.out")
        self.stderr_path = self.stdout_path if stderr == STDOUT else Path(stderr) if stderr else Path(f"{stem}.err")
        self.pid = self._zygote.start({"argv": self.args[1:], "cwd": str(Path(cwd or os.getcwd()).resolve()),
                                       "env": env, "stdout": str(self.stdout_path), "stderr": str(self.stderr_path),
                                       "new_session": start_new_session})
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, time.monotonic())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, None if timeout is None else time.monotonic() + timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) as text once the command has ended; its own files are removed."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            exc.output, exc.stderr = _text(self.stdout_path), _text(self.stderr_path)
            raise
        texts = _text(self.stdout_path), _text(self.stderr_path)
        for path in self._own:
            path.unlink(missing_ok=True)
        return texts


STDOUT = "stdout"  #: stderr=STDOUT: both streams to stdout's file, as subprocess.STDOUT


def popen(argv: list, *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
          stdout: str | Path | None = None, stderr: str | Path | None = None,
          start_new_session: bool = False) -> Child:
    """`python ARGV...` (a script path, or "-m", MODULE) started in a child of the zygote, as subprocess.Popen
    starts it; stdout and stderr go to the files named (stderr=STDOUT: stdout's), or to files of its own that
    communicate() reads.  start_new_session as Popen's (the child calls setsid): a launcher a test SIGKILLs
    with its forkserver and workers, `os.killpg(child.pid, SIGKILL)`, as a machine is lost."""
    return Child(argv, cwd, env, stdout, stderr, start_new_session)


def run_python(argv: list, *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python ARGV...` in a child of the zygote, answered as subprocess.run(capture_output=True, text=True)
    answers; on `timeout` the child is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
    child = popen(argv, cwd=cwd, env=env)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        out, err = child.communicate()
        raise subprocess.TimeoutExpired(child.args, timeout, out, err) from None
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def _text(path: Path) -> str:
    """As subprocess.run(text=True) decodes (the locale's encoding, universal newlines)."""
    try:
        with open(path, encoding=None, newline=None) as f:
            return f.read()
    except FileNotFoundError:
        return ""


_SCRATCH: list[Path] = []


def _scratch() -> Path:
    """This test process's folder for the streams of commands given no files (removed at its exit)."""
    if not _SCRATCH:
        _SCRATCH.append(Path(tempfile.mkdtemp(prefix=f"zygote-{os.getpid()}-")))
    return _SCRATCH[0]


@atexit.register
def _close() -> None:
    for folder in _SCRATCH:
        shutil.rmtree(folder, ignore_errors=True)
    for zygote in _ZYGOTES.values():
        if zygote.proc.poll() is None:
            zygote.proc.stdin.close()
            try:
                zygote.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                zygote.proc.kill()


# -- the zygote itself ---------------------------------------------------------------------------------------

def _become_the_command(request: dict) -> None:
    """In the forked child: set up what a fresh `python ARGV` would have, run it, and exit as Python would
    (never returns)."""
    import importlib
    import io
    import runpy

    if request.get("new_session"):
        os.setsid()  # before anything it starts (a forkserver, workers): they are in its process group
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write),
                            (2, request["stderr"], write)):
        if fd == 2 and path == request["stdout"]:
            os.dup2(1, 2)  # stderr=STDOUT: one file, one offset
            continue
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False),
                                                   errors="backslashreplace", line_buffering=True)
    argv = request["argv"]
    module = argv[1] if argv[0] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *[os.path.abspath(p) for p in extra], *sys.path[1:]]
    importlib.invalidate_caches()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's global generator is seeded from the OS
    try:
        if module:
            sys.argv = [module, *argv[2:]]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:  # the interpreter's own answer to an uncaught exception: the traceback, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    _finalise_and_exit(code)


def _exit_status(stop: SystemExit) -> int:
    """The status Python exits with for this SystemExit (a message is printed to stderr, status 1)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def _finalise_and_exit(code: int) -> None:
    """What Py_FinalizeEx does that a command can see, in its order: non-daemon threads joined, atexit
    handlers run, the standard streams flushed.  Then os._exit: tearing down the modules inherited from the
    zygote would write to every page of them (copy-on-write) for nothing a command observes."""
    import atexit as _atexit
    import threading

    threading._shutdown()
    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # as Python does after a KeyboardInterrupt: die by the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _serve() -> None:
    """One request a line on stdin: fork, say the child's pid; say each child's exit status when it ends
    (several may run at once).  Nothing here may catch a forked child's way out: it leaves by os._exit."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()
    print(json.dumps("ready"), flush=True)
    pending, children = b"", set()
    while True:
        if b"\n" not in pending and select.select([0], [], [], 0.05 if children else None)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break  # the test process has gone: its commands run on, orphaned, as Popen's would
            pending += chunk
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            print(json.dumps({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)
        if b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _become_the_command(json.loads(line))  # leaves by os._exit, never back here
            children.add(pid)
            print(json.dumps({"started": pid}), flush=True)


if __name__ == "__main__":
    _serve()
