"""Crash safety: a run SIGKILLed at many points and resumed ends bitwise equal to an uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY
from vgraph.backends.torch.training.batches import default_corpus_documents
from zygote import popen, run_python

STEPS = 40

# Runs `vgraph train` and SIGKILLs itself at a chosen point: a real SIGKILL (no cleanup, no finally,
# no buffered output flushed), placed deterministically.
KILLER = textwrap.dedent("""
    import importlib, os, signal, sys
    import torch
    from vgraph.backends.torch import cli
    from vgraph.backends.torch.training import checkpoint
    T = importlib.import_module("vgraph.backends.torch.training.train")  # the module, not the function

    mode, n, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    seen = [0]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def counting(original, when=lambda *a, **k: True, before=True):
        def wrapper(*a, **k):
            if when(*a, **k):
                seen[0] += 1
                if seen[0] == n and before:
                    die()
            result = original(*a, **k)
            if seen[0] == n and not before:
                die()
            return result
        return wrapper

    if mode == "after-checkpoint":     # the n-th checkpoint is complete, `latest` points to it
        checkpoint.save_checkpoint = counting(checkpoint.save_checkpoint, before=False)
    elif mode == "mid-write":          # the n-th checkpoint has its tensors written but no state.json
        checkpoint._write_json = counting(checkpoint._write_json, when=lambda path, data: path.name == "state.json")
    elif mode == "mid-step":           # the n-th step has its gradients but not its update, and the
        original = torch.optim.Adam.step   # metrics file ends in half a line (as if killed mid-append)
        def step(self, *a, **k):
            seen[0] += 1
            if seen[0] == n:
                with open(T.Path(args[args.index("--out") + 1]) / "metrics.jsonl", "a") as f:
                    f.write('{"step": 99, "loss": 1.2')
                die()
            return original(self, *a, **k)
        torch.optim.Adam.step = step
    sys.exit(cli.main(args))
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    corpus = base / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    killer = base / "killer.py"
    killer.write_text(KILLER, encoding="utf-8")
    return base, corpus, killer


def _args(corpus: Path, out: Path) -> list[str]:
    return ["train", str(TINY), "--data", str(corpus), "--steps", str(STEPS), "--batch", "4", "--lr", "3e-3",
            "--seed", "5", "--checkpoint-every", "4", "--keep-checkpoints", "2", "--val-every", "0",
            "--deterministic", "--threads", "1", "--quiet", "--out", str(out)]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """`python CMD...` to its end, in a fork of the zygote (tests/zygote.py: torch imported once; a SIGKILL is the
    child's own, said as -9), as the reference beside it and the run killed from outside (`popen`)."""
    return run_python(cmd, env=_env(), timeout=120)


def _latest_step(run_dir: Path) -> int:
    pointer = run_dir / "latest"
    return int(pointer.read_text().strip().split("-")[1]) if pointer.is_file() else 0


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        out = {}
        for key in f.keys():
            t = f.get_tensor(key)
            out[key] = (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return out


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_anywhere_then_resume_is_bitwise_identical(setup) -> None:
    base, corpus, killer = setup
    reference, interrupted = base / "reference", base / "interrupted"

    # The uninterrupted reference runs alongside the interrupted chain.
    ref_proc = popen(["-m", "vgraph.backends.torch.cli", *_args(corpus, reference)], env=_env())

    resume = [*_args(corpus, interrupted), "--resume"]
    kills = [("after-checkpoint", 2), ("mid-step", 5), ("mid-write", 2)]
    steps_at_kill = []
    for i, (mode, n) in enumerate(kills):
        proc = _run([killer, mode, str(n), *(resume if i else _args(corpus, interrupted))])
        assert proc.returncode == -signal.SIGKILL, (mode, proc.returncode, proc.stderr)
        steps_at_kill.append(_latest_step(interrupted))
        if mode == "mid-write":  # a torn checkpoint directory is left behind; `latest` still names a whole one
            torn = list(interrupted.glob(".step-*.tmp-*"))
            assert len(torn) == 1 and not (torn[0] / "state.json").exists()
            assert (torn[0] / "model.safetensors").exists()
    assert steps_at_kill[0] == 8  # killed right after its second checkpoint
    assert steps_at_kill == sorted(steps_at_kill) and steps_at_kill[-1] < STEPS

    # And one kill from outside at whatever moment the process has reached.
    proc = popen(["-m", "vgraph.backends.torch.cli", *resume], env=_env())
    start_step = _latest_step(interrupted)
    deadline = time.monotonic() + 60
    while proc.poll() is None and _latest_step(interrupted) == start_step and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(0.013)  # then a little further: into the next steps, or wherever the process is
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.communicate()

    finished = _run(["-m", "vgraph.backends.torch.cli", *resume])
    assert finished.returncode == 0, finished.stderr
    _, ref_err = ref_proc.communicate(timeout=120)
    assert ref_proc.returncode == 0, ref_err
    assert not list(interrupted.glob(".step-*"))  # stale temporaries were cleaned up

    final = f"step-{STEPS:08d}"
    for name in ("model.safetensors", "optimizer.safetensors", "state.safetensors"):
        mine, theirs = _tensors(interrupted / final / name), _tensors(reference / final / name)
        assert mine.keys() == theirs.keys() and mine, name
        for key in mine:  # bit for bit (the file headers' key order may differ between processes)
            assert mine[key] == theirs[key], f"{name}: {key}"
    ref_rows, int_rows = _rows(reference), _rows(interrupted)
    assert [r["step"] for r in int_rows] == list(range(1, STEPS + 1))  # no duplicates, no torn line
    assert [(r["loss"], r["lr"]) for r in int_rows] == [(r["loss"], r["lr"]) for r in ref_rows]
