"""`vgraph launch --nnodes 2` for real: one launcher per host of the netlab testbed (tools/netlab.py), each host
a network namespace with its own address, the launchers joined by `--master-addr <host 0's IP>` and the shared
secret.  A pipeline over the two hosts trains like `vgraph train` (losses, validation, final weights); a
2-replica run whose second host loses its link mid-run goes on with `--on-failure shrink` (every step logged
once, the same training), and with `restart` the host whose link comes back rejoins from the last checkpoint.

These run as root (CI does, on this machine kind: there they never skip); the tiny fixture network keeps each
run to seconds.  The launchers' channel (membership.py) and its decisions are also tested without a testbed,
over loopback, in tests/test_membership.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_FP32
from tools.netlab import Testbed
from weights_util import assert_same_weights
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.checkpoint import latest_checkpoint
from vgraph.backends.torch.training.batches import default_corpus_documents

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                 reason="the testbed needs root (CI runs as root: there it never skips)")]

VGRAPH = str(Path(sys.executable).with_name("vgraph"))
TOKEN = "testbed-launch-secret-0123"
SEED, BATCH, MICRO, LR = 3, 8, 4, 1e-3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("testbed")
    (d / "fleet.yml").write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return d


def settings(files: Path, steps: int) -> dict:
    return dict(network=str(TINY_FP32), data=str(files / "corpus.txt"), steps=steps, batch=BATCH, lr=LR, seed=SEED,
                val_every=10, checkpoint_every=5, threads=1)


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    """`vgraph train` of the same settings, one process: (its metrics rows, its last checkpoint), per step count."""
    out = {}
    for steps in (6, 30):
        run = tmp_path_factory.mktemp("ref") / f"run{steps}"
        rows = train(TrainConfig(**settings(files, steps), out=run, progress=False, tensorboard=False)).history
        out[steps] = (rows, latest_checkpoint(run))
    return out


def launch_argv(files: Path, tb: Testbed, node: int, out: Path, steps: int, *extra: str) -> list[str]:
    s = settings(files, steps)
    return [VGRAPH, "launch", s["network"], "--fleet", str(files / "fleet.yml"), "--data", s["data"],
            "--steps", str(steps), "--batch", str(BATCH), "--micro-batches", str(MICRO), "--lr", str(LR),
            "--seed", str(SEED), "--val-every", "10", "--checkpoint-every", "5", "--threads", "1",
            "--no-tensorboard", "--nnodes", "2", "--node-rank", str(node), "--master-addr", tb.ips[0],
            "--master-port", "29500", "--out", str(out / f"node{node}"), *extra]


def start(tb: Testbed, argvs: list[list[str]], logs: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, VGRAPH_LAUNCH_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher finds the interface towards the master itself
    return [tb.popen(i, argv, env=env, stdout=(logs / f"host{i}.log").open("w"), stderr=subprocess.STDOUT,
                     cwd=str(ROOT)) for i, argv in enumerate(argvs)]


def rows_of(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def same_training(run: Path, ref: tuple[list[dict], Path], steps: int) -> None:
    """Every step logged once; losses and validation losses at rtol 1e-5; the final weights and optimizer
    state as tests/weights_util.py holds two trainings to (measured here: at most 4e-6 of a tensor's largest
    value after 6 steps)."""
    rows, (ref_rows, ref_checkpoint) = rows_of(run), ref
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("loss", "val_loss"):
        got = torch.tensor([r[key] for r in rows if key in r], dtype=torch.float64)
        want = torch.tensor([r[key] for r in ref_rows if key in r], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert_same_weights(latest_checkpoint(run), ref_checkpoint, steps=steps, lr=LR)


def test_a_pipeline_over_two_namespace_hosts_trains_like_one_process(files, reference, tmp_path) -> None:
    with Testbed(2) as tb:
        procs = start(tb, [launch_argv(files, tb, i, tmp_path, 6, "--replicas", "1") for i in range(2)], tmp_path)
        codes = [p.wait(timeout=300) for p in procs]
    logs = [(tmp_path / f"host{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs
    # A pipeline of two stages, one per host: w0's worker on host 0, w1's on host 1.
    assert "on 2 worker(s) w0, w1" in logs[0] and "(1 replica(s)" in logs[0]
    assert "[w0] task" in logs[0] and "[w1] task" in logs[1] and "[w1]" not in logs[0]
    placement = json.loads((tmp_path / "node0" / "placement.json").read_text())
    assert {r["boundary_bytes"] for r in rows_of(tmp_path / "node0")} == {placement["bytes_per_step"]} != {0}
    same_training(tmp_path / "node0", reference[6], 6)


def cut_when(tb: Testbed, run: Path, step: int) -> None:
    wait_for(lambda: any(r["step"] >= step for r in rows_of(run)), f"step {step}")
    tb.cut(1)


def test_a_host_that_loses_its_link_costs_its_replica_with_shrink(files, reference, tmp_path) -> None:
    with Testbed(2) as tb:
        procs = start(tb, [launch_argv(files, tb, i, tmp_path, 30, "--replicas", "2", "--on-failure", "shrink",
                                       "--link-timeout", "2", "--comm-timeout", "60") for i in range(2)], tmp_path)
        cut_when(tb, tmp_path / "node0", 8)
        assert procs[0].wait(timeout=300) == 0, (tmp_path / "host0.log").read_text()
        lead, other = ((tmp_path / f"host{i}.log").read_text() for i in range(2))
    # Host 0 noticed the silence (not a gloo timeout: --comm-timeout is 60 s) and went on alone with the
    # global batch; host 1 noticed it could not reach host 0 and stopped its worker.
    assert "machine(s) 1 silent for 2 s" in lead and "Timed out" not in lead
    assert "with 1 replica(s), batch shares [8]" in lead and "[w1]" not in lead
    assert "no answer from machine 0 for 2 s" in other and "stopping this machine's workers" in other
    same_training(tmp_path / "node0", reference[30], 30)  # resumed from a checkpoint: nothing lost or twice


def test_a_host_whose_link_comes_back_rejoins_with_restart(files, reference, tmp_path) -> None:
    with Testbed(2) as tb:
        procs = start(tb, [launch_argv(files, tb, i, tmp_path, 30, "--replicas", "2", "--on-failure", "restart",
                                       "--link-timeout", "2", "--comm-timeout", "60") for i in range(2)], tmp_path)
        cut_when(tb, tmp_path / "node0", 8)
        wait_for(lambda: "silent for 2 s" in (tmp_path / "host0.log").read_text(), "host 0 to notice")
        tb.restore(1)
        codes = [p.wait(timeout=300) for p in procs]
    lead, other = ((tmp_path / f"host{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], (lead, other)
    assert "attempt 1" in lead and "attempt 1" in other and "attempt 2" not in lead
    assert "resumed from" in lead and other.count("[w1] task") == 2  # host 1's worker started again
    same_training(tmp_path / "node0", reference[30], 30)
