"""What a training step costs, per VNode and per edge: the numbers placement decides on.

Per VNode (bytes at the *effective* precision: `node.meta["precision"]` when
the precision pass ran, else the declared one):

- parameters the node owns (a tied weight counts once, at its publisher);
- gradients, one per parameter, at the parameter dtype;
- optimizer state: fp32 master weights when the parameters are stored in
  reduced precision, plus Adam's two fp32 moments per parameter (`sgd`: one
  fp32 momentum buffer; `none`: frozen, no gradient or state).  A trainable
  node without an `optimizer` key is taken to use Adam, as in production;
- activations kept for backward, per sample: the outputs (of a node with
  several, those somebody reads: the fused LM-head loss keeps no logits unless
  they are asked for); a broadcast's copies are free;
- forward FLOPs per sample (`OpDef.flop_count`); a training step costs about
  three times the forward pass (backward = two matmuls per forward one);
- rematerialisation (`remat: recompute` marks, see vgraph/cost/remat.py): a
  recomputed VNode keeps no activation (`recompute_bytes` says what backward
  rebuilds), every member of a recomputed region runs its forward again
  (`recompute_flops`), and a PNode's peak adds its largest region's rebuilt
  bytes (`CostModel.transient_bytes`).

Per edge: the bytes one step moves if the edge is cut, the forward activation
plus its gradient on the way back (integer tensors have no gradient), times
the batch.  An edge leaving a `compress` VNode (the compress-boundary pass)
moves each direction in that VNode's wire format (`vgraph.ops.boundary.wire_bytes`:
what the workers of `vgraph launch` send and count).  A tied weight used on a PNode other than its publisher's costs a
weight sync per step: the user's gradient goes to the owner and the updated
weight comes back (2 x the weight at its dtype, independent of the batch),
and the user's PNode holds a replica (weight + gradient).

A step runs `micro_batches` micro-batches of `ceil(batch / micro_batches)`
samples; with a 1F1B pipeline schedule a stage keeps the activations of at
most min(micro_batches, stages) micro-batches (the pipeline's stage count).
"""
from __future__ import annotations

from functools import cached_property
from math import ceil, prod
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from vgraph.cost.analyze import human
from vgraph.cost.grad_compression import NO_GRAD_COMPRESSION, GradCompression, parse_grad_compress, per_node
from vgraph.cost.remat import NO_REMAT, RematLayout, marked_ids, remat_layout
from vgraph.ir.graph import Graph, VNode
from vgraph.ops import REGISTRY, OpDef
from vgraph.ops.boundary import wire_bytes
from vgraph.ops.schema import DTYPE_OF_PRECISION
from vgraph.types import DTYPE_BYTES, TensorType

DEFAULT_BATCH = 8
_FLOAT = frozenset(("float32", "float16", "bfloat16"))
FP32 = 4
ADAM_STATE = 2 * FP32  # two fp32 moments per parameter
SGD_STATE = FP32  # one fp32 momentum buffer
TRAIN_FLOPS_FACTOR = 3  # forward + backward (about twice the forward)


class NodeCost(NamedTuple):
    id: str
    type: str
    group: str | None
    params: int  # parameters owned
    param_dtype: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int  # fp32 master copy (reduced-precision parameters only)
    adam_bytes: int  # optimizer moments
    activation_bytes: int  # per sample, kept for backward
    flops: int  # forward, per sample
    recompute_bytes: int = 0  # per sample: outputs rebuilt in backward instead of kept (remat)
    recompute_flops: int = 0  # per sample: forward FLOPs run again in backward (remat)

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state: master weights and moments."""
        return self.master_bytes + self.adam_bytes

    @property
    def static_bytes(self) -> int:
        """What the node holds whatever the batch: parameters, gradients, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.adam_bytes

    def memory_bytes(self, resident_samples: int) -> int:
        return self.static_bytes + self.activation_bytes * resident_samples

    def step_flops(self, batch: int) -> int:
        return (TRAIN_FLOPS_FACTOR * self.flops + self.recompute_flops) * batch


