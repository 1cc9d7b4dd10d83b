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

from vgraph.backends.torch import checkpoint as C


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
