"""Draw a network as SVG through Graphviz: what a user checks before submitting it.

- clusters: one per colocation group (`group_by="colocate"`) or per PNode
  (`group_by="pnode"`, after the `partition` pass or with a placement);
- node labels: id, type, output shape with its effective dtype (the precision
  pass's annotation when present), parameter count;
- fused VNodes (anything with `fused_from`) are drawn with a double border on
  orange and say how many VNodes they replaced;
- edges that cross PNodes are red and labelled with their bytes per step
  (activation + gradient at the placement's batch);
- `collapse=True` draws each run of structurally identical colocation groups
  (e.g. transformer_block_1..7) once, as "transformer_block_1..7 (x7)", with
  the block-to-block edge dashed and marked with the repeat count.

Needs the `graphviz` Python package and Graphviz's `dot` program.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, NamedTuple, Sequence

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.cost.costmodel import DEFAULT_BATCH, cost_model, effective_dtype
from vgraph.ir.graph import Graph, VNode
from vgraph.ops.boundary import compress_label

CATEGORY_COLORS = {"layer": "#dbeafe", "activation": "#dcfce7", "structural": "#f1f5f9", "training": "#fce7f3",
                   "text": "#ede9fe", "boundary": "#fef9c3"}
FUSED_COLOR = "#fed7aa"
CUT_COLOR = "#dc2626"
CLUSTER_COLORS = ("#f8fafc", "#f0fdf4", "#fefce8", "#eff6ff", "#fdf2f8", "#f5f3ff", "#ecfeff", "#fff7ed")
INSTALL_HINT = ("Graphviz's 'dot' program is not installed: install Graphviz (Debian/Ubuntu: "
                "apt-get install graphviz; macOS: brew install graphviz; conda: conda install graphviz)")


def render_svg(graph: Graph, *, group_by: str = "colocate", collapse: bool = False,
               placement: Mapping[str, Any] | None = None) -> str:
    """The SVG text of `graph`.  `placement`: placement.json's content (or just its
    "assignment"); by default each VNode's meta["pnode"]."""
    return _pipe(to_dot(graph, group_by=group_by, collapse=collapse, placement=placement))


def render_png(graph: Graph, *, group_by: str = "colocate", collapse: bool = False,
               placement: Mapping[str, Any] | None = None) -> bytes:
    """The same drawing as PNG bytes (for viewers without SVG, e.g. TensorBoard's image tab)."""
    return _pipe(to_dot(graph, group_by=group_by, collapse=collapse, placement=placement), "png")


def to_dot(graph: Graph, *, group_by: str = "colocate", collapse: bool = False,
           placement: Mapping[str, Any] | None = None) -> str:
    """The Graphviz DOT source `render_svg` draws."""
    if group_by not in ("colocate", "pnode"):
        raise VGraphError(f"group_by must be 'colocate' or 'pnode', got {group_by!r}")
    assign = _assignment(graph, placement)
    if group_by == "pnode" and not assign:
        raise VGraphError("group_by='pnode' needs a placement: run the 'partition' pass (vgraph render "
                          "--fleet FLEET) or pass placement=")
    info = dict(graph.meta.get("placement") or {})
    if placement and "batch" in placement:
        info["batch"] = placement["batch"]
    batch = int(info.get("batch") or DEFAULT_BATCH)
    order = graph.topo_order()
    folded = _collapse(graph, order, assign) if collapse else _Folded({}, {}, {}, {})
    lines = ["digraph vgraph {",
             f"  graph [rankdir=TB, fontname=Helvetica, fontsize=12, nodesep=0.25, ranksep=0.35, "
             f"label={_q(_title(graph, info, batch, collapse))}, labelloc=t];",
             "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10, margin=\"0.12,0.04\"];",
             "  edge [fontname=Helvetica, fontsize=9, color=\"#64748b\", arrowsize=0.6];"]
    lines += _cluster_lines(graph, order, assign, group_by, info, folded)
    cm = cost_model(graph, batch=batch) if assign else None
    lines += _edge_lines(graph, assign, folded, cm)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster_lines(graph: Graph, order: Sequence[VNode], assign: Mapping[str, str], group_by: str,
                   info: Mapping[str, Any], folded: "_Folded") -> list[str]:
    """The drawn VNodes inside their clusters: colocation groups, or PNodes with their groups nested inside."""
    outer: "OrderedDict[str | None, OrderedDict[str | None, list[str]]]" = OrderedDict()
    drawn: set[str] = set()
    for n in order:
        rid = folded.rep.get(n.id, n.id)
        if rid in drawn:
            continue
        drawn.add(rid)
        if group_by == "pnode":
            outer.setdefault(assign.get(n.id), OrderedDict()).setdefault(n.group, []).append(rid)
        else:
            outer.setdefault(n.group, OrderedDict()).setdefault(None, []).append(rid)
    decl = {n.id: _node_decl(n, folded.repeats) for n in order if folded.rep.get(n.id, n.id) == n.id}
    lines = []
    for i, (key, inner) in enumerate(outer.items()):
        indent = "  "
        if key is not None:
            members = [m for ids in inner.values() for m in ids]
            label = _cluster_label(graph, key, group_by, info, members, folded.cluster_label)
            lines.append(f"  subgraph {_q('cluster_' + key)} {{")
            lines.append(f"    label={_q(label)}; style=\"rounded,filled\"; color=\"#94a3b8\"; "
                         f"fillcolor={_q(CLUSTER_COLORS[i % len(CLUSTER_COLORS)])}; fontsize=11;")
            indent = "    "
        for group, members in inner.items():
            nested = group_by == "pnode" and group is not None
            if nested:
                label = _cluster_label(graph, group, "colocate", info, members, folded.cluster_label)
                lines.append(f"{indent}subgraph {_q(f'cluster_{key}/{group}')} {{")
                lines.append(f"{indent}  label={_q(label)}; style=\"rounded,dashed\"; color=\"#94a3b8\"; "
                             f"fontsize=10;")
            lines += [f"{indent}{'  ' if nested else ''}{decl[m]}" for m in members]
            if nested:
                lines.append(f"{indent}}}")
        if key is not None:
            lines.append("  }")
    return lines


