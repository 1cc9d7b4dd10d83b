"""Rescue shards (backends/torch/training/rescue.py) and their way to machine 0 (launcher/shard_transfer.py):
which step the survivors' shards make a checkpoint at (one step for every VNode, never a mix: a rank lost
between the control all-reduce and the optimizer step leaves survivors at s and s + 1), and what is refused:
a truncated shard, another run's, a renamed one, a step past the run's end, a VNode the network lacks,
replicas that disagree, a shard cut off half way by a second loss, and requests that name paths."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

from ports import launch_port
from vgraph.backends.torch.distributed.launcher.membership import Machines
from vgraph.backends.torch.distributed.launcher.shard_transfer import ShardReceiver, send_shards
from vgraph.backends.torch.training import checkpoint as ckpt
from vgraph.backends.torch.training.rescue import (SHARD_FILES, assemble, read_shards, run_identity, save_rescued,
                                                   write_shard)

RUN = run_identity("name: net\n", {"seed": 1, "batch": 8})
KEYS = {"a.weight", "a.bias", "b.weight"}
STAGE_A, STAGE_B = ("a.weight", "a.bias"), ("b.weight",)
TOKEN = "rescue-unit-secret-0123"


def shard(folder: Path, rank: int, step: int, keys=STAGE_A, attempt: int = 0, run: str = RUN, value: float = 0.0):
    """A rank's shard at `step`: each parameter filled with step + value (so steps are told apart), Adam-like
    moments beside it."""
    model = {k: torch.full((2, 3), float(step) + value) for k in keys}
    optim = {k: {"step": torch.tensor(float(step)), "exp_avg": torch.full((2, 3), 0.1 * step)} for k in keys}
    return write_shard(folder, run=run, attempt=attempt, rank=rank, pnode=f"w{rank}", step=step, model=model,
                       optim=optim, extra={"grad_scaler": {"scale": 1.0}, "compression": {"boundary": {}}})


def rescue(folder: Path, floor: int = 0, ceiling: int = 100, reached: int = 0):
    shards, refused = read_shards(folder, run=RUN, attempt=0)
    return assemble(shards, keys=KEYS, floor=floor, ceiling=ceiling, reached=reached, refused=refused)


def test_the_shards_at_one_step_make_the_checkpoint(tmp_path):
    shard(tmp_path, 0, 5)
    shard(tmp_path, 1, 5, STAGE_B)
    shard(tmp_path, 2, 5)  # replica 1 of stage A: identical, not needed
    found = rescue(tmp_path, floor=4)
    assert found.step == 5 and found.reached == 5 and found.ranks == [0, 1, 2] and set(found.model) == KEYS
    assert all(float(t[0, 0]) == 5.0 for t in found.model.values())
    assert float(found.optim["b.weight"]["step"]) == 5.0
    path = save_rescued(tmp_path / "run", found, {"layout": "unfused"}, keep=3)
    saved = ckpt.load_checkpoint(path)
    assert ckpt.latest_checkpoint(tmp_path / "run") == path and saved.step == 5 and set(saved.model_state) == KEYS
    assert saved.extra["rescued_from"] == [0, 1, 2] and saved.extra["layout"] == "unfused"


def test_rescue_saved_assembles_saves_and_says_what_it_refused(tmp_path, monkeypatch):
    """The one rescue machine 0 and a successor both make (rescue.rescue_saved): the shards assembled and
    saved in the run directory, each refused shard said; a checkpoint that cannot be written (a full disk)
    keeps the step found and says why, saving nothing."""
    import errno

    from vgraph.backends.torch.training import rescue as rescue_mod

    folder = tmp_path / "shards"
    shard(folder, 0, 5)
    shard(folder, 1, 5, STAGE_B)
    shard(folder, 2, 5, run=run_identity("name: other\n", {"seed": 1, "batch": 8}))  # another run's: refused
    said: list[str] = []
    kwargs = dict(run=RUN, attempt=0, keys=KEYS, floor=4, ceiling=100, logged=5, extra={"layout": "unfused"}, keep=3,
                  say=said.append)
    found = rescue_mod.rescue_saved(folder, tmp_path / "run", **kwargs)
    assert found.step == 5 and found.ranks == [0, 1] and found.unsaved == ""
    assert found.saved is not None and ckpt.latest_checkpoint(tmp_path / "run") == found.saved
    assert ckpt.load_checkpoint(found.saved).step == 5
    assert len(said) == 1 and said[0].startswith("launch: rescue shard refused: a0-r2")

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rescue_mod, "save_rescued", full)
    found = rescue_mod.rescue_saved(folder, tmp_path / "full", **kwargs)
    assert found.step == 5 and found.saved is None and found.unsaved == "No space left on device"
    assert not (tmp_path / "full").exists()
    nothing = rescue_mod.rescue_saved(folder, tmp_path / "later", **{**kwargs, "floor": 5})  # no gain: not saved
    assert nothing.step is None and nothing.saved is None and not (tmp_path / "later").exists()


def test_a_rank_lost_between_the_control_all_reduce_and_the_optimizer_step(tmp_path):
    """Rank 0's all-reduce completed and it stepped to 4; its replica (rank 2) and stage B (rank 1) still
    waited in it at 3.  Step 3 is whole (rank 2 has stage A at 3): the checkpoint is at 3, never rank 0's step
    4 mixed with stage B's 3, and step 4 is counted as redone (reached 4)."""
    shard(tmp_path / "whole", 0, 4)
    shard(tmp_path / "whole", 2, 3)
    shard(tmp_path / "whole", 1, 3, STAGE_B)
    found = rescue(tmp_path / "whole", floor=2)
    assert found.step == 3 and found.reached == 4 and found.ranks == [1, 2]
    assert {float(t[0, 0]) for t in found.model.values()} == {3.0}  # nothing of step 4
    # Without rank 2, no step holds every VNode: stage A only at 4, stage B only at 3.
    shard(tmp_path / "torn", 0, 4)
    shard(tmp_path / "torn", 1, 3, STAGE_B)
    torn = rescue(tmp_path / "torn", floor=2)
    assert torn.step is None and torn.reached == 4 and "none holds a.bias" in torn.why
    assert rescue(tmp_path / "whole", floor=3).step is None  # no later than the last checkpoint: no gain


