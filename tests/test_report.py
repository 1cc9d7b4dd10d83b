"""`vgraph report`: the page from a run directory's files (core only), and every way a RUN can be wrong.

The run directories here are written by hand, as `vgraph train` / `vgraph launch`
write them (run.json, metrics.jsonl, network.yml, placement.json, launch/job-N.json),
so these tests need no training; tests/test_watch_run.py runs the real commands
and a browser.
"""
from __future__ import annotations

import html
import html.parser
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from conftest import FIXTURES
from vgraph.cli.main import main
from vgraph.report.charts import Series, line_chart, nice_ticks, tick_labels
from vgraph.report.page import build_report, read_run, write_report

TINY = FIXTURES / "tiny_2l.yml"


def run_info(**extra) -> dict:
    return {"network": "tiny-2l", "seed": 0, "batch": 8, "seq_len": 16, "passes": None, "fuse": True,
            "device": "cpu", "precision": {"target": "cpu", "compute_dtype": "float32"}, "lr": 6e-4, "steps": 6,
            "memory_estimate": {"parameters": 100_000, "gradients": 100_000, "optimizer": 200_000,
                                "activations": 50_000, "workspace": 10_000, "total": 460_000,
                                "measured_as": "process_peak_rss"}, **extra}


def rows(n: int = 6, pnodes: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        row = {"step": s, "loss": 4.6 - 0.1 * s, "lr": 6e-4, "tokens_per_s": 900.0 + 10 * s, "elapsed_s": 0.5 * s,
               "peak_memory_bytes": 400_000_000, "learning_rate": 6e-4}
        if s % 3 == 0:
            row["val_loss"] = 4.65 - 0.1 * s
        if pnodes:
            row["pnodes"] = {p: {"step_s": 0.05 + 0.01 * i, "idle_s": 0.01 * (i + 1), "bytes_sent": 32768,
                                 "peak_memory_bytes": 300_000_000} for i, p in enumerate(pnodes)}
        out.append(row)
    return out


def make_run(path: Path, *, info: dict | None = None, metrics: list[dict] | None = None, network: str | None = None,
             tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "run.json").write_text(json.dumps(info if info is not None else run_info()))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (metrics if metrics is not None
                                                                                 else rows())) + tail)
    (path / "network.yml").write_text(network if network is not None else TINY.read_text())
    (path / "latest").write_text("step-00000006\n")
    return path