class EdgeCost(NamedTuple):
    src: str
    src_slot: int
    dst: str
    dst_slot: int
    bytes_per_sample: int  # forward activation
    gradient: bool  # a gradient flows back
    back_bytes_per_sample: int  # that gradient (the activation's size unless compressed; 0 without one)

    def bytes_per_step(self, batch: int) -> int:
        return (self.bytes_per_sample + self.back_bytes_per_sample) * batch


class TieCost(NamedTuple):
    """A tied weight read by `user` and owned by `publisher`."""

    alias: str
    publisher: str
    user: str
    weight_bytes: int  # the weight at its parameter dtype

    @property
    def sync_bytes_per_step(self) -> int:
        """When the two are on different PNodes: gradient to the owner, weight back."""
        return 2 * self.weight_bytes

    @property
    def replica_bytes(self) -> int:
        """What the user's PNode holds when separated: a copy of the weight and its gradient."""
        return 2 * self.weight_bytes


class CostModel:
    """Per-VNode and per-edge costs of one training step.

    Stored as columns (what partitioning a 100k-VNode network reads, as numpy arrays);
    `nodes` (id -> NodeCost) and `edges` (EdgeCost list) are built from them on first use.
    """

    def __init__(self, name: str, batch: int, micro_batches: int, node_columns: dict[str, list],
                 edge_columns: dict[str, list], ties: list[TieCost], remat: RematLayout | None = None,
                 grad_compress: GradCompression = NO_GRAD_COMPRESSION) -> None:
        self.name = name
        self.grad_compress = grad_compress  # how replicas all-reduce gradients (vgraph/cost/grad_compression.py)
        self.remat = remat if remat is not None else NO_REMAT
        self.batch = batch
        self.micro_batches = micro_batches
        self.node_columns = node_columns  # id, type, group, params, param_dtype, param_bytes, ..., reduce_bytes,
        # reduce_flops, reduce_memory (what replicas all-reduce of each VNode under `grad_compress`)
        # src (node index), src_slot, dst (node index), dst_slot, bytes_per_sample, gradient,
        # back_bytes_per_sample, codec_flops (training FLOPs per sample the producer spends when the edge is cut:
        # 0 unless priced compressed by compression.with_compressed_edges)
        self.edge_columns = edge_columns
        self.ties = ties

    @cached_property
    def nodes(self) -> dict[str, NodeCost]:
        c = self.node_columns
        return {row[0]: NodeCost(*row) for row in zip(*(c[f] for f in NodeCost._fields))}

    @cached_property
    def edges(self) -> list[EdgeCost]:
        c = self.edge_columns
        ids = self.node_columns["id"]
        return [EdgeCost(ids[s], ss, ids[d], ds, b, g, k) for s, ss, d, ds, b, g, k in
                zip(c["src"], c["src_slot"], c["dst"], c["dst_slot"], c["bytes_per_sample"], c["gradient"],
                    c["back_bytes_per_sample"])]

    def edge_round_trip(self) -> np.ndarray:
        """Per edge (column order): bytes per sample both ways if cut, activation + gradient."""
        c = self.edge_columns
        return np.asarray(c["bytes_per_sample"], dtype=float) + np.asarray(c["back_bytes_per_sample"], dtype=float)

    def train_flops_per_sample(self) -> np.ndarray:
        """Forward + backward + rematerialised FLOPs of each VNode for one sample (node order)."""
        return (np.asarray(self.node_columns["flops"], dtype=float) * TRAIN_FLOPS_FACTOR
                + np.asarray(self.node_columns["recompute_flops"], dtype=float))

    def transient_bytes(self, ids: Iterable[str] | None = None) -> int:
        """Per sample: the recomputed bytes of the largest colocation group among `ids` (vgraph/cost/remat.py)."""
        if not self.remat.regions:
            return 0
        c = self.node_columns
        pick = None if ids is None else set(ids)
        per_group: dict[object, int] = {}
        for nid, size in zip(c["id"], c["recompute_bytes"]):
            if size and (pick is None or nid in pick):
                g = self.remat.groups[self.remat.region_of[nid]]
                per_group[g] = per_group.get(g, 0) + size
        return max(per_group.values(), default=0)

    def column(self, column: str) -> np.ndarray:
        """A node column (e.g. "flops", "param_bytes") or edge column ("edge:src", ...) as numpy."""
        if column.startswith("edge:"):
            return np.asarray(self.edge_columns[column[5:]])
        return np.asarray(self.node_columns[column])

    @property
    def micro_batch(self) -> int:
        return ceil(self.batch / self.micro_batches)

    def resident_samples(self, stages: int = 1) -> int:
        """Samples whose activations a stage keeps at once (1F1B: at most one micro-batch per stage)."""
        return self.micro_batch * max(1, min(self.micro_batches, stages))

    def node_memory(self, node_id: str, stages: int = 1) -> int:
        return self.nodes[node_id].memory_bytes(self.resident_samples(stages))

    def edge_bytes(self, e: EdgeCost) -> int:
        return e.bytes_per_step(self.batch)

    def bytes_sent(self, assign: Mapping[str, str]) -> dict[str, tuple[int, int]]:
        """What each PNode sends when the VNodes are placed by `assign` (VNode -> PNode): (bytes per sample
        of boundary tensors, bytes per step of tied-weight sync).

        Why apart from the edge totals: a cut edge's `bytes_per_step` is its traffic both ways (the
        activation forward, sent by the producer's PNode, and its gradient back, sent by the reader's),
        and a PNode's `boundary_bytes_per_step` counts every cut edge it touches, in and out.  What a
        worker measures is only what it sends; this is the prediction on that basis.  A separated tie:
        the publisher's PNode sends the weight, the user's the weight's gradient.
        """
        out: dict[str, list[int]] = {}
        for e in self.edges:
            a, b = assign[e.src], assign[e.dst]
            if a != b:
                out.setdefault(a, [0, 0])[0] += e.bytes_per_sample
                if e.gradient:
                    out.setdefault(b, [0, 0])[0] += e.back_bytes_per_sample
        for t in self.ties:
            a, b = assign[t.publisher], assign[t.user]
            if a != b:
                out.setdefault(a, [0, 0])[1] += t.weight_bytes
                out.setdefault(b, [0, 0])[1] += t.sync_bytes_per_step - t.weight_bytes
        return {p: (v[0], v[1]) for p, v in out.items()}

    def totals(self, ids: Iterable[str] | None = None, stages: int = 1) -> dict[str, int]:
        """Summed bytes by kind and training FLOPs per step of `ids` (default: every node)."""
        nodes = self.nodes.values() if ids is None else (self.nodes[i] for i in ids)
        out = dict(params=0, param_bytes=0, grad_bytes=0, optimizer_bytes=0, activation_bytes=0,
                   flops_per_step=0, recompute_flops_per_step=0)
        resident = self.resident_samples(stages)
        out["transient_bytes"] = self.transient_bytes(ids) * resident
        for c in nodes:
            out["params"] += c.params
            out["param_bytes"] += c.param_bytes
            out["grad_bytes"] += c.grad_bytes
            out["optimizer_bytes"] += c.optimizer_bytes
            out["activation_bytes"] += c.activation_bytes * resident
            out["flops_per_step"] += c.step_flops(self.batch)
            out["recompute_flops_per_step"] += c.recompute_flops * self.batch
        out["memory_bytes"] = (out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]
                               + out["activation_bytes"] + out["transient_bytes"])
        return out

    def to_json(self) -> dict:
        return {
            "name": self.name, "batch": self.batch, "micro_batches": self.micro_batches,
            "micro_batch": self.micro_batch, "totals": self.totals(),
            "nodes": [{"id": c.id, "type": c.type, "group": c.group, "params": c.params,
                       "param_dtype": c.param_dtype, "param_bytes": c.param_bytes, "grad_bytes": c.grad_bytes,
                       "master_bytes": c.master_bytes, "adam_bytes": c.adam_bytes,
                       "activation_bytes_per_sample": c.activation_bytes,
                       "activation_bytes_per_micro_batch": c.activation_bytes * self.micro_batch,
                       "flops_per_sample": c.flops, "flops_per_step": c.step_flops(self.batch),
                       **({"remat": "recompute", "recompute_bytes_per_sample": c.recompute_bytes}
                          if c.recompute_bytes else {}),
                       **({"recompute_flops_per_sample": c.recompute_flops} if c.recompute_flops else {})}
                      for c in self.nodes.values()],
            "edges": [{"from": e.src, "from_slot": e.src_slot, "to": e.dst, "to_slot": e.dst_slot,
                       "bytes_per_sample": e.bytes_per_sample, "gradient": e.gradient,
                       "gradient_bytes_per_sample": e.back_bytes_per_sample,
                       "bytes_per_step": self.edge_bytes(e)} for e in self.edges],
            "ties": [{"alias": t.alias, "publisher": t.publisher, "user": t.user,
                      "weight_bytes": t.weight_bytes, "sync_bytes_per_step": t.sync_bytes_per_step}
                     for t in self.ties],
        }