def test_a_run_with_per_rank_state_takes_no_rescue(tmp_path):
    shard(tmp_path, 0, 5)
    shard(tmp_path, 1, 5, STAGE_B)
    shards, _ = read_shards(tmp_path, run=RUN, attempt=0)
    assert assemble(shards, keys=KEYS, floor=0, ceiling=100).step == 5  # the premise: a whole step
    found = assemble(shards, keys=KEYS, floor=0, ceiling=100, per_rank_state="error feedback")
    assert found.step is None and found.why == "error feedback" and found.reached == 5


def test_a_step_rank_0_did_not_log_is_not_taken(tmp_path):
    """Rank 0 (which writes the rows) still waited in step 4's all-reduce when the others completed it: step 4
    is whole in the shards but has no row, so it is not taken (the log would miss it); step 3 is not whole."""
    shard(tmp_path, 0, 3)
    shard(tmp_path, 1, 4, STAGE_B)
    shard(tmp_path, 2, 4)
    assert rescue(tmp_path).step == 4  # the premise: without the log's bound, step 4 is whole
    shards, _ = read_shards(tmp_path, run=RUN, attempt=0)
    found = assemble(shards, keys=KEYS, floor=0, ceiling=100, logged=3, reached=3)
    assert found.step is None and found.reached == 4 and found.why.startswith("step 4 has no row in the log")
    assert assemble(shards, keys=KEYS, floor=0, ceiling=100, logged=4).step == 4


def test_replicas_that_disagree_are_not_taken(tmp_path):
    shard(tmp_path, 0, 6)
    shard(tmp_path, 1, 6, STAGE_B)
    shard(tmp_path, 2, 6, value=0.5)  # stage A's replica holds other values at the same step
    shard(tmp_path, 3, 5)
    shard(tmp_path, 4, 5, STAGE_B)
    found = rescue(tmp_path)
    assert found.step == 5 and found.reached == 6  # step 6 refused, the whole and agreeing step 5 taken
    why = rescue(tmp_path, floor=5).why
    assert why.startswith("at step 6 shards a0-r0 and a0-r2 hold different values of a.") and "step 5 is no" in why


