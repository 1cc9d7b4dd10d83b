"""`vgraph launch`'s communication choice (distributed/runtime/comm_choice.py): every branch, and the nccl path's code
run end to end over gloo (`comm="nccl-on-gloo"`: a separate gloo control group, activations staged through
host memory), which must train exactly like the single-process trainer.
"""
from __future__ import annotations

import json

import pytest
import torch

import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch import TrainConfig, train
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.runtime.comm_choice import CommChoice, choose_comm, worker_device
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.runtime.worker import LAUNCH_DIR
from vgraph.base.diagnostics import VGraphError


@pytest.mark.parametrize("device, workers, gpus, nccl, mode, want", [
    ("cpu", 2, 0, True, "auto", CommChoice("cpu", "gloo", False, False)),
    ("cuda", 2, 2, True, "auto", CommChoice("cuda", "nccl", False, True)),       # a GPU each: nccl + control group
    ("cuda", 2, 8, True, "auto", CommChoice("cuda", "nccl", False, True)),
    ("cuda", 3, 2, True, "auto", CommChoice("cuda", "gloo", True, False)),       # GPUs shared: gloo via host
    ("cuda", 2, 2, False, "auto", CommChoice("cuda", "gloo", True, False)),      # no nccl in this torch
    ("cuda", 2, 2, True, "gloo", CommChoice("cuda", "gloo", True, False)),
    ("cuda", 2, 2, True, "nccl-on-gloo", CommChoice("cuda", "gloo", True, True)),
    ("cpu", 2, 0, False, "nccl-on-gloo", CommChoice("cpu", "gloo", True, True)),
])
def test_choose_comm_covers_every_branch(device, workers, gpus, nccl, mode, want) -> None:
    assert choose_comm(device, workers, gpus, nccl, mode) == want


def test_choice_fields_and_description() -> None:
    choice = choose_comm("cuda", 2, 2, True)
    assert choice.job_fields() == {"device": "cuda", "backend": "nccl", "stage_through_cpu": False,
                                   "control_group": True}
    assert choice.describe() == "nccl (control over gloo)"
    assert choose_comm("cpu", 1, 0, True).describe() == "gloo"
    with pytest.raises(ValueError, match="comm mode"):
        choose_comm("cpu", 1, 0, True, "mpi")


def test_worker_devices() -> None:
    assert worker_device("cpu", 3, 0) == torch.device("cpu")
    assert [worker_device("cuda", r, 2) for r in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    with pytest.raises(VGraphError, match="sees no GPU"):  # the job's mistake: exit 3, not a crash to restart
        worker_device("cuda", 0, 0)


def test_an_unknown_comm_mode_is_a_diagnostic(tmp_path) -> None:
    with pytest.raises(VGraphError, match="comm must be one of auto, gloo, nccl-on-gloo"):
        launch(LaunchConfig(network="x.yml", fleet="f.yml", comm="nccl", out=tmp_path / "r", progress=False))


def test_the_nccl_path_over_gloo_trains_like_one_process(tmp_path) -> None:
    graph = transformer(TransformerSpec("tiny-comm", layers=2, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                       head_up=64, precision=None))  # dropout 0.1 stays on
    vgraph.save(graph, tmp_path / "net.yml")
    (tmp_path / "fleet.yml").write_text("name: t\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (tmp_path / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assignment = {n.id: "w1" if n.cfg.get("colocate_group") == "transformer_block_1" else "w0" for n in graph.nodes}
    common = dict(network=str(tmp_path / "net.yml"), data=str(tmp_path / "corpus.txt"), steps=4, batch=4, lr=1e-3,
                  seed=2, val_every=0, checkpoint_every=0, threads=1, progress=False)
    ref = train(TrainConfig(**common, out=tmp_path / "ref")).history
    lines: list[str] = []
    result = launch(LaunchConfig(**{**common, "progress": True}, out=tmp_path / "run", fleet=str(tmp_path / "fleet.yml"),
                                 micro_batches=2, placement=assignment, comm="nccl-on-gloo", log=lines.append))
    assert any("gloo (control over gloo, staged through host memory)" in line for line in lines), lines[:3]
    job = json.loads((tmp_path / "run" / LAUNCH_DIR / "job-0.json").read_text())
    assert (job["backend"], job["control_group"], job["stage_through_cpu"]) == ("gloo", True, True)
    assert len(set(result.placement["assignment"].values())) == 2
    torch.testing.assert_close(torch.tensor([r["loss"] for r in result.history], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in ref], dtype=torch.float64), rtol=1e-5, atol=0)