class PageParser(html.parser.HTMLParser):
    """Every element and attribute of the page, as a browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    return parser


def assert_inert(page: str) -> None:
    """No script, no frame or object, no event handler, nothing fetched from anywhere."""
    parsed = parse(page)
    for tag, attrs in parsed.tags:
        assert tag not in ("script", "iframe", "object", "embed", "img", "link", "foreignobject", "a", "image"), tag
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)
            assert "javascript:" not in (value or "").lower()
            assert not (value or "").lower().startswith(("http:", "https:", "//")) or name == "xmlns", (tag, name)
    assert not any(ord(c) < 32 and c not in "\n\t" for c in page)  # no raw control characters


# -- the page ------------------------------------------------------------------------------------

def test_train_run_page_has_curves_network_memory_and_settings(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    out = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    assert "train run, 6 logged step(s)" in capsys.readouterr().out
    page = out.read_text()
    assert_inert(page)
    parsed = parse(page)
    charts = [a.get("class") for t, a in parsed.tags if t == "svg"]
    assert "chart loss" in charts and "chart throughput" in charts and "network" in charts
    loss_svg = page[page.index('class="chart loss"'):]
    loss_svg = loss_svg[:loss_svg.index("</svg>")]
    assert loss_svg.count("<polyline") == 2 and loss_svg.count("<circle") == 2  # train curve; 2 validations
    assert "block0_attention" in page and "fused from 2" in page  # the production pipeline's fusions drawn
    assert "step 6 of 6" in page and "step-00000006" in page
    assert "estimate: total" in page and "449 KiB" in page and "381 MiB" in page  # estimate vs measured
    assert "learning_rate" in page  # the network's metrics: entry
    assert "Content-Security-Policy" in page


def test_launch_run_page_has_pnode_figures_and_cut_edges(tmp_path: Path) -> None:
    metrics = rows(pnodes=("w0", "w1"))
    for row in metrics:  # as vgraph 0.2.0 records them: both PNodes' bytes, each one's tensor peak and RSS
        row["boundary_bytes"] = 65536
        for figures in row["pnodes"].values():
            figures.update(tensor_peak_bytes=520_000, peak_rss_bytes=figures.pop("peak_memory_bytes"))
    run = make_run(tmp_path / "run", info=run_info(launch={"fleet": "test", "pnodes": ["w0", "w1"]}),
                   metrics=metrics)
    groups = {"token_embedding": "w0", "transformer_block_0": "w0", "transformer_block_1": "w1"}
    from vgraph import load

    source = load(TINY)
    assignment = {n.id: groups[n.group] for n in source.nodes}
    (run / "launch").mkdir()
    (run / "launch" / "job-0.json").write_text(json.dumps({"pipeline_before": "dead-nodes,precision",
                                                           "assignment": {"x": "w0"}, "pipeline_after": ""}))
    (run / "launch" / "job-1.json").write_text(json.dumps({
        "pipeline_before": "dead-nodes,precision", "assignment": assignment,
        "pipeline_after": "fuse-heads,fuse-lm-head-ce", "target": "cpu"}))
    (run / "placement.json").write_text(json.dumps(placement()))
    out, rec, why = write_report(run, tmp_path / "report.html")
    assert why is None and rec.command == "launch"
    page = out.read_text()
    assert_inert(page)
    for figure in ("step_s", "idle_s", "bytes_sent"):
        chart = page[page.index(f'class="chart pnode-{figure}"'):]
        chart = chart[:chart.index("</svg>")]
        assert chart.count("<polyline") == 2 and ">w0<" in chart and ">w1<" in chart
    assert "PNode w0" in page and "PNode w1" in page  # the drawing's clusters: the latest job's assignment
    assert "KiB/step" in page  # a cut edge's label
    assert "dead-nodes,precision,partition,fuse-heads,fuse-lm-head-ce" in page
    # Bytes on one basis: what each PNode sends, predicted (placement.json) beside measured (the workers).
    table = pnode_table(page)
    assert [row[0] for row in table] == ["w0", "w1", "all PNodes"]
    for row in table:
        assert row[5] == row[6] == ("65.5k" if row[0] == "all PNodes" else "32.8k"), row
    assert table[0][7:10] == ["488 KiB", "508 KiB", "286 MiB"]  # tensor estimate, tensor peak; RSS apart
    assert "counted once, at its sender" in page and "before 0.2.0" not in page


def placement(sent: bool = True) -> dict:
    """A placement.json of two PNodes; `sent=False`: as vgraph < 0.2.0 wrote it (bytes in + out only)."""
    pnodes = {"w0": {"vnodes": ["a"] * 19, "memory_bytes": 500_000, "capacity_bytes": 2**30, "seconds": 0.016,
                     "boundary_bytes_per_step": 65536, "bytes_sent_per_step": 32768},
              "w1": {"vnodes": ["b"] * 13, "memory_bytes": 300_000, "capacity_bytes": 2**30, "seconds": 0.011,
                     "boundary_bytes_per_step": 65536, "bytes_sent_per_step": 32768}}
    if not sent:
        for info in pnodes.values():
            del info["bytes_sent_per_step"]
    return {"network": "tiny-2l", "batch": 8, "pnodes": pnodes, "cut_bytes_per_step": 65536,
            **({"bytes_per_step": 65536} if sent else {})}


def pnode_table(page: str) -> list[list[str]]:
    """The PNodes table's body rows as text cells."""
    section = page[page.index("<h2>PNodes</h2>"):]
    section = section[section.index("<table>"):section.index("</table>")]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", section, re.S)[1:]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in rows]


def memory_table(page: str) -> dict[str, str]:
    section = page[page.index("<h2>Memory</h2>"):]
    section = section[:section.index("</section>")]
    return {html.unescape(re.sub(r"<[^>]+>", "", k)): html.unescape(v) for k, v in
            re.findall(r"<tr><td>(.*?)</td><td class=\"num\">(.*?)</td></tr>", section, re.S)}


