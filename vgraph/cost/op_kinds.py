"""What a VNode costs on a PNode beyond FLOPs / peak: efficiency and fixed overhead per op kind.

A single FLOP/s figure per PNode predicts small networks far too fast (measured: 12x on this project's
held-out 3-block network at batch 8 on a CPU).  At these sizes a small matmul reaches a fraction of a
large GEMM's rate, attention a smaller one, elementwise ops (layernorm, activations, dropout, residual
adds) are memory-bound and reach about a hundredth, and every VNode costs fixed time per micro-batch
(framework dispatch, autograd bookkeeping) whatever its size.  `vgraph probe` measures these on the
machine, for a network, and writes them into the PNode's fleet entry:

    - id: host0
      flops: 41.2G                      # a large GEMM's sustained rate: the peak the kinds refer to
      efficiency:
        matmul: {of_peak: 0.31, overhead: 45us}     # linear, tied LM head + cross-entropy
        attention: {of_peak: 0.05, overhead: 180us}
        elementwise: {of_peak: 0.004, overhead: 30us}
        structural: {overhead: 12us}                # no FLOPs: broadcast, reshape, stack, embedding lookup

A VNode of kind k with F training FLOPs per sample then costs, per micro-batch of m samples,
`overhead_k + m * F / (flops * of_peak_k)` seconds on that PNode (`stepcost.py`).  A PNode without
`efficiency` keeps the old single-figure model (of_peak 1, no overhead), and a kind the entry does not
name does too.  The kinds are fixed by op type (`op_kind`): an op type not listed is elementwise when it
has FLOPs, structural when it has none.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("matmul", "attention", "elementwise", "structural")
MATMUL_TYPES = frozenset(("linear", "tied_lm_head_ce", "kv_head"))  # a kv_head: two projections
ATTENTION_TYPES = frozenset(("attention", "attention_head"))
KIND_KEYS = ("of_peak", "overhead")
_SECONDS = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?$")
_PER = {"s": 1.0, None: 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divisors: 45 / 1e6 is exactly 4.5e-05


def op_kind(op_type: str, flops: float) -> str:
    """The kind a VNode of `op_type` with `flops` forward FLOPs per sample is costed as."""
    if op_type in MATMUL_TYPES:
        return "matmul"
    if op_type in ATTENTION_TYPES:
        return "attention"
    return "elementwise" if flops > 0 else "structural"


@dataclass(frozen=True)
class KindCost:
    """One kind on one PNode: the share of the PNode's `flops` it reaches (None: no FLOPs to rate) and the
    fixed seconds each VNode of the kind costs per micro-batch (forward and backward)."""

    of_peak: float | None
    overhead: float


@dataclass(frozen=True)
class Efficiency:
    """Per kind, what `vgraph probe` measured; kinds it does not name cost FLOPs / peak with no overhead."""

    kinds: tuple[tuple[str, KindCost], ...]

    def get(self, kind: str) -> KindCost | None:
        return dict(self.kinds).get(kind)

    def of_peak(self, kind: str) -> float:
        cost = self.get(kind)
        return cost.of_peak if cost is not None and cost.of_peak is not None else 1.0

    def overhead(self, kind: str) -> float:
        cost = self.get(kind)
        return cost.overhead if cost is not None else 0.0

    def flow(self) -> str:
        """The YAML flow mapping a fleet entry carries (`fleet.pnode_flow`)."""
        items = []
        for kind, cost in self.kinds:
            parts = ([f"of_peak: {cost.of_peak:.4g}"] if cost.of_peak is not None else []) + \
                    [f"overhead: {format_seconds(cost.overhead)}"]
            items.append(f"{kind}: {{{', '.join(parts)}}}")
        return "{" + ", ".join(items) + "}"


def vnode_seconds(op_type: str, forward_flops: float, train_flops: float, micro_batches: int, flops: float,
                  efficiency: Efficiency | None) -> float:
    """Seconds a VNode's `train_flops` (a step's worth) cost on a PNode of peak `flops`: at its kind's share
    of the peak, plus its kind's overhead per micro-batch (what `stepcost` charges a stage)."""
    if efficiency is None:
        return train_flops / flops
    kind = op_kind(op_type, forward_flops)
    return train_flops / (flops * efficiency.of_peak(kind)) + micro_batches * efficiency.overhead(kind)


def parse_seconds(text: str) -> float:
    """'45us' -> 4.5e-05, '0.2ms' -> 0.0002, '1e-5' and '1e-5s' -> 1e-05 (a plain number is seconds)."""
    m = _SECONDS.match(str(text).strip())
    if not m:
        raise ValueError(f"expected a time like 45us, 0.2ms or 1e-5 (seconds), got {text!r}")
    value = float(m.group(1)) / _PER[m.group(2)]
    if not math.isfinite(value) or value > 3600:
        raise ValueError(f"{text!r} is more than an hour")
    return value


def format_seconds(value: float) -> str:
    return f"{value * 1e6:.4g}us"


def check_both_keys(fields: dict[str, str], keys: tuple[str, str], example: str) -> None:
    """A fleet entry's two-key flow mapping (`update`, `cpu_burst`) has exactly `keys`; ValueError naming the
    first unknown or missing one, with `example` as the spelling to copy."""
    unknown = sorted(set(fields) - set(keys))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (keys: {', '.join(keys)})")
    missing = [k for k in keys if k not in fields]
    if missing:
        raise ValueError(f"missing {missing[0]!r} (give both: {example})")


def parse_kind(kind: str, fields: dict[str, str]) -> KindCost:
    """A kind's {of_peak, overhead} as read from YAML text; ValueError naming what is wrong."""
    if kind not in KINDS:
        raise ValueError(f"unknown op kind {kind!r} (kinds: {', '.join(KINDS)})")
    unknown = sorted(set(fields) - set(KIND_KEYS))
    if unknown:
        raise ValueError(f"{kind}: unknown key {unknown[0]!r} (keys: {', '.join(KIND_KEYS)})")
    of_peak = None
    if "of_peak" in fields:
        try:
            of_peak = float(fields["of_peak"])
        except ValueError:
            raise ValueError(f"{kind}: of_peak must be a number, got {fields['of_peak']!r}") from None
        if not (0 < of_peak <= 1):
            raise ValueError(f"{kind}: of_peak must be in (0, 1], a share of the PNode's flops, got "
                             f"{fields['of_peak']!r}")
    if kind == "structural" and of_peak is not None:
        raise ValueError("structural: these ops have no FLOPs, give only an overhead")
    overhead = parse_seconds(fields["overhead"]) if "overhead" in fields else 0.0
    return KindCost(of_peak, overhead)


__all__ = ["KINDS", "KindCost", "Efficiency", "op_kind", "vnode_seconds", "parse_kind", "parse_seconds",
           "format_seconds"]
