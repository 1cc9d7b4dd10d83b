"""Pass manager: pipeline text, ordering, verification, change detection, instruments, rewriter."""
from __future__ import annotations

from collections import Counter

import pytest

from conftest import TINY
from vgraph import load
from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import VNode
from vgraph.transform.pass_api import Option, Pass, PassContext, PassError, register_pass
from vgraph.transform.pipeline import PassManager, build_pipeline, order_pipeline, parse_pipeline, run_pipeline
from vgraph.transform.rewrite import Each, P, match


pytestmark = pytest.mark.usefixtures("local_passes")  # passes a test registers are forgotten after it


def test_parse_pipeline_text():
    assert parse_pipeline("fuse-heads, fuse-lm-head-ce,precision{target=cuda-sm80}") == [
        ("fuse-heads", {}), ("fuse-lm-head-ce", {}), ("precision", {"target": "cuda-sm80"})]
    assert parse_pipeline("a{x=1,y=two}") == [("a", {"x": "1", "y": "two"})]
    with pytest.raises(PassError, match="cannot parse at column"):
        parse_pipeline("fuse-heads,,{x=1}")
    with pytest.raises(PassError, match="is not key=value"):
        parse_pipeline("precision{target}")


def test_unknown_pass_and_option_are_clear_errors():
    with pytest.raises(PassError, match="unknown pass 'fuse-head'.*did you mean 'fuse-heads'"):
        build_pipeline("fuse-head")
    with pytest.raises(PassError, match="has no option colour"):
        build_pipeline("precision{colour=red}")


def make_pass(name, requires=(), after=(), fn=None, options=None):
    cls = type(name.title().replace("-", ""), (Pass,), {
        "name": name, "requires": requires, "after": after, "options": options or {},
        "__doc__": f"Test pass {name}.", "run": lambda self, g, ctx: fn(g, ctx) if fn else None})
    return register_pass(cls)


def test_dependency_order_is_stable_and_cycles_are_errors():
    make_pass("a-pass")
    make_pass("b-pass", after=("a-pass",))
    make_pass("c-pass")
    order = order_pipeline(build_pipeline("b-pass,c-pass,a-pass"))
    assert [p.name for p in order] == ["c-pass", "a-pass", "b-pass"]
    make_pass("x-pass", after=("y-pass",))
    make_pass("y-pass", after=("x-pass",))
    with pytest.raises(PassError, match="cycle among: x-pass -> y-pass"):
        order_pipeline(build_pipeline("x-pass,y-pass"))


def test_missing_required_pass_is_an_error(tiny):
    make_pass("needs-precision", requires=("precision",))
    with pytest.raises(PassError, match="requires 'precision', which is not in the pipeline"):
        run_pipeline(tiny, "needs-precision")
    run_pipeline(tiny, "needs-precision,precision")  # reordered: precision first
    run_pipeline(tiny, "needs-precision")  # precision already applied to this graph


def test_a_pass_that_breaks_the_graph_is_named(tiny):
    def break_it(g, ctx):
        g.node("block0_ffn_up").set_config(in_dim=7)
    make_pass("breaker", fn=break_it)
    with pytest.raises(VGraphError) as info:
        run_pipeline(tiny, "breaker")
    text = str(info.value)
    assert "pass 'breaker' broke the graph" in text
    assert "node 'block0_ffn_up'" in text and "in_dim=7" in text


def test_changed_is_decided_by_comparing_not_by_trusting(tiny):
    make_pass("liar", fn=lambda g, ctx: Counter(rewrote=99))
    make_pass("quiet", fn=lambda g, ctx: g.node("block0_ln1").meta.__setitem__("touched", True))
    pm = run_pipeline(tiny, "liar,quiet")
    liar, quiet = pm.records
    assert liar.changes == {"rewrote": 99} and not liar.changed
    assert quiet.changes == {} and quiet.changed


def test_options_are_typed():
    make_pass("opt-pass", options={"n": Option(int, 3, "a count"), "flag": Option(bool, False)})
    (p,) = build_pipeline("opt-pass{n=5,flag=true}")
    assert p.opts == {"n": 5, "flag": True}
    assert p.spec() == "opt-pass{n=5,flag=True}"
    with pytest.raises(PassError, match="n='x' is not a valid int"):
        build_pipeline("opt-pass{n=x}")


def test_dump_dir_and_report(tiny, tmp_path):
    pm = run_pipeline(tiny, "dead-nodes,fuse-heads", dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.yml"))
    assert names == ["00_input.yml", "01_dead-nodes.yml", "02_fuse-heads.yml"]
    assert load(tmp_path / "02_fuse-heads.yml").nodes_of_type("attention")
    report = pm.report()
    assert "fuse-heads" in report and "39 -> 33" in report and "heads_fused=4" in report


def test_verification_can_be_turned_off(tiny):
    make_pass("breaker2", fn=lambda g, ctx: g.node("block0_ffn_up").set_config(in_dim=7))
    PassManager("breaker2", verify=False).run(tiny)  # no error: the user asked for it


def test_pattern_failures_are_data_with_reasons(tiny):
    pat = P("stack", "stack", Each(P("attention_head", "heads", P("layernorm", "ln"))))
    result = match(tiny, pat, tiny.node("block0_stack"))
    assert not result
    assert "is a broadcast, not layernorm" in str(result)
    ok = match(tiny, P("stack", None, Each(P("attention_head", "heads", P("broadcast", "b")))),
               tiny.node("block0_stack"))
    assert ok and [h.id for h in ok["heads"]] == ["block0_head0", "block0_head1"]
    assert ok["b"].id == "block0_heads"


def test_same_name_must_bind_the_same_node(tiny):
    pat = P("add", "add", P(None, "x"), P(None, "x"))
    result = match(tiny, pat, tiny.node("block0_attn_residual"))
    assert not result and "would be both" in str(result)


def test_explain_reports_rejected_candidates(tiny):
    tiny.node("block1_head1").set_config(rope_theta=500.0)
    ctx = PassContext(explain=True)
    PassManager("fuse-heads", ctx=ctx).run(tiny)
    assert any("block1_stack" in x and "rope_theta" in x for x in ctx.explanations)
    assert len(tiny.nodes_of_type("attention")) == 1


def test_fused_nodes_keep_the_source_line(tiny):
    run_pipeline(tiny, "fuse-heads")
    attn = tiny.node("block0_attention")
    assert attn.loc is not None and attn.loc.file == str(TINY)
    assert isinstance(attn, VNode)