def test_a_launch_run_of_an_older_vgraph_shows_no_bytes_against_another_basis(tmp_path: Path) -> None:
    """Its placement.json counted each PNode's bytes in and out: not set against the bytes measured sent."""
    run = make_run(tmp_path / "run", info=run_info(launch={"fleet": "test"}), metrics=rows(pnodes=("w0", "w1")))
    (run / "placement.json").write_text(json.dumps(placement(sent=False)))
    page = write_report(run, tmp_path / "report.html")[0].read_text()
    w0, w1, total = pnode_table(page)
    assert w0[5:7] == ["-", "32.8k"] and total[5] == "65.5k"  # cut_bytes_per_step: everything sent
    assert w0[7:10] == ["488 KiB", "-", "286 MiB"]  # its peak_memory_bytes was the CPU's RSS, not a tensor peak
    assert "written by a vgraph before 0.2.0" in page and "65.5k" not in w0


def test_memory_is_compared_like_with_like(tmp_path: Path) -> None:
    """The tensor peak against the tensor estimate; the process's RSS on its own, never as a ratio."""
    info = run_info()
    info["memory_estimate"] = dict(info["memory_estimate"], tensor_peak_as="live_tensor_bytes")
    del info["memory_estimate"]["measured_as"]
    metrics = [dict(r, tensor_peak_bytes=414_000, peak_rss_bytes=r.pop("peak_memory_bytes")) for r in rows()]
    page = write_report(make_run(tmp_path / "new", info=info, metrics=metrics), tmp_path / "new.html")[0].read_text()
    table = memory_table(page)
    assert table["measured tensor peak (tensors followed through the first steps)"] == "404 KiB"
    assert table["tensor peak / estimated total"] == "0.90x"
    rss = next(k for k in table if k.startswith("process peak RSS"))
    assert table[rss] == "381 MiB" and "not comparable with the estimate" in rss
    assert [v for v in table.values() if v.endswith("x")] == ["0.90x"]


def test_memory_of_an_older_run_keeps_its_rss_out_of_the_ratio(tmp_path: Path) -> None:
    """vgraph < 0.2.0 recorded the CPU's peak RSS as `peak_memory_bytes` (the report said 475.43x): now it is
    the RSS figure, and no tensor peak or ratio is claimed; on CUDA the same key was the allocator's peak."""
    page = write_report(make_run(tmp_path / "cpu"), tmp_path / "cpu.html")[0].read_text()
    table = memory_table(page)
    assert table["measured tensor peak (not measured by this vgraph)"] == "-"
    assert not [v for v in table.values() if v.endswith("x")]
    assert table[next(k for k in table if k.startswith("process peak RSS"))] == "381 MiB"
    info = run_info(device="cuda")
    info["memory_estimate"]["measured_as"] = "cuda_max_memory_allocated"
    metrics = [dict(r, peak_memory_bytes=230_000) for r in rows()]
    page = write_report(make_run(tmp_path / "gpu", info=info, metrics=metrics), tmp_path / "gpu.html")[0].read_text()
    table = memory_table(page)
    assert table["measured tensor peak (the CUDA allocator's peak)"] == "225 KiB"
    assert table["tensor peak / estimated total"] == "0.50x"


def test_a_run_still_going_is_read_as_it_is(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", info=run_info(steps=100), metrics=rows(4), tail='{"step": 5, "loss": 4.')
    (run / "latest").unlink()
    out, rec, _ = write_report(run, tmp_path / "r.html")
    page = out.read_text()
    assert [r["step"] for r in rec.rows] == [1, 2, 3, 4]
    assert "step 4 of 100 (still running, or stopped)" in page and "none yet" in page
    assert "1 line(s) that are not metrics rows were skipped" in page


def test_a_resumed_run_shows_each_step_once(tmp_path: Path) -> None:
    again = [dict(r, loss=r["loss"] - 1) for r in rows()[3:]]
    run = make_run(tmp_path / "run", metrics=rows() + again)
    rec = read_run(run)
    assert [r["step"] for r in rec.rows] == [1, 2, 3, 4, 5, 6]
    assert rec.rows[-1]["loss"] == pytest.approx(again[-1]["loss"])


def test_a_run_without_metrics_yet(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(run_info()))
    out, rec, why = write_report(run, tmp_path / "r.html")
    page = out.read_text()
    assert "no step logged yet" in page and "no data yet" in page and "metrics.jsonl is missing" in page
    assert why and "network.yml is missing" in why


def test_without_graphviz_the_page_says_why_there_is_no_drawing(tmp_path: Path, monkeypatch) -> None:
    run = make_run(tmp_path / "run")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    out, _, why = write_report(run, tmp_path / "r.html")
    assert "Graphviz" in why and "apt-get install graphviz" in out.read_text()
    assert 'class="chart loss"' in out.read_text()


# -- hostile input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "no such run directory"),
    (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is a file, not a run directory"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "not a run directory of vgraph train or vgraph launch"),
])
def test_what_is_not_a_run_is_a_diagnostic(tmp_path: Path, capsys, make, message) -> None:
    run = make(tmp_path)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


