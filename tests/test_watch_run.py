"""Watching a run for real: TensorBoard's own reader on `vgraph train` / `vgraph launch` run directories, and
`vgraph report` pages rendered by headless Chromium (the curves and the network must show on screen).

Tiny network (tests/fixtures/tiny_2l.yml: dim 32, 2 heads), 6 steps, a small corpus.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path

import pytest

from browser_util import colour_mask, drawn_label_sizes, ink, screenshot
from hardening_util import modes_against_umask
from conftest import FIXTURES
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.cli.main import main
from vgraph.report.page import LOSS_COLOR, PNODE_COLORS, THROUGHPUT_COLOR, VAL_COLOR
from vgraph.report.render import CATEGORY_COLORS, CUT_COLOR, FUSED_COLOR

TINY = FIXTURES / "tiny_2l.yml"
STEPS = 6


def accumulator(run_dir: Path):
    """TensorBoard's own reader of the run directory's event files (purging what a resumed run redid)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def steps_of(acc, tag: str) -> list[int]:
    return [event.step for event in acc.Scalars(tag)]


def raw_steps(run_dir: Path, tag: str) -> list[int]:
    """Every event of `tag` in every event file, as written (no purge)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            out += [event.step for value in event.summary.value if value.tag == tag]
    return out


def cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=30_000)), encoding="utf-8")
    return path


def train_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(TINY), "--data", str(corpus), "--steps", str(STEPS), "--val-every", "3", "--val-batches", "2",
            "--checkpoint-every", "3", "--threads", "1", "--out", str(out), "--quiet", *extra]


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("watch") / "run"
    return run, cli(*train_args(corpus, run))


def test_tensorboard_reads_the_train_curves(trained) -> None:
    run, _ = trained
    acc = accumulator(run)
    assert steps_of(acc, "train/loss") == list(range(1, STEPS + 1))
    assert steps_of(acc, "val/loss") == [3, 6]
    for tag in ("train/lr", "train/tokens_per_s", "metrics/learning_rate"):
        assert len(steps_of(acc, tag)) == STEPS, tag
    # Memory is measured at sync points (the run's first step, validations, checkpoints, the clock): running
    # peaks, so the rows between two sync points carry none of their own.
    for tag in ("train/tensor_peak_bytes", "train/peak_rss_bytes"):
        steps = steps_of(acc, tag)
        assert steps[0] == 1 and steps[-1] == STEPS and {3, 6} <= set(steps), (tag, steps)
    assert acc.Tags()["images"] == ["network"]
    image = acc.Images("network")[0]
    assert image.width > 100 and image.height > 100
    settings = acc.Tensors("run/settings/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| seed | 0 |" in settings and "memory_estimate" in settings


def test_train_prints_the_report_command_and_records_memory(trained) -> None:
    import json

    run, out = trained
    assert f"report: vgraph report {run} -o {run / 'report.html'}" in out
    info = json.loads((run / "run.json").read_text())
    assert info["memory_estimate"]["total"] > 0 and info["memory_estimate"]["tensor_peak_as"] == "live_tensor_bytes"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Measured at sync points (the first step's among them): the tensor peak of the first two steps, then
    # kept; the process's RSS holds torch's runtime besides.
    measured = [r for r in rows if "tensor_peak_bytes" in r]
    assert measured[0]["step"] == 1 and measured[-1]["step"] == rows[-1]["step"] and len(measured) >= 3
    assert len({r["tensor_peak_bytes"] for r in measured[1:]}) == 1
    assert all(0 < r["tensor_peak_bytes"] < r["peak_rss_bytes"] for r in measured)


def test_a_resumed_run_continues_the_curves_without_repeating_steps(trained, corpus: Path, tmp_path: Path) -> None:
    """Killed after step 6 was logged but before its checkpoint: the resumed run redoes 4..6 once each."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    shutil.rmtree(run / "step-00000006")
    (run / "latest").write_text("step-00000003\n")
    cli(*train_args(corpus, run, "--resume"))
    assert sorted(raw_steps(run, "train/loss")) == [1, 2, 3, 4, 4, 5, 5, 6, 6]  # both sessions' events on disk
    acc = accumulator(run)
    assert steps_of(acc, "train/loss") == list(range(1, STEPS + 1))  # the reader shows each step once
    assert steps_of(acc, "val/loss") == [3, 6]
    files = sorted(run.glob("events.out.tfevents.*"))
    assert len(files) == 2
    cli(*train_args(corpus, run, "--resume"))  # already at its last step: nothing trained, nothing written
    assert sorted(run.glob("events.out.tfevents.*")) == files


