"""Shared fixtures: the production networks and the tiny test networks."""
from __future__ import annotations

import os
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
