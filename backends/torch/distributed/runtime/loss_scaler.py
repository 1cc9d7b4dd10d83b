"""Dynamic loss scaling for a partitioned run: one decision, taken by every rank alike.

GradScaler's rule (halve on a non-finite gradient, double after 2000 good
steps) and its state_dict format, so checkpoints move between `vgraph train`
and `vgraph launch`; the non-finite flag is all-reduced first (worker.py), so
every rank skips or steps together.
"""
from __future__ import annotations

from typing import Any

__all__ = ["SharedLossScaler"]


class SharedLossScaler:
    """Dynamic loss scaling with one decision for all ranks (GradScaler's rule and state_dict)."""

    def __init__(self, enabled: bool, init_scale: float) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = 2.0, 0.5, 2000
        self.tracker = 0

    def get_scale(self) -> float:
        """The current scale (GradScaler's name: train_step.LossCheck reads either)."""
        return self.scale

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.tracker = 0

    def state_dict(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.tracker}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.enabled and state:
            self.scale = float(state["scale"])
            self.tracker = int(state.get("_growth_tracker", 0))
