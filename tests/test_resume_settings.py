"""What `resume_run` refuses, notes and restores when a run's settings change (run_checkpoints.py).

From surviving mutants (TESTING.md): a data-defining setting (seed, batch, ...) changed in either
direction must be refused (a mutant refusing only increases passed every test: the one test changes the
seed 3 -> 4); a changed learning rate or schedule is resumed with a note; and optimizer state is restored
for every parameter even when an earlier one was never stepped.  A real checkpoint of the tiny network
is written with `save_run_checkpoint` and read back with `resume_run`.
"""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from vgraph import load
from vgraph.backends.torch.lowering.lower import compile_network, param_sources
from vgraph.backends.torch.training.optimizers import NodeOptimizers
from vgraph.backends.torch.training.run_checkpoints import (TrainingState, optimizer_state_to_graph, resume_run,
                                                   save_run_checkpoint)
from vgraph.backends.torch.training.config import TrainingError

RUN = {"seed": 5, "batch": 4, "seq_len": 16, "data": "corpus-b.txt", "vocab_size": 64, "tokenizer": "byte",
       "lr": 0.01, "warmup": 2, "schedule": "cosine"}
CHANGED = {"seed": (4, 6), "batch": (2, 8), "seq_len": (8, 32), "data": ("corpus-a.txt", "corpus-c.txt"),
           "vocab_size": (32, 128), "tokenizer": ("bpe", "char"), "lr": (0.001, 0.1), "warmup": (1, 3),
           "schedule": ("constant", "linear")}


def _state() -> TrainingState:
    module = compile_network(load(TINY), train=True, seed=0)
    return TrainingState(module, NodeOptimizers(module, 0.01), torch.amp.GradScaler("cpu", enabled=False))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))  # resume checks it
    return save_run_checkpoint(run, 3, _state(), dict(RUN), yaml_text="", tokenizer_json=tokenizer.to_str(), keep=1)


@pytest.mark.parametrize("key", ["seed", "batch", "seq_len", "data", "vocab_size", "tokenizer"])
@pytest.mark.parametrize("side", [0, 1], ids=["smaller", "larger"])
def test_a_changed_data_setting_is_refused_either_way(checkpoint, key: str, side: int) -> None:
    value = CHANGED[key][side]
    with pytest.raises(TrainingError, match=f"trained with {key}={RUN[key]!r}, this run has {key}={value!r}"):
        resume_run(checkpoint, _state(), {**RUN, key: value}, say=lambda _: None)


@pytest.mark.parametrize("key", ["lr", "warmup", "schedule"])
@pytest.mark.parametrize("side", [0, 1], ids=["smaller", "larger"])
def test_a_changed_schedule_setting_is_resumed_with_a_note(checkpoint, key: str, side: int) -> None:
    said: list[str] = []
    value = CHANGED[key][side]
    assert resume_run(checkpoint, _state(), {**RUN, key: value}, say=said.append) == 3
    assert f"note: resuming with {key}={value!r} (the run had {RUN[key]!r})" in said
    said.clear()
    resume_run(checkpoint, _state(), dict(RUN), say=said.append)
    assert not any(s.startswith("note:") for s in said)


def test_optimizer_state_survives_a_never_stepped_parameter_before_it() -> None:
    graph = load(TINY)
    sources = param_sources(graph)
    keys = list(sources)
    skipped = {u for u, _ in sources[keys[0]]}
    states = {u: {"step": float(i)} for i, key in enumerate(keys) for u, _ in sources[key] if u not in skipped}
    restored = optimizer_state_to_graph(states, graph)
    assert list(restored) == keys[1:]
    assert all(restored[k] == states[sources[k][0][0]] for k in keys[1:])


def test_a_damaged_checkpoint_is_a_training_error(tmp_path) -> None:
    """`vgraph train` reports a TrainingError as a diagnostic; a bare CheckpointError would be a traceback."""
    damaged = tmp_path / "step-00000003"
    damaged.mkdir()
    (damaged / "state.json").write_text("{not json")
    with pytest.raises(TrainingError, match="cannot resume: cannot read"):
        resume_run(damaged, _state(), dict(RUN), say=lambda _: None)


def test_optimizer_moments_split_and_join_like_the_weights() -> None:
    """Moments of a fused parameter (fused heads: weights and 1-D biases) are split into the unfused
    layout exactly as the weights are (`to_unfused_layout`), and joined back; scalars are copied."""
    from vgraph.backends.torch.lowering.lower import init_state, to_unfused_layout
    from vgraph.backends.torch.training.run_checkpoints import optimizer_state_to_unfused
    from vgraph.transform.pipeline import run_pipeline

    graph = load(TINY)
    run_pipeline(graph, "fuse-heads,fuse-lm-head-ce")
    sources = param_sources(graph)
    w = init_state(graph, seed=0)
    fused_dims = {w[k].dim() for k, pieces in sources.items() if len(pieces) > 1}
    assert {1, 2} <= fused_dims  # fused weights and fused biases are both exercised
    states = {k: {"step": torch.tensor(7.0), "exp_avg": w[k], "exp_avg_sq": w[k] * w[k], "beta": 0.5} for k in w}
    unfused = optimizer_state_to_unfused(states, graph)
    expected = to_unfused_layout(w, graph)
    assert set(unfused) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(unfused[key]["exp_avg"], tensor)
        assert torch.equal(unfused[key]["exp_avg_sq"], tensor * tensor)
        assert unfused[key]["step"] == 7.0 and unfused[key]["beta"] == 0.5
    back = optimizer_state_to_graph(unfused, graph)
    assert set(back) == set(w)
    for key in w:
        assert torch.equal(back[key]["exp_avg"], w[key]) and torch.equal(back[key]["exp_avg_sq"], w[key] * w[key])
