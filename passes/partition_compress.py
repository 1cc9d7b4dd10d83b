"""`partition{compress=auto}`: plan with cut edges priced compressed, keep that plan if its step is shorter.

The replica planner (`partition_replicas.plan_replicas`) prices a plan from the
cost model's per-edge bytes.  With `compress=auto` it plans twice: once as the
network is, once with every float edge priced as the int8 wire format both ways
(`with_compressed_edges`: activations and gradients one
byte an element plus a float32 scale per token, the codec's FLOPs charged to the
producer's stage when the edge is cut).  Compressing changes which cut is best
(a cut costs about a quarter), so the second plan may cut elsewhere or use more
stages.  The plan of lower predicted step wins; when it is the compressed one,
every PNode pair it cuts between is recorded in `graph.meta["placement"]["compress"]`
and `compress-boundary{activations=auto,gradients=auto}` compresses those edges
(the partition itself only places VNodes: it keeps what the network computes).

Why all cut edges of a plan and not a choice per edge: on every link the
planner considers, sending a quarter of the bytes saves more seconds than the
codec's six FLOPs an element cost (at 1 Gbit/s four bytes take 32 ns, six FLOPs
on a 1 TFLOP/s PNode 6 ps), so per edge the answer is always the same; what
does change with the links is whether the compressed plan beats the best
uncompressed one, which is the comparison made here.  Lossy compression may cost
convergence, which the cost model cannot see: BENCHMARKS.md measures it.

`grad_compress` (PowerSGD for the replicas' all-reduce, as `vgraph launch
--grad-compress`) goes into both cost models, so the planner also weighs
replicas against the cheaper all-reduce.
"""
from __future__ import annotations

from typing import Any

from vgraph.cost.grad_compression import GradCompression
from vgraph.cost.costmodel import TRAIN_FLOPS_FACTOR, CostModel, cost_model, effective_dtype
from vgraph.cost.fleet import Fleet
from vgraph.ir.graph import Graph, VNode
from vgraph.ops.boundary import CODEC_FLOPS, wire_bytes

from vgraph.passes.partition_problem import PartitionError
from vgraph.passes.partition_replicas import ReplicaPlan, plan_replicas

__all__ = ["plan_compressed", "describe_choice", "cut_pairs", "with_compressed_edges"]

AUTO_CODEC = "int8"
AUTO_SCALE = "token"


def plan_compressed(graph: Graph, fleet: Fleet, *, batch: int, micro_batches: int, replicas: int | None,
                    grad_compress: GradCompression, auto: bool) -> tuple[ReplicaPlan, CostModel, dict[str, Any]]:
    """(plan, the cost model it was priced with, the compression chosen: {} for none)."""
    cm = cost_model(graph, batch=batch, micro_batches=micro_batches, grad_compress=grad_compress)
    plan, cm = plan_replicas(graph, fleet, batch=batch, micro_batches=micro_batches, replicas=replicas, cm=cm)
    if not auto:
        return plan, cm, {}
    squeezed = with_compressed_edges(cm, graph, AUTO_CODEC, AUTO_SCALE)
    try:
        other, _ = plan_replicas(graph, fleet, batch=batch, micro_batches=micro_batches, replicas=replicas,
                                 cm=squeezed)
    except PartitionError:  # the same memory constraints: cannot happen when the first plan exists
        return plan, cm, _declined(plan)
    pairs = cut_pairs(graph, other)
    if not pairs or not other.cost.step_seconds < plan.cost.step_seconds * (1 - 1e-9):
        return plan, cm, _declined(plan, other)
    return other, squeezed, {"activations": AUTO_CODEC, "gradients": AUTO_CODEC, "scale": AUTO_SCALE,
                             "pnode_pairs": pairs, "uncompressed_step_seconds": plan.cost.step_seconds,
                             "step_seconds": other.cost.step_seconds}


def _declined(plan: ReplicaPlan, other: ReplicaPlan | None = None) -> dict[str, Any]:
    return {"activations": "none", "gradients": "none", "pnode_pairs": [],
            "uncompressed_step_seconds": plan.cost.step_seconds,
            "compressed_step_seconds": other.cost.step_seconds if other is not None else None}


def cut_pairs(graph: Graph, plan: ReplicaPlan) -> list[str]:
    """'a->b' for every PNode pair of replica 0 that a float edge crosses (producer a, consumer b)."""
    where = plan.assignment(0)
    pairs = set()
    for e in graph.edges:
        a, b = where.get(e.src), where.get(e.dst)
        src = graph.node(e.src)
        if a is None or b is None or a == b or e.src_slot >= len(src.outputs):
            continue
        if src.outputs[e.src_slot].kind == "float":
            pairs.add(f"{a}->{b}")
    return sorted(pairs)


def describe_choice(chosen: dict[str, Any]) -> str:
    """The note `partition{compress=auto}` leaves."""
    before = chosen.get("uncompressed_step_seconds")
    if chosen.get("pnode_pairs"):
        return (f"partition: compress=auto: {chosen['activations']} on the cut edges {', '.join(chosen['pnode_pairs'])}"
                f" lowers the predicted step from {before:.4g} s to {chosen['step_seconds']:.4g} s; "
                f"compress-boundary{{activations=auto,gradients=auto}} inserts it")
    after = chosen.get("compressed_step_seconds")
    return (f"partition: compress=auto: compressing the cut edges does not lower the predicted step "
            f"({before:.4g} s" + (f" uncompressed, {after:.4g} s compressed" if after is not None else "")
            + "); nothing to compress")


def with_compressed_edges(cm: CostModel, graph: Graph, codec: str = "int8", scale: str = "token") -> CostModel:
    """`cm` with every float edge priced as if a `compress` VNode sent it in `codec` both ways, its codec's
    training FLOPs charged to the producer's stage when the edge is cut (what `partition{compress=auto}`
    compares plans with).  Edges that already leave a `compress` VNode keep their price."""
    c = cm.edge_columns
    ids = cm.node_columns["id"]
    fwd, back, flops = list(c["bytes_per_sample"]), list(c["back_bytes_per_sample"]), list(c["codec_flops"])
    for k, (s, slot, grad) in enumerate(zip(c["src"], c["src_slot"], c["gradient"])):
        src = graph.node(ids[s])
        if not grad or src.type == "compress" or slot >= len(src.outputs):
            continue
        t = src.outputs[slot]
        dtype = _effective(t.dtype, src)
        fwd[k] = wire_bytes(t.shape, dtype, codec, scale)
        back[k] = wire_bytes(t.shape, dtype, codec, scale)
        flops[k] = t.numel * CODEC_FLOPS[codec] * TRAIN_FLOPS_FACTOR
    columns = dict(c, bytes_per_sample=fwd, back_bytes_per_sample=back, codec_flops=flops)
    return CostModel(cm.name, cm.batch, cm.micro_batches, cm.node_columns, columns, cm.ties, cm.remat,
                     cm.grad_compress)


def _effective(declared: str, node: VNode) -> str:
    prec = node.meta.get("precision") or {}
    return effective_dtype(declared, prec.get("activation"))
