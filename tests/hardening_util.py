"""Helpers of the hardening tests (issue 11)."""
from __future__ import annotations

import resource
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def file_size_limit(max_bytes: int) -> Iterator[None]:
    """Writes past `max_bytes` in any file fail with EFBIG ("File too large"), in every library, as
    on a full disk (Python ignores SIGXFSZ, so the write returns the error instead of killing us)."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextmanager
def signal_after_rows(metrics: Path, rows: int, signum: int, timeout_s: float = 300) -> Iterator[None]:
    """Send `signum` to this process once `metrics` (a run's metrics.jsonl) holds `rows` rows: an
    interrupt that arrives while the run is training, whatever the machine's speed."""
    import os
    import threading
    import time

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().count("\n") >= rows:
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        watcher.join()
