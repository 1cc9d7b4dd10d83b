"""What a training run reports: metrics.jsonl / metrics.csv, the loss curve, the progress bar and its lines.

The rows are written at every sync point of the loop (loop.py: every
`--log-every` steps or about once a second, at validation and at checkpoints);
a resumed run drops the rows past its checkpoint (`MetricsLog.restart`) and
writes them again.  Shared with the workers of `vgraph launch`, whose rank 0
writes the same files.  The loop hands it plain rows and column names: it
knows nothing of the step that made them.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Any, Protocol

from vgraph.base.safeio import atomic_write
from vgraph.run.files import METRICS_CSV, METRICS_JSONL, RunReader

from .run_files import atomic_write_text, run_slug

__all__ = ["MetricsLog", "MetricsSink", "progress_bar", "LineProgress", "read_rows"]



class MetricsSink(Protocol):
    """Where else the rows go as they are written (tensorboard_log.TensorBoardLog)."""

    def restart(self, upto_step: int) -> None: ...
    def write(self, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


class MetricsLog:
    """metrics.jsonl (the record) and metrics.csv (the same rows as a table); `sink` gets the same rows."""

    def __init__(self, run_dir: Path, columns: list[str], sink: MetricsSink | None = None) -> None:
        self.jsonl = run_dir / METRICS_JSONL
        self.csv = run_dir / METRICS_CSV
        self.columns = columns
        self.rows: list[dict[str, Any]] = []
        self.sink = sink
        self._version = 0  # bumped by every change of `rows`, so plot() can skip a drawing it already made
        self._drawn: tuple[Path, int] | None = None

    def restart(self, upto_step: int) -> None:
        """Keep rows up to `upto_step` (a resumed run redoes what came after) and rewrite both files."""
        rows = [row for row in read_rows(self.jsonl) if row["step"] <= upto_step]
        self.rows = rows
        self._version += 1
        atomic_write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in rows))
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=self.columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.csv, table.getvalue())
        if self.sink is not None:
            self.sink.restart(upto_step)

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.rows.extend(rows)
        self._version += 1
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        with open(self.csv, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore").writerows(rows)
        if self.sink is not None:
            self.sink.write(rows)

    def close(self) -> None:
        """Flush and close the sink (the files above are complete after every append)."""
        if self.sink is not None:
            self.sink.close()

    def plot(self, path: Path, title: str) -> None:
        """Draw the loss curve to `path` (PNG, atomically), unless these very rows were drawn there already.

        Seconds of matplotlib: the loops call it at checkpoints and at the end, never per validation.
        """
        if self._drawn == (path, self._version) and path.is_file():
            return
        # The object API with the Agg canvas: no pyplot, no GUI backend, nothing global.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        train = [(r["step"], r["loss"]) for r in self.rows if _finite(r.get("loss"))]
        val = [(r["step"], r["val_loss"]) for r in self.rows if _finite(r.get("val_loss"))]
        fig = Figure(figsize=(7, 4.2), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        if train:
            steps, losses = zip(*train)
            ax.plot(steps, losses, lw=0.8, alpha=0.45, label="train loss")
            if len(losses) >= 20:
                span = max(5, len(losses) // 50)
                smooth, ema = [], losses[0]
                for v in losses:
                    ema += (v - ema) / span
                    smooth.append(ema)
                ax.plot(steps, smooth, lw=1.6, label=f"train loss (EMA {span})")
        if val:
            ax.plot(*zip(*val), "o-", lw=1.4, ms=4, label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png")
        atomic_write(path, image.getvalue(), durable=False)  # redrawn at every checkpoint
        self._drawn = (path, self._version)

def read_rows(jsonl: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, read as every reader of a run reads it (vgraph/run/files.py: bounded, no
    symlink followed, a torn or damaged line skipped, one row per step, the last written, numbers checked;
    none if it is missing): what a resumed run keeps, and what `vgraph launch` returns as its history."""
    return RunReader(jsonl.parent).metrics() if jsonl.name == METRICS_JSONL else []


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)



def progress_bar(total: int, initial: int, name: str, enabled: bool):
    """The tqdm bar on a terminal; progress lines (`LineProgress`) when stderr is captured (a log, CI, tools/
    main.sh), where a bar redrawn with carriage returns shows nothing until the end; disabled under --quiet.

    `name` prefixes every line: the command (`train`, `launch`), not the network, whose name (46 characters
    for a production one) the run's first line states once."""
    from tqdm import tqdm

    if enabled and not sys.stderr.isatty():
        return LineProgress(total, initial, run_slug(name))
    return tqdm(total=total, initial=initial, desc=run_slug(name), unit="step", disable=not enabled,
                dynamic_ncols=True, file=sys.stderr)


class LineProgress:
    """The progress bar's interface, printing one line at the first step, then every `every` steps, at every
    new validation loss (`val=`, shown when it is computed, not at the next tenth step) and at the last:
    `train: step 40/160 (25%) loss=5.1 tok_s=2,890 lr=6.00e-04 val=5.3, 1m02s elapsed, eta 3m06s`."""

    def __init__(self, total: int, initial: int, name: str, every: int = 10) -> None:
        import time

        self.total, self.n, self.name, self.every = total, initial, name, every
        self.start, self.started_at = initial, time.perf_counter()
        self.printed = initial if initial else -every  # the first step is always shown
        self.shown_val: str | None = None  # the validation loss of the last line

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, refresh: bool = False, **values: str) -> None:
        """Called after each `update` with the step's figures: the moment a line may be due."""
        import time

        new_val = values.get("val") is not None and values.get("val") != self.shown_val
        if self.n - self.printed < self.every and self.n not in (self.total, self.start + 1) and not new_val:
            return
        self.shown_val = values.get("val", self.shown_val)
        elapsed = time.perf_counter() - self.started_at
        done = self.n - self.start
        eta = elapsed / done * (self.total - self.n) if done else 0.0
        figures = " ".join(f"{k}={v}" for k, v in values.items())
        print(f"{self.name}: step {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%) {figures}, "
              f"{_clock(elapsed)} elapsed, eta {_clock(eta)}", file=sys.stderr, flush=True)
        self.printed = self.n

    def write(self, msg: str, file=None) -> None:
        print(msg, file=file or sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"