def test_hostile_shards_are_refused_with_a_reason(tmp_path):
    shard(tmp_path, 0, 5)
    shard(tmp_path, 1, 5, STAGE_B)
    shard(tmp_path, 2, 5, run="another-run")
    shard(tmp_path, 3, 500)  # past the run's last step (ceiling 100)
    shard(tmp_path, 4, 5, ("a.weight", "x.weight"))  # a VNode the network lacks
    shard(tmp_path, 5, 5)
    (tmp_path / "a0-r5" / ckpt.MODEL_FILE).write_bytes((tmp_path / "a0-r5" / ckpt.MODEL_FILE).read_bytes()[:40])
    shard(tmp_path, 6, 5)
    (tmp_path / "a0-r6").rename(tmp_path / "a0-r7")  # its record says rank 6
    shard(tmp_path, 8, 5, attempt=1)  # another attempt's: not this rescue's, and not refused
    (tmp_path / "notes").mkdir()
    (tmp_path / "a0-r9").symlink_to(tmp_path / "a0-r0")
    found = rescue(tmp_path)
    assert found.step == 5 and found.ranks == [0, 1]
    why = "\n".join(found.refused)
    for expected in ("a0-r2: it belongs to another run", "a0-r3: says step 500, past the run's last step 100",
                     "a0-r4: holds x.weight, which the network does not have", "a0-r5: cannot be read",
                     "a0-r7: its record says attempt 0, rank 6", "notes: not a rescue shard",
                     "a0-r9: not a rescue shard"):
        assert expected in why, why
    assert "a1-r8" not in why and len(found.refused) == 7


@pytest.fixture()
def channel(tmp_path):
    """Machine 0 (serving a ShardReceiver into tmp_path/m0) and machine 1 of a run on loopback."""
    port = launch_port()
    m0, m1 = Machines(), Machines()
    m0.open("127.0.0.1", port, TOKEN, 0, 2, link_timeout=5.0, rejoin_timeout=5.0)
    receiver = ShardReceiver(tmp_path / "m0")
    m0.serve_extra(receiver.answer)
    m1.open("127.0.0.1", port, TOKEN, 1, 2, link_timeout=5.0, rejoin_timeout=5.0)
    yield m1, tmp_path / "m0", receiver
    m1.close()
    m0.close()


def test_a_machine_sends_its_shards_to_machine_0_over_the_sealed_channel(channel, tmp_path, monkeypatch):
    m1, received, _ = channel
    monkeypatch.setattr("vgraph.backends.torch.distributed.launcher.shard_transfer.CHUNK_BYTES", 100)  # chunks
    shard(tmp_path / "m1", 1, 5, STAGE_B)
    assert (tmp_path / "m1" / "a0-r1" / ckpt.MODEL_FILE).stat().st_size > 100  # more than a chunk
    shard(tmp_path / "m1", 3, 5, attempt=1)  # another attempt's: stays here
    said: list[str] = []
    assert send_shards(m1.request, tmp_path / "m1", 0, said.append) == ["a0-r1"] and said == []
    assert sorted(p.name for p in (tmp_path / "m1").iterdir()) == ["a0-r1", "a1-r3"]
    shard(received, 0, 5)  # machine 0's own
    found = rescue(received)
    assert found.step == 5 and found.ranks == [0, 1]
    assert torch.equal(found.model["b.weight"], torch.full((2, 3), 5.0))


def test_a_second_loss_during_the_rescue_leaves_no_shard(channel, tmp_path):
    """Machine 1 sends half of a shard, then is lost: nothing arrives whole, the assembly does not see it and
    falls back (no step covers every VNode)."""
    m1, received, _ = channel
    shard(tmp_path / "m1", 1, 5, STAGE_B)
    data = (tmp_path / "m1" / "a0-r1" / ckpt.MODEL_FILE).read_bytes()
    reply = m1.request("rescue-put", shard="a0-r1", file=ckpt.MODEL_FILE, offset=0,
                       data=base64.b64encode(data[:50]).decode())
    assert reply == {"ok": True, "have": 50}
    shard(received, 0, 5)
    found = rescue(received)
    assert found.step is None and found.refused == [] and "none holds b.weight" in found.why
    assert (received / ".in-a0-r1").is_dir() and not (received / "a0-r1").exists()
    assert send_shards(m1.request, tmp_path / "m1", 1, lambda line: None) == []  # the next rescue's send
    assert not (tmp_path / "m1" / "a0-r1").exists()  # ... removes the earlier attempt's shards


