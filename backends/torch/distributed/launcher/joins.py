"""Machine 0's glue to elastic.py: the admission of a run that takes joins (what it offers a joined machine, a
join or a leave turned into a re-plan decision: boundaries.py) and what the launchers' channel answers besides
heartbeats and decisions (the other machines' rescue shards: shard_transfer.py, the joiners' requests).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ...training.rescue import RESCUE_DIR
from . import elastic
from .boundaries import last_step, replan
from .inputs import Run
from .shard_transfer import ShardReceiver

__all__ = ["open_admission", "serve_channel"]


def open_admission(run: Run) -> elastic.Admission:
    """Machine 0 of a run that takes joins: what it offers a joined machine (the prepared corpus's files,
    by the names its manifest gives) and how it decides on a join, served on the launchers' channel."""
    from vgraph.data.shards import MANIFEST, SPLITS, TOKENIZER_FILE, open_prepared

    admission = elastic.Admission(run.run_dir, run.fleet, run.source, run.max_nnodes, run.nnodes,
                                  step=lambda: last_step(run), on_join=lambda adm, joined: _on_join(run, joined),
                                  on_leave=lambda adm, machine, pnodes, step: _on_leave(run, machine, pnodes, step),
                                  homes=lambda: {**(run.home or {}), **admission.home()},
                                  successors=list(range(run.node_rank + 1, run.nnodes)) if run.succeeds else [])
    corpus = Path(run.data_dir)
    splits = open_prepared(corpus, verify="size").manifest["splits"]  # checked: names inside the directory
    for name in (MANIFEST, TOKENIZER_FILE):
        admission.serve(name, corpus / name)
    for shard in (shard for split in SPLITS for shard in splits[split]["shards"]):
        for key in ("bin", "idx"):  # the manifest's SHA-256 of each: a large corpus is not read again here
            admission.serve(shard[key], corpus / shard[key], shard[f"{key}_sha256"])
    return admission


def serve_channel(run: Run) -> None:
    """Machine 0: what its channel answers besides heartbeats and decisions: the other machines' rescue shards
    (shard_transfer.py) and, in a run that takes joins, the joiners' requests (elastic.py)."""
    receiver = ShardReceiver(run.launch_dir / RESCUE_DIR)

    def answer(request: dict) -> dict:
        if str(request.get("op", "")).startswith("rescue-"):
            return receiver.answer(request)
        if run.admission is not None:
            return run.admission.answer(request)
        if run.elastic:  # a successor taking the run over: its admission opens once it decided (failures.py)
            return {"wait": "the coordinator is being taken over"}
        return {"error": "this run takes no joins (--nnodes MIN:MAX)"}

    run.machines.serve_extra(answer)


def _on_join(run: Run, joined: Any) -> None:
    """A machine was admitted (its own thread): re-plan onto the grown fleet when it pays (`replan`)."""
    replan(run, "join", joined.step, run.admission.grown_fleet,
            {"pnode": joined.pnode.id, "machine": joined.machine}, label=f"join {joined.pnode.id}")


def _on_leave(run: Run, machine: int, pnodes: list[str], step: int) -> None:
    """Machine `machine` said it leaves (its own thread): the running plan cannot go on without its PNodes,
    so the boundary is taken whatever the price; the decision's figures say what the next plan predicts."""
    replan(run, "leave", step, run.admission.grown_fleet, {"pnodes": pnodes, "machine": machine},
            label=f"leave {', '.join(pnodes)} (machine {machine})", gone=pnodes)
