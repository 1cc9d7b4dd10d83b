"""Shared fixtures: the production networks and the tiny test networks."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

# Debug mode for every pipeline the suite runs, in this process and in the subprocesses it starts: the pass
# manager lints the graph's use-def storage after every pass (vgraph.transform.pipeline.LintInstrument).
os.environ.setdefault("VGRAPH_DEBUG", "1")

ROOT = Path(__file__).resolve().parent.parent
NETWORKS = ROOT / "networks"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NET6 = NETWORKS / "distributed_attention_example_6_swiglu_head.yml"
NET8 = NETWORKS / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml"
PRODUCTION = [NET6, NET8]
# The next network (issue 14): 12 blocks of 12 heads, dim 768, 2K context.
NET12 = NETWORKS / "distributed_attention_example_12_swiglu_head_vocab32768_seq2048.yml"
TINY = FIXTURES / "tiny_2l.yml"
TINY_FP32 = FIXTURES / "tiny_1l_fp32.yml"


def vgraph_in_process(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`vgraph ARGS...` run by its main() in this process, answered as subprocess.run(capture_output=True) would.

    A fresh `python -m vgraph` costs 2.5-3 CPU-s here (the plugin entry points import torch); a test that needs
    the command's behaviour, not a separate process, runs it here.  Use it with the `local_passes` fixture
    when --plugin registers passes (plugin files are forgotten after each test by the autouse fixture below)."""
    from vgraph.cli.main import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as stop:  # argparse's own exits (--help, a usage error)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["vgraph", *argv], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def net6():
    from vgraph import load

    return load(NET6)


@pytest.fixture(scope="session")
def net8():
    from vgraph import load

    return load(NET8)


@pytest.fixture()
def tiny():
    from vgraph import load

    return load(TINY)


@pytest.fixture()
def local_passes():
    """Passes a test registers with @register_pass are forgotten after it."""
    from vgraph.transform.pass_api import LOCAL_PASSES

    saved = dict(LOCAL_PASSES)
    yield LOCAL_PASSES
    LOCAL_PASSES.clear()
    LOCAL_PASSES.update(saved)


@pytest.fixture(autouse=True)
def _plugin_files_stay_with_their_test():
    """Plugin files a test loads in-process are forgotten after it: `vgraph launch` forwards every plugin file
    its process has loaded to its workers, so one test's --plugin would otherwise reach a later test's launch."""
    from vgraph import plugins

    saved = dict(plugins._FILES)
    yield
    plugins._FILES.clear()
    plugins._FILES.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _corpus_cache(tmp_path_factory):
    """Prepared corpora (the embedded one, text given to --data) are cached in a directory of this test session,
    shared by the xdist workers (the cache's lock makes them build each entry once), never the user's."""
    import os

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    os.environ["VGRAPH_CACHE_DIR"] = str(root / "vgraph-cache")
    yield


# -- the order the suite is dealt in -------------------------------------------------------------------------

DURATIONS = Path(__file__).resolve().parent / "durations.json"  # written by tools/durations.py


def _shares_module_setup(item: pytest.Item) -> bool:
    """Whether the test uses a module- or class-scoped fixture of its own module: such a module is one unit of
    work, or each xdist worker would build the fixture again."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    module = item.nodeid.split("::")[0]
    return any(d.scope in ("module", "class") and d.baseid.startswith(module) for ds in defs.values() for d in ds)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deal the longest units of work first (LPT), so the suite does not end on one worker running a
    minute-long test while the other idles.  A unit is a test, or a whole module sharing a module-scoped fixture
    (sent to one worker as an xdist group); its seconds come from tests/durations.json (tools/durations.py).
    tools/test.sh runs `--dist loadgroup --no-loadscope-reorder`, which sends the units in this order, one at a
    time as workers free up."""
    try:
        recorded = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = {}
    seconds = {k: float(v) for k, v in (recorded.items() if isinstance(recorded, dict) else ())
               if isinstance(v, (int, float)) and v >= 0}  # a damaged file orders nothing, it breaks nothing
    unit_of = {}
    for item in items:
        unit_of[item] = item.nodeid.split("::")[0] if _shares_module_setup(item) else item.nodeid
        if unit_of[item] != item.nodeid:
            item.add_marker(pytest.mark.xdist_group(unit_of[item]))
    weight: dict[str, float] = {}
    for item in items:
        weight[unit_of[item]] = weight.get(unit_of[item], 0.0) + seconds.get(item.nodeid, 0.0)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(unit_of[item], i)
    items.sort(key=lambda it: (-weight[unit_of[it]], first[unit_of[it]]))  # stable: a unit keeps its own order
