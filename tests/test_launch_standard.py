"""The standard launchers (issue 25 item 3): workers from `vgraph launch --emit-job` under torchrun and srun.

* torchrun --max-restarts 1, two local processes (two data-parallel replicas), the job's test hook holding
  rank 1 after step 3 and this test SIGKILLing it: torchrun restarts the worker set, which resumes from the
  step-2 checkpoint by itself; the run completes, every step is logged once, and the final weights and
  optimizer state are bit for bit those of an uninterrupted `vgraph launch` (deterministic CPU run).  The
  shared secret is set, so the workers' keys sit behind it on torchrun's store.
* two local processes started with SLURM's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, a
  compressed SLURM_JOB_NODELIST whose first host is the master): the same training as `vgraph train`
  (losses rtol 1e-5, weights and optimizer state as weights_util.py allows).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ports import launch_port
import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.checkpoint import load_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.rendezvous import TOKEN_ENV
from weights_util import assert_same_weights
from zygote import STDOUT, popen, run_python

pytestmark = pytest.mark.slow

STEPS, BATCH, MICRO, LR, SEED = 6, 8, 4, 1e-3, 7
WORKER = "vgraph.backends.torch.distributed.runtime.worker"
SECRET = "launch-standard-test-secret-0123"  # passes rendezvous.check_token, as a real one must
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("standard")
    vgraph.save(transformer(TransformerSpec("tiny-std", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                            head_up=64, precision=None)), d / "net.yml")  # dropout on
    (d / "fleet.yml").write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return d


def common(files: Path) -> dict:
    return dict(network=str(files / "net.yml"), data=str(files / "corpus.txt"), steps=STEPS, batch=BATCH, lr=LR,
                seed=SEED, val_every=3, checkpoint_every=2, threads=1, progress=False, deterministic=True)


def emit(files: Path, out: Path, **over) -> Path:
    launch(LaunchConfig(**{**common(files), **over}, out=out, fleet=str(files / "fleet.yml"), micro_batches=MICRO,
                        replicas=2, emit_job=out.parent / f"{out.name}-job", log=lambda line: None))
    return out.parent / f"{out.name}-job" / "job.json"


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", TOKEN_ENV)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_torchrun_restarts_a_killed_worker_set_from_the_last_checkpoint(files: Path, tmp_path: Path) -> None:
    reference = launch(LaunchConfig(**common(files), out=tmp_path / "ref", fleet=str(files / "fleet.yml"),
                                    micro_batches=MICRO, replicas=2))
    job = emit(files, tmp_path / "run", hold=("w1", 3))
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{launch_port()}", "--max-restarts", "1", "--monitor-interval", "0.1",
           "-m", WORKER, str(job)]
    log = (tmp_path / "torchrun.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(**{TOKEN_ENV: SECRET}))
    try:
        marker = tmp_path / "run" / "launch" / "held-w1"
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.05)
        held = json.loads(marker.read_text())
        assert held["step"] == 3
        time.sleep(0.3)  # the other worker moves on and blocks on the held one
        os.kill(held["pid"], signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, (tmp_path / "torchrun.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    last = f"step-{STEPS:08d}"
    assert load_checkpoint(tmp_path / "run" / last).extra["launch"]["attempt"] == 1  # written by the restarted set
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # every step logged once
    assert [r["loss"] for r in got] == [r["loss"] for r in reference.history]
    assert_same_weights(tmp_path / "run" / last, tmp_path / "ref" / last, bitwise=True)


def test_two_processes_with_slurm_variables_train_like_vgraph_train(files: Path, tmp_path: Path) -> None:
    ref = train(TrainConfig(**common(files), out=tmp_path / "ref"))
    job = emit(files, tmp_path / "run", progress=True)  # rank 0 draws its own bar (progress.py)
    port = launch_port()
    procs = []
    for rank in (0, 1):
        env = _env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242",
                   SLURM_JOB_NODELIST="localhost,node[02-03]", MASTER_PORT=str(port), **{TOKEN_ENV: SECRET})
        procs.append(popen(["-m", WORKER, job], stdout=tmp_path / f"rank{rank}.log", stderr=STDOUT, env=env))
    for proc in procs:  # forks of the zygote (tests/zygote.py): the workers' own processes, torch imported once
        try:
            assert proc.wait(timeout=240) == 0, (tmp_path / "rank0.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    shown = (tmp_path / "rank0.log").read_text()  # captured, so the bar prints lines, as `vgraph train`'s does
    assert f"launch: step {STEPS}/{STEPS} (100%) loss=" in shown and "eta" in shown
    for key in ("loss", "val_loss"):
        mine = [r[key] for r in got if key in r]
        theirs = [r[key] for r in ref.history if key in r]
        assert len(mine) == len(theirs) > 0
        torch.testing.assert_close(torch.tensor(mine, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64),
                                   rtol=1e-5, atol=0)
    last = f"step-{STEPS:08d}"
    assert_same_weights(tmp_path / "run" / last, tmp_path / "ref" / last, steps=STEPS, lr=LR)


@pytest.mark.parametrize("token", [None, "t" * 32, "short-secret"], ids=["unset", "one-letter", "short"])
def test_srun_without_a_real_shared_secret_is_refused(files: Path, tmp_path: Path, token: str | None) -> None:
    job = emit(files, tmp_path / "run")
    env = _env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID="1",
               SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(launch_port()), **({TOKEN_ENV: token} if token else {}))
    done = run_python(["-m", WORKER, job], env=env, timeout=120)  # a fork of the zygote: torch imported once
    assert done.returncode == 3 and TOKEN_ENV in done.stderr and "Traceback" not in done.stderr


def test_torchrun_sigterm_makes_rank_0_save_a_checkpoint(files: Path, tmp_path: Path) -> None:
    """Issue 38 item 7: the printed command carries --max-restarts; SIGTERM to torchrun (as a scheduler's
    preemption sends it) reaches the workers through torchrun's agent, and they finish the step and rank 0
    writes its checkpoint, as under `vgraph launch`, instead of dying with the run's steps since the last one."""
    run, lines = tmp_path / "run", []
    launch(LaunchConfig(**{**common(files), "steps": 50, "checkpoint_every": 0}, out=run, fleet=str(files / "fleet.yml"),
                        micro_batches=MICRO, replicas=2, emit_job=tmp_path / "run-job", hold=("w0", 2),
                        log=lines.append))
    printed = "\n".join(lines)
    assert "torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 3 " in printed and "resumes from the latest" in printed
    cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{launch_port()}", "--max-restarts", "3", "--monitor-interval", "0.1",
           "-m", WORKER, str(tmp_path / "run-job" / "job.json")]
    log = (tmp_path / "torchrun.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(**{TOKEN_ENV: SECRET}))
    try:
        marker = run / "launch" / "held-w0"
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.05)
        assert json.loads(marker.read_text())["step"] == 2 and not list(run.glob("step-*"))  # nothing saved yet
        proc.send_signal(signal.SIGTERM)  # to torchrun only: its agent forwards it to the workers
        time.sleep(1.0)
        (run / "launch" / "release").write_text("")  # rank 0 goes on from its held step
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    shown = (tmp_path / "torchrun.log").read_text()
    assert code != 0, shown  # the job was stopped, not finished
    saved = sorted(p.name for p in run.glob("step-*"))
    assert saved == ["step-00000003"], shown  # the step in flight finished, then rank 0 saved it
    assert load_checkpoint(run / "step-00000003").step == 3
    assert "stopped by SIGTERM" in shown and "runtime/worker.py" not in shown  # (torchrun prints its own)
