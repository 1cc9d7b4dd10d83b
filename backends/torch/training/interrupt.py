"""Ctrl-C and SIGTERM during a run: the first one stops cleanly, a second one stops at once.

Why: a long run killed by Ctrl-C used to exit 130 with no message and no
checkpoint (1,319 steps lost in one try).  While a `StopRequest` is
installed, the first SIGINT or SIGTERM only sets a flag and says what will
happen; the training loop sees the flag after the current step, writes a
checkpoint, and raises `Interrupted`, whose message says where the
checkpoint is and how to resume (exit status 128 + the signal, as a shell
expects).  A second signal raises KeyboardInterrupt right away, without
waiting for anything.

Signal handlers can only be set in the main thread; elsewhere (a library
caller's worker thread) nothing is installed and signals behave as before.
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from vgraph.base.diagnostics import VGraphError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(VGraphError):
    """A run the user stopped after its state was saved; the CLI exits 128 + the signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum


class StopRequest:
    """The flag a training loop polls once per step (`requested`), set by the first signal."""

    late_requests = True  # one process: a request during a sync point's logging still stops there (loop.py)

    def __init__(self, say: Callable[[str], None], on_request: Callable[[], None] | None = None, *,
                 echo_s: float = 0.0) -> None:
        self.say = say
        self.signum: int | None = None
        self.on_request = on_request  # called once, at the first signal (vgraph launch: tell the workers)
        # A worker under torchrun or srun gets one stop twice: Ctrl-C reaches the whole process group and the
        # agent forwards it again; a preempted SLURM job signals every process and srun forwards it. A second
        # signal within `echo_s` of the first is that echo, not a second request.
        self.echo_s = echo_s
        self._first_at = 0.0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if time.monotonic() - self._first_at < self.echo_s:
                return
            self.say("second interrupt: stopping now, without a checkpoint")
            raise KeyboardInterrupt
        self.signum = signum
        self._first_at = time.monotonic()
        self.say(f"{signal.Signals(signum).name}: finishing this step and writing a checkpoint "
                 f"(interrupt again to stop at once)")
        if self.on_request is not None:
            self.on_request()

    def install(self) -> Callable[[], None]:
        """Handle SIGINT and SIGTERM from now on; returns the function that puts the previous
        handlers back (a no-op outside the main thread, where nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return restore

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """`install` for the duration of a block."""
        restore = self.install()
        try:
            yield self
        finally:
            restore()

    def interrupted(self, message: str) -> Interrupted:
        assert self.signum is not None
        return Interrupted(message, self.signum)


__all__ = ["StopRequest", "Interrupted", "STOP_SIGNALS"]
