"""`vgraph report` on hostile run directories (issue 21, "Reading a run").

A run directory may come from anyone, and the page is made to be shared: the report reads only regular
files inside the run (no symlink out of it), never opens a path a run file names, is bounded in size,
depth and work (linear in the input), and turns every number through the one checked reader.  The
regression tests name the defect each one held; the property test generates run directories (metrics,
run.json, placement.json, job files with arbitrary JSON values, symlinks to a secret outside) and checks
that `report` never raises, never reads outside the run and never shows the secret.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES
from test_report import make_run, rows, run_info
from vgraph.cli.main import main
from vgraph.report.page import read_run, write_report

TINY = FIXTURES / "tiny_2l.yml"
SECRET = "SECRET-7f3a"  # what a file outside the run holds; it must never reach the page


# -- watching what the report opens ---------------------------------------------------------------------------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only inside `opened()`


@contextmanager
def opened() -> Iterator[list[str]]:
    """Every path the process opens in the block (relative ones are names opened relative to a directory
    descriptor: the run reader opens each component of a run's file that way)."""
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


def outside(paths: list[str], where: Path) -> list[str]:
    """The opened paths that are, or lead through a symlink to, something under `where`."""
    return [p for p in paths if str(where) in p or (os.path.isabs(p) and str(where) in os.path.realpath(p))]


def report(run: Path, out: Path, capsys) -> tuple[int, str, str]:
    code = main(["report", str(run), "-o", str(out)])
    err = capsys.readouterr().err
    page = out.read_text(encoding="utf-8") if out.is_file() else ""
    return code, err, page


@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    """A JSON file outside the run that would show up if followed (it parses as run.json, metrics and a job)."""
    path = tmp_path / "outside" / "secret.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"network": SECRET, "step": 1, "loss": 1.0, SECRET: 2.0, "passes": SECRET}) + "\n")
    return path


# -- symlinks and paths a run file names (defect 4) -----------------------------------------------------------

@pytest.mark.parametrize("name", ["run.json", "metrics.jsonl", "latest", "placement.json", "network.yml",
                                  "launch", "launch/job-0.json"])
def test_a_symlink_in_the_run_is_not_followed_out_of_it(name: str, tmp_path: Path, secret: Path, capsys) -> None:
    run = make_run(tmp_path / "run")
    link = run / name
    link.parent.mkdir(exist_ok=True)
    link.unlink(missing_ok=True)
    if name == "launch":
        (secret.parent / "job-0.json").write_text(secret.read_text())
        link.symlink_to(secret.parent, target_is_directory=True)
    else:
        link.symlink_to(secret)
    with opened() as paths:
        code, err, page = report(run, tmp_path / "r.html", capsys)
    assert code == 0 and "Traceback" not in err
    assert SECRET not in page
    assert not outside(paths, secret.parent), paths
    if name != "launch":
        assert "symbolic link" in page


def test_a_run_json_naming_a_file_in_its_passes_never_gets_it_opened(tmp_path: Path, secret: Path,
                                                                    capsys) -> None:
    fleet = secret.parent / "fleet.yml"
    fleet.write_text(f"{SECRET}\n")
    run = make_run(tmp_path / "run", info=run_info(passes=f"dead-nodes,partition{{fleet={fleet}}}"))
    with opened() as paths:
        code, err, page = report(run, tmp_path / "r.html", capsys)
    assert code == 0 and "Traceback" not in err
    assert SECRET not in page and str(fleet) not in paths
    assert "name a file" in page


# -- numbers, depth and types that were tracebacks (defect "report ... OverflowError, RecursionError, ...") ----

HUGE = 10**400


@pytest.mark.parametrize("case", ["huge-int-loss", "huge-int-estimate", "huge-int-step", "subnormal-losses",
                                  "close-losses", "opposite-huge-losses", "deep-run-json", "deep-metrics-line",
                                  "deep-placement", "deep-job"])
def test_numbers_and_depth_that_were_tracebacks_are_notes(case: str, tmp_path: Path, capsys) -> None:
    info, metrics, tail = run_info(), rows(), ""
    deep = "[" * 100_000 + "]" * 100_000
    if case == "huge-int-loss":
        tail = f'{{"step": 7, "loss": {HUGE}, "tokens_per_s": {HUGE}}}\n'
    elif case == "huge-int-estimate":
        info["memory_estimate"]["total"] = HUGE
        info["steps"] = HUGE
    elif case == "huge-int-step":
        tail = f'{{"step": {HUGE}, "loss": 1.0}}\n'
    elif case == "subnormal-losses":
        metrics = [dict(r, loss=5e-324 * (i % 2), val_loss=1e-310) for i, r in enumerate(metrics)]
    elif case == "close-losses":
        metrics = [dict(r, loss=2.2250738585072014e-308 + i * 5e-324) for i, r in enumerate(metrics)]
    elif case == "opposite-huge-losses":
        metrics = [dict(r, loss=(-1) ** i * 1.7e308) for i, r in enumerate(metrics)]
    elif case == "deep-metrics-line":
        tail = deep + "\n"
    run = make_run(tmp_path / "run", info=info, metrics=metrics, tail=tail)
    if case == "deep-run-json":
        (run / "run.json").write_text(deep)
    elif case == "deep-placement":
        (run / "placement.json").write_text(deep)
    elif case == "deep-job":
        (run / "launch").mkdir()
        (run / "launch" / "job-0.json").write_text('{"assignment": ' + deep + "}")
    code, err, page = report(run, tmp_path / "r.html", capsys)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "<svg" in page


WRONG_TYPES = [None, True, 7, -1, 1.5, "text", [], [1, "a"], {}, {"a": [1]}, "x" * 5000]


@pytest.mark.parametrize("where", ["passes", "fuse", "precision", "semantic_changes", "plugins", "steps",
                                   "memory_estimate", "launch", "network", "device"])
@pytest.mark.parametrize("value", WRONG_TYPES, ids=lambda v: type(v).__name__ + str(len(str(v))))
def test_any_type_in_run_json_is_shown_or_noted(where: str, value, tmp_path: Path) -> None:
    compiles = where in ("passes", "fuse", "precision", "semantic_changes")  # else no drawing: seconds saved
    run = make_run(tmp_path / "run", info=run_info(**{where: value}), network=None if compiles else "")
    out, rec, _ = write_report(run, tmp_path / "r.html")
    assert "<html" in out.read_text()


@pytest.mark.parametrize("where", ["assignment", "pipeline_before", "pipeline_after", "target", "ranks"])
@pytest.mark.parametrize("value", WRONG_TYPES + [{"token_embedding": ["w0"]}, {"token_embedding": 3}],
                         ids=lambda v: type(v).__name__ + str(len(str(v))))
def test_any_type_in_a_job_file_is_shown_or_noted(where: str, value, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", info=run_info(launch={"fleet": "t", "pnodes": ["w0"]}),
                   metrics=rows(pnodes=("w0",)))
    (run / "launch").mkdir()
    job = {"pipeline_before": "dead-nodes,precision", "pipeline_after": "", "target": "cpu", "assignment": {}}
    job[where] = value
    (run / "launch" / "job-0.json").write_text(json.dumps(job))
    out, rec, _ = write_report(run, tmp_path / "r.html")
    assert "<html" in out.read_text()


@pytest.mark.parametrize("value", WRONG_TYPES)
def test_any_type_in_placement_json_is_shown_or_noted(value, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", metrics=rows(pnodes=("w0",)))
    for doc in (value, {"pnodes": value}, {"pnodes": {"w0": value}}, {"assignment": value}):
        (run / "placement.json").write_text(json.dumps(doc))
        out, rec, _ = write_report(run, tmp_path / "r.html")
        assert "<html" in out.read_text()


@pytest.mark.parametrize("pnodes", WRONG_TYPES + [{"w0": WRONG_TYPES}, {"w0": {"step_s": [1]}}])
def test_any_type_in_a_metrics_row_is_left_out(pnodes, tmp_path: Path) -> None:
    metrics = [dict(r, pnodes=pnodes, loss=[1], val_loss={"a": 1}, tokens_per_s="fast", elapsed_s=True,
                    lr=None, peak_memory_bytes=HUGE if i else -1) for i, r in enumerate(rows())]
    text = "".join(json.dumps(r) + "\n" for r in metrics)
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").write_text(text)
    out, rec, _ = write_report(run, tmp_path / "r.html")
    assert [r["step"] for r in rec.rows] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(v, (int, float, dict)) for r in rec.rows for v in r.values())
    assert "<html" in out.read_text()


# -- linear work (defect: quadratic in distinct PNode names) ---------------------------------------------------

def _lines_executed(fn) -> int:
    """How many lines of vgraph's report code run while `fn` runs: the work, counted (never timed)."""
    count = 0
    prefix = str(Path(read_run.__code__.co_filename).parent.parent)

    def tracer(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.startswith(prefix):
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _pnode_run(path: Path, n: int) -> Path:
    """n logged steps, each naming a PNode of its own (a hostile or damaged metrics file)."""
    metrics = [{"step": s, "loss": 1.0, "pnodes": {f"p{s}": {"step_s": 0.1, "idle_s": 0.0, "bytes_sent": 1}}}
               for s in range(1, n + 1)]
    return make_run(path, metrics=metrics, network="")


def test_the_report_is_linear_in_distinct_pnode_names(tmp_path: Path) -> None:
    from vgraph.report.page import build_report

    small, large = _pnode_run(tmp_path / "s", 150), _pnode_run(tmp_path / "l", 600)
    work = [_lines_executed(lambda r=r: build_report(read_run(r))) for r in (small, large)]
    assert work[1] < 6 * work[0], f"4x the rows cost {work[1] / work[0]:.1f}x the work: not linear"


def test_the_report_is_linear_in_metrics_rows(tmp_path: Path) -> None:
    from vgraph.report.page import build_report

    runs = [make_run(tmp_path / str(n), metrics=rows(n, pnodes=("w0", "w1")), network="") for n in (150, 600)]
    work = [_lines_executed(lambda r=r: build_report(read_run(r))) for r in runs]
    assert work[1] < 6 * work[0], f"4x the rows cost {work[1] / work[0]:.1f}x the work: not linear"


def test_many_pnodes_are_bounded_on_the_page(tmp_path: Path) -> None:
    run = _pnode_run(tmp_path / "run", 400)
    out, rec, _ = write_report(run, tmp_path / "r.html")
    page = out.read_text()
    assert "p400" in page and "p1<" not in page  # the most recent shown, the rest counted
    assert "PNodes not shown" in page


# -- the property test ---------------------------------------------------------------------------------------

NUMBERS = st.one_of(st.floats(), st.integers(), st.sampled_from([HUGE, -HUGE, 5e-324, -1e-310, 1.7e308]),
                    st.booleans())
JSON = st.recursive(st.none() | NUMBERS | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=4),
                    max_leaves=12)
FIELDS = ["step", "machines", "loss", "val_loss", "tokens_per_s", "elapsed_s", "lr", "peak_memory_bytes", "boundary_bytes",
          "pnodes", "loss_scale", "metric_x"]
ROW = st.dictionaries(st.sampled_from(FIELDS), JSON | NUMBERS, max_size=6)
RUN_KEYS = ["network", "passes", "fuse", "precision", "steps", "memory_estimate", "semantic_changes", "plugins",
            "launch", "device", "seed"]
FILES = ["run.json", "metrics.jsonl", "placement.json", "latest", "network.yml", "launch/job-0.json",
         "launch/job-7.json", "launch/fleet-events.jsonl"]
EVENT_FIELDS = ["event", "kind", "step", "chosen", "pnode", "pnodes", "reason", "old_step_s", "new_step_s",
                "bytes_moved", "move_s", "overhead_s", "seconds", "outcome"]
EVENT = st.dictionaries(st.sampled_from(EVENT_FIELDS), st.one_of(
    JSON, NUMBERS, st.sampled_from(["replan", "boundary", "moved", "join", "new", "keep", "j\x1b<b>"])), max_size=8)


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, allow_nan=True), encoding="utf-8")


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(run_json=st.one_of(JSON, st.dictionaries(st.sampled_from(RUN_KEYS), JSON, max_size=6)),
       metrics=st.lists(st.one_of(ROW, JSON, st.text(max_size=20)), max_size=8),
       placement=st.one_of(JSON, st.fixed_dictionaries({"pnodes": JSON, "assignment": JSON})),
       job=st.one_of(JSON, st.dictionaries(st.sampled_from(["assignment", "pipeline_before", "pipeline_after",
                                                            "target", "ranks"]), JSON, max_size=5)),
       links=st.sets(st.sampled_from(FILES), max_size=3),
       latest=st.text(max_size=30), network=st.sampled_from(["tiny", "", "garbage"]),
       fleet=st.lists(st.one_of(EVENT, JSON, st.text(max_size=20)), max_size=8))
