"""Training a partitioned network across processes on torch.distributed (`vgraph launch`).

    from vgraph.backends.torch.distributed import LaunchConfig, launch
    result = launch(LaunchConfig(network="net.yml", fleet="fleet.yml", steps=100, batch=8, micro_batches=4))
    result.history[-1]["loss"], result.restarts, result.placement["cut_bytes_per_step"]

One worker process per PNode of the placement hosts that PNode's part of the
network; boundary activations and their gradients travel by point-to-point
send/recv; micro-batches are pipelined (1F1B or GPipe); a tied weight split over
PNodes is synced every step; a worker that dies is detected and the run
restarts from the last checkpoint, on the same placement or re-partitioned
onto the surviving PNodes.  It is the same training as `vgraph train`
(same losses up to float rounding; checkpoints in the same unfused format, so
a run moves freely between one process and any partition).

The pieces, each in its own module:

* vgraph/run/step_plan.py (the core: no torch) - tasks (PNode x depth),
              transfers (cut edges), ties, the 1F1B / GPipe schedules and
              their per-peer message order (deadlock-free by construction);
* comm.py   - the transport: isend / ordered recv with buffering, bytes counted;
              the control group's small collectives (ControlGroup);
* worker.py - one rank's entry point and training loop: set-up, loss
              reduction, optimizer step, logging on rank 0;
* rank_stage.py - a rank's stage: its tasks' modules, optimizers, tied
              weights; stage_runner.py - its ops of one schedule round;
* grad_sync.py - the replicas' gradient sum: buckets all-reduced on torch's
              collectives while the last backward runs;
* tie_sync.py - tied weights split over two ranks, synced by reduce and
              broadcast;
* replica_groups.py - the stage groups of data-parallel replicas, and the
              check that replicas hold the same parameters;
* rank_zero.py - metrics entries and checkpoint shares gathered on rank 0
              (scattered back on resume);
* loss_scaler.py - fp16 loss scaling decided alike on every rank;
* launcher/ - the `launch` command (launch.py): its inputs resolved once
              (inputs.py), the placement (placing.py), each attempt's job file
              (emission.py), the attempts with their forkserver-started
              workers (attempts.py), failure detection, rescue and restarts
              (failures.py), joins and re-plan boundaries
              (boundaries.py).

Dropout keyed by (seed, step, VNode, sample) lives one level up
(`vgraph.backends.torch.lowering.dropout`): `vgraph train` uses it too.
"""
from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562), as the backend's package does (its __init__): a worker importing
# `distributed.job` does not import the launcher, and the launcher does not import torch through dropout.
_HOME = {
    **dict.fromkeys(("LaunchConfig", "LaunchResult", "launch", "place", "register_launch", "split_pipeline"),
                    ".launcher.launch"),
    **dict.fromkeys(("DistPlan", "Task", "Tie", "Transfer", "make_plan", "rank_ops", "schedule_ops"),
                    "vgraph.run.step_plan"),
    **dict.fromkeys(("dropout_key", "keyed_dropout"), "..lowering.dropout"),
}

__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:  # a submodule (`from ...distributed import job`) is then imported by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