def _edge_lines(graph: Graph, assign: Mapping[str, str], folded: "_Folded", cm: Any) -> list[str]:
    """Edges between drawn VNodes (once per folded repeat), cut edges with their bytes per step as the cost
    model prices them (compressed after a `compress`), and a dotted line per tied weight synced across a cut."""
    r = lambda node_id: folded.rep.get(node_id, node_id)  # noqa: E731
    sizes = {(c.src, c.src_slot, c.dst, c.dst_slot): cm.edge_bytes(c) for c in cm.edges} if cm else {}
    seen: dict[tuple, int] = {}
    lines = []
    for e in graph.edges:
        src, dst = r(e.src), r(e.dst)
        cut = bool(assign) and assign.get(e.src) != assign.get(e.dst)
        a, b = folded.copy_of.get(e.src), folded.copy_of.get(e.dst)
        internal_repeat = a is not None and b is not None and a[0] == b[0] and a[1] != b[1]
        key = (src, e.src_slot, dst, e.dst_slot, internal_repeat, cut)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            continue
        attrs: dict[str, str] = {}
        if internal_repeat:
            count = folded.repeats.get(src, (0, 1))[1] - 1
            attrs.update(style="dashed", constraint="false", label=f"x{count}", color="#475569")
        if cut:  # bytes both ways, as the cost model prices the edge (compressed after a `compress`)
            size = sizes.get((e.src, e.src_slot, e.dst, e.dst_slot), 0)
            attrs.update(color=CUT_COLOR, penwidth="2.2", fontcolor=CUT_COLOR,
                         label=f"{_bytes(size)}/step")
        lines.append(f"  {_q(src)} -> {_q(dst)}" + (f" [{_attrs(attrs)}]" if attrs else "") + ";")
    if cm is not None:
        for t in cm.ties:
            if assign.get(t.publisher) != assign.get(t.user):
                lines.append(f"  {_q(r(t.publisher))} -> {_q(r(t.user))} [style=dotted, color={_q(CUT_COLOR)}, "
                             f"fontcolor={_q(CUT_COLOR)}, constraint=false, label="
                             f"{_q('weight sync ' + _bytes(t.sync_bytes_per_step) + '/step')}];")
    return lines


# -- pieces ----------------------------------------------------------------------------------------

def _assignment(graph: Graph, placement: Mapping[str, Any] | None) -> dict[str, str]:
    if placement is not None:
        assign = placement.get("assignment", placement)
        return {k: str(v) for k, v in assign.items() if isinstance(v, str) and k in graph}
    return {n.id: n.meta["pnode"] for n in graph.nodes if n.meta.get("pnode")}


