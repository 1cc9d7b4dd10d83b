"""supervisor.warm: the forkserver the workers fork from starts before the first attempt (its imports beside
the placement, or while a joiner waits for admission), and the first attempt's workers fork from that same
server.  In a child of the zygote (a fresh interpreter's modules and multiprocessing state): the pytest
process's own forkserver may already run."""
from __future__ import annotations

import json

from conftest import ROOT
from zygote import run_python

PROBE = """
import json, os, sys
from multiprocessing import forkserver
from vgraph.backends.torch.distributed.launcher import supervisor
main = sys.modules["__main__"]
before = forkserver._forkserver._forkserver_pid
supervisor._context()
preload = list(forkserver._forkserver._preload_modules)  # what the workers' server imports
supervisor._context(rank_zero=False)
joiner = list(forkserver._forkserver._preload_modules)  # a joined machine's: never rank 0's
import multiprocessing as mp
def light(rank_zero=True):  # the same server with a light preload: torch's imports would cost this test ~10 CPU-s
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["json"])
    return ctx
supervisor._context = light
supervisor.warm()
warmed = forkserver._forkserver._forkserver_pid
supervisor.warm(wait=True)  # again, waiting for it: the same server
again = forkserver._forkserver._forkserver_pid
alive = os.waitpid(warmed, os.WNOHANG)[0] == 0
ctx = supervisor._context()
p = ctx.Process(target=os.getpid)
with supervisor._main_module_hidden():
    p.start()
p.join(60)
used = forkserver._forkserver._forkserver_pid
print(json.dumps({"before": before, "warmed": warmed, "again": again, "alive": alive, "used": used,
                  "exit": p.exitcode, "main_kept": sys.modules["__main__"] is main,
                  "preload": preload, "joiner": joiner}))
"""


def test_warm_starts_the_workers_forkserver_once_and_the_first_worker_forks_from_it(tmp_path) -> None:
    script = tmp_path / "warm_probe.py"
    script.write_text(PROBE)
    out = run_python([str(script)], cwd=str(ROOT), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] is None and isinstance(got["warmed"], int)  # the premise: no server before warm()
    assert got["again"] == got["used"] == got["warmed"] and got["alive"] and got["exit"] == 0
    assert got["main_kept"] and "torch._dynamo" in got["preload"]
    # The workers' own module (torch, the lowering, the loop): the launcher no longer imports it for them.
    assert "vgraph.backends.torch.distributed.runtime.worker" in got["preload"]
    assert "vgraph.backends.torch.distributed.runtime.worker" in got["joiner"]
    # Rank 0's imports (the loss curve, TensorBoard) only where rank 0 may run: not on a joined machine.
    assert "matplotlib.figure" in got["preload"] and "torch.utils.tensorboard" in got["preload"]
    assert "torch._dynamo" in got["joiner"] and not {"matplotlib.figure", "torch.utils.tensorboard"} & set(got["joiner"])
