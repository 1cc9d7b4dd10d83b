"""A damaged checkpoint is a clear CheckpointError (a diagnostic), never a Python traceback.

From surviving mutants (TESTING.md): nothing checked that a `state.json` which is not JSON, or whose
values have the wrong type (a null step, a list used as a dict key), ends as CheckpointError; a
mutant that let TypeError or ValueError escape passed every other test.  Each case below starts from a
checkpoint `save_checkpoint` wrote and damages one file the way a disk or a hand edit could.
"""
from __future__ import annotations

import json

import pytest
import torch

from vgraph.backends.torch.training import checkpoint as C


@pytest.fixture
def saved(tmp_path):
    return C.save_checkpoint(tmp_path / "step-1", step=1, model_state={"w": torch.ones(2)},
                             optimizer_states={"w": {"step": 1}}, rng_state={}, extra={"note": "x"})


def _edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00garbage", b""], ids=["syntax", "not-utf8", "empty"])
def test_unreadable_json_is_a_checkpoint_error(saved, raw: bytes) -> None:
    (saved / C.STATE_JSON_FILE).write_bytes(raw)
    with pytest.raises(C.CheckpointError, match="cannot read"):
        C.load_checkpoint(saved)


def test_a_null_step_is_a_checkpoint_error(saved) -> None:
    _edit(saved / C.STATE_JSON_FILE, lambda d: d.update(step=None))  # int(None): TypeError
    with pytest.raises(C.CheckpointError, match="malformed checkpoint"):
        C.load_checkpoint(saved)


def test_an_unhashable_dict_key_is_a_checkpoint_error(saved) -> None:
    _edit(saved / C.STATE_JSON_FILE, lambda d: d.update(extra={"__dict__": [[["a", "list"], 1]]}))
    with pytest.raises(C.CheckpointError, match="malformed checkpoint"):
        C.load_checkpoint(saved)


def test_the_undamaged_checkpoint_loads(saved) -> None:
    ck = C.load_checkpoint(saved)
    assert ck.step == 1 and ck.extra == {"note": "x"} and ck.optimizer_states == {"w": {"step": 1}}
    assert torch.equal(ck.model_state["w"], torch.ones(2))


@pytest.mark.parametrize("fmt", ["other-checkpoint", "zz-checkpoint", None], ids=["before", "after", "missing"])
def test_another_format_is_refused(saved, fmt) -> None:
    """Formats sorting before and after 'vgraph-checkpoint' are both someone else's files."""
    _edit(saved / C.STATE_JSON_FILE, lambda d: d.update(format=fmt))
    with pytest.raises(C.CheckpointError, match="is not a vgraph-checkpoint file"):
        C.load_checkpoint(saved)


@pytest.mark.parametrize("name", ["../step-1", "sub/step-1"])
def test_latest_never_points_outside_the_run_directory(tmp_path, name: str) -> None:
    """A hand-edited `latest` naming a path (even one holding a complete checkpoint) is refused."""
    run = tmp_path / "run"
    for where in (tmp_path / "step-1", run / "sub" / "step-1"):  # what each name would reach
        C.save_checkpoint(where, step=1, model_state={}, optimizer_states={}, rng_state={}, update_latest=False)
    (run / "latest").write_text(name + "\n")
    with pytest.raises(C.CheckpointError, match="invalid checkpoint name"):
        C.latest_checkpoint(run)


@pytest.mark.parametrize("aliases", ['{"b": ["w"]}', '["w"]', "{not json", '{"b": "missing"}'],
                         ids=["unhashable", "not-a-dict", "not-json", "unknown-key"])
def test_damaged_alias_metadata_is_a_checkpoint_error(saved, aliases: str) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(saved / C.MODEL_FILE), metadata={"format": "pt", "vgraph_aliases": aliases})
    with pytest.raises(C.CheckpointError, match="bad tensor metadata"):
        C.load_checkpoint(saved)
