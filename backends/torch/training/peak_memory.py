"""What a run measured of its memory, on the basis of what memory.py estimated before it started.

Why record it: the estimate (memory.py) refuses networks that cannot fit, so
a user must be able to see how it compares with reality on their runs
(`vgraph report` shows the two side by side).  The estimate goes into
run.json once (`estimate_record`); the measurements go into metrics rows at
sync points, so a run still going shows them too.

Two figures, never compared with each other:

* **tensor peak** (`tensor_peak_bytes`), the same quantity the estimate
  models: the most bytes of tensors alive at once.  On CUDA the allocator
  tracks it (`torch.cuda.max_memory_allocated`).  A CPU has no such counter,
  so `LiveTensorBytes` measures the session's first `MEASURED_STEPS` steps,
  forward, backward and update: the second has Adam's moments, as every
  later step, and a one-step run still gets the first.  Only those two: a
  Python call per aten op is not free (the tiny network's step took 0.54 s
  followed against 0.33 s not, once, on a loaded 2-core machine).
* **process peak RSS** (`peak_rss_bytes`): the process's resident-set
  high-water mark, Python, torch's runtime and the C allocator's caches
  included, on every device.  It says what the machine must have, not
  whether the estimate is right, so it is shown as its own figure.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .memory import MemoryEstimate

__all__ = ["estimate_record", "TensorPeak", "LiveTensorBytes", "state_tensors", "memory_figures", "peak_rss_bytes",
           "tensor_measure_name", "MEASURED_STEPS"]

MEASURED_STEPS = 2


def tensor_measure_name(device: torch.device) -> str:
    """How `tensor_peak_bytes` is measured on `device` (recorded in run.json beside the estimate)."""
    return "cuda_max_memory_allocated" if device.type == "cuda" else "live_tensor_bytes"


def estimate_record(estimate: MemoryEstimate, device: torch.device) -> dict[str, Any]:
    """run.json's `memory_estimate`: every term in bytes, the total, and how the run measures its tensor peak."""
    return {"batch": estimate.batch, "parameters": estimate.parameters, "gradients": estimate.gradients,
            "optimizer": estimate.optimizer, "activations": estimate.activations, "workspace": estimate.workspace,
            "total": estimate.total, "tensor_peak_as": tensor_measure_name(device)}


def peak_rss_bytes() -> int | None:
    """The process's peak resident set so far; None where the platform cannot tell."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class LiveTensorBytes(TorchDispatchMode):
    """The most bytes of tensors alive at once inside a block of torch code (a context manager).

    A TorchDispatchMode sees every tensor any aten op allocates in the block
    (forward, backward, optimizer) and follows each storage until it is freed
    (a weakref finalizer on the storage), so `peak` is independent of the C
    allocator's caching.  Views and in-place ops allocate nothing and are
    skipped.  `existing` tensors (parameters, gradients, optimizer state) are
    counted from the start and followed the same way, so `peak` is the block's
    whole tensor footprint, what the estimate models.  It also records the
    largest tensor, overall and among those whose last dimension is `vocab`
    (the memory benchmarks' proof that a fused loss never forms logits).

    Why not torch's `torch.distributed._tools.mem_tracker.MemTracker`, which
    measures the same (1,248,660 vs this 1,242,500 bytes on the tiny network's
    training step at batch 8; 689,758,292 vs 689,193,028 on the 6-layer
    network's): it refuses a module called more than once in the tracked
    block (NotImplementedError, "multiple iterative calls"), and a pipelined
    `vgraph launch` step calls each stage's module once per micro-batch.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = (), vocab: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        self.live: dict[int, int] = {}
        self.current = 0
        self.largest: tuple[int, tuple[int, ...]] = (0, ())
        self.largest_vocab: tuple[int, tuple[int, ...]] = (0, ())
        for tensor in existing:
            self._follow(tensor)
        self.peak = self.current

    def _freed(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def _follow(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.live:
            return
        self.live[ptr] = storage.nbytes()
        self.current += storage.nbytes()
        weakref.finalize(storage, self._freed, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out  # aliases of existing storage: nothing new is allocated
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape))
            if self.vocab and t.dim() and t.shape[-1] == self.vocab and t.numel() > self.largest_vocab[0]:
                self.largest_vocab = (t.numel(), tuple(t.shape))
            self._follow(t)
        self.peak = max(self.peak, self.current)
        return out


def state_tensors(tracked: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors modules and optimizers hold between steps: parameters, buffers, gradients, optimizer state."""
    for obj in tracked:
        if isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                yield t
                if t.grad is not None:
                    yield t.grad
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class TensorPeak:
    """The tensor peak of a training session on `device` (see the module docstring).

    `begin_step()` before a step's forward and `end_step()` after its update;
    `tracked()` gives the modules and optimizers whose tensors exist before
    the step.  `bytes()` is the peak so far, None before it is known.
    """

    def __init__(self, device: torch.device, tracked: Callable[[], Iterable[Any]]) -> None:
        self.device = device
        self.tracked = tracked
        self.steps = 0
        self.peak: int | None = None
        self._tracker: LiveTensorBytes | None = None

    def begin_step(self) -> None:
        self.steps += 1
        if self.device.type == "cuda" or self.steps > MEASURED_STEPS:
            return
        self._tracker = LiveTensorBytes(state_tensors(self.tracked()))
        self._tracker.__enter__()

    def end_step(self) -> None:
        tracker = self.close()
        if tracker is not None:
            self.peak = max(self.peak or 0, tracker.peak)

    def close(self) -> LiveTensorBytes | None:
        """Leave the tracker's dispatch mode if a step is being measured (also when the step failed: the
        mode must not outlive the loop in this process); the tracker, or None."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        return tracker

    def bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak


def memory_figures(peak: TensorPeak) -> dict[str, int]:
    """A metrics row's memory fields: `tensor_peak_bytes` once known, `peak_rss_bytes` where the OS tells."""
    figures = {"tensor_peak_bytes": peak.bytes(), "peak_rss_bytes": peak_rss_bytes()}
    return {k: v for k, v in figures.items() if v is not None}
