"""What makes a checkpoint survive a power loss, from a surviving mutant (TESTING.md).

A rename is durable only once the directory holding it is fsynced: the checkpoint's own directory (its
files) before it is renamed into place, the run directory after the rename and after `latest` moves.
No test can cut the power, so this one records which directories `save_checkpoint` fsyncs (a mutant
that skipped the directory fsync on POSIX passed every other test).
"""
from __future__ import annotations

import os
import stat

import torch

from vgraph.backends.torch.training import checkpoint as C


def test_save_fsyncs_the_checkpoint_and_the_run_directory(tmp_path, monkeypatch) -> None:
    opened: dict[int, str] = {}
    synced_dirs: list[str] = []
    real_open, real_fsync = os.open, os.fsync

    def spy_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        opened[fd] = os.fspath(path)
        return fd

    def spy_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced_dirs.append(opened.get(fd, "?"))
        return real_fsync(fd)

    monkeypatch.setattr(C.os, "open", spy_open)
    monkeypatch.setattr(C.os, "fsync", spy_fsync)
    run = tmp_path / "run"
    for step in (1, 2, 2):  # a new checkpoint, another, and one replacing an existing directory
        C.save_checkpoint(run / f"step-{step}", step=step, model_state={"w": torch.ones(2)},
                          optimizer_states={}, rng_state={})
        names = [os.path.basename(p) for p in synced_dirs]
        assert any(n.startswith(f".step-{step}.tmp-") for n in names), names  # the files, before the rename
        assert names.count("run") >= 2, names  # after the rename, and after `latest` moved
        synced_dirs.clear()
    assert (run / "latest").read_text() == "step-2\n"


def test_atomic_write_fsyncs_the_new_file_before_renaming_it_over_the_old(tmp_path, monkeypatch) -> None:
    """A crash between the rename and the data reaching the disk leaves an empty file where the old one was:
    the new file's own fsync must come first.  The system calls are recorded in order, the fsynced file known
    by its inode (the one the target has afterwards); both writers (bytes, and a library writing by name)."""
    from vgraph.base import safeio

    calls: list[tuple[str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(fd):
        calls.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def spy_replace(src, dst, *args, **kwargs):
        calls.append(("replace", os.stat(src).st_ino))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(safeio.os, "fsync", spy_fsync)
    monkeypatch.setattr(safeio.os, "replace", spy_replace)
    target = tmp_path / "out.txt"
    target.write_text("old")
    for write in (lambda: safeio.atomic_write(target, "new"),
                  lambda: safeio.atomic_write_with(target, lambda tmp: tmp.write_text("newer"))):
        calls.clear()
        write()
        inode = target.stat().st_ino
        assert ("fsync", inode) in calls and ("replace", inode) in calls, calls  # the premise: both happened
        assert calls.index(("fsync", inode)) < calls.index(("replace", inode)), calls
    assert target.read_text() == "newer"