def test_the_receiver_takes_no_path_and_no_torn_file(channel, tmp_path):
    m1, received, receiver = channel
    put = dict(shard="a0-r1", file=ckpt.MODEL_FILE, offset=0, data=base64.b64encode(b"x" * 10).decode())
    for bad, message in ((dict(shard="../../etc"), "not a rescue shard's name"),
                         (dict(shard="a0-r1/.."), "not a rescue shard's name"),
                         (dict(file="../state.json"), "not a file of a shard"),
                         (dict(data="***"), "must be base64"),
                         (dict(offset=-1), "whole number of bytes"),
                         (dict(offset=True), "whole number of bytes"),
                         (dict(offset=7), "but 0 bytes arrived so far")):
        assert message in m1.request("rescue-put", **{**put, **bad})["error"]
    assert "only another machine" in receiver.answer({"op": "rescue-put", "machine": 0, **put})["error"]
    assert m1.request("rescue-put", **put) == {"ok": True, "have": 10}
    assert m1.request("rescue-put", **put) == {"ok": True, "have": 10}  # sent again after a lost answer
    files = {name: {"size": 10, "sha256": "0" * 64} for name in SHARD_FILES}
    assert "did not arrive whole" in m1.request("rescue-done", shard="a0-r1", files=files)["error"]
    assert "a shard has the files" in m1.request("rescue-done", shard="a0-r1", files={"x": {}})["error"]
    assert not (received / "a0-r1").exists() and sorted(p.name for p in received.iterdir()) == [".in-a0-r1"]


def test_a_link_that_fails_during_the_send_is_said_and_skipped(tmp_path):
    shard(tmp_path, 1, 5, STAGE_B)
    said: list[str] = []

    def lost(op, timeout=0, **fields):
        raise OSError("connection refused")

    assert send_shards(lost, tmp_path, 0, said.append) == []
    assert len(said) == 1 and "a0-r1 not sent to the coordinator: connection refused" in said[0]


def test_rank_0_writes_the_rows_a_failure_left_unwritten(tmp_path):
    """RankOutput.unwritten (the loop's failure path): rank 0 appends the steps it finished since its last sync
    point, so a rescue after them leaves no step unlogged; the resumed attempt's restart cuts the log back to
    the step it resumed from.  Other ranks (no log) write nothing."""
    from vgraph.backends.torch.distributed.runtime.rank_zero import RankOutput
    from vgraph.backends.torch.training.metrics_log import MetricsLog, read_rows

    def output(log):
        return RankOutput(None, None, log=log, progress=None, pnodes=[], curve=(tmp_path / "c.png", "n"),
                          before_save=lambda: None, after_step=lambda step: None, say=lambda line: None)

    log = MetricsLog(tmp_path, ["step", "loss", "lr", "elapsed_s", "tokens_per_s"])
    log.restart(0)
    log.append([{"step": 1, "loss": 2.0, "lr": 1e-3, "elapsed_s": 0.1, "tokens_per_s": 10.0}])
    output(log).unwritten([{"step": s, "loss": 1.5, "lr": 1e-3, "elapsed_s": 0.1 * s} for s in (2, 3)])
    output(None).unwritten([{"step": 4, "loss": 1.0, "lr": 1e-3, "elapsed_s": 0.4}])
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[-1].startswith("3,1.5,")
    MetricsLog(tmp_path, log.columns).restart(2)  # the rescue took step 2: step 3 is trained again
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2]


def test_the_final_summary_says_the_steps_redone(tmp_path, monkeypatch, capsys):
    from conftest import TINY_FP32
    from vgraph.backends.torch.distributed.launcher import launch as launch_module

    def finished(config):
        return launch_module.LaunchResult(Path(config.out), 6, 1.25, None, None, restarts=2, steps_redone=1)

    monkeypatch.setattr(launch_module, "launch", finished)
    assert launch_module.main(["launch", str(TINY_FP32), "--fleet", "cpu2", "--out", str(tmp_path / "run")]) == 0
    assert "step 6, loss 1.2500, 2 restart(s), 1 step(s) redone;" in capsys.readouterr().out
