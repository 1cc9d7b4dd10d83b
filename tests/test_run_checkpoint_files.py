"""Which checkpoint directories a training run keeps, prunes and cleans (backends/torch/training/run_checkpoints.py).

`--keep-checkpoints N` keeps the newest N complete checkpoints (at least one) and never the one just
written, even when an older step is rewritten after a resume; a killed write leaves `.step-*.tmp-*` /
`.step-*.old-*` directories that the next run removes, and nothing else.  Oracle: the directory listing.
Mutation testing (TESTING.md) reaches these rules only through a slow SIGKILL test outside its target.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from vgraph.backends.torch.training.run_checkpoints import clean_stale, prune_checkpoints, run_checkpoints


def _steps(run: Path, *steps: int) -> None:
    for s in steps:
        (run / f"step-{s:08d}").mkdir(parents=True)
        (run / f"step-{s:08d}" / "state.json").write_text("{}")


def _left(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir())


def test_run_checkpoints_lists_directories_oldest_first(tmp_path) -> None:
    _steps(tmp_path, 12, 3, 7)
    (tmp_path / "step-00000099").write_text("a file, not a checkpoint")
    (tmp_path / "latest").write_text("step-00000012\n")
    assert [p.name for p in run_checkpoints(tmp_path)] == ["step-00000003", "step-00000007", "step-00000012"]


@pytest.mark.parametrize("keep, left", [(1, [5]), (2, [4, 5]), (3, [3, 4, 5]), (5, [1, 2, 3, 4, 5]),
                                        (9, [1, 2, 3, 4, 5]), (0, [5]), (-2, [5])])
def test_prune_keeps_the_newest(tmp_path, keep: int, left: list[int]) -> None:
    _steps(tmp_path, 1, 2, 3, 4, 5)
    prune_checkpoints(tmp_path, keep, tmp_path / "step-00000005")
    assert _left(tmp_path) == [f"step-{s:08d}" for s in left]


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path) -> None:
    _steps(tmp_path, 2, 3, 4, 5)  # step 3 rewritten after resuming from it; 4 and 5 from the killed run
    prune_checkpoints(tmp_path, 1, tmp_path / "step-00000003")
    assert _left(tmp_path) == ["step-00000003", "step-00000005"]
    prune_checkpoints(tmp_path, 2, tmp_path / "step-00000003")
    assert _left(tmp_path) == ["step-00000003", "step-00000005"]


def test_clean_stale_removes_only_killed_writes(tmp_path) -> None:
    _steps(tmp_path, 1)
    for name in (".step-00000002.tmp-41-0123456789ab", ".step-00000001.old-0123456789ab"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("partial")
    keep = (".step-notes", ".other.tmp-1", "notes.tmp-1")
    for name in keep:
        (tmp_path / name).mkdir()
    clean_stale(tmp_path)
    assert _left(tmp_path) == sorted(["step-00000001", *keep])
    assert (tmp_path / "step-00000001" / "state.json").is_file()