def effective_dtype(declared: str, activation: str | None) -> str:
    """A float tensor's effective dtype: fp32 stays fp32 (losses), reduced becomes the compute dtype."""
    if activation is None or declared == "float32" or declared not in ("float16", "bfloat16"):
        return declared
    return activation


def tensor_bytes(t: TensorType, activation: str | None = None) -> int:
    return t.numel * DTYPE_BYTES[effective_dtype(t.dtype, activation)]


def cost_model(graph: Graph, *, batch: int = DEFAULT_BATCH, micro_batches: int = 1,
               grad_compress: GradCompression | str | None = None) -> CostModel:
    """Costs of every VNode and edge of a verified graph (types inferred); `grad_compress` says how
    replicas would all-reduce its gradients (vgraph/cost/grad_compression.py).

    Long because it is written as one tight loop (about 5 us a VNode), each
    column appended through a bound method: partitioning a 100k-VNode network
    starts here, and a call per VNode and field would be paid by every plan.
    """
    if batch < 1 or micro_batches < 1:
        raise ValueError("batch and micro_batches must be >= 1")
    grad_compress = parse_grad_compress(grad_compress)
    # What the loop reads of the graph, resolved into tables first (the remat regions, the input and
    # output edges, the endpoints, each shared weight's publisher and dtype), so that the loop below asks
    # the graph nothing: one pass over the IR, then one over the tables.
    marks = marked_ids(graph)
    layout = remat_layout(graph, marks) if marks else None
    inputs_of = graph.input_index()
    vnodes = {nid: graph.node(nid) for nid in graph.node_ids()}
    endpoint_slots = {(ep.node, ep.slot) for ep in graph.iter_endpoints()}
    publishers = graph.publishers()
    published = {alias: (pub, ((pub.meta.get("precision") or {}).get("param") or graph.param_dtype(pub)))
                 for alias, pub in publishers.items()}
    used_slots: dict[str, set[int]] = {}
    for e in graph.edges:
        used_slots.setdefault(e.src, set()).add(e.src_slot)
    cols: dict[str, list] = {f: [] for f in NodeCost._fields}
    ecols: dict[str, list] = {f: [] for f in ("src", "src_slot", "dst", "dst_slot", "bytes_per_sample",
                                              "gradient", "back_bytes_per_sample")}
    ties: list[TieCost] = []
    trained_shapes: list[tuple[tuple[int, ...], ...]] = []  # per VNode, its trained parameters' shapes
    attrs = graph.attrs
    net_param = DTYPE_OF_PRECISION[attrs.get("param_precision") or attrs.get("precision") or "float32"]
    ops: dict[str, OpDef] = {}
    dtype_bytes = DTYPE_BYTES
    index = {nid: i for i, nid in enumerate(vnodes)}
    (c_id, c_type, c_group, c_params, c_pdtype, c_pbytes, c_grad, c_master, c_adam, c_act,
     c_flops) = (cols[f].append for f in NodeCost._fields[:11])
    e_src, e_src_slot, e_dst, e_dst_slot, e_bytes, e_grad, e_back = (ecols[f].append for f in ecols)
    for i, n in enumerate(vnodes.values()):
        op = ops.get(n.type)
        if op is None:
            op = ops[n.type] = REGISTRY.get(n.type)
        config = n.config
        prec = n.meta.get("precision")
        act = pdtype = None
        if prec:
            act, pdtype = prec.get("activation"), prec.get("param")
        if pdtype is None:
            own = config.get("param_precision") or config.get("precision")
            pdtype = DTYPE_OF_PRECISION[own] if own else net_param
        cfg = n.cfg
        slots = inputs_of[n.id]
        outs = n.outputs
        shapes = op.param_shapes(cfg) if op.params is not None else {}
        params = sum(prod(s) for s in shapes.values())
        flops = 0
        if op.flops and outs:
            ins = _input_types(n, op, cfg, slots, vnodes)
            if len(ins) >= op.input_range()[0]:
                flops = op.flop_count(cfg, ins, outs)
        optimizer = config.get("optimizer") or "adam"
        trained = params > 0 and optimizer != "none"
        pbytes = params * dtype_bytes[pdtype]
        activation = 0
        if len(outs) == 1:  # one output: kept unless the node is dead (dead-nodes removes those)
            t = outs[0]
            activation = t.numel * dtype_bytes[effective_dtype(t.dtype, act)]
        elif n.type != "broadcast":  # several outputs: only those read are computed and kept
            nid = n.id
            used = used_slots.get(nid, ())
            for slot, t in enumerate(outs):
                if slot in used or (nid, slot) in endpoint_slots:
                    activation += t.numel * dtype_bytes[effective_dtype(t.dtype, act)]
        trained_shapes.append(tuple(shapes.values()) if trained else ())
        if trained:
            grad = pbytes
            master = params * FP32 if pdtype != "float32" else 0
            moments = params * (ADAM_STATE if optimizer in ("adam", "adamw") else SGD_STATE if optimizer == "sgd" else 0)
        else:
            grad = master = moments = 0
        c_id(n.id)
        c_type(n.type)
        c_group(config.get("colocate_group"))
        c_params(params)
        c_pdtype(pdtype)
        c_pbytes(pbytes)
        c_grad(grad)
        c_master(master)
        c_adam(moments)
        c_act(activation)
        c_flops(flops)
        for e in slots.values():
            src = vnodes[e.src]
            src_outs = src.outputs
            if e.src_slot >= len(src_outs):
                continue
            t = src_outs[e.src_slot]
            src_prec = src.meta.get("precision")
            e_src(index[e.src])
            e_src_slot(e.src_slot)
            e_dst(i)
            e_dst_slot(e.dst_slot)
            dtype = effective_dtype(t.dtype, src_prec.get("activation") if src_prec else None)
            fwd = t.numel * dtype_bytes[dtype]
            grad = t.dtype in _FLOAT
            back = fwd if grad else 0
            if src.type == "compress":  # each direction in its wire format
                scfg = src.cfg
                fwd = wire_bytes(t.shape, dtype, scfg["activations"], scfg["scale"])
                back = wire_bytes(t.shape, dtype, scfg["gradients"], scfg["scale"]) if grad else 0
            e_bytes(fwd)
            e_grad(grad)
            e_back(back)
        if op.tied_params is not None:
            for alias, shape in op.tied(cfg).values():
                pub, pub_dtype = published.get(alias, (None, None))
                if pub is not None and pub.id != n.id:
                    ties.append(TieCost(alias, pub.id, n.id, prod(shape) * dtype_bytes[pub_dtype]))
    # What each VNode all-reduces when replicas sync its gradients, the compression's FLOPs and memory
    # (grad_compression.py): priced once here, beside its gradient bytes, for every cut a planner reads.
    cols["reduce_bytes"], cols["reduce_flops"], cols["reduce_memory"] = per_node(
        trained_shapes, np.asarray(cols["grad_bytes"], dtype=float), np.asarray(cols["params"], dtype=float),
        grad_compress)
    ecols["codec_flops"] = [0] * len(ecols["src"])
    cols["recompute_bytes"] = [0] * len(cols["id"])
    cols["recompute_flops"] = [0] * len(cols["id"])
    if layout is not None:  # remat: recomputed outputs are not kept; region members run their forward again
        act, again, flops = cols["activation_bytes"], cols["recompute_flops"], cols["flops"]
        for nid in layout.reexecuted:
            k = index[nid]
            again[k] = flops[k]
        for nid in layout.recomputed:
            k = index[nid]
            cols["recompute_bytes"][k], act[k] = act[k], 0
    return CostModel(graph.name, batch, micro_batches, cols, ecols, ties, layout, grad_compress)


