"""`vgraph report RUN -o report.html`: one self-contained page about a training run, to share.

Why a page: a run directory holds the record (run.json, metrics.jsonl,
placement.json, the network), but reading it takes tools; the page puts the
loss and validation curves, throughput, the network as the run compiled it
(passes and placement: fused VNodes, cut edges), per-PNode figures of a
`vgraph launch` run, the memory estimate next to what was measured, and the
settings in one file anyone can open offline.

Self-contained and inert: inline SVG (charts drawn by charts.py, the
network by render.py and sanitised by svg_embed.py), inline CSS, no script,
no font or image fetched, and a Content-Security-Policy that forbids
fetching anyway.  Every string from the run (network name, node ids,
settings) is escaped.

Tolerant: a run still going is read as it is (a torn last line of
metrics.jsonl, a missing placement or checkpoint are noted, not fatal), and
a network that cannot be rebuilt or drawn (no Graphviz, a plugin op type)
leaves a note where the drawing would be.  Only a RUN that is not a run
directory at all is an error.  The core only: this reads files, imports no
torch.
"""
from __future__ import annotations

import datetime
import html
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.numbers import is_number
from vgraph.base.safeio import atomic_write, check_output
from vgraph.report.charts import PALETTE, Series, format_number, line_chart
from vgraph.run import files
from vgraph.run.fleet_events import FleetHistory, machine_spans, read_fleet

__all__ = ["RunRecord", "read_run", "build_report", "write_report"]

# Each curve kind has its own colours (a browser test finds the curves by them): PNodes use the rest.
LOSS_COLOR, VAL_COLOR, THROUGHPUT_COLOR, LR_COLOR = PALETTE[0], PALETTE[1], PALETTE[2], PALETTE[-1]
PNODE_COLORS = PALETTE[3:-1]


@dataclass
class RunRecord:
    """What a run directory holds, as far as it could be read; `notes` says what could not."""

    path: Path
    run: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    placement: dict[str, Any] | None = None
    job: dict[str, Any] | None = None  # the latest launch/job-N.json (launch runs)
    fleet: FleetHistory = field(default_factory=FleetHistory)  # launch/fleet-events.jsonl (fleet_events.py)
    network_yaml: str | None = None
    checkpoint: str | None = None
    inputs: list[Path] = field(default_factory=list)  # every file read (the output may be none of them)
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return "launch" if self.placement is not None or "launch" in self.run or self.job else "train"


# -- reading -------------------------------------------------------------------------------------

def read_run(run_dir: str | Path) -> RunRecord:
    """The run directory's files; refused (VGraphError) only when `run_dir` is not a run directory."""
    path = Path(run_dir)
    shown = printable(str(path))
    if not path.exists():
        raise VGraphError(f"{shown}: no such run directory")
    if not path.is_dir():
        raise VGraphError(f"{shown}: is a file, not a run directory (give the --out directory of vgraph train "
                          f"or vgraph launch)")
    if not any((path / name).is_file() for name in (files.RUN_JSON, files.METRICS_JSONL)):
        raise VGraphError(f"{shown}: not a run directory of vgraph train or vgraph launch (it has no run.json "
                          f"and no metrics.jsonl yet)")
    reader = files.RunReader(path)  # only the run's own regular files, bounded, numbers checked (run/files.py)
    rec = RunRecord(path, notes=reader.notes, inputs=reader.read)
    rec.run = reader.run_info()
    rec.rows = reader.metrics()
    rec.placement = reader.placement()
    rec.job = reader.latest_job()
    steps = rec.run.get("steps")
    rec.fleet = read_fleet(reader, steps if isinstance(steps, int) else None)
    rec.network_yaml = reader.text(files.NETWORK_YML, "network file")
    rec.checkpoint = reader.latest_checkpoint_name()
    # The run's own files are never replaced by a report, read or not (a previous report may be).
    rec.inputs += [p for p in path.iterdir() if p.is_file() and p.suffix.lower() not in (".html", ".htm")]
    return rec


# -- the page ------------------------------------------------------------------------------------

