"""precision: the effective dtypes of every VNode for a compile target.

Production policy (network-yaml spec): reduced precision runs fp16 on GPUs
below compute capability 8.0 and native bf16 from 8.0 on; losses stay in
fp32 (or the declared cost_precision); reduced-precision parameters keep fp32
master weights in the optimizer; fp16 needs dynamic loss scaling.  A CPU
without fast half-precision math runs fp32 and the pass says so.  The YAML's
declared precision is never changed: the result is an annotation
(node.meta["precision"], graph.meta["precision"]) that backends read.
"""
from __future__ import annotations

import re
from collections import Counter

from vgraph.ir.graph import Graph, VNode
from vgraph.ops.schema import DTYPE_OF_PRECISION
from vgraph.transform.pass_api import Option, Pass, PassContext, PassError

F32 = "float32"
_CUDA = re.compile(r"^cuda-sm(\d)(\d+)$")


def parse_target(target: str) -> tuple[str, int | None]:
    """'cpu' -> ('cpu', None); 'cuda-sm86' -> ('cuda', 86)."""
    if target == "cpu":
        return "cpu", None
    m = _CUDA.match(target)
    if not m:
        raise PassError(f"pass 'precision': unknown target {target!r} (expected cpu or cuda-smXY, "
                        f"e.g. cuda-sm75, cuda-sm80, cuda-sm90)")
    return "cuda", int(m.group(1) + m.group(2))


def reduced_dtype(target: str) -> str:
    """What declared fp16/bf16 becomes on `target`."""
    kind, sm = parse_target(target)
    if kind == "cpu":
        return F32
    return "float16" if sm < 80 else "bfloat16"


def node_precision(graph: Graph, node: VNode, reduced: str) -> dict:
    def eff(dtype: str) -> str:
        return F32 if dtype == F32 else reduced

    param, act = eff(graph.param_dtype(node)), eff(graph.activation_dtype(node))
    owns_or_ties = bool(node.op.param_shapes(node.cfg) or node.op.tied(node.cfg))
    out = {"param": param, "activation": act,
           "master": F32 if owns_or_ties and param != F32 else None}
    if node.op.is_cost:
        declared = node.cfg.get("cost_precision")
        out["loss"] = DTYPE_OF_PRECISION[declared] if declared else F32
    return out


class Precision(Pass):
    """Resolve declared precisions into effective per-VNode dtypes for a target (cpu, cuda-smXY)."""

    name = "precision"
    preserves_semantics = True  # an annotation of how to run the same function
    options = {"target": Option(str, None, "cpu or cuda-smXY; default: the caller's target, else cpu")}

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        target = self.opts["target"] or ctx.target or "cpu"
        reduced = reduced_dtype(target)
        counts: Counter = Counter()
        declared_reduced = False
        for node in graph.nodes:
            declared_reduced |= "float32" != graph.activation_dtype(node) or "float32" != graph.param_dtype(node)
            new = node_precision(graph, node, reduced)
            if node.meta.get("precision") != new:
                node.meta["precision"] = new
                counts["annotated"] += 1
        acts = {n.meta["precision"]["activation"] for n in graph.nodes}
        compute = next((d for d in ("float16", "bfloat16") if d in acts), F32)
        if parse_target(target)[0] == "cpu" and declared_reduced:
            reason = ("target cpu: declared reduced precision runs in float32 (this CPU has no fast "
                      "half-precision matmul); the YAML keeps its declared precision")
        elif compute == F32:
            reason = f"target {target}: float32 as declared"
        else:
            reason = (f"target {target}: declared reduced precision runs as {compute}"
                      f"{' with dynamic loss scaling' if compute == 'float16' else ''}; fp32 loss and "
                      f"fp32 master weights")
        summary = {"target": target, "compute_dtype": compute, "loss_scaling": compute == "float16",
                   "reason": reason}
        if graph.meta.get("precision") != summary:
            graph.meta["precision"] = summary
            counts["network"] += 1
        ctx.notes.append(reason)
        return counts