def _input_types(n: VNode, op: OpDef, cfg: dict, slots: dict, vnodes: dict) -> list[TensorType]:
    """The types arriving at each input slot (network inputs as the op declares them)."""
    if slots and len(slots) == max(slots) + 1 >= op.input_range()[0]:  # every slot fed: the usual case
        out = []
        for slot in range(len(slots)):
            e = slots[slot]
            out.append(vnodes[e.src].outputs[e.src_slot])
        return out
    out = []
    count = max(slots) + 1 if slots else 0
    for slot in range(max(op.input_range()[0], count)):
        e = slots.get(slot)
        if e is not None:
            src = vnodes[e.src]
            if e.src_slot < len(src.outputs):
                out.append(src.outputs[e.src_slot])
        elif n.input_shapes and slot < len(n.input_shapes):
            out.append(TensorType(tuple(n.input_shapes[slot])))
        elif slot == 0 and cfg.get("input_shape"):  # as verify reads an unconnected first input
            out.append(TensorType(tuple(cfg["input_shape"])))
        elif op.network_input:
            t = op.network_input(cfg, slot, out)
            if t is not None:
                out.append(t)
    return out


# -- presentation ---------------------------------------------------------------------------

def _b(n: float) -> str:
    return human(n, "B") if n else "0"


