"""Tests for atomic checkpoints (vgraph.backends.torch.training.checkpoint)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vgraph.backends.torch.training import checkpoint as C

DIM = 32


def _make_vnodes(seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    return {
        "ffn0": torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Dropout(0.2)),
        "ffn1": torch.nn.Linear(DIM, DIM),
    }


def _make_optimizers(vnodes: dict[str, torch.nn.Module]) -> dict[str, torch.optim.Adam]:
    return {
        name: torch.optim.Adam(module.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01)
        for name, module in vnodes.items()
    }


def _train_step(vnodes, optimizers) -> float:
    """Uses the torch (dropout, randn), numpy and python RNGs, like a real loop might."""
    x = torch.randn(4, DIM) * float(np.random.uniform(0.5, 1.5)) + random.random()
    y = vnodes["ffn1"](torch.relu(vnodes["ffn0"](x)))
    loss = (y**2).mean()
    for opt in optimizers.values():
        opt.zero_grad()
    loss.backward()
    for opt in optimizers.values():
        opt.step()
    return loss.item()


def _model_state(vnodes) -> dict[str, torch.Tensor]:
    return {f"{name}.{param}": t for name, m in vnodes.items() for param, t in m.state_dict().items()}


def test_adam_resume_continues_identically(tmp_path) -> None:
    vnodes = _make_vnodes(0)
    optimizers = _make_optimizers(vnodes)
    random.seed(1)
    np.random.seed(2)
    for _ in range(3):
        _train_step(vnodes, optimizers)

    ckpt_dir = C.save_checkpoint(
        tmp_path / "run" / "step-3",
        step=3,
        model_state=_model_state(vnodes),
        optimizer_states={name: opt.state_dict() for name, opt in optimizers.items()},
        rng_state=C.capture_rng_state(),
        extra={"tokens_seen": 1234},
    )
    reference_losses = [_train_step(vnodes, optimizers) for _ in range(3)]
    reference_params = {k: v.clone() for k, v in _model_state(vnodes).items()}

    # Fresh process state: different init, scrambled RNGs.
    resumed = _make_vnodes(99)
    resumed_opts = _make_optimizers(resumed)
    random.seed(7)
    np.random.seed(7)
    assert C.latest_checkpoint(tmp_path / "run") == ckpt_dir
    ckpt = C.load_checkpoint(C.latest_checkpoint(tmp_path / "run"))
    assert ckpt.step == 3 and ckpt.extra == {"tokens_seen": 1234}
    for name, module in resumed.items():
        prefix = f"{name}."
        module.load_state_dict({k[len(prefix):]: v for k, v in ckpt.model_state.items() if k.startswith(prefix)})
        resumed_opts[name].load_state_dict(ckpt.optimizer_states[name])
    C.restore_rng_state(ckpt.rng_state)

    resumed_losses = [_train_step(resumed, resumed_opts) for _ in range(3)]
    assert resumed_losses == reference_losses
    for key, value in _model_state(resumed).items():
        assert torch.equal(value, reference_params[key]), key


def test_optimizer_state_types_round_trip(tmp_path) -> None:
    vnodes = _make_vnodes(0)
    opt = _make_optimizers(vnodes)["ffn1"]
    random.seed(0)
    np.random.seed(0)
    _train_step(vnodes, {"ffn1": opt})
    original = opt.state_dict()
    C.save_checkpoint(tmp_path / "c", step=1, model_state={}, optimizer_states={"ffn1": original}, rng_state={})
    loaded = C.load_checkpoint(tmp_path / "c").optimizer_states["ffn1"]

    assert loaded["param_groups"] == original["param_groups"]
    assert isinstance(loaded["param_groups"][0]["betas"], tuple)
    assert sorted(loaded["state"]) == sorted(original["state"]) == [0, 1]
    for idx, per_param in original["state"].items():
        for key, value in per_param.items():
            assert torch.equal(loaded["state"][idx][key], value)
            assert loaded["state"][idx][key].dtype == value.dtype


def test_tied_weights_saved_once_and_restored_shared(tmp_path) -> None:
    embedding = torch.randn(100, DIM)
    state = {
        "embed.weight": embedding,
        "lm_head.weight": embedding,  # tied
        "proj.weight_t": torch.randn(DIM, 8).t(),  # non-contiguous
        "rows.a": (base := torch.randn(6, DIM))[:3],  # overlapping views of one storage
        "rows.b": base[2:],
        "half": torch.randn(4, dtype=torch.bfloat16),
    }
    path = C.save_checkpoint(tmp_path / "c", step=0, model_state=state, optimizer_states={}, rng_state={})
    with safe_open(str(path / C.MODEL_FILE), framework="pt") as f:
        stored = set(f.keys())
    assert stored == {"embed.weight", "proj.weight_t", "rows.a", "rows.b", "half"}

    loaded = C.load_checkpoint(path).model_state
    assert set(loaded) == set(state)
    assert loaded["lm_head.weight"] is loaded["embed.weight"]
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
        assert loaded[key].dtype == value.dtype
    assert loaded["rows.a"].untyped_storage().data_ptr() != loaded["rows.b"].untyped_storage().data_ptr()


def test_rng_and_extra_values_round_trip(tmp_path) -> None:
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    rng = C.capture_rng_state()
    extra = {
        "nested": {"t": (1, 2.5, "x"), 3: [None, True]},
        "nonfinite": [math.inf, -math.inf],
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalar": np.int64(7),
        "tensor": torch.arange(3),
    }
    C.save_checkpoint(tmp_path / "c", step=2, model_state={}, optimizer_states={}, rng_state=rng, extra=extra)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt = C.load_checkpoint(tmp_path / "c")
    C.restore_rng_state(ckpt.rng_state)
    assert random.random() == expected[0]
    assert float(np.random.rand()) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])

    got = ckpt.extra
    assert got["nested"] == {"t": (1, 2.5, "x"), 3: [None, True]}
    assert got["nonfinite"] == [math.inf, -math.inf]
    assert got["array"].dtype == np.float32 and np.array_equal(got["array"], extra["array"])
    assert got["np_scalar"] == 7 and torch.equal(got["tensor"], extra["tensor"])


def test_unsupported_value_fails_before_writing(tmp_path) -> None:
    with pytest.raises(TypeError, match="extra/bad"):
        C.save_checkpoint(tmp_path / "c", step=0, model_state={}, optimizer_states={}, rng_state={},
                          extra={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    first = C.save_checkpoint(run / "step-1", step=1, model_state={"w": torch.ones(2)},
                              optimizer_states={}, rng_state={})

    def failing_write_json(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(C, "_write_json", failing_write_json)
    with pytest.raises(OSError, match="disk full"):
        C.save_checkpoint(run / "step-2", step=2, model_state={"w": torch.zeros(2)},
                          optimizer_states={}, rng_state={})
    with pytest.raises(OSError, match="disk full"):
        C.save_checkpoint(run / "step-1", step=1, model_state={"w": torch.zeros(2)},
                          optimizer_states={}, rng_state={})
    monkeypatch.undo()

    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-1"]  # no temp leftovers
    assert C.latest_checkpoint(run) == first
    assert torch.equal(C.load_checkpoint(first).model_state["w"], torch.ones(2))


def test_overwrite_and_latest_pointer(tmp_path) -> None:
    run = tmp_path / "run"
    assert C.latest_checkpoint(run) is None
    C.save_checkpoint(run / "step-1", step=1, model_state={"w": torch.ones(2)}, optimizer_states={}, rng_state={})
    C.save_checkpoint(run / "step-2", step=2, model_state={"w": torch.ones(2)}, optimizer_states={}, rng_state={})
    assert C.latest_checkpoint(run) == (run / "step-2").absolute()
    assert (run / "latest").read_text().strip() == "step-2"

    again = C.save_checkpoint(run / "step-2", step=2, model_state={"w": torch.full((2,), 3.0)},
                              optimizer_states={}, rng_state={})
    assert torch.equal(C.load_checkpoint(again).model_state["w"], torch.full((2,), 3.0))
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-1", "step-2"]

    C.save_checkpoint(run / "side", step=9, model_state={}, optimizer_states={}, rng_state={}, update_latest=False)
    assert C.latest_checkpoint(run).name == "step-2"


def test_errors_are_clear(tmp_path) -> None:
    run = tmp_path / "run"
    C.save_checkpoint(run / "step-1", step=1, model_state={}, optimizer_states={}, rng_state={})
    with pytest.raises(C.CheckpointError, match="run directory"):
        C.load_checkpoint(run)
    (run / "latest").write_text("gone\n")
    with pytest.raises(C.CheckpointError, match="not a complete checkpoint"):
        C.latest_checkpoint(run)
    (run / "step-1" / C.MODEL_FILE).write_bytes(b"garbage!" * 4)
    with pytest.raises(C.CheckpointError, match="cannot read"):
        C.load_checkpoint(run / "step-1")
    with pytest.raises(ValueError, match="step"):
        C.save_checkpoint(run / "x", step=-1, model_state={}, optimizer_states={}, rng_state={})
    with pytest.raises(ValueError, match="invalid checkpoint directory name"):
        C.save_checkpoint(run / "latest", step=1, model_state={}, optimizer_states={}, rng_state={})
