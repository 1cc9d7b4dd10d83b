"""`vgraph passes [--json]` and pipeline ordering: options with types, defaults and allowed values;
`after`/`before`; a pipeline never reorders what the user wrote without saying so."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, TINY, vgraph_in_process
from vgraph.cli.pass_listing import listing
from vgraph.transform.pass_api import Pass, PassError, register_pass
from vgraph.transform.pipeline import build_pipeline, order_pipeline, run_pipeline

PLUGIN = '''
from vgraph.transform.pass_api import Option, Pass, register_pass

@register_pass
class Tidy(Pass):
    """Tidy up before fusion."""
    name = "tidy"
    after = ("dead-nodes",)
    before = ("fuse-heads",)
    options = {"mode": Option(str, "fast", "how hard to try", choices=("fast", "thorough")),
               "rounds": Option(int, 2, "repetitions", min=1, max=10)}
    def run(self, graph, ctx):
        return None
'''


pytestmark = pytest.mark.usefixtures("local_passes")  # passes a test registers are forgotten after it


def vgraph(*args, cwd=ROOT):
    return vgraph_in_process(*args, cwd=cwd)


@pytest.fixture()
def plugin(tmp_path):
    path = tmp_path / "tidy.py"
    path.write_text(PLUGIN)
    return path


def test_passes_shows_option_types_defaults_allowed_values_and_order(plugin):
    done = vgraph("passes", "--plugin", str(plugin))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    block = text[text.index("tidy  ["):].split("\n")
    assert block[1] == "    Tidy up before fusion."
    assert "    changes what the network computes" in block[2]
    assert block[3] == "    order: runs after dead-nodes; runs before fuse-heads (when in the same pipeline)"
    assert "    option mode (str, default 'fast', one of fast, thorough): how hard to try" in block
    assert "    option rounds (int, default 2, 1 to 10): repetitions" in block
    assert "fuse-heads  [" in text and "keeps what the network computes" in text
    assert "precision  [" in text and "option target (str, default None)" in text


def test_passes_json(plugin):
    done = vgraph("passes", "--json", "--plugin", str(plugin))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    tidy = next(p for p in doc["passes"] if p["name"] == "tidy")
    assert tidy["after"] == ["dead-nodes"] and tidy["before"] == ["fuse-heads"]
    assert tidy["preserves_semantics"] is False and tidy["origin"] == str(plugin)
    assert tidy["options"] == [
        {"name": "mode", "type": "str", "default": "fast", "doc": "how hard to try", "choices": ["fast", "thorough"]},
        {"name": "rounds", "type": "int", "default": 2, "doc": "repetitions", "min": 1, "max": 10}]
    fuse = next(p for p in doc["passes"] if p["name"] == "fuse-heads")
    assert fuse["preserves_semantics"] is True and fuse["after"] == ["partition", "precision"]
    assert doc["default_pipeline"].startswith("dead-nodes,")


def test_listing_in_process_matches_the_registry():
    names = [p["name"] for p in listing()["passes"]]
    assert names == sorted(names) and {"dead-nodes", "fuse-heads", "precision"} <= set(names)


def make(name, after=(), before=()):
    return register_pass(type(name.title().replace("-", ""), (Pass,), {
        "name": name, "after": after, "before": before, "__doc__": f"Test pass {name}.",
        "run": lambda self, g, ctx: None}))


def test_before_orders_like_after_and_conflicts_are_cycles():
    make("early", before=("late",))
    make("late")
    assert [p.name for p in order_pipeline(build_pipeline("late,early"))] == ["early", "late"]
    make("stubborn", after=("late",), before=("late",))
    with pytest.raises(PassError, match="cycle among"):
        order_pipeline(build_pipeline("late,stubborn"))


def test_a_reordered_pipeline_says_so(tiny):
    make("mine", after=("dead-nodes",))
    pm = run_pipeline(tiny, "mine,dead-nodes")
    assert [r.name for r in pm.records] == ["dead-nodes", "mine"]
    assert ("pipeline order: 'dead-nodes' runs before 'mine', although written after it: 'mine' declares "
            "after='dead-nodes'") in pm.ctx.notes
    make("first", before=("mine",))
    pm = run_pipeline(tiny.copy(), "mine,first")
    assert any("'first' declares before='mine'" in n for n in pm.ctx.notes)
    pm = run_pipeline(tiny.copy(), "dead-nodes,mine")  # as written: nothing to say
    assert not any(n.startswith("pipeline order") for n in pm.ctx.notes)


def test_optimize_prints_the_reordering(plugin, tmp_path):
    done = vgraph("optimize", str(TINY), "--plugin", str(plugin), "--passes", "fuse-heads,tidy",
                  "-o", str(tmp_path / "o.yml"))
    assert done.returncode == 0, done.stderr
    assert ("note: pipeline order: 'tidy' runs before 'fuse-heads', although written after it: 'tidy' "
            "declares before='fuse-heads'") in done.stdout


@pytest.mark.parametrize("spec,message", [
    ("tidy{mode=slow}", "option mode='slow' must be one of fast, thorough"),
    ("tidy{rounds=0}", "option rounds='0' must be 1 to 10"),
    ("tidy{rounds=99999999999999999999}", "must be 1 to 10"),
    ("tidy{rounds=two}", "option rounds='two' is not a valid int"),
    ("tidy{rounds=}", "is empty"),
    ("tidy{colour=red}", "has no option colour"),
])
def test_bad_option_values_on_the_command_line(plugin, tmp_path, spec, message):
    out = tmp_path / "o.yml"
    done = vgraph("optimize", str(TINY), "--plugin", str(plugin), "--passes", spec, "-o", str(out))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