def _title(graph: Graph, info: Mapping[str, Any], batch: int, collapse: bool) -> str:
    title = f"{graph.name}  ({len(graph)} VNodes"
    if "bottleneck_seconds" in info:
        title += (f"; fleet {info.get('fleet')}, batch {batch}: bottleneck {info['bottleneck_seconds']:.3g} s/step "
                  f"on {info.get('bottleneck_pnode')}, cut {_bytes(info.get('cut_bytes_per_step', 0))}/step")
    if collapse:
        title += "; repeated blocks collapsed"
    return title + ")"


def _cluster_label(graph: Graph, key: str, group_by: str, info: Mapping[str, Any], members: list[str],
                   collapsed: Mapping[str, str]) -> str:
    if group_by == "pnode":
        p = (info.get("pnodes") or {}).get(key) or {}
        extra = ""
        if p:
            extra = (f"\n{_bytes(p.get('memory_bytes', 0))} of {_bytes(p.get('capacity_bytes', 0))}, "
                     f"{p.get('seconds', 0):.3g} s/step")
        return f"PNode {key}{extra}"
    label = next((collapsed[m] for m in members if m in collapsed), key)
    policy = next((graph.node(m).config.get("colocate_policy") for m in members if m in graph), None)
    return label + (f"  [{policy}]" if policy else "")


def _node_decl(n: VNode, repeats: Mapping[str, tuple]) -> str:
    op = n.op
    lines = [_display_id(n.id, repeats)]
    fused = [x for x in str(n.config.get("fused_from") or "").split(",") if x.strip()]
    lines.append(n.type + (f" (fused from {len(fused)})" if fused else ""))
    if n.type == "compress":  # what crosses the cut after it, each way
        lines.append(compress_label(n.cfg))
    prec = n.meta.get("precision") or {}
    if n.outputs:
        outs = n.outputs
        shown = outs[0] if len(set(outs)) == 1 else None
        if shown is not None:
            dims = "[" + ", ".join(map(str, shown.shape)) + "]"
            lines.append(f"{len(outs)} x {dims}" if len(outs) > 1 else dims)
            lines[-1] += " " + effective_dtype(shown.dtype, prec.get("activation"))
        else:
            lines.append(" ".join("[" + ", ".join(map(str, t.shape)) + "]" for t in outs))
    params = sum(_prod(s) for s in op.param_shapes(n.cfg).values())
    tied = op.tied(n.cfg) if op.tied_params is not None else {}
    if params:
        lines.append(f"{_count(params)} params" + (f" {prec['param']}" if prec.get("param") else ""))
    elif tied:
        lines.append("tied: " + ", ".join(alias for alias, _ in tied.values()))
    recomputed = n.config.get("remat") == "recompute"
    if recomputed:
        lines.append("recomputed in backward")
    attrs = {"label": "\\n".join(_esc(line) for line in lines),
             "fillcolor": FUSED_COLOR if fused else CATEGORY_COLORS.get(op.category, "#ffffff"),
             "tooltip": _esc(f"{n.id}: {n.type}")}
    if fused:
        attrs.update(peripheries="2", penwidth="1.6", color="#c2410c")
    if recomputed:  # dashed: its outputs are not kept for backward (the remat pass)
        attrs["style"] = "rounded,filled,dashed"
    return f"{_q(n.id)} [{_attrs(attrs, raw=('label', 'tooltip'))}];"


class _Folded(NamedTuple):
    """What `_collapse` folds: VNode -> the VNode drawn for it; drawn VNode -> (ids it stands for, run
    length); drawn VNode -> its run's cluster label; VNode -> (run number, which copy in the run)."""

    rep: dict[str, str]
    repeats: dict[str, tuple]
    cluster_label: dict[str, str]
    copy_of: dict[str, tuple[int, int]]


