"""Fresh Python processes for the suite's commands, forked from one that has already imported torch.

    from zygote import run_python
    done = run_python([script, *args], cwd=..., env=..., timeout=600)   # as subprocess.run(capture_output=True)

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
import signal
import subprocess
import sys
import time
from pathlib import Path

#: What the zygote imports (third-party only: nothing whose registries or entry points the commands load).  Not
#: onnxruntime: its thread pool, started at import, is not fork-safe (a forked child hung in its exit handlers).
PRELOAD = ("numpy", "yaml", "torch", "torch._dynamo", "onnx")
#: Variables the preloaded libraries read at their import: a command whose values differ gets another zygote.
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "LD_", "ORT_",
                   "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE")

_ZYGOTES: dict[tuple, subprocess.Popen] = {}


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)))


def _zygote(env: dict[str, str]) -> subprocess.Popen:
    key = _key(env)
    proc = _ZYGOTES.get(key)
    if proc is None or proc.poll() is not None:
        zenv = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=zenv, cwd="/", text=True, bufsize=1)
        ready = proc.stdout.readline()
        if json.loads(ready or "null") != "ready":
            raise RuntimeError(f"the zygote did not start (said {ready!r}, exit {proc.poll()})")
        _ZYGOTES[key] = proc
    return proc


def _read(proc: subprocess.Popen, deadline: float | None) -> dict | None:
    """The zygote's next answer, or None at the deadline."""
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if select.select([proc.stdout], [], [], left)[0]:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the zygote exited ({proc.poll()}) while running a command")
            return json.loads(line)
        if deadline is not None and time.monotonic() >= deadline:
            return None


def run_python(argv: list, *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python ARGV...` (a script path, or "-m", MODULE) in a child of the zygote, answered as
    subprocess.run(capture_output=True, text=True) answers; on `timeout` the child is killed and
    subprocess.TimeoutExpired raised, as subprocess.run does."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    proc = _zygote(env)
    out_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    stem = out_dir / f"zygote-{os.getpid()}-{time.monotonic_ns()}"
    out, err = Path(f"{stem}.out"), Path(f"{stem}.err")
    request = {"argv": argv, "cwd": str(Path(cwd or os.getcwd()).resolve()), "env": env, "stdout": str(out),
               "stderr": str(err)}
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    try:
        pid = _read(proc, None)["pid"]
        done = _read(proc, None if timeout is None else time.monotonic() + timeout)
        if done is None:
            os.kill(pid, signal.SIGKILL)
            _read(proc, None)
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, _text(out), _text(err))
        return subprocess.CompletedProcess([sys.executable, *argv], done["returncode"], _text(out), _text(err))
    finally:
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)


def _text(path: Path) -> str:
    """As subprocess.run(text=True) decodes (the locale's encoding, universal newlines)."""
    try:
        with open(path, encoding=None, newline=None) as f:
            return f.read()
    except FileNotFoundError:
        return ""


@atexit.register
def _close() -> None:
    for proc in _ZYGOTES.values():
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


# -- the zygote itself ---------------------------------------------------------------------------------------

def _become_the_command(request: dict) -> None:
    """In the forked child: set up what a fresh `python ARGV` would have, run it, and exit as Python would
    (never returns)."""
    import importlib
    import io
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
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
    """One request a line on stdin: fork, say the child's pid, wait for it, say its exit status."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc
    gc.freeze()
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become_the_command(request)  # leaves by SystemExit or the command's exception, never back here
        print(json.dumps({"pid": pid}), flush=True)
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                          "cpu_s": usage.ru_utime + usage.ru_stime}), flush=True)


if __name__ == "__main__":
    _serve()