def test_a_control_character_in_the_run_path_is_escaped_in_the_message(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "run\x1b[2J"), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[2J" in err


@pytest.mark.parametrize("name", ["metrics.jsonl", "run.json", "network.yml", "latest", "tokenizer.json"])
def test_the_report_never_replaces_a_file_of_the_run(tmp_path: Path, capsys, name: str) -> None:
    run = make_run(tmp_path / "run")
    (run / "tokenizer.json").write_text("{}")
    before = (run / name).read_bytes()
    assert main(["report", str(run), "-o", str(run / name)]) == 2
    assert "refusing to overwrite an input" in capsys.readouterr().err
    assert (run / name).read_bytes() == before


def test_an_output_that_is_a_directory_or_empty_is_refused(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    assert main(["report", str(run), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["report", str(run), "-o", ""]) == 2
    assert "empty" in capsys.readouterr().err


def test_a_report_inside_the_run_directory_is_rewritten(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    assert main(["report", str(run), "-o", str(run / "report.html")]) == 0
    assert main(["report", str(run), "-o", str(run / "report.html")]) == 0  # a report is not an input
    assert sorted(p.name for p in run.iterdir()) == ["latest", "metrics.jsonl", "network.yml", "report.html",
                                                     "run.json"]  # no temporary left


HOSTILE = '<script>alert(1)</script><img src=x onerror=alert(2)>"\'&\x1b[2J\x00\u202e-->]]>'


def test_html_and_control_characters_from_the_run_are_escaped(tmp_path: Path) -> None:
    network = TINY.read_text().replace("name: tiny-2l", "name: " + json.dumps(HOSTILE), 1)
    hostile_rows = rows(pnodes=(HOSTILE, "w1"))
    for r in hostile_rows:
        r[HOSTILE] = 1.5  # a metrics: entry with a hostile name
    info = run_info(network=HOSTILE, data=HOSTILE, passes=None, **{HOSTILE: HOSTILE})
    run = make_run(tmp_path / "run", info=info, metrics=hostile_rows, network=network)
    (run / "latest").write_text(HOSTILE)
    out, _, why = write_report(run, tmp_path / "r.html")
    page = out.read_text()
    assert_inert(page)
    assert "<script" not in page.lower() and "onerror=" not in page.replace("onerror=alert(2)&gt;", "")
    assert "&lt;script&gt;" in page  # shown as text
    assert why is None and "&lt;script&gt;alert(1)&lt;/script&gt;" in page[page.index('class="network"'):]


def test_a_node_id_with_markup_is_drawn_as_text(tmp_path: Path) -> None:
    """Node ids reach the page through Graphviz's SVG: it is rebuilt from an allowlist, so markup stays text."""
    from vgraph import load
    from vgraph.report.page import RunRecord
    from vgraph.report.render import render_svg
    from vgraph.report.svg_embed import embeddable_svg

    graph = load(TINY)
    graph.name = HOSTILE
    svg = embeddable_svg(render_svg(graph))
    page = build_report(RunRecord(tmp_path, run=run_info(), rows=rows()), drawing=svg)
    assert_inert(page)
    assert 'class="network"' in page and "<title>" in svg


def test_corrupt_metrics_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", tail="\n".join([
        "not json", "[1, 2]", '{"step": "7"}', '{"step": true}', '{"step": -3}', '{"loss": 1}',
        '{"step": 8, "loss": NaN, "tokens_per_s": Infinity, "val_loss": "x"}',
        '{"step": 9, "loss": 1e308, "tokens_per_s": -1e308}', "\x00\xff garbage"]) + "\n")
    raw = (run / "metrics.jsonl").read_bytes() + b"\xff\xfe\n"
    (run / "metrics.jsonl").write_bytes(raw)
    out, rec, _ = write_report(run, tmp_path / "r.html")
    assert [r["step"] for r in rec.rows] == [1, 2, 3, 4, 5, 6, 8, 9]
    page = out.read_text()
    assert_inert(page)
    assert "8 line(s) that are not metrics rows were skipped" in page
    assert "NaN" not in page.split("<section><h2>Settings")[0].split("<footer")[0].replace("NaN)", "")


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b"\xff\xfe", b'"text"', b"null"])
def test_a_damaged_run_json_is_a_note(tmp_path: Path, content: bytes) -> None:
    run = make_run(tmp_path / "run")
    (run / "run.json").write_bytes(content)
    out, rec, _ = write_report(run, tmp_path / "r.html")
    assert rec.notes and "run.json" in " ".join(rec.notes)
    assert_inert(out.read_text())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(st.text(max_size=40),
                                st.builds(json.dumps, st.dictionaries(
                                    st.sampled_from(["step", "loss", "val_loss", "tokens_per_s", "pnodes", "lr", "x"]),
                                    st.one_of(st.integers(-5, 10**12), st.floats(allow_nan=True), st.text(max_size=8),
                                              st.none(), st.dictionaries(st.text(max_size=4), st.floats()))))),
                      max_size=12))