def format_costs(cm: CostModel, graph: Graph, fleet=None) -> str:
    """Tables for `vgraph analyze --fleet`: per VNode, per colocation group, per PNode."""
    lines = [f"network {cm.name!r}: cost of one training step, batch {cm.batch} "
             f"({cm.micro_batches} micro-batch{'es' * (cm.micro_batches != 1)} of {cm.micro_batch})"]
    head = ("node", "params", "dtype", "param B", "grad B", "optim B", "act B/sample", "act B/ubatch",
            "FLOPs/step")
    rows = [head]
    for n in graph.topo_order():
        c = cm.nodes[n.id]
        rows.append((c.id + (" (recomputed)" if c.recompute_bytes else ""), f"{c.params:,}", c.param_dtype if c.params else "-", _b(c.param_bytes),
                     _b(c.grad_bytes), _b(c.optimizer_bytes), _b(c.activation_bytes),
                     _b(c.activation_bytes * cm.micro_batch), human(c.step_flops(cm.batch))))
    lines += _table(rows)
    groups: dict[str, list[str]] = {}
    for n in graph.nodes:
        groups.setdefault(n.group or "(ungrouped)", []).append(n.id)
    lines.append("")
    grows = [("colocation group", "vnodes", "params", "grad", "optimizer", "activations", "memory",
              "FLOPs/step")]
    for g, ids in groups.items():
        t = cm.totals(ids)
        grows.append((g, str(len(ids)), _b(t["param_bytes"]), _b(t["grad_bytes"]), _b(t["optimizer_bytes"]),
                      _b(t["activation_bytes"]), _b(t["memory_bytes"]), human(t["flops_per_step"])))
    t = cm.totals()
    grows.append(("total", str(len(cm.nodes)), _b(t["param_bytes"]), _b(t["grad_bytes"]),
                  _b(t["optimizer_bytes"]), _b(t["activation_bytes"]), _b(t["memory_bytes"]),
                  human(t["flops_per_step"])))
    lines += _table(grows)
    edge_total = sum(cm.edge_bytes(e) for e in cm.edges)
    lines.append(f"edges: {len(cm.edges)}, {_b(edge_total)} per step if every edge were cut "
                 f"(activation + gradient)")
    for tie in cm.ties:
        lines.append(f"tied weight {tie.alias!r}: '{tie.user}' reads '{tie.publisher}'s weight; "
                     f"{_b(tie.sync_bytes_per_step)} per step if they are on different PNodes")
    if fleet is not None:
        lines.append("")
        lines.append(f"fleet {fleet.name!r}: the whole network on one PNode")
        frows = [("pnode", "accelerator", "memory", "fits", "step compute")]
        need = t["memory_bytes"]
        for p in fleet:
            frows.append((p.id, p.accelerator or "-", _b(p.memory), "yes" if need <= p.memory else
                          f"no (needs {_b(need)})", f"{t['flops_per_step'] / p.flops:.4g} s"))
        lines += _table(frows)
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


__all__ = ["NodeCost", "EdgeCost", "TieCost", "CostModel", "cost_model", "format_costs", "tensor_bytes",
           "effective_dtype",
           "DEFAULT_BATCH", "TRAIN_FLOPS_FACTOR"]
