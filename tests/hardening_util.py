"""Helpers of the hardening tests (issue 11)."""
from __future__ import annotations

import resource
import signal
from contextlib import contextmanager
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