# Found by the strategy above (CI of 2026-12-02): one row's PNodes a mapping, a later row's a number; and a
# PNode's figures that are not a mapping.
@example(lines=['{"pnodes":{},"step":0}', '{"loss": null, "step": 1, "val_loss": null, "pnodes": 1}'])
@example(lines=['{"pnodes":{"h0":{"step_s":1}},"step":1}', '{"step": 2, "pnodes": {"h0": 3, "h1": null}}'])
def test_any_metrics_file_gives_an_inert_page(tmp_path: Path, lines: list[str]) -> None:
    run = tmp_path / "any"
    run.mkdir(exist_ok=True)
    (run / "run.json").write_text(json.dumps(run_info()))
    (run / "metrics.jsonl").write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    rec = read_run(run)
    steps = [r["step"] for r in rec.rows]
    assert steps == sorted(set(steps))
    assert_inert(build_report(rec))


# -- the charts --------------------------------------------------------------------------------------

@given(lo=st.floats(-1e6, 1e6), span=st.floats(1e-6, 1e6))
def test_ticks_are_round_ordered_and_cover_the_range(lo: float, span: float) -> None:
    ticks = nice_ticks(lo, lo + span)
    assert ticks == sorted(ticks) and 2 <= len(ticks) <= 12
    slack = 1e-6 * span + 1e-9 * max(1.0, abs(lo))  # float rounding of ticks at the ends
    assert all(lo - slack <= t <= lo + span + slack for t in ticks)
    labels = tick_labels(ticks)
    if max(abs(t) for t in ticks) < 1e4:
        assert len(set(labels)) == len(labels)  # close values get enough decimals to differ


def test_a_chart_draws_only_finite_points() -> None:
    svg = line_chart("t <&>", [Series("a", [(1, 1.0), (2, math.nan), (3, math.inf), (4, 2.0)]),
                               Series("b", [])])
    assert svg.count("<polyline") == 1 and "t &lt;&amp;&gt;" in svg
    assert "no data yet" in line_chart("empty", [Series("a", [(1, math.nan)])])
    assert "<circle" in line_chart("one point", [Series("a", [(1, 3.0)])])


# -- the fleet over time (launch runs whose machines change; vgraph/run/fleet_events.py) ---------------------

FLEET_EVENTS = [
    {"event": "join", "pnode": "j1", "machine": 1, "step": 2, "outcome": "admitted", "queued": False},
    {"event": "replan", "kind": "join", "pnode": "j1", "step": 2, "chosen": "new", "reason": "saves 9.1 s",
     "old_step_s": 2.4, "new_step_s": 1.2, "bytes_moved": 52_000, "move_s": 0.01, "overhead_s": 3.0},
    {"event": "boundary", "step": 3, "pnodes": ["j1", "m0"], "requested": 10.5},
    {"event": "moved", "step": 3, "first_step": 4, "seconds": 4.25},
    {"event": "join", "pnode": "j2", "step": 5, "outcome": "refused", "reason": "the run has its 2 machines"},
]