def _collapse(graph: Graph, order: list[VNode], assign: Mapping[str, str]) -> _Folded:
    """Runs of consecutive, structurally identical colocation groups (on the same PNodes too).

    Returns: VNode -> the VNode drawn for it (the run's first group's member at the same
    position); drawn VNode -> (ids at that position along the run, run length); drawn VNode
    -> the run's cluster label; VNode -> (run number, which copy in the run).
    """
    members: "OrderedDict[str, list[str]]" = OrderedDict()
    for n in order:
        if n.group:
            members.setdefault(n.group, []).append(n.id)
    signatures = {g: _signature(graph, ids, assign) for g, ids in members.items()}
    groups = list(members)
    rep: dict[str, str] = {}
    repeats: dict[str, tuple] = {}
    labels: dict[str, str] = {}
    copy_of: dict[str, tuple[int, int]] = {}
    i = 0
    while i < len(groups):
        j = i + 1
        while j < len(groups) and signatures[groups[j]] == signatures[groups[i]]:
            j += 1
        run = groups[i:j]
        if len(run) >= 2:
            label = f"{_span(run[0], run[-1])} (x{len(run)})"
            for pos, first in enumerate(members[run[0]]):
                ids = [members[g][pos] for g in run]
                for copy, node_id in enumerate(ids):
                    rep[node_id] = first
                    copy_of[node_id] = (i, copy)
                repeats[first] = (ids, len(run))
                labels[first] = label
        i = j
    return _Folded(rep, repeats, labels, copy_of)


def _signature(graph: Graph, ids: list[str], assign: Mapping[str, str]) -> tuple:
    index = {nid: i for i, nid in enumerate(ids)}
    nodes = []
    for nid in ids:
        n = graph.node(nid)
        cfg = tuple(sorted((k, len(str(v).split(",")) if k == "fused_from" else v)  # ids differ per copy
                           for k, v in n.config.items() if k != "colocate_group"))
        nodes.append((n.type, cfg, n.outputs, assign.get(nid)))
    edges = sorted((index[e.src], e.src_slot, index[e.dst], e.dst_slot) for nid in ids
                   for e in graph.in_edges(nid) if e.src in index)
    return tuple(nodes), tuple(edges)


def _display_id(node_id: str, repeats: Mapping[str, tuple]) -> str:
    if node_id in repeats:
        ids, _ = repeats[node_id]
        return _span(ids[0], ids[-1])
    return node_id


def _span(first: str, last: str) -> str:
    """'block0_ln1', 'block7_ln1' -> 'block{0..7}_ln1'; 'transformer_block_0', '..._7' -> 'transformer_block_0..7'."""
    if first == last:
        return first
    pre = 0
    while pre < min(len(first), len(last)) and first[pre] == last[pre]:
        pre += 1
    while pre > 0 and first[pre - 1].isdigit():
        pre -= 1
    suf = 0
    while suf < min(len(first), len(last)) - pre and first[-1 - suf] == last[-1 - suf]:
        suf += 1
    while suf > 0 and first[len(first) - suf].isdigit():
        suf -= 1
    a, b = first[pre:len(first) - suf], last[pre:len(last) - suf]
    if not suf:
        return f"{first[:pre]}{a}..{b}"
    return f"{first[:pre]}{{{a}..{b}}}{first[len(first) - suf:]}"


def _pipe(dot: str, fmt: str = "svg") -> Any:
    try:
        import graphviz
    except ImportError:
        raise VGraphError("rendering needs the 'graphviz' Python package (pip install graphviz) and "
                          + INSTALL_HINT.split(": ", 1)[1]) from None
    try:
        return graphviz.Source(dot).pipe(format=fmt, encoding="utf-8" if fmt == "svg" else None)
    except graphviz.ExecutableNotFound:
        raise VGraphError(INSTALL_HINT) from None
    except graphviz.CalledProcessError as exc:
        raise VGraphError(f"Graphviz failed: {exc.stderr.decode(errors='replace') if exc.stderr else exc}") from None


def _q(text: str) -> str:
    """A DOT string of any text: what XML cannot hold (control characters) is escaped
    first, so the SVG stays well-formed whatever a graph built in code holds; a
    newline we put in a label ourselves stays a line break."""
    return '"' + "\\n".join(_esc(line) for line in str(text).split("\n")) + '"'


def _esc(text: str) -> str:
    """Text inside a label we assemble with explicit \\n line breaks."""
    return printable(text).replace("\\", "\\\\").replace('"', '\\"')


def _attrs(attrs: Mapping[str, str], raw: tuple[str, ...] = ()) -> str:
    return ", ".join(f'{k}="{v}"' if k in raw else f"{k}={_q(v)}" for k, v in attrs.items())


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _count(n: int) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.3g}{suffix}"
    return str(n)


def _bytes(n: float) -> str:
    for factor, suffix in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= factor:
            return f"{n / factor:.3g} {suffix}"
    return f"{int(n)} B"


__all__ = ["render_svg", "render_png", "to_dot", "INSTALL_HINT"]
