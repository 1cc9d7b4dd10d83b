"""TensorBoard event files in the run directory, written from the same rows as metrics.jsonl.

Why: PyTorch users watch a run live in TensorBoard (`tensorboard --logdir
runs`).  `MetricsLog` (metrics_log.py) hands every row it appends to this
sink, so the curves hold exactly what metrics.jsonl holds, for `vgraph train`
and for rank 0 of `vgraph launch` alike:

    train/loss, val/loss, train/lr, train/tokens_per_s, train/loss_scale,
    train/bytes_sent (launch: every rank's traffic of the step),
    train/tensor_peak_bytes, train/peak_rss_bytes (peak_memory.py),
    metrics/<name> (the network's `metrics:` entries),
    pnode/<id>/step_time_s, pnode/<id>/idle_s, pnode/<id>/bytes_sent (launch),
    fleet/machines (launch: the machines that trained each step),
    fleet/replan_predicted_before_s, fleet/replan_predicted_after_s, fleet/replan_bytes_moved,
    fleet/replan_seconds (launch: each re-plan at its boundary's step; the seconds measured) and the
    text fleet/replan (what asked for it, why),

plus the run's settings as text and the network drawing (vgraph's renderer
through Graphviz, as PNG) as an image.

**Resume**: a resumed run redoes the steps after its checkpoint, and
metrics.jsonl drops the rows past it; here the new writer starts with
`purge_step = checkpoint step + 1` (0 when it restarts without a checkpoint
over a killed session's events), which makes TensorBoard's reader discard
the earlier session's events from that step on, so a curve never holds a step
twice.  A command that trains nothing (already at its last step) opens no
writer and leaves no empty event file.
"""
from __future__ import annotations

import io
import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import Graph
from vgraph.run.files import EVENTS_PREFIX

__all__ = ["TensorBoardLog", "SCALAR_TAGS", "pnode_tag", "metric_tag"]

# metrics.jsonl field -> TensorBoard tag (the loop's own fields; anything else numeric is a `metrics:` entry)
SCALAR_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
               "loss_scale": "train/loss_scale", "boundary_bytes": "train/bytes_sent",
               "tensor_peak_bytes": "train/tensor_peak_bytes", "peak_rss_bytes": "train/peak_rss_bytes",
               "machines": "fleet/machines"}
NOT_SCALARS = {"step", "elapsed_s", "pnodes"}
# A re-plan's figures (vgraph/run/fleet_events.Replan) -> TensorBoard tag, at the step of its boundary
REPLAN_TAGS = {"old_step_s": "fleet/replan_predicted_before_s", "new_step_s": "fleet/replan_predicted_after_s",
               "bytes_moved": "fleet/replan_bytes_moved", "seconds": "fleet/replan_seconds"}
PNODE_FIGURES = {"step_s": "step_time_s", "idle_s": "idle_s", "bytes_sent": "bytes_sent"}
FLUSH_SECONDS = 5  # a live run shows up within seconds
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _tag_part(name: str) -> str:
    """A name from a network file made safe as one level of a tag (no '/', spaces or control characters)."""
    return _TAG_UNSAFE.sub("_", str(name))[:100] or "_"


def metric_tag(name: str) -> str:
    return f"metrics/{_tag_part(name)}"