def fleet_run(path: Path, events: list, machines=(1, 1, 1, 2, 2, 2)) -> Path:
    metrics = rows(pnodes=("m0",))
    for row, n in zip(metrics, machines):
        row["machines"] = n
        if n == 2:
            row["pnodes"]["j1"] = dict(row["pnodes"]["m0"])
    run = make_run(path, info=run_info(launch={"fleet": "one", "pnodes": ["m0"]}), metrics=metrics)
    (run / "launch").mkdir(exist_ok=True)
    (run / "launch" / "fleet-events.jsonl").write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n"
                                                               for e in events))
    return run


def fleet_section(page: str) -> str:
    match = re.search(r'<section class="fleet">.*?</section>', page, re.S)
    return match.group(0) if match else ""


def test_the_fleet_over_time_shows_machines_per_step_and_each_replan(tmp_path: Path) -> None:
    run = fleet_run(tmp_path / "run", FLEET_EVENTS)
    page = build_report(read_run(run))
    assert_inert(page)
    section = fleet_section(page)
    assert "<h2>Fleet over time</h2>" in section and "Machines per step" in section
    spans = re.search(r'<table class="fleet-spans">.*?</table>', section, re.S).group(0)
    cells = [c for r in re.findall(r"<tr>(.*?)</tr>", spans) if (c := re.findall(r"<td[^>]*>(.*?)</td>", r))]
    assert cells == [["1", "3", "1", "m0"], ["4", "6", "2", "j1, m0"]]  # the machines change at the boundary
    replans = re.search(r'<table class="fleet-replans">.*?</table>', section, re.S).group(0)
    (row,) = [c for r in re.findall(r"<tr>(.*?)</tr>", replans) if (c := re.findall(r"<td[^>]*>(.*?)</td>", r))]
    assert row == ["2", "3", "join", "j1", "new", "2.4", "1.2", "50.8 KiB", "3.01", "4.25", "j1, m0", "saves 9.1 s"]
    assert "join admitted: 1" in section and "join refused: 1" in section
    assert "machines" not in re.sub(r'<section class="fleet">.*?</section>', "", page).split("<h2>Training")[1] \
        .split("</section>")[0]  # the count is the fleet's, not one of the network's metrics


@pytest.mark.parametrize("machines, events, shown", [
    ((None,) * 6, [], False),  # vgraph train: no machines, no events
    ((1,) * 6, [], False),  # a launch on one machine that never changed
    ((1,) * 6, FLEET_EVENTS[:1], True),  # one machine, but a join happened
    ((2,) * 6, [], True),  # two machines from the start
])
def test_the_section_is_there_only_for_a_fleet_of_several_machines_or_with_events(tmp_path, machines, events,
                                                                                    shown) -> None:
    run = fleet_run(tmp_path / "run", events, machines)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                               for r in metrics))
    if not events:
        (run / "launch" / "fleet-events.jsonl").unlink()
    assert bool(fleet_section(build_report(read_run(run)))) is shown


def test_hostile_fleet_events_are_notes_and_escaped_text(tmp_path: Path) -> None:
    hostile = "j\x1b[2J<script>alert(1)</script>"
    events = [
        "{torn", json.dumps({"event": "boundary", "step": 10**40}), '{"event": "moved", "step": 3, "seconds": NaN}',
        {"event": "replan", "kind": "le\u202eave", "pnode": hostile, "step": 2, "chosen": "new", "reason": hostile,
         "old_step_s": "fast", "new_step_s": -1, "bytes_moved": 1e300},
        {"event": "boundary", "step": 3, "pnodes": [hostile, ["x"], 7]},
        {"event": "replan", "step": 99, "chosen": "new"},  # beyond the run's 6 steps
    ]
    run = fleet_run(tmp_path / "run", events)
    rec = read_run(run)
    page = build_report(rec)
    assert_inert(page)
    section = fleet_section(page)
    assert "<script>" not in page and "&lt;script&gt;" in section and "\\x1b" in section and "\\u202e" in section
    assert any("3 line(s) that are not fleet events" in n for n in rec.notes), rec.notes
    row = re.findall(r"<td[^>]*>(.*?)</td>", re.search(r'<table class="fleet-replans">.*?</table>', section,
                                                       re.S).group(0))
    assert row[5:10] == ["-", "-", "9.09e+287 TiB", "-", "-"]  # not numbers: '-'; huge bytes shown as a number