def test_no_tensorboard_writes_no_event_file(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "quiet"
    cli("train", str(TINY), "--data", str(corpus), "--steps", "1", "--val-every", "0", "--threads", "1",
        "--out", str(run), "--quiet", "--no-tensorboard")
    assert (run / "metrics.jsonl").is_file() and not list(run.glob("events.out.tfevents.*"))


def shows(pixels, colour: str, at_least: int, tolerance: float = 0.1) -> bool:
    return int(colour_mask(pixels, colour, tolerance).sum()) >= at_least


def test_chromium_shows_the_train_report(trained, tmp_path: Path) -> None:
    run, _ = trained
    page = tmp_path / "report.html"
    assert "train run, 6 logged step(s)" in cli("report", str(run), "-o", str(page))
    pixels = screenshot(page, tmp_path / "shot.png", 1300, 2400)
    assert ink(pixels) > 0.01  # not a blank page (a blank one: 0)
    top = pixels[:700]  # the Training section: the curves come first
    assert shows(top, LOSS_COLOR, 300) and shows(top, VAL_COLOR, 150) and shows(top, THROUGHPUT_COLOR, 300)
    drawing = pixels[700:]
    assert shows(drawing, FUSED_COLOR, 500, 0.03)  # the fused attention and LM-head VNodes
    assert shows(drawing, CATEGORY_COLORS["layer"], 1000, 0.03)  # the linear / layernorm boxes


MIN_LABEL_PX = 11  # issue 28: the drawing's labels at least 11 px tall on a 1,400 px wide screen


def assert_labels_readable(page: Path) -> None:
    """Every label of the network drawing, as Chromium draws it at 1,400 px, is at least 11 px."""
    sizes = drawn_label_sizes(page, 1400)
    assert len(sizes) > 20 and sum("params" in text for text, _ in sizes) > 5  # node labels, not only titles
    small = [(text, round(px, 1)) for text, px in sizes if px < MIN_LABEL_PX]
    assert not small, f"labels under {MIN_LABEL_PX} px: {small[:5]}"


def test_chromium_draws_the_train_reports_labels_readably(trained, tmp_path: Path) -> None:
    run, _ = trained
    page = tmp_path / "report.html"
    cli("report", str(run), "-o", str(page))
    assert_labels_readable(page)


@pytest.fixture(scope="module")
def launched(corpus: Path, tmp_path_factory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("launch")
    fleet = work / "fleet.yml"
    fleet.write_text("name: pair\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    run = work / "run"
    # The forkserver the workers fork from is started at another umask first (as an earlier launch in this
    # process would have): the workers must take the launcher's umask of now, not the forkserver's.
    from vgraph.backends.torch.distributed.launcher.supervisor import _context

    old = os.umask(0o022)
    started = _context().Process(target=os.getpid)
    started.start()
    started.join()
    os.umask(LAUNCH_UMASK)  # every file the launch writes must honour it
    try:
        out = cli("launch", str(TINY), "--fleet", str(fleet), "--replicas", "1", "--data", str(corpus),
                  "--steps", str(STEPS), "--val-every", "3", "--val-batches", "2", "--threads", "1",
                  "--out", str(run), "--quiet")
    finally:
        os.umask(old)
    return run, out


LAUNCH_UMASK = 0o027


@pytest.mark.slow
def test_every_file_of_a_launch_run_honours_the_umask(launched) -> None:
    """Checkpoints (safetensors writes 0600 by itself), the launch directory, event files: all as the umask says."""
    run, _ = launched
    assert (run / "step-00000006" / "model.safetensors").is_file() and (run / "launch").is_dir()
    assert modes_against_umask(run, LAUNCH_UMASK) == []


@pytest.mark.slow
def test_tensorboard_reads_the_launch_curves_per_pnode(launched) -> None:
    run, out = launched
    assert f"report: vgraph report {run}" in out
    acc = accumulator(run)
    assert steps_of(acc, "train/loss") == list(range(1, STEPS + 1))
    assert steps_of(acc, "val/loss") == [3, 6]
    for pnode in ("w0", "w1"):
        for figure in ("step_time_s", "idle_s", "bytes_sent"):
            assert steps_of(acc, f"pnode/{pnode}/{figure}") == list(range(1, STEPS + 1))
        step_times = [e.value for e in acc.Scalars(f"pnode/{pnode}/step_time_s")]
        idle = [e.value for e in acc.Scalars(f"pnode/{pnode}/idle_s")]
        assert all(0 <= i <= s for i, s in zip(idle, step_times))  # idle is a part of the step
    sent = {p: [e.value for e in acc.Scalars(f"pnode/{p}/bytes_sent")] for p in ("w0", "w1")}
    total = [e.value for e in acc.Scalars("train/bytes_sent")]
    assert [a + b for a, b in zip(sent["w0"], sent["w1"])] == total  # each PNode's share of the step's traffic
    assert acc.Tags()["images"] == ["network"]


@pytest.mark.slow
def test_chromium_shows_the_launch_report_with_pnode_curves(launched, tmp_path: Path) -> None:
    run, _ = launched
    page = tmp_path / "report.html"
    assert "launch run, 6 logged step(s)" in cli("report", str(run), "-o", str(page))
    html = page.read_text()
    assert 'class="chart pnode-step_s"' in html and "PNode w0" in html and "PNode w1" in html
    # The run matches its plan: predicted and measured bytes agree per PNode and in all (both: bytes sent), and
    # each PNode's tensor peak stands beside its tensor estimate, its RSS apart.
    section = html[html.index("<h2>PNodes</h2>"):]
    table = section[section.index("<table>"):section.index("</table>")]
    rows = [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)[1:]]
    assert [r[0] for r in rows] == ["w0", "w1", "all PNodes"]
    for row in rows:
        assert row[5] == row[6] != "-", row
    for row in rows[:2]:
        assert all(cell.endswith(("KiB", "MiB")) for cell in row[7:10]), row
    pixels = screenshot(page, tmp_path / "shot.png", 1300, 3000)
    assert ink(pixels) > 0.01
    assert shows(pixels[:700], LOSS_COLOR, 300) and shows(pixels[:700], VAL_COLOR, 150)
    pnode_part = pixels[700:1500]  # the PNodes section follows the training curves
    assert shows(pnode_part, PNODE_COLORS[0], 200) and shows(pnode_part, PNODE_COLORS[1], 200)
    assert shows(pixels[1300:], CUT_COLOR, 150, 0.08)  # the red cut edges between the two PNodes
    assert shows(pixels[1300:], FUSED_COLOR, 500, 0.03)
    assert_labels_readable(page)


def test_a_new_session_waits_out_the_second_of_an_earlier_event_file(tmp_path: Path) -> None:
    """TensorBoard orders event files by name, which starts with their second: a session must not share one."""
    from vgraph.backends.torch.training.tensorboard_log import wait_past_earlier_sessions

    now, slept = 1_764_644_000.25, []
    (tmp_path / "events.out.tfevents.1764644000.host.name.99.0").write_bytes(b"")
    (tmp_path / "events.out.tfevents.garbage").write_bytes(b"")
    wait_past_earlier_sessions(tmp_path, clock=lambda: now, sleep=slept.append)
    assert slept == [pytest.approx(0.75)]
    slept.clear()
    wait_past_earlier_sessions(tmp_path, clock=lambda: now + 1.0, sleep=slept.append)  # already past it
    (tmp_path / "events.out.tfevents.9999999999.host.1.0").write_bytes(b"")  # from a clock set back: no wait
    wait_past_earlier_sessions(tmp_path, clock=lambda: now, sleep=slept.append)
    assert slept == []
    wait_past_earlier_sessions(tmp_path / "missing", clock=lambda: now, sleep=slept.append)
    assert slept == []
