"""Helpers of the hardening tests (issue 11)."""
from __future__ import annotations

import resource
import signal
import stat
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


def modes_against_umask(root: Path, umask: int) -> list[str]:
    """Every file and directory under `root` whose mode is not what `umask` allows (0o666/0o777 minus it)."""
    wrong = []
    for path in sorted(root.rglob("*")):
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        if not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) != want:
            wrong.append(f"{path.relative_to(root)}: {oct(stat.S_IMODE(path.stat().st_mode))}, not {oct(want)}")
    return wrong


def widened_head(text: str) -> str:
    """The tiny network with a wider SwiGLU head (64 -> 96 hidden units): valid, the same vocabulary, other
    parameter shapes (what a resume onto a changed network must explain)."""
    down = 'id: head_down\n    type: linear\n    config:\n      in_dim: "32"'
    assert text.count('out_dim: "64"') == 1 and down in text
    return text.replace('out_dim: "64"', 'out_dim: "96"').replace(down, down.replace('"32"', '"48"'))


def small_corpus(directory: Path) -> str:
    """A 20 kB training text (the embedded corpus, cut) written into `directory`: what the hardening tests
    train the tiny network on."""
    from vgraph.backends.torch.training.batches import default_corpus_documents

    path = directory / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return str(path)