def test_report_never_raises_never_reads_outside_never_leaks(tmp_path_factory, run_json, metrics, placement, job,
                                                             links, latest, network, fleet) -> None:
    base = tmp_path_factory.mktemp("hostile")
    elsewhere = base / "outside"
    elsewhere.mkdir()
    secret = elsewhere / "secret.json"
    secret.write_text(json.dumps({"network": SECRET, "step": 1, SECRET: 1.0, "assignment": {SECRET: SECRET}}))
    run = base / "run"
    (run / "launch").mkdir(parents=True)
    _write_json(run / "run.json", run_json)
    (run / "metrics.jsonl").write_text("".join((m if isinstance(m, str) else json.dumps(m)) + "\n"
                                               for m in metrics), encoding="utf-8", errors="surrogatepass")
    _write_json(run / "placement.json", placement)
    _write_json(run / "launch" / "job-0.json", job)
    (run / "launch" / "fleet-events.jsonl").write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n"
                                                               for e in fleet), encoding="utf-8",
                                                       errors="surrogatepass")
    (run / "latest").write_text(latest, encoding="utf-8", errors="surrogatepass")
    (run / "network.yml").write_text({"tiny": TINY.read_text(), "": "", "garbage": "{[: x"}[network])
    for name in links:
        target = run / name
        target.unlink(missing_ok=True)
        target.symlink_to(secret)
    out = base / "report.html"
    with opened() as paths:
        code = main(["report", str(run), "-o", str(out)])
    assert code == 0
    page = out.read_text(encoding="utf-8")
    assert SECRET not in page
    assert not outside(paths, elsewhere), paths


def test_a_job_files_pipeline_text_that_does_not_parse_is_shown_as_written() -> None:
    """The caption builds the launch's pipeline as a value; text that is no pipeline is described, not run."""
    from vgraph.report.page import _job_pipeline

    assert _job_pipeline({"pipeline_before": " dead-nodes, precision", "pipeline_after": "fuse-heads"}) == \
        "dead-nodes,precision,partition,fuse-heads"
    assert _job_pipeline({"pipeline_before": "a,,b{", "pipeline_after": ""}) == "a,,b{,partition"
    assert _job_pipeline({}) == "partition"