def pnode_tag(pnode: str, figure: str) -> str:
    return f"pnode/{_tag_part(pnode)}/{PNODE_FIGURES[figure]}"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class TensorBoardLog:
    """The sink `MetricsLog` writes rows to (`restart`, `write`, `close`)."""

    def __init__(self, run_dir: Path, *, settings: Mapping[str, Any], graph: Graph | None = None,
                 placement: Mapping[str, Any] | None = None, say: Callable[[str], None] = lambda msg: None) -> None:
        self.run_dir = Path(run_dir)
        self.settings = dict(settings)
        self.graph = graph
        self.placement = placement
        self.say = say
        self.start_step = 0
        self._writer: Any = None
        self._pnodes: set[str] = set()
        self._replans: set[tuple[Any, ...]] = set()  # (boundary, kind, pnode, figure) written this session

    # -- the sink interface -------------------------------------------------------------------
    def restart(self, upto_step: int) -> None:
        """The run continues after `upto_step` (0: a fresh run); later events of an earlier session are dropped.

        The writer opens now when there are steps left to train (settings["steps"]), so its one-off cost
        (the import, the drawing) is paid before the first step rather than inside one."""
        self.start_step = int(upto_step)
        steps = self.settings.get("steps")
        if isinstance(steps, int) and upto_step < steps:
            self._open()

    def write(self, rows: Iterable[Mapping[str, Any]]) -> None:
        writer = self._open()
        new_pnodes = False
        for row in rows:
            step = row.get("step")
            if not isinstance(step, int):
                continue
            for key, value in row.items():
                if key in NOT_SCALARS:
                    continue
                number = _number(value)
                if number is not None:
                    writer.add_scalar(SCALAR_TAGS.get(key) or metric_tag(key), number, step)
            for pnode, figures in (row.get("pnodes") or {}).items():
                if pnode not in self._pnodes:
                    self._pnodes.add(pnode)
                    new_pnodes = True
                for key in PNODE_FIGURES:
                    number = _number((figures or {}).get(key))
                    if number is not None:
                        writer.add_scalar(pnode_tag(pnode, key), number, step)
        if new_pnodes:
            writer.add_custom_scalars(self._layout())

    def replans(self, replans: Iterable[Any]) -> None:
        """The run's re-plans (fleet_events.Replan) at their boundary's step, each figure once per session.

        Only those past their boundary and not before this session's start: the session before a boundary
        cannot know it, and one resumed later (purge_step: start + 1) still holds the earlier ones."""
        for r in replans:
            if r.chosen != "new" or r.boundary is None or r.boundary < self.start_step:
                continue
            key = (r.boundary, r.kind, r.pnode)
            fresh = [(name, tag) for name, tag in REPLAN_TAGS.items()
                     if (*key, name) not in self._replans and _number(getattr(r, name)) is not None]
            if (*key, "text") not in self._replans:
                fresh.append(("text", "fleet/replan"))
            writer = self._open() if fresh else None
            for name, tag in fresh:
                self._replans.add((*key, name))
                if name == "text":
                    text = _cell(f"step {r.boundary}: {r.kind} {r.pnode}".strip() + f": {r.reason}")
                    writer.add_text(tag, text, r.boundary)
                else:
                    writer.add_scalar(tag, float(getattr(r, name)), r.boundary)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- opening: settings and network, once per session ---------------------------------------
    def _open(self) -> Any:
        if self._writer is not None:
            return self._writer
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        wait_past_earlier_sessions(self.run_dir)
        self._writer = SummaryWriter(str(self.run_dir), purge_step=self._purge_step(), flush_secs=FLUSH_SECONDS)
        self._writer.add_text("run/settings", settings_markdown(self.settings), self.start_step)
        self._add_network_image()
        return self._writer

    def _purge_step(self) -> int | None:
        """Where TensorBoard drops an earlier session's events: after the checkpoint this run resumes from,
        or all of them when it restarts from step 0 over event files of a session killed before its first
        checkpoint (else those steps showed twice); a new run's directory has none to drop."""
        if self.start_step:
            return self.start_step + 1
        return 0 if any(self.run_dir.glob(EVENTS_PREFIX + "*")) else None

    def _add_network_image(self) -> None:
        if self.graph is None:
            return
        try:
            png = network_png(self.graph, self.placement)
        except VGraphError as exc:  # no Graphviz here: the curves matter more than the picture
            self.say(f"note: TensorBoard gets no network image ({exc.diagnostics[0].message})")
            return
        import numpy as np
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        self._writer.add_image("network", pixels, self.start_step, dataformats="HWC")

    def _layout(self) -> dict[str, Any]:
        """Custom-scalars charts with every PNode's curve in one chart per figure."""
        pnodes = sorted(self._pnodes)
        return {"PNodes": {title: ["Multiline", [pnode_tag(p, key) for p in pnodes]]
                           for key, title in (("step_s", "step time (s)"), ("idle_s", "idle / bubble time (s)"),
                                              ("bytes_sent", "bytes sent per step"))}}


def _quiet_writer_threads() -> None:
    """TensorBoard writes events from a thread of its own; when a write fails (a full disk) that thread
    printed its own OSError traceback, and the same error reaches the training thread anyway at the next
    write or at close (EventFileWriter re-raises it there), where it becomes a diagnostic.  So an OSError
    ending one of TensorBoard's writer threads is not printed a second time, as a traceback; every other
    thread's exception still goes to the hook that was there.  Installed at each writer's opening unless it
    is the hook already (a caller, a test runner, may have put its own hook in since)."""
    previous = threading.excepthook
    if getattr(previous, "vgraph_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.vgraph_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def settings_markdown(settings: Mapping[str, Any]) -> str:
    """The run's settings as a Markdown table (TensorBoard's text plugin renders it)."""
    lines = ["| setting | value |", "|---|---|"]
    for key, value in settings.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        lines.append(f"| {_cell(key)} | {_cell(text)} |")
    return "\n".join(lines)


def _cell(text: Any) -> str:
    cleaned = "".join(c if c.isprintable() else " " for c in str(text))
    return cleaned.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")[:2000]


def network_png(graph: Graph, placement: Mapping[str, Any] | None) -> bytes:
    """The network as vgraph's renderer draws it (by PNode when placed; repeated blocks collapsed), as PNG."""
    from vgraph.report.render import render_png

    placed = bool(placement) or any(n.meta.get("pnode") for n in graph.nodes)
    return render_png(graph, group_by="pnode" if placed else "colocate", collapse=len(graph) > 40,
                      placement=placement)


def wait_past_earlier_sessions(run_dir: Path, clock: Callable[[], float] = time.time,
                               sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait (at most a second) until the clock has left the second of every event file already in `run_dir`.

    TensorBoard reads a run's event files in name order, and a writer names its file after the second it was
    created, then the host and the pid: a session started within the second of an earlier one could sort
    before it, and the reader then met the resumed session's purge before the steps it purges (the suite saw
    steps 4, 5, 6, 1, 2, 3 once, on a fast machine).  A file from the future (a clock set back) is left as it
    is: waiting cannot help it."""
    stamps = [p.name[len(EVENTS_PREFIX):].split(".")[0] for p in run_dir.glob(EVENTS_PREFIX + "*")]
    seconds = [int(stamp) for stamp in stamps if stamp.isdigit()]
    if not seconds:
        return
    wait = max(seconds) + 1 - clock()
    if 0 < wait <= 1.0:
        sleep(wait)
