"""A placed network, cut into one network per PNode, and put back together.

After the `partition` pass every VNode carries `meta["pnode"]`.  From that:

- `placement_report` prices the placement as it stands now (after fusions,
  too): per PNode its VNodes, memory, FLOPs and step time, every cut edge with
  its bytes per step, the bottleneck and the total cut (placement.json);
- `split_network` gives one valid network per PNode: a cut edge becomes a
  `send` in the producer's part and a `receive` in the consumer's (both name
  their peer PNode, VNode and slot); a tied weight used away from its
  publisher becomes a `weight_replica` (see vgraph/ops/boundary.py);
- `stitch` inverts it: the original network, up to the boundary pairs;
- `export_partition` writes DIR/<pnode>.yml, DIR/placement.json and, on
  request, DIR/<pnode>.onnx through an exporter plugin.

Exporters come from the entry-point group `vgraph.exporters` (the core never
imports a backend): `name = "module:function"`, called as
`function(graph, node_ids, name=...)` and returning the serialised model (bytes, or
an object with `SerializeToString()`), e.g. the ONNX backend's
`vgraph.backends.onnx.subgraph:export_subgraph`.  `register_exporter` adds one
in code.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from vgraph.base.diagnostics import Diagnostic, VGraphError, printable
from vgraph.base.safeio import OutputDir, read_json
from vgraph.cost.costmodel import DEFAULT_BATCH, CostModel, cost_model
from vgraph.cost.fleet import Fleet, resolve_fleet
from vgraph.cost.op_kinds import vnode_seconds
from vgraph.ir.graph import Endpoint, Graph, VNode
from vgraph.ir.verify import verify
from vgraph.ops.boundary import BOUNDARY_TYPES, shape_text
from vgraph.placement.replica_report import with_replicas
from vgraph.transform.rewrite import fresh_id
from vgraph.yamlio import save

PLACEMENT_FILE = "placement.json"
EXPORTER_GROUP = "vgraph.exporters"
EXPORTERS: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True)
class CutEdge:
    src: str
    src_slot: int
    dst: str
    dst_slot: int
    src_pnode: str
    dst_pnode: str
    bytes_per_step: int

    def to_json(self) -> dict:
        return {"from": self.src, "from_slot": self.src_slot, "to": self.dst, "to_slot": self.dst_slot,
                "from_pnode": self.src_pnode, "to_pnode": self.dst_pnode, "bytes_per_step": self.bytes_per_step}


def assignment_of(graph: Graph) -> dict[str, str]:
    """VNode -> PNode from `meta["pnode"]`; a VNode a later pass created without one takes its
    producer's (or else a consumer's) PNode.  No placement at all is an error."""
    out = {n.id: n.meta["pnode"] for n in graph.nodes if n.meta.get("pnode")}
    if not out:
        raise VGraphError("the network has no placement: run the 'partition' pass first "
                          "(vgraph partition FILE --fleet FLEET -o DIR)")
    for n in graph.topo_order():
        if n.id not in out:
            near = [e.src for e in graph.in_edges(n.id)] + [e.dst for e in graph.out_edges(n.id)]
            pnode = next((out[m] for m in near if m in out), None)
            if pnode is None:
                raise VGraphError([Diagnostic("has no PNode (meta 'pnode') and no placed neighbour: run "
                                              "'partition' after the passes that add VNodes", n.loc, n.id)])
            out[n.id] = pnode
    return out


def placement_report(graph: Graph, fleet: Fleet | str, *, batch: int | None = None, micro_batches: int | None = None,
                     cm: CostModel | None = None) -> dict:
    """placement.json's content for the graph's current assignment (same objective as the pass)."""
    fleet = resolve_fleet(fleet)
    assign, pnode_of = assignment_of(graph), {p.id: p for p in fleet}  # unknown PNodes refused before pricing
    unknown = sorted(set(assign.values()) - set(pnode_of))
    if unknown:
        raise VGraphError(f"the placement uses PNode(s) {', '.join(map(repr, unknown))} that fleet "
                          f"{fleet.name!r} does not have ({', '.join(fleet.ids)})")
    placed = graph.meta.get("placement") or {}
    batch = batch or placed.get("batch") or DEFAULT_BATCH
    micro_batches = micro_batches or placed.get("micro_batches") or 1
    cm = cm or cost_model(graph, batch=batch, micro_batches=micro_batches, grad_compress=placed.get("grad_compress"))
    resident = cm.resident_samples(len(fleet))
    per = {p.id: {"vnodes": [], "memory_bytes": 0, "flops_per_step": 0, "boundary_bytes_per_step": 0,
                  "compute_seconds": 0.0} for p in fleet}
    for n in graph.topo_order():
        c = cm.nodes[n.id]
        slot = per[assign[n.id]]
        slot["vnodes"].append(n.id)
        slot["memory_bytes"] += c.memory_bytes(resident)
        slot["flops_per_step"] += c.step_flops(cm.batch)
        p = pnode_of[assign[n.id]]  # by op kind when the PNode carries a probe's figures (op_kinds.py)
        slot["compute_seconds"] += vnode_seconds(c.type, c.flops, c.step_flops(cm.batch), cm.micro_batches, p.flops,
                                                 p.efficiency)
    cuts: list[CutEdge] = []
    for e in cm.edges:
        a, b = assign[e.src], assign[e.dst]
        if a != b:
            size = cm.edge_bytes(e)
            cuts.append(CutEdge(e.src, e.src_slot, e.dst, e.dst_slot, a, b, size))
            per[a]["boundary_bytes_per_step"] += size
            per[b]["boundary_bytes_per_step"] += size
    sync = []
    for t in cm.ties:
        a, b = assign[t.publisher], assign[t.user]
        if a != b:
            sync.append({"alias": t.alias, "publisher": t.publisher, "user": t.user, "from_pnode": a,
                         "to_pnode": b, "bytes_per_step": t.sync_bytes_per_step})
            per[a]["boundary_bytes_per_step"] += t.sync_bytes_per_step
            per[b]["boundary_bytes_per_step"] += t.sync_bytes_per_step
            per[b]["memory_bytes"] += t.replica_bytes
    sent = cm.bytes_sent(assign)
    for p in fleet:
        slot = per[p.id]
        per_sample, sync_sent = sent.get(p.id, (0, 0))
        slot["bytes_sent_per_step"] = per_sample * cm.batch + sync_sent  # what the PNode's worker counts
        slot["capacity_bytes"] = p.memory
        slot["comm_seconds"] = slot["boundary_bytes_per_step"] / p.bandwidth
        slot["seconds"] = slot["compute_seconds"] + slot["comm_seconds"]
        slot["fits"] = slot["memory_bytes"] <= p.memory
    bottleneck = max(fleet, key=lambda p: per[p.id]["seconds"])
    endpoints = [{"kind": kind, "name": ep.name, "pnode": assign[ep.node]}
                 for kind, eps in graph.endpoints.items() for ep in eps]
    report = {
        "network": graph.name, "fleet": fleet.name, "batch": cm.batch, "micro_batches": cm.micro_batches,
        "assignment": assign, "cut_edges": [c.to_json() for c in cuts], "weight_sync": sync,
        "pnodes": per, "bottleneck_seconds": per[bottleneck.id]["seconds"], "bottleneck_pnode": bottleneck.id,
        "cut_bytes_per_step": sum(c.bytes_per_step for c in cuts) + sum(s["bytes_per_step"] for s in sync),
        "endpoints": endpoints,
    }
    return with_replicas(report, graph, fleet, cm,  # replicas, step_seconds, ... (replica_report.py)
                         pipeline=str(placed.get("pipeline") or "1f1b"), sent=sent)


# -- splitting ------------------------------------------------------------------------------------

def split_network(graph: Graph, assignment: Mapping[str, str] | None = None) -> dict[str, Graph]:
    """One verified network per PNode that holds VNodes, keyed by PNode id (fleet order of first use)."""
    assign = dict(assignment) if assignment is not None else assignment_of(graph)
    taken = set(graph.node_ids())
    pnodes = list(dict.fromkeys(assign[n.id] for n in graph.topo_order()))
    parts: dict[str, Graph] = {}
    for pid in pnodes:
        part = Graph(f"{graph.name}@{pid}", source=graph.source)
        part.attrs = dict(graph.attrs)
        part.extra = copy.deepcopy(graph.extra)
        parts[pid] = part
    for n in graph.nodes:
        parts[assign[n.id]].add_node(VNode(n.id, n.type, dict(n.config), n.input_shapes, n.output_shapes,
                                           n.loc, copy.deepcopy(n.meta), n.outputs))
    for e in sorted(graph.edges, key=lambda e: (e.dst, e.dst_slot)):
        a, b = assign[e.src], assign[e.dst]
        if a == b:
            parts[a].add_edge(e.src, e.src_slot, e.dst, e.dst_slot, e.loc)
            continue
        t = graph.node(e.src).outputs[e.src_slot]
        send = fresh_id_in(taken, f"send__{e.dst}__in{e.dst_slot}")
        recv = fresh_id_in(taken, f"recv__{e.dst}__in{e.dst_slot}")
        parts[a].add_node(VNode(send, "send", {"peer_pnode": b, "peer_node": e.dst, "peer_slot": e.dst_slot},
                                meta={"pnode": a}))
        parts[a].add_edge(e.src, e.src_slot, send, 0, e.loc)
        names = {ep.name for ep in parts[a].outputs}
        parts[a].add_endpoint("outputs", Endpoint(fresh_id_in(names, send), send, 0))
        parts[b].add_node(VNode(recv, "receive", {"peer_pnode": a, "peer_node": e.src, "peer_slot": e.src_slot,
                                                  "shape": shape_text(t.shape), "dtype": t.dtype},
                                output_shapes=(t.shape,), meta={"pnode": b}))
        parts[b].add_edge(recv, 0, e.dst, e.dst_slot, e.loc)
    publishers = graph.publishers()
    for n in graph.nodes:
        op = n.op
        if op.tied_params is None:
            continue
        for alias, _ in op.tied(n.cfg).values():
            pub = publishers.get(alias)
            where = assign[n.id]
            if pub is None or assign[pub.id] == where or alias in parts[where].publishers():
                continue
            shape = tuple(pub.op.param_shapes(pub.cfg)["weight"])
            replica = fresh_id_in(taken, f"replica__{alias}")
            parts[where].add_node(VNode(replica, "weight_replica", {
                "peer_pnode": assign[pub.id], "peer_node": pub.id, "shape": shape,
                "shared_weight_alias": alias, "optimizer": "none"}, meta={"pnode": where}))
    for kind, eps in graph.endpoints.items():
        for ep in eps:
            parts[assign[ep.node]].add_endpoint(kind, ep)
    for part in parts.values():
        verify(part)
    return parts


def fresh_id_in(taken: set[str], base: str) -> str:
    """`fresh_id`, reserving the name in `taken`."""
    name = fresh_id(taken, base)
    taken.add(name)
    return name


def stitch(parts: Mapping[str, Graph], placement: Mapping[str, Any] | None = None) -> Graph:
    """The network the parts were cut from: boundary pairs become edges again."""
    if not parts:
        raise VGraphError("nothing to stitch: no parts")
    first = next(iter(parts.values()))
    name = (placement or {}).get("network") or first.name.rsplit("@", 1)[0]
    whole = Graph(name)
    whole.attrs = dict(first.attrs)
    whole.extra = copy.deepcopy(first.extra)
    sends: dict[tuple[str, str, str, int], tuple[str, int]] = {}  # (pnode, peer pnode, peer node, slot) -> value
    for pid, part in parts.items():
        for n in part.nodes:
            if n.type in BOUNDARY_TYPES:
                if n.type == "send":
                    e = part.input_edge(n.id, 0)
                    if e is None:
                        raise VGraphError([Diagnostic(f"part '{pid}': send has no input", n.loc, n.id)])
                    sends[(pid, n.cfg["peer_pnode"], n.cfg["peer_node"], n.cfg["peer_slot"])] = (e.src, e.src_slot)
                continue
            if n.id in whole:
                raise VGraphError([Diagnostic(f"part '{pid}': VNode is also in another part", n.loc, n.id)])
            whole.add_node(VNode(n.id, n.type, dict(n.config), n.input_shapes, n.output_shapes, n.loc))
    used: set[tuple[str, str, str, int]] = set()
    for pid, part in parts.items():
        for e in part.edges:
            src, dst = part.node(e.src), part.node(e.dst)
            if src.type in BOUNDARY_TYPES or dst.type in BOUNDARY_TYPES:
                continue
            whole.add_edge(e.src, e.src_slot, e.dst, e.dst_slot)
        for n in part.nodes:
            if n.type != "receive":
                continue
            peer = n.cfg["peer_pnode"]
            for e in part.out_edges(n.id):
                key = (peer, pid, e.dst, e.dst_slot)
                value = sends.get(key)
                if value is None or value != (n.cfg["peer_node"], n.cfg["peer_slot"]):
                    raise VGraphError([Diagnostic(
                        f"part '{pid}': receive from '{peer}' {n.cfg['peer_node']}:{n.cfg['peer_slot']} "
                        f"has no matching send in part '{peer}'", n.loc, n.id)])
                used.add(key)
                whole.add_edge(value[0], value[1], e.dst, e.dst_slot)
    unmatched = set(sends) - used
    if unmatched:
        pid, peer, node, slot = sorted(unmatched)[0]
        raise VGraphError(f"part '{pid}': a send to '{peer}' {node}:{slot} has no matching receive")
    found: dict[tuple[str, str], Endpoint] = {}
    for part in parts.values():
        for kind, eps in part.endpoints.items():
            for ep in eps:
                if ep.node in whole:
                    found[(kind, ep.name)] = ep
    order = [(e["kind"], e["name"]) for e in (placement or {}).get("endpoints", [])]
    order += [key for key in found if key not in order]
    for kind, ep_name in order:
        if (kind, ep_name) in found:
            whole.add_endpoint(kind, found[(kind, ep_name)])
    verify(whole)
    return whole


# -- writing ------------------------------------------------------------------------------------------

def register_exporter(name: str, fn: Callable[..., Any]) -> None:
    """Make `fn(graph, node_ids, name=...) -> bytes | model` available as `--<name>` output."""
    EXPORTERS[name] = fn


def find_exporter(name: str) -> Callable[..., Any]:
    if name in EXPORTERS:
        return EXPORTERS[name]
    from vgraph.plugins import find_plugin

    plugin = find_plugin(EXPORTER_GROUP, name)
    if plugin is not None:
        return plugin.load()
    raise VGraphError(f"no {name!r} exporter is installed: a backend provides it as entry point "
                      f"{name!r} in the group {EXPORTER_GROUP!r} (e.g. the ONNX backend)")


def export_partition(graph: Graph, fleet: Fleet | str, out_dir: str | Path, *, batch: int | None = None,
                     micro_batches: int | None = None, formats: tuple[str, ...] = (),
                     inputs: tuple[str | Path | None, ...] = ()) -> dict:
    """Write DIR/<pnode>.yml per PNode, DIR/placement.json (and DIR/<pnode>.<fmt> per format);
    returns the placement report with a "files" list.

    DIR then holds exactly one partition: the files an earlier partition wrote
    there and this one does not are removed.  Only files vgraph partition can
    prove it wrote (DIR's manifest, `safeio.OutputDir`) are replaced or removed;
    any other file of the same name, an input, or a DIR inside a run's files
    is refused before anything is written.  Every file is written atomically.
    """
    report = placement_report(graph, fleet, batch=batch, micro_batches=micro_batches)
    parts: dict[str, Graph] = {}
    for assignment in report["replica_assignments"]:  # every replica's PNodes get their network
        parts.update(split_network(graph, assignment))
    exporters = {fmt: find_exporter(fmt) for fmt in formats}  # fail before writing anything
    out = OutputDir(out_dir, command="partition", inputs=inputs)  # replaces only what it wrote (safeio.py)
    out.plan([f"{pid}.{ext}" for pid in parts for ext in ("yml", *formats)] + [PLACEMENT_FILE])
    files = []
    for pid, part in parts.items():
        save(part, out.check(f"{pid}.yml"))
        files.append(str(out.wrote(f"{pid}.yml")))
        for fmt, exporter in exporters.items():
            model = exporter(graph, report["pnodes"][pid]["vnodes"], name=part.name)
            data = model if isinstance(model, (bytes, bytearray)) else model.SerializeToString()
            files.append(str(out.write(f"{pid}.{fmt}", bytes(data))))
    report["files"] = files
    files.append(str(out.write(PLACEMENT_FILE, json.dumps(report, indent=2) + "\n")))
    out.remove_stale()  # DIR holds one partition: what an earlier partition wrote and this one did not goes
    return report


def load_parts(directory: str | Path) -> tuple[dict[str, Graph], dict]:
    """The parts and placement.json of an exported directory (of replica 0 when the plan has replicas:
    every replica's parts are the same network on other PNodes)."""
    from vgraph.yamlio import load

    d = Path(directory)
    try:
        placement = read_json(d / PLACEMENT_FILE, what="placement.json")
        first = set((placement.get("replica_pnodes") or [[]])[0]) if placement.get("replicas", 1) > 1 else None
        parts = {pid: load(d / f"{pid}.yml") for pid, info in placement["pnodes"].items()
                 if info["vnodes"] and (first is None or pid in first)}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise VGraphError(f"{printable(d / PLACEMENT_FILE)}: not a placement: {printable(exc, 200)}") from None
    return parts, placement


def format_report(report: dict) -> str:
    from vgraph.cost.fleet import human_bytes

    rows = [("pnode", "vnodes", "memory", "capacity", "compute s", "comm s", "step s")]
    for pid, p in report["pnodes"].items():
        if not p["vnodes"]:
            continue
        mark = " *" if pid == report["bottleneck_pnode"] else ""
        rows.append((pid + mark, str(len(p["vnodes"])), human_bytes(p["memory_bytes"]),
                     human_bytes(p["capacity_bytes"]), f"{p['compute_seconds']:.4g}", f"{p['comm_seconds']:.4g}",
                     f"{p['seconds']:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"network {report['network']!r} on fleet {report['fleet']!r}, batch {report['batch']}"]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    idle = [pid for pid, p in report["pnodes"].items() if not p["vnodes"]]
    if idle:
        lines.append(f"idle PNodes: {', '.join(idle)} (the planner predicts no shorter step using them at batch "
                     f"{report['batch']}: another pipeline stage or replica would cost more in transfers or in the "
                     f"gradient all-reduce than it saves; a larger --batch or --replicas N puts them to work)")
    lines.append(f"bottleneck: {report['bottleneck_seconds']:.4g} s per step on '{report['bottleneck_pnode']}' (*); "
                 f"cut: {len(report['cut_edges'])} edges, {human_bytes(report['cut_bytes_per_step'])} per step")
    for s in report["weight_sync"]:
        lines.append(f"weight sync: {s['alias']!r} '{s['publisher']}' ({s['from_pnode']}) -> '{s['user']}' "
                     f"({s['to_pnode']}), {human_bytes(s['bytes_per_step'])} per step")
    return "\n".join(lines)


__all__ = ["CutEdge", "assignment_of", "placement_report", "split_network", "stitch", "export_partition",
           "load_parts", "register_exporter", "find_exporter", "format_report", "PLACEMENT_FILE"]