def build_report(rec: RunRecord, *, drawing: str | None = None) -> str:
    """The HTML page of `rec`; `drawing`: the network's embeddable SVG (`network_drawing`), or None."""
    e = html.escape
    run, rows = rec.run, rec.rows
    name = str(run.get("network") or (rec.placement or {}).get("network") or rec.path.name)
    title = f"vgraph {rec.command} run: {name}"
    parts = [_HEAD.format(title=e(printable(title, 200))), f"<h1>{e(printable(title, 200))}</h1>",
             _summary(rec)]
    if rec.notes:
        parts.append("<ul class=\"notes\">" + "".join(f"<li>{e(printable(n, 500))}</li>" for n in rec.notes)
                     + "</ul>")
    parts.append('<section><h2>Training</h2><div class="charts">' + "".join(_training_charts(rows)) + "</div>"
                 + _metric_table(rows) + "</section>")
    if any(isinstance(r.get("pnodes"), dict) for r in rows) or rec.placement:
        parts.append(_pnode_section(rec))
    fleet = _fleet_section(rec)
    if fleet:
        parts.append(fleet)
    parts.append("<section><h2>Network</h2>" + _network_caption(rec)
                 + (f'<div class="drawing">{drawing}</div>' if drawing else "") + "</section>")
    parts.append(_memory_section(rec))
    parts.append("<section><h2>Settings</h2>" + _settings_table(run) + "</section>")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts.append(f'<footer>written by <code>vgraph report</code> on {e(stamp)} from {e(printable(str(rec.path), 300))}'
                 f"</footer></body></html>\n")
    return "\n".join(parts)


_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px;
       color: #0f172a; background: #f8fafc; }}
