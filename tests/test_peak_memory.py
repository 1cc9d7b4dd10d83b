"""The tensor peak a run reports (backends/torch/training/peak_memory.py): counted by hand on known allocations, and
against torch's own tracker (`MemTracker`) on a training step of the tiny network, where that tracker works."""
from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from conftest import ROOT, TINY
from vgraph.backends.torch.training.peak_memory import (MEASURED_STEPS, LiveTensorBytes, TensorPeak, memory_figures,
                                               state_tensors)

sys.path.insert(0, str(ROOT / "benchmarks"))
from train_step_fixture import training_step  # noqa: E402  (the memory benchmarks' step, as vgraph train runs it)

CPU = torch.device("cpu")


def test_live_bytes_counted_by_hand() -> None:
    kept = torch.zeros(1000)  # 4,000 bytes before the block, freed inside it
    with LiveTensorBytes([kept, kept.view(10, 100), kept[:10]]) as live:  # one storage, counted once
        assert live.current == live.peak == 4000
        a = torch.empty(1000)
        b = a * 2
        assert live.current == 12000
        a.view(100, 10).add_(1)  # a view and an in-place op allocate nothing
        assert live.current == 12000
        del a, kept
        assert live.current == 4000  # both storages freed: followed, not just added up
        c = torch.empty(2000, dtype=torch.float64)
        assert live.current == 20000 and live.peak == 20000
        del b, c
    assert live.current == 0 and live.peak == 20000
    assert live.largest == (2000, (2000,))


def test_the_peak_of_a_training_step_agrees_with_torchs_tracker() -> None:
    """On a step torch's MemTracker can follow (each module called once): the same peak within 1%."""
    from torch.distributed._tools.mem_tracker import MemTracker

    graph, module, optimizers, step, _, _ = training_step(TINY, None, 8, keyed_dropout=True)
    step()  # Adam's moments exist from here on: the following steps are alike
    tracked = (module, *optimizers.optimizers)
    with LiveTensorBytes(state_tensors(tracked)) as ours:
        step()
    theirs = MemTracker()
    theirs.track_external(*tracked)
    with theirs:
        step()
    total = theirs.get_tracker_snapshot("peak")[CPU]["Total"]
    assert ours.peak == pytest.approx(total, rel=0.01)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    assert ours.peak > 3 * params  # parameters, Adam's two moments and the step's activations at least


def test_tensor_peak_measures_the_first_steps_only_and_never_leaves_its_mode_behind() -> None:
    weights = torch.nn.Linear(100, 100)
    peak = TensorPeak(CPU, lambda: (weights,))
    state = 4 * (100 * 100 + 100)
    assert peak.bytes() is None and memory_figures(peak).keys() == {"peak_rss_bytes"}
    sizes = [10_000, 1_000, 50_000]  # floats allocated in steps 1, 2, 3 (3 is not measured)
    for n in sizes:
        peak.begin_step()
        x = torch.empty(n)
        del x
        peak.end_step()
        assert _get_current_dispatch_mode() is None
    assert MEASURED_STEPS == 2 and peak.bytes() == state + 4 * 10_000
    assert memory_figures(peak)["tensor_peak_bytes"] == peak.bytes() < memory_figures(peak)["peak_rss_bytes"]

    failing = TensorPeak(CPU, lambda: (weights,))
    with pytest.raises(RuntimeError):
        try:
            failing.begin_step()
            raise RuntimeError("a step that fails halfway")
        finally:
            failing.close()  # what the training loop's `finally` does
    assert _get_current_dispatch_mode() is None and failing.bytes() is None
