"""tools/same_training.py's compare: equal recordings pass; a one-ulp weight, -0.0 for 0.0, another dtype, a
changed or added state key and a changed metric are each named where they are; wall-clock figures and the same
NaN are not differences.  Recordings are made here by hand (record itself runs `vgraph`: the suite's training
tests cover that), shaped as `record` writes them."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tools import same_training

STEP = "step-00000006"


def recording(root: Path, weights: dict[str, torch.Tensor] | None = None, state: dict | None = None,
              rows: list[dict] | None = None) -> Path:
    weights = weights if weights is not None else {"w": torch.tensor([1.0, -2.5, 0.0]), "b": torch.zeros(2)}
    state = state if state is not None else {"step": 6, "extra": {"__dict__": [["run", {"__dict__": [
        ["seed", 7], ["data_digest", "a" * 64]]}]]}}
    rows = rows if rows is not None else [{"step": s, "loss": 4.5 - s / 10, "elapsed_s": 0.1 * s,
                                           "pnodes": {"a": {"step_s": 0.2, "bytes_sent": 100}}} for s in (1, 2)]
    for name in ("train", "resume", "launch"):
        run = root / name
        (run / STEP).mkdir(parents=True)
        (run / "latest").write_text(STEP + "\n")
        save_file(weights, str(run / STEP / "model.safetensors"))
        (run / STEP / "state.json").write_text(json.dumps(state))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_equal_recordings_pass_and_timings_are_not_differences(tmp_path: Path) -> None:
    a = recording(tmp_path / "a")
    slower = [{"step": s, "loss": 4.5 - s / 10, "elapsed_s": 9.0, "pnodes": {"a": {"step_s": 3.0, "bytes_sent": 100}}}
              for s in (1, 2)]
    assert same_training.compare(a, recording(tmp_path / "b", rows=slower)) == []


@pytest.mark.parametrize("weights, named", [
    ({"w": torch.tensor([1.0, -2.5, 0.0]).nextafter(torch.tensor(9.0)), "b": torch.zeros(2)}, "w differs"),  # 1 ulp
    ({"w": torch.tensor([1.0, -2.5, -0.0]), "b": torch.zeros(2)}, "w differs"),  # torch.equal takes it for 0.0
    ({"w": torch.tensor([1.0, -2.5, 0.0], dtype=torch.float64), "b": torch.zeros(2)}, "w differs"),
    ({"w": torch.tensor([1.0, -2.5, 0.0]), "b": torch.zeros(1, 2)}, "b differs"),  # another shape, the same bytes
    ({"w": torch.tensor([1.0, -2.5, 0.0])}, "tensor names differ"),
])
def test_every_tensor_difference_is_named(weights, named, tmp_path: Path) -> None:
    diffs = same_training.compare(recording(tmp_path / "a"), recording(tmp_path / "b", weights=weights))
    assert [d for d in diffs if d.startswith("train/model.safetensors: ")] == [f"train/model.safetensors: {named}"]


def test_the_same_nan_is_the_same_bytes(tmp_path: Path) -> None:
    nan = {"w": torch.tensor([1.0, math.nan, 0.0]), "b": torch.zeros(2)}
    assert not torch.equal(nan["w"], nan["w"])  # the premise: by value, a NaN differs from itself
    assert same_training.compare(recording(tmp_path / "a", weights=nan), recording(tmp_path / "b", weights=nan)) == []


def test_state_and_metric_differences_are_named_by_their_keys(tmp_path: Path) -> None:
    state = {"step": 6, "extra": {"__dict__": [["run", {"__dict__": [["seed", 8], ["data_digest", "a" * 64],
                                                                      ["data_content", "c" * 64]]}]]}}
    rows = [{"step": 1, "loss": 4.4, "elapsed_s": 0.1, "pnodes": {"a": {"step_s": 0.2, "bytes_sent": 101}}}]
    diffs = same_training.compare(recording(tmp_path / "a"), recording(tmp_path / "b", state=state, rows=rows))
    assert "train/state.json: extra.run.seed: A 7, B 8" in diffs
    assert "train/state.json: extra.run.data_content only in B" in diffs
    assert "launch/metrics.jsonl: rows: A has 2 items, B 1" in diffs
    assert "launch/metrics.jsonl: rows[0].pnodes.a.bytes_sent: A 100, B 101" in diffs
    assert len(same_training.where_differs({"k": list(range(20))}, {"k": list(range(1, 21))})) == 5  # the first few


def test_one_and_one_point_zero_are_not_the_same_json() -> None:
    assert same_training.where_differs({"x": 1}, {"x": 1.0}) == ["x: A 1, B 1.0"]
