"""What a run measured of its memory, next to what memory.py estimated before it started.

Why record both: the estimate (memory.py) refuses networks that cannot fit,
so a user must be able to see how it compares with reality on their runs
(`vgraph report` shows the two side by side).  The estimate goes into
run.json once (`estimate_record`); the measurement goes into metrics rows at
sync points (`peak_memory_bytes`), so a run still going shows it too.

What "measured" means depends on the device, and the record says which:
on CUDA the allocator's peak (`torch.cuda.max_memory_allocated`: tensors
only, what the estimate models); on a CPU the process's peak resident set
(`ru_maxrss`), which also holds the Python and torch runtime, so it is an
upper bound of what the estimate models, not the same quantity.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from .memory import MemoryEstimate

__all__ = ["estimate_record", "peak_memory_bytes", "measure_name"]


def measure_name(device: torch.device) -> str:
    """How `peak_memory_bytes` measures on `device` (recorded in run.json beside the estimate)."""
    if device.type == "cuda":
        return "cuda_max_memory_allocated"
    return "process_peak_rss"


def estimate_record(estimate: MemoryEstimate, device: torch.device) -> dict[str, Any]:
    """run.json's `memory_estimate`: every term in bytes, the total, and how the run measures."""
    return {"batch": estimate.batch, "parameters": estimate.parameters, "gradients": estimate.gradients,
            "optimizer": estimate.optimizer, "activations": estimate.activations, "workspace": estimate.workspace,
            "total": estimate.total, "measured_as": measure_name(device)}


def peak_memory_bytes(device: torch.device) -> int | None:
    """The peak so far, measured as `measure_name(device)` says; None where the platform cannot tell."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
