"""Where one process's rows and checkpoints go (loop.RunOutput for `vgraph train`): it writes them itself.

Under `vgraph launch` rank 0 gathers the ranks' entries and checkpoint shares
instead (distributed/runtime/rank_zero.RankOutput); the loop cannot tell them
apart.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .loop import merge_entries
from .metrics_log import MetricsLog

__all__ = ["LocalOutput"]


class LocalOutput:
    """metrics.jsonl/.csv (and TensorBoard) through `log`, the progress `bar`, checkpoints through `save`
    and the loss curve (drawn at checkpoints and at the end: matplotlib takes seconds; a killed run keeps
    the curve of its last checkpoint)."""

    def __init__(self, log: MetricsLog, bar: Any, save: Callable[[int], Path], curve: tuple[Path, str]) -> None:
        self.log, self.bar, self._save, self.curve = log, bar, save, curve
        self.last_val: float | None = None  # shown on the bar until the next validation

    def gather(self, extras: list[tuple[int, dict[str, Any]]], figures: dict[str, Any]) -> Any:
        return extras, figures  # nothing to gather: they are all here

    def write(self, step: int, rows: list[dict[str, Any]], gathered: Any, val_loss: float | None) -> None:
        extras, figures = gathered
        merge_entries(rows, extras)
        rows[-1].update(figures)
        if val_loss is not None:
            self.last_val = val_loss
        self.log.append(rows)
        self.bar.update(len(rows))
        shown = {"val": f"{self.last_val:.4f}"} if self.last_val is not None else {}
        self.bar.set_postfix(loss=f"{rows[-1]['loss']:.4f}", tok_s=f"{rows[-1]['tokens_per_s']:,.0f}",
                             lr=f"{rows[-1]['lr']:.2e}", **shown, refresh=False)

    def save(self, step: int) -> Path:
        path = self._save(step)
        self.finish()
        return path

    def step_done(self, step: int) -> None:
        pass  # nothing waits on one process

    def finish(self) -> None:
        self.log.plot(*self.curve)

    def unwritten(self, rows: list[dict[str, Any]]) -> None:
        pass  # one process resumes from its last checkpoint, whose rows are all written

    def close(self) -> None:
        self.bar.close()
        self.log.close()
