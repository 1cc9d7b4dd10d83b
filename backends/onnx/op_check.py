"""``vgraph check-onnx --ops [TYPE ...]``: each op type's torch and ONNX lowerings, one VNode at a time.

In the spirit of PyTorch's OpInfo tests: every op type carries a few small
sample configs (``OpDef.examples``; a plugin declares its own), and each runs
as a one-VNode network (``vgraph.ir.builder.example_graph``) through both
backends on random inputs at every scale of ``OP_SCALES``, from where the op
is nearly linear (0.01) to where it saturates or its intermediates grow large
(100), on seeded weights of a trained network's scale.  A network FILE adds
the configs and input shapes its VNodes of those types have.  Each output is
compared with the tolerance of ``check.TOLERANCES``.

A plugin author checks a new op with ``vgraph check-onnx --ops my_op`` before
any network uses it; a lowering that is right only where activations are tiny
(tanh-approximated GELU for the exact one, a sigmoid that overflows) fails
at some scale.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from vgraph import Graph, VGraphError
from vgraph.ir.builder import example_graph, isolated_node
from vgraph.run.network_match import NON_FUNCTIONAL
from vgraph.ops import REGISTRY
from vgraph.plugins import declared_lowerings

from .check import CheckReport, TOLERANCES, check_network

__all__ = ["OP_SCALES", "OpCase", "op_cases", "check_ops"]

#: Input scales of the per-op check: float inputs (and an embedder's table) times each.
OP_SCALES = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)
#: Op types that are not computations, which the check passes over when it checks every type.
NOT_COMPUTATIONS = frozenset({"weight_replica"})


@dataclass(frozen=True)
class OpCase:
    """One sample of one op type: the label the report shows and its one-VNode network."""

    op: str
    label: str
    graph: Graph


def _requested(types: Sequence[str] | None, network: Graph | None) -> tuple[list[str], list[str]]:
    """(canonical op types to check, notes on the ones left out); unknown names are one error."""
    if types:
        unknown = [t for t in types if t not in REGISTRY]
        if unknown:
            raise VGraphError([f"--ops: unknown op type {t!r} (vgraph ops lists them)" for t in unknown])
        return list(dict.fromkeys(REGISTRY.canonical(t) or t for t in types)), []
    used = {n.type for n in network.nodes} if network is not None else None
    chosen, notes = [], []
    for op in REGISTRY:
        if (used is not None and op.name not in used) or op.name in NOT_COMPUTATIONS:
            continue
        missing = [b for b in ("torch", "onnx") if b not in declared_lowerings().get(op.name, {})]
        if missing:
            notes.append(f"{op.name}: not checked, it has no {' and no '.join(missing)} lowering")
            continue
        chosen.append(op.name)
    return chosen, notes


def op_cases(types: Sequence[str] | None = None, network: Graph | None = None) -> tuple[list[OpCase], list[str]]:
    """The samples of ``types`` (default: every type both backends lower, or every type ``network`` uses):
    each type's declared examples, then each distinct config and input shapes it has in ``network``."""
    chosen, notes = _requested(types, network)
    cases: list[OpCase] = []
    for op_name in chosen:
        op = REGISTRY.get(op_name)
        for i, ex in enumerate(op.examples):
            label = f"{op_name} {ex.label or f'#{i + 1}'}"
            cases.append(OpCase(op_name, label, example_graph(op_name, dict(ex.config), ex.inputs,
                                                              name=f"example-{op_name}-{i + 1}")))
        seen: set[tuple] = set()
        for node in (network.nodes_of_type(op_name) if network is not None else ()):
            one = isolated_node(network, node.id)
            key = tuple((n.type, n.input_shapes, tuple(sorted((k, repr(v)) for k, v in n.config.items()
                                                              if k not in NON_FUNCTIONAL)))
                        for n in one.nodes)  # placement and precision keys do not change what it computes
            if key not in seen:
                seen.add(key)
                cases.append(OpCase(op_name, f"{op_name} as '{node.id}'", one))
        if not any(c.op == op_name for c in cases) and not types:
            notes.append(f"{op_name}: not checked, it declares no examples and "
                         f"{'the network does not use it' if network is not None else 'no network was given'}")
        elif not any(c.op == op_name for c in cases):
            raise VGraphError(f"--ops: op type {op_name!r} declares no examples (OpDef(examples=...)) and "
                              f"{'the network does not use it' if network is not None else 'no network was given'}"
                              ": give a network that uses it (vgraph check-onnx NET.yml --ops ...)")
    return cases, notes


def check_ops(cases: Sequence[OpCase], *, batch: int = 2, seed: int = 0, rtol: float | None = None,
              atol: float | None = None, scales: Sequence[float] = OP_SCALES) -> CheckReport:
    """Every case through both backends at every scale, as one report (case label "<op> <sample> x<scale>")."""
    tol = TOLERANCES["float32"]
    report = CheckReport(f"{len(cases)} op sample(s)", batch, "", tol.rtol if rtol is None else rtol,
                         tol.atol if atol is None else atol,
                         weights=f"weights seeded (seed {seed}), matrices N(0, 1/fan_in); input scales "
                                 f"{', '.join(f'{s:g}' for s in scales)}")
    for case in cases:
        one = check_network(case.graph, batch=batch, seed=seed, rtol=report.rtol, atol=report.atol, scales=scales)
        report.provider = one.provider
        for out in one.outputs:  # "training graph, x10" -> "<op> <sample> x10"
            report.outputs.append(replace(out, case=f"{case.label} x{out.case.rsplit(' x', 1)[-1]}"))
    return report
