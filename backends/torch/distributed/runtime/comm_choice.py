"""How the workers of `vgraph launch` talk: the process-group backend and what follows from it.

Why a module of its own: the nccl path has logic of its own (each worker on
its own GPU, a separate gloo group for the CPU-side control messages nccl
cannot carry, activations staying on the device) that a machine without GPUs
would otherwise never run.  Deciding it in one pure function makes every
branch testable anywhere, and the `nccl-on-gloo` mode takes the nccl path's
code (separate control group, host-staged activations) over gloo, so the
test suite runs it end to end on CPUs.

Decisions (`choose_comm`):

* CPU workers: gloo, activations on the CPU, one group for everything;
* CUDA, every local worker with a GPU of its own and nccl available: nccl for
  the activations and gradients (device tensors, no host copy), plus a gloo
  control group for losses, checkpoints gathering and barriers;
* CUDA, more local workers than GPUs (they share one) or no nccl: gloo, with
  CUDA tensors staged through host memory (`Transport(stage_through_cpu)`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from vgraph.base.diagnostics import VGraphError

if TYPE_CHECKING:
    import torch

__all__ = ["CommChoice", "COMM_MODES", "DEFAULT_BUCKET_BYTES", "choose_comm", "worker_device"]

COMM_MODES = ("auto", "gloo", "nccl-on-gloo")
# The replicas' gradient buckets (grad_sync.py), here with the other settings the launcher checks and writes into
# the job without importing torch (backends/torch/__init__.py says why).
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default


@dataclass(frozen=True)
class CommChoice:
    device: str  # "cuda" or "cpu": where each worker computes
    backend: str  # torch.distributed backend of the default group
    stage_through_cpu: bool  # device tensors go through host memory on the wire
    control_group: bool  # a separate gloo group for CPU-side collectives (the default one is nccl's)

    def job_fields(self) -> dict:
        """What the launcher writes into each worker's job."""
        return asdict(self)

    def describe(self) -> str:
        extra = [x for x, on in (("control over gloo", self.control_group),
                                 ("staged through host memory", self.stage_through_cpu)) if on]
        return self.backend + (f" ({', '.join(extra)})" if extra else "")


def choose_comm(device_type: str, local_workers: int, cuda_devices: int, nccl_available: bool,
                mode: str = "auto") -> CommChoice:
    """The backend of a launch with `local_workers` workers on this machine (see the module docstring).

    `mode`: "auto" (the rules above), "gloo" (gloo whatever the device), or
    "nccl-on-gloo" (the nccl path's code with gloo as the wire: for tests).
    """
    if mode not in COMM_MODES:
        raise ValueError(f"comm mode must be one of {', '.join(COMM_MODES)}, not {mode!r}")
    cuda = device_type == "cuda"
    if mode == "nccl-on-gloo":
        return CommChoice("cuda" if cuda else "cpu", "gloo", stage_through_cpu=True, control_group=True)
    if not cuda:
        return CommChoice("cpu", "gloo", stage_through_cpu=False, control_group=False)
    nccl = mode == "auto" and nccl_available and 0 < local_workers <= cuda_devices
    if nccl:
        return CommChoice("cuda", "nccl", stage_through_cpu=False, control_group=True)
    return CommChoice("cuda", "gloo", stage_through_cpu=True, control_group=False)


def worker_device(device: str, local_rank: int, cuda_devices: int) -> torch.device:
    """The device of the worker with `local_rank` on its machine: its own GPU (round robin when shared)."""
    import torch

    if device != "cuda":
        return torch.device("cpu")
    if cuda_devices < 1:  # the job's mistake (or the machine's), not a crash torchrun should restart
        raise VGraphError(f"this job runs on CUDA (device: cuda) but this worker (local rank {local_rank}) sees no "
                          f"GPU: start its workers on machines with GPUs, or write the job again with --device cpu")
    return torch.device("cuda", local_rank % cuda_devices)