h1 {{ font-size: 22px; margin: 0 0 8px; }} h2 {{ font-size: 17px; margin: 0 0 10px; }}
section {{ background: #ffffff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 14px 16px; margin: 14px 0; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.summary {{ display: flex; flex-wrap: wrap; gap: 10px; margin: 10px 0; }}
.summary div {{ background: #ffffff; border: 1px solid #e2e8f0; border-radius: 6px; padding: 6px 10px; }}
.summary b {{ display: block; font-size: 16px; }} .summary span {{ font-size: 11px; color: #64748b; }}
table {{ border-collapse: collapse; font-size: 12px; margin-top: 8px; }}
td, th {{ border: 1px solid #e2e8f0; padding: 3px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f1f5f9; }} td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
td code {{ white-space: pre-wrap; word-break: break-all; }}
.notes {{ background: #fffbeb; border: 1px solid #fde68a; border-radius: 6px; padding: 8px 8px 8px 28px; }}
.drawing {{ overflow-x: auto; }}
.drawing svg.network {{ display: block; }}
tr.total td {{ font-weight: 600; background: #f8fafc; }}
.caption {{ font-size: 12px; color: #475569; }}
.warning {{ font-size: 14px; color: #9a3412; background: #fff7ed; border-left: 4px solid #ea580c; padding: 6px 10px; }}
footer {{ font-size: 11px; color: #64748b; }}
</style></head><body>"""


def _summary(rec: RunRecord) -> str:
    rows, run = rec.rows, rec.run
    last = rows[-1] if rows else {}
    steps = run.get("steps")
    done = last.get("step", 0)
    if not rows:
        state = "no step logged yet"
    elif not isinstance(steps, int) or isinstance(steps, bool):
        state = f"step {done}"
    else:
        state = f"step {done} of {steps}" + ("" if done >= steps else " (still running, or stopped)")
    vals = [r["val_loss"] for r in rows if _finite(r.get("val_loss"))]
    speeds = [r["tokens_per_s"] for r in rows if _finite(r.get("tokens_per_s"))]
    boxes = [("progress", state),
             ("last loss", format_number(last["loss"]) if _finite(last.get("loss")) else "-"),
             ("last validation loss", format_number(vals[-1]) if vals else "-"),
             ("median tokens/s", format_number(statistics.median(speeds)) if speeds else "-"),
             ("elapsed", f"{last['elapsed_s']:.1f} s" if _finite(last.get("elapsed_s")) else "-"),
             ("latest checkpoint", rec.checkpoint or "none yet")]
    return '<div class="summary">' + "".join(
        f"<div><span>{html.escape(k)}</span><b>{html.escape(printable(v, 120))}</b></div>" for k, v in boxes) + "</div>"


def _finite(x: Any) -> bool:
    """A number the page may compute with: the one checked reader's rule (finite, normal, float range)."""
    return is_number(x)


def _points(rows: Iterable[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in rows if _finite(r.get(key))]


def _training_charts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    charts = [line_chart("Loss", [Series("train loss", _points(rows, "loss"), LOSS_COLOR),
                                  Series("validation loss", _points(rows, "val_loss"), VAL_COLOR, markers=True)],
                         y_label="cross-entropy (nats/token)", css_class="chart loss"),
              line_chart("Throughput", [Series("tokens/s", _points(rows, "tokens_per_s"), THROUGHPUT_COLOR)],
                         y_label="tokens/s", css_class="chart throughput")]
    lr = _points(rows, "lr")
    if lr:
        charts.append(line_chart("Learning rate", [Series("lr", lr, LR_COLOR)], y_label="lr",
                                 css_class="chart lr"))
    return charts


_OWN_FIELDS = {"step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale", "boundary_bytes",
               "peak_memory_bytes", "tensor_peak_bytes", "peak_rss_bytes", "pnodes", "machines"}


def _metric_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The network's `metrics:` entries (and the loss scale): their latest values."""
    latest: dict[str, tuple[int, float]] = {}
    for r in rows:
        for key, value in r.items():
            if (key not in _OWN_FIELDS or key == "loss_scale") and _finite(value):
                latest[str(key)] = (r["step"], value)
    if not latest:
        return ""
    body = "".join(f"<tr><td>{html.escape(printable(k, 100))}</td><td class=\"num\">{format_number(v)}</td>"
                   f"<td class=\"num\">{s}</td></tr>" for k, (s, v) in sorted(latest.items()))
    return ("<table><tr><th>metric (the network's <code>metrics:</code>)</th><th>latest</th><th>at step</th></tr>"
            + body + "</table>")


def _job_pipeline(job: dict) -> str:
    """The pipeline a launch ran, as its job file splits it around the partition (the text as written
    where the file's text is not a pipeline: the caption describes, compiled_graph refuses)."""
    from vgraph.transform.pass_api import PassError
    from vgraph.transform.pipeline import Pipeline

    before, after = job.get("pipeline_before") or "", job.get("pipeline_after") or ""
    try:
        return str(Pipeline.parse(before) + Pipeline.of("partition") + Pipeline.parse(after))
    except PassError:
        return ",".join(p for p in (before, "partition", after) if p)


def _network_caption(rec: RunRecord) -> str:
    passes = rec.run.get("passes")
    if rec.job:
        spec = _job_pipeline(rec.job)
    else:
        spec = "the production pipeline" if passes is None else (passes or "no passes")
        if rec.run.get("fuse") is False and passes is None:
            spec = "the production pipeline without fusions"
    text = (f"As the run compiled it: passes {spec}. Fused VNodes have a double orange border; edges cut between "
            f"PNodes are red and labelled with their bytes per step both ways (the activation forward, its gradient "
            f"back).")
    return f'<p class="caption">{html.escape(printable(text, 600))}</p>'


MAX_PNODES_SHOWN = 64  # a fleet's PNodes fit; a damaged or hostile metrics file naming 100,000 does not


def _pnodes_measured(rec: RunRecord) -> tuple[list[str], dict[str, list[tuple[int, Mapping[str, Any]]]], int]:
    """(the PNodes shown, each PNode's (step, figures) in step order, how many are not shown), in one pass
    over the rows: the report is linear in the metrics, whatever the number of PNode names.  Shown are
    placement.json's PNodes and the most recently measured, at most MAX_PNODES_SHOWN, in order of appearance."""
    predicted = (rec.placement or {}).get("pnodes") or {}
    own: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for r in rec.rows:
        measured = r.get("pnodes")
        if not isinstance(measured, Mapping):  # a damaged row ("pnodes": 1): nothing of it to draw
            continue
        for p, figures in measured.items():
            if isinstance(figures, Mapping):
                own.setdefault(p, []).append((r["step"], figures))
    everyone = list(dict.fromkeys([*own, *predicted]))
    if len(everyone) <= MAX_PNODES_SHOWN:
        return everyone, own, 0
    recent = sorted(own, key=lambda p: own[p][-1][0], reverse=True)
    keep = set(list(dict.fromkeys([*predicted, *recent]))[:MAX_PNODES_SHOWN])
    return [p for p in everyone if p in keep], own, len(everyone) - len(keep)


def _pnode_section(rec: RunRecord) -> str:
    predicted = (rec.placement or {}).get("pnodes") or {}
    pnodes, own, hidden = _pnodes_measured(rec)
    charts = []
    for key, title, unit in (("step_s", "Step time per PNode", "seconds"),
                             ("idle_s", "Idle (bubble) time per PNode", "seconds"),
                             ("bytes_sent", "Bytes sent per PNode", "bytes / step")):
        series = [Series(str(p), [(s, f[key]) for s, f in own.get(p, ()) if _finite(f.get(key))],
                         PNODE_COLORS[i % len(PNODE_COLORS)]) for i, p in enumerate(pnodes)]
        charts.append(line_chart(title, series, y_label=unit, css_class=f"chart pnode-{key}"))
    head = ("<tr><th>PNode</th><th>VNodes</th><th>predicted s/step</th><th>measured s/step (median)</th>"
            "<th>idle s/step (median)</th><th>predicted bytes sent/step</th><th>measured bytes sent/step (median)</th>"
            "<th>predicted tensor memory</th><th>measured tensor peak</th><th>process peak RSS</th>"
            "<th>capacity</th></tr>")
    body = [_pnode_row(p, predicted.get(p) if isinstance(predicted.get(p), dict) else {},
                       [f for _, f in own.get(p, ())], _on_cuda(rec)) for p in pnodes]
    body.append(_total_row(rec))
    old = bool(predicted) and not any("bytes_sent_per_step" in v for v in predicted.values() if isinstance(v, dict))
    basis = ("Bytes are what each PNode sends (its boundary activations forward, their gradients back, tied-weight "
             "syncs, its share of the gradient all-reduce); each cut edge's traffic is counted once, at its sender."
             + (" This placement.json was written by a vgraph before 0.2.0, which recorded each PNode's bytes in and "
                "out rather than the bytes it sends: the prediction is not shown against the measurement."
                if old else ""))
    memory = ("Memory: the tensor peak (the most bytes of tensors alive at once: the allocator's peak on CUDA, "
              "tensors followed through the first steps on a CPU) against placement.json's tensor estimate; the "
              "process peak RSS (Python, torch's runtime and allocator caches included) is shown on its own.")
    idle = ("Idle time is time blocked on peers (pipeline bubble, gradient ring, the step's reduction; also a "
            "peer's work between steps, e.g. rank 0 writing logs, validating or checkpointing).")
    shown = (f"{hidden:,} PNodes not shown: the page shows placement.json's PNodes and the most recently "
             f"measured, at most {MAX_PNODES_SHOWN}." if hidden else "")
    caption = " ".join(filter(None, (basis, memory, idle, shown)))
    from vgraph.placement.replica_report import step_prediction_gap

    gap = step_prediction_gap(rec.placement or {}, rec.rows)
    warning = f'<p class="warning">Prediction off: {html.escape(gap)}</p>' if gap else ""
    return ('<section><h2>PNodes</h2>' + warning + '<div class="charts">' + "".join(charts) + "</div><table>"
            + head + "".join(body) + f'</table><p class="caption">{html.escape(caption)}</p></section>')


MAX_SPANS_SHOWN = 100  # a fleet that changed more often is shown by its latest changes (the chart has all)
MAX_REPLANS_SHOWN = 100


def _fleet_section(rec: RunRecord) -> str:
    """"Fleet over time": machines per step (chart and spans) and the re-plans, when the run had more than one
    machine or any fleet event; "" otherwise (a `vgraph train` run, a launch on one fixed machine)."""
    spans = machine_spans(rec.rows)
    history = rec.fleet
    if not history.rows and all(s.machines <= 1 for s in spans):
        return ""
    e = html.escape
    replans = history.replans
    counted = [(r["step"], r["machines"]) for r in rec.rows if isinstance(r.get("machines"), int)]
    at = dict(counted)
    machines: list[tuple[int, int]] = []  # drawn as steps: a change is a vertical jump at its first step
    for step, n in counted:
        if machines and machines[-1][1] != n:
            machines.append((step, machines[-1][1]))
        machines.append((step, n))
    marks = [(r.boundary if r.boundary is not None else r.step,
              at.get(r.boundary if r.boundary is not None else r.step, 0)) for r in replans if r.chosen == "new"]
    chart = line_chart("Machines per step", [Series("machines", machines, PALETTE[3]),
                                             Series("re-plans", marks, PALETTE[1], markers=True)],
                       y_label="machines", css_class="chart fleet-machines") if machines else ""
    shown = spans[-MAX_SPANS_SHOWN:]
    span_rows = "".join(f'<tr><td class="num">{s.first}</td><td class="num">{s.last}</td>'
                        f'<td class="num">{s.machines}</td><td>{e(", ".join(s.pnodes))}</td></tr>' for s in shown)
    spans_table = ("<table class=\"fleet-spans\"><tr><th>from step</th><th>to step</th><th>machines</th>"
                   "<th>PNodes</th></tr>" + span_rows + "</table>") if shown else ""
    head = ("<tr><th>step</th><th>boundary</th><th>kind</th><th>PNode</th><th>chosen</th>"
            "<th>predicted s/step before</th><th>after</th><th>bytes moved</th><th>predicted move s</th>"
            "<th>measured move s</th><th>fleet after</th><th>why</th></tr>")
    body = "".join(_replan_row(r) for r in replans[-MAX_REPLANS_SHOWN:])
    table = f'<table class="fleet-replans">{head}{body}</table>' if replans else ""
    counts = ", ".join(f"{e(k)}: {n:,}" for k, n in sorted(history.counts.items())[:40])
    cut = [f"the latest {MAX_SPANS_SHOWN} of {len(spans):,} spans" if len(spans) > MAX_SPANS_SHOWN else "",
           f"the latest {MAX_REPLANS_SHOWN} of {len(replans):,} decisions" if len(replans) > MAX_REPLANS_SHOWN else ""]
    caption = ("Machines: the machines whose workers trained each logged step (metrics.jsonl's <code>machines</code>; "
               "the PNodes are the step's measured ones). Re-plans: each decision of launch/fleet-events.jsonl, the "
               "predicted step before and after it, the bytes of state it moves and the seconds predicted for the "
               "move and boundary; measured: from the stop request to the next attempt's first step, and of it the "
               "part not training (the steps after the request left out), what the next decision prices."
               + (f" Events: {counts}." if counts else "")
               + "".join(f" Shown: {c}." for c in cut if c))
    return ('<section class="fleet"><h2>Fleet over time</h2><div class="charts">' + chart + "</div>" + spans_table
            + table + f'<p class="caption">{caption}</p></section>')


def _replan_row(r: Any) -> str:
    cells = [str(r.step), "-" if r.boundary is None else str(r.boundary), r.kind, r.pnode or "-", r.chosen,
             _num(r.old_step_s), _num(r.new_step_s), _bytes(r.bytes_moved), _num(r.predicted_s),
             _num(r.seconds) + (f" ({_num(r.lost_s)} not training)" if r.lost_s is not None else ""),
             ", ".join(r.pnodes) or "-", r.reason or "-"]
    text = {2, 3, 4, 10, 11}
    return "<tr>" + "".join(("<td>" if i in text else '<td class="num">') + html.escape(printable(c, 400)) + "</td>"
                            for i, c in enumerate(cells)) + "</tr>"


def _pnode_row(pnode: str, pred: Mapping[str, Any], own: Sequence[Mapping[str, Any]], cuda: bool) -> str:
    """One PNode's prediction (placement.json) beside its measurements (metrics rows)."""
    def median(key: str) -> str:
        values = [f[key] for f in own if _finite(f.get(key))]
        return format_number(statistics.median(values)) if values else "-"

    tensor, rss = _memory_peaks(own, cuda)
    vnodes = pred.get("vnodes")
    cells = [printable(pnode, 80), str(len(vnodes)) if isinstance(vnodes, list) else "-",
             _num(pred.get("seconds")), median("step_s"), median("idle_s"),
             _num(pred.get("bytes_sent_per_step")), median("bytes_sent"), _bytes(pred.get("memory_bytes")),
             _bytes(tensor), _bytes(rss), _bytes(pred.get("capacity_bytes"))]
    return "<tr>" + "".join(("<td>" if i == 0 else '<td class="num">') + html.escape(c) + "</td>"
                            for i, c in enumerate(cells)) + "</tr>"


def _total_row(rec: RunRecord) -> str:
    """Every PNode together: placement.json's bytes_per_step against the bytes all workers sent a step."""
    sent = [r["boundary_bytes"] for r in rec.rows if _finite(r.get("boundary_bytes"))]
    total = (rec.placement or {}).get("bytes_per_step", (rec.placement or {}).get("cut_bytes_per_step"))
    cells = ["all PNodes", "", "", "", "", _num(total), format_number(statistics.median(sent)) if sent else "-",
             "", "", "", ""]
    return '<tr class="total">' + "".join(("<td>" if i == 0 else '<td class="num">') + html.escape(c) + "</td>"
                                          for i, c in enumerate(cells)) + "</tr>"


def _on_cuda(rec: RunRecord) -> bool:
    return str(rec.run.get("device") or "").startswith("cuda")


def _memory_peaks(figures: Sequence[Mapping[str, Any]], cuda: bool) -> tuple[Any, Any]:
    """(tensor peak, process peak RSS): the latest of each among `figures` (metrics rows or per-PNode entries).
    Runs of vgraph before 0.2.0 recorded one `peak_memory_bytes`: the allocator's peak on CUDA (a tensor peak),
    the process's peak RSS elsewhere."""
    def latest(key: str) -> Any:
        return next((f[key] for f in reversed(figures) if _finite(f.get(key))), None)

    tensor, rss, legacy = latest("tensor_peak_bytes"), latest("peak_rss_bytes"), latest("peak_memory_bytes")
    if legacy is not None:
        if cuda and tensor is None:
            tensor = legacy
        elif not cuda and rss is None:
            rss = legacy
    return tensor, rss


def _num(x: Any) -> str:
    return format_number(x) if _finite(x) else "-"


def _bytes(n: Any) -> str:
    """Bytes as the drawing labels them (render.py), '-' for what is not a number."""
    from vgraph.report.render import _bytes as render_bytes

    return render_bytes(n) if _finite(n) and n >= 0 else "-"


def _memory_section(rec: RunRecord) -> str:
    """The estimate against the tensor peak, like with like; the process's peak RSS as its own figure."""
    estimate = rec.run.get("memory_estimate")
    estimate = estimate if isinstance(estimate, dict) else None
    how = {"process_peak_rss": None, "cuda_max_memory_allocated": "the CUDA allocator's peak",
           "live_tensor_bytes": "tensors followed through the first steps"}
    kind = (estimate or {}).get("tensor_peak_as") or (estimate or {}).get("measured_as")
    tensor, rss = _memory_peaks(rec.rows, _on_cuda(rec) or kind == "cuda_max_memory_allocated")
    if estimate is None and tensor is None and rss is None:
        if rec.command == "launch":
            return ""  # per PNode, in the PNodes table
        return ("<section><h2>Memory</h2><p class=\"caption\">This run recorded no memory estimate or "
                "measurement (written by an older vgraph).</p></section>")
    rows = [(f"estimate: {key}", _bytes(estimate.get(key)))
            for key in ("parameters", "gradients", "optimizer", "activations", "workspace", "total")
            if estimate is not None and key in estimate]
    rows.append((f"measured tensor peak ({how.get(kind) or 'not measured by this vgraph'})",
                 _bytes(tensor) if tensor is not None else "not yet" if how.get(kind) else "-"))
    if estimate is not None and tensor is not None and _finite(estimate.get("total")) and estimate["total"] > 0:
        rows.append(("tensor peak / estimated total", f"{tensor / estimate['total']:.2f}x"))
    rows.append(("process peak RSS (Python, torch's runtime and allocator caches included: what the machine "
                 "must have, not comparable with the estimate)", _bytes(rss) if rss is not None else "-"))
    return ("<section><h2>Memory</h2><table>" + "".join(
        f"<tr><td>{html.escape(printable(k, 200))}</td><td class=\"num\">{html.escape(v)}</td></tr>" for k, v in rows)
        + "</table></section>")


def _settings_table(run: Mapping[str, Any]) -> str:
    if not run:
        return '<p class="caption">no settings recorded (run.json missing or unreadable)</p>'
    cells = []
    for key, value in run.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        cells.append(f"<tr><td>{html.escape(printable(key, 100))}</td>"
                     f"<td><code>{html.escape(printable(text, 2000))}</code></td></tr>")
    return "<table>" + "".join(cells) + "</table>"


# -- the network as the run compiled it ----------------------------------------------------------

def network_drawing(rec: RunRecord) -> tuple[str | None, str | None]:
    """(embeddable SVG of the run's compiled network, None) or (None, why it is not drawn)."""
    from vgraph.report.render import render_svg
    from vgraph.report.svg_embed import embeddable_svg

    if rec.network_yaml is None:
        return None, "the network is not drawn: network.yml is missing"
    try:
        graph = compiled_graph(rec)
        placed = bool(rec.placement) or any(n.meta.get("pnode") for n in graph.nodes)
        svg = render_svg(graph, group_by="pnode" if placed else "colocate", collapse=len(graph) > 40,
                         placement=_drawable_placement(rec.placement, graph))
        return embeddable_svg(svg), None
    except VGraphError as exc:
        from vgraph.plugins import missing_plugins

        hint = "".join(f"; {d.message}" for d in missing_plugins(rec.run))
        return None, f"the network is not drawn: {exc.diagnostics[0].message}{hint}"


def _drawable_placement(placement: Mapping[str, Any] | None, graph: Any) -> Mapping[str, Any] | None:
    """placement.json when its assignment names the drawn graph's VNodes (else each VNode's own PNode)."""
    if not placement or not isinstance(placement.get("assignment"), dict):
        return None
    return placement if all(n.id in placement["assignment"] for n in graph.nodes) else None


def compiled_graph(rec: RunRecord):
    """The graph the run trained: its network.yml through the run's passes (and, for launch, its placement)."""
    from vgraph.run.compiled_graph import apply_assignment, definition_spec, refuse_files_named, training_spec
    from vgraph.transform.pipeline import run_pipeline
    from vgraph.yamlio import loads

    source = loads(rec.network_yaml or "", file=str(rec.path / files.NETWORK_YML))
    job = rec.job or {}  # its fields' types are checked by the reader (run/files.py)
    if isinstance(job.get("assignment"), dict):
        before, after = job.get("pipeline_before") or "", job.get("pipeline_after") or ""
        for spec in (before, after):
            refuse_files_named(spec, "the job file")
        return apply_assignment(source, before, job["assignment"], after, job.get("target") or "cpu",
                                job.get("plan_choices"))
    precision = rec.run.get("precision") or {}
    target = str(precision.get("target") or "cpu")
    refuse_files_named(rec.run.get("passes"), files.RUN_JSON)
    spec = training_spec(definition_spec(rec.run), rec.run.get("fuse", True) is not False)
    graph = source.copy()
    if spec is None or spec:  # None: the production pipeline; an empty one runs nothing
        run_pipeline(graph, spec, target=target)
    return graph


# -- the command ---------------------------------------------------------------------------------

def write_report(run_dir: str | Path, output: str | Path) -> tuple[Path, RunRecord, str | None]:
    """Read the run, write the page atomically to `output` (never over a file of the run it read)."""
    rec = read_run(run_dir)
    out = check_output(output, inputs=rec.inputs, what="report")
    drawing, why = network_drawing(rec)
    if why:
        rec.notes.append(why)
    atomic_write(out, build_report(rec, drawing=drawing))
    return out, rec, why
