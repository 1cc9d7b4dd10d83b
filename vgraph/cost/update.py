"""What a rank spends each step beyond its training program: a PNode's `update` figure.

Every launch worker, after the step's forward and backward and before the next, draws its batch and steps
its optimizers over the parameters it holds.  On the testbed's one-host tb-small run (0.5 core) that was
8-10 ms of a 51 ms step, the largest part the cost model did not price: the program's time is measured by
`vgraph probe`, the control collectives by `probe --collectives`, and this was neither.  The probe times it
as a worker does it (backends/torch/probe/measure.py, `update_costs`) and writes

    - id: host0
      update: {fixed: 1.4ms, per_param: 0.6ns}

A rank holding P trainable parameters then spends `fixed + P x per_param` seconds a step on it
(`seconds`); the step waits for its slowest rank (vgraph/cost/stepcost.py).  A PNode without the figure
spends nothing, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

from vgraph.cost.op_kinds import check_both_keys, format_seconds, parse_seconds

UPDATE_KEYS = ("fixed", "per_param")


@dataclass(frozen=True)
class Update:
    """A rank's seconds each step outside the program: `fixed`, plus `per_param` per parameter it trains."""

    fixed: float
    per_param: float

    def seconds(self, params: float) -> float:
        return self.fixed + params * self.per_param

    def flow(self) -> str:
        """The YAML flow mapping a fleet entry carries (`fleet.pnode_flow`)."""
        return f"{{fixed: {format_seconds(self.fixed)}, per_param: {self.per_param * 1e9:.4g}ns}}"


def parse_update(fields: dict[str, str]) -> Update:
    """`{fixed: T, per_param: T}` as read from YAML text (both required); ValueError naming what is wrong."""
    check_both_keys(fields, UPDATE_KEYS, "{fixed: 1.4ms, per_param: 0.6ns}")
    values = []
    for key in UPDATE_KEYS:
        try:
            values.append(parse_seconds(fields[key]))
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    if values[1] > 1e-3:
        raise ValueError(f"per_param: {fields['per_param']!r} is more than a millisecond per parameter")
    return Update(*values)


__all__ = ["Update", "UPDATE_KEYS", "parse_update"]
