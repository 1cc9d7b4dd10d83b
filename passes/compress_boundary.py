"""compress-boundary: send what crosses each cut edge in a smaller wire format (a `compress` VNode per edge).

On slow links the boundary activations and their gradients dominate a
pipeline's step.  AC-SGD (Wang et al., NeurIPS 2022) quantizes both to a few
bits per element and keeps the convergence; this pass is that rewrite as IR:
after `partition`, every cut edge carrying a float tensor, `a -> b` with `a`
and `b` on different PNodes, becomes `a -> compress -> b`, the `compress`
VNode on `a`'s PNode (so the cut is now `compress -> b`) with

* `activations`, `gradients`: the wire format forward and back: fp16, bf16
  or int8 with a float32 scale per token or per channel (`scale`), or none;
* `error_feedback`: the gradient's sender adds what the previous step's
  rounding lost at the same sample position (error feedback, Seide et al.
  2014; Karimireddy et al. 2019).  AC-SGD's own error compensation is on
  the activations, with a buffer per training example kept across epochs;
  for a corpus streamed once that buffer is never read again, so here the
  feedback is on the gradients, per position in the batch, which corrects
  the parameter gradients upstream in sum (they are sums over positions).

The op's meaning, its wire formats and bytes are in vgraph/ops/boundary.py;
the torch backend computes it in one process (`vgraph train`) and sends the
wire format itself under `vgraph launch` (the same numbers); the cost model
prices the cut edge compressed.  The network's function changes (rounding),
so `preserves_semantics` is False; the weights do not (a `compress` VNode has
none), so `vgraph launch` keeps storing the network as given.

`activations=auto,gradients=auto` compresses what `partition{compress=auto}`
chose (the PNode pairs whose edges it priced compressed: partition_compress.py).
The pass is idempotent: an edge that already leaves a `compress` VNode is
left alone.  Edges into or out of nothing placed (no `meta["pnode"]`) are an
error: run `partition` first.
"""
from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from vgraph.ir.graph import Edge, Graph, VNode
from vgraph.ops.boundary import CODECS, COMPRESSION_PASS, SCALES
from vgraph.transform.pass_api import Option, Pass, PassContext, PassError
from vgraph.transform.rewrite import fresh_id

__all__ = ["CompressBoundary"]

_AUTO = "auto"


class CompressBoundary(Pass):
    """Compress what crosses each cut edge: activations forward, gradients back (fp16, bf16, int8)."""

    name = COMPRESSION_PASS
    preserves_semantics = False  # rounding changes what the network computes...
    keeps_weights = True  # ...but not its weights: `compress` VNodes hold none
    after = ("dead-nodes", "precision", "partition", "fuse-heads", "fuse-lm-head-ce", "remat")
    options = {
        "activations": Option(str, "int8", "wire format of the activation sent forward (auto: what "
                              "partition{compress=auto} chose)", choices=(*CODECS, _AUTO)),
        "gradients": Option(str, "int8", "wire format of its gradient sent back (auto: as partition chose)",
                            choices=(*CODECS, _AUTO)),
        "scale": Option(str, "token", "int8 groups: token (a scale per position) or channel (a scale per "
                        "channel across positions; needs a per-sample rank of 2)", choices=SCALES),
        "error_feedback": Option(bool, False, "the gradient's sender adds what the last rounding lost"),
    }

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        where = {n.id: n.meta.get("pnode") for n in graph.nodes}
        if not any(where.values()):
            raise PassError(f"pass {self.spec()!r} compresses cut edges and the network has no placement: run "
                            f"'partition' before it (partition{{fleet=FILE}}, or vgraph launch / partition "
                            f"--fleet)")
        wanted = self._codecs(graph)
        count: Counter = Counter()
        taken = set(graph.node_ids())
        for e in sorted(graph.edges, key=lambda e: (e.dst, e.dst_slot)):
            src = graph.node(e.src)
            a, b = where.get(e.src), where.get(e.dst)
            if a is None or b is None or a == b or src.type == "compress":
                continue
            codecs = wanted(a, b)
            t = src.outputs[e.src_slot] if e.src_slot < len(src.outputs) else None
            if codecs is None or t is None or t.kind != "float":
                continue
            scale = self.opts["scale"]
            if scale == "channel" and len(t.shape) < 2:
                scale = "token"
                count["token_scale_fallback"] += 1
            self._insert(graph, e, a, b, codecs, scale, fresh_id(taken, f"compress__{e.dst}__in{e.dst_slot}"),
                         taken)
            count["compressed"] += 1
        if count["token_scale_fallback"]:
            ctx.notes.append(f"{self.spec()}: {count['token_scale_fallback']} cut edge(s) carry a per-sample "
                             f"vector (rank 1): scale=token there (one scale per sample)")
        return count

    def _codecs(self, graph: Graph):
        """(producer PNode, consumer PNode) -> (activations, gradients) to use, or None to leave the edge."""
        act, grad = self.opts["activations"], self.opts["gradients"]
        if _AUTO in (act, grad):
            chosen = (graph.meta.get("placement") or {}).get("compress")
            if not isinstance(chosen, dict):
                raise PassError(f"pass {self.spec()!r}: auto takes the choice of partition{{compress=auto}}, and "
                                f"this network's partition made none: run partition{{compress=auto}} first, or "
                                f"name the formats (activations=int8)")
            pairs = set(chosen.get("pnode_pairs") or ())
            picked = (chosen.get("activations", "none"), chosen.get("gradients", "none"))

            def choose(a: str, b: str) -> tuple[str, str] | None:
                if f"{a}->{b}" not in pairs:
                    return None
                codecs = (picked[0] if act == _AUTO else act, picked[1] if grad == _AUTO else grad)
                return None if codecs == ("none", "none") else codecs
            return choose
        if (act, grad) == ("none", "none"):
            return lambda a, b: None
        return lambda a, b: (act, grad)

    def _insert(self, graph: Graph, e: Edge, a: str, b: str, codecs: tuple[str, str], scale: str, cid: str,
                taken: set[str]) -> None:
        taken.add(cid)
        config: dict[str, Any] = {"activations": codecs[0], "gradients": codecs[1], "scale": scale,
                                  "peer_pnode": b}
        if self.opts["error_feedback"] and codecs[1] != "none":
            config["error_feedback"] = True
        src = graph.node(e.src)
        meta = {"pnode": a}
        if src.meta.get("precision"):
            meta["precision"] = copy.deepcopy(src.meta["precision"])
        graph.remove_edge(e)
        graph.add_node(VNode(cid, "compress", config, loc=e.loc, meta=meta))
        graph.add_edge(e.src, e.src_slot, cid, 0, e.loc)
        graph.add_edge(cid, 0, e.dst, e.dst_slot, e.loc)
