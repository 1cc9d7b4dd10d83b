"""Rules that see their pass: options reach predicates and rewrite functions; a rule's bugs are clear errors."""
from __future__ import annotations

import pytest

from conftest import ROOT, TINY, vgraph_in_process
from vgraph.base.diagnostics import VGraphError
from vgraph.transform.pass_api import Option, PassContext, PassError, register_pass
from vgraph.transform.pipeline import build_pipeline, run_pipeline
from vgraph.transform.replace import NewNode
from vgraph.transform.rewrite import P, RewritePass, Rule, RuleContext, RuleError, RuleSet, match, reads, replace


pytestmark = pytest.mark.usefixtures("local_passes")  # passes a test registers are forgotten after it


def slight(node, ctx):
    return node.cfg["rate"] <= ctx.opts["max_rate"] or f"rate {node.cfg['rate']} is above max_rate"


def drop(graph, m, ctx):
    d = m["d"]
    ctx.notes.append(f"{ctx.opts['label']}: {d.id}")
    return replace(graph, [d], [], {d.id: reads(d, 0)}, counts={"dropped": 1})


def dropout_pass(rules):
    """A plugin pass built from rules: options and rules, no run()."""
    return register_pass(type("DropSlightDropout", (RewritePass,), {
        "__doc__": "Remove dropout whose rate is at most max_rate.",
        "name": "drop-slight-dropout",
        "options": {"max_rate": Option(float, 0.05, "largest rate removed", min=0.0, max=1.0),
                    "label": Option(str, "dropped", "note prefix")},
        "rules": rules}))


def test_options_reach_predicates_and_rewrite_functions(tiny):
    dropout_pass([Rule("drop", P("dropout", "d", where=slight), drop)])  # a plain list is a rule set
    pm = run_pipeline(tiny, "drop-slight-dropout", explain=True)
    assert not pm.records[0].changed and tiny.nodes_of_type("dropout")
    assert "drop: 'block0_attn_dropout' not rewritten: rate 0.1 is above max_rate" in pm.ctx.explanations
    pm = run_pipeline(tiny, "drop-slight-dropout{max_rate=0.2,label=gone}")
    assert pm.records[0].changes == {"dropped": 4} and not tiny.nodes_of_type("dropout")
    assert "gone: block0_attn_dropout" in pm.ctx.notes


def test_a_one_argument_predicate_still_works_and_a_bare_context_has_no_options(tiny):
    ctx = RuleContext(PassContext(target="cpu"))
    assert ctx.opts == {} and ctx.target == "cpu"
    found = match(tiny, P("dropout", "d", where=lambda n: n.cfg["rate"] > 0), tiny.node("block0_attn_dropout"), ctx)
    assert found and found["d"].id == "block0_attn_dropout"


def test_a_rule_set_applies_without_a_pass(tiny):
    rules = RuleSet([Rule("drop", P("dropout", "d"), lambda g, m, ctx: replace(g, [m["d"]], [], {m["d"].id: reads(m["d"])}))])
    assert rules.apply(tiny, PassContext()) == {"removed": 4, "created": 0}


def boom(*_):
    raise ZeroDivisionError("division by zero")


@pytest.mark.parametrize("rule,message", [
    (Rule("bad-fn", P("dropout", "d"), boom), "rule 'bad-fn' failed: ZeroDivisionError: division by zero"),
    (Rule("bad-where", P("dropout", "d", where=boom), drop),
     "rule 'bad-where' failed: ZeroDivisionError: division by zero"),
    (Rule("bad-wiring", P("dropout", "d"),
          lambda g, m, ctx: replace(g, [m["d"]], [x := NewNode("relu", "r", {}, [("block0_attn_dropout", 0)])],
                                    {m["d"].id: x[0]})),
     "rule 'bad-wiring': wrong replacement: .* is an output the replacement removes"),
])
def test_a_failing_rule_names_pass_rule_and_node(tiny, rule, message):
    dropout_pass([rule])
    with pytest.raises(VGraphError, match=message) as info:  # a plugin's pass: vgraph names it as well
        run_pipeline(tiny, "drop-slight-dropout")
    (diag,) = [d for d in info.value.diagnostics if d.node is not None]
    assert diag.node == "block0_attn_dropout" and diag.loc is not None and diag.loc.file == str(TINY)
    assert str(diag).startswith(f"{TINY}:") and "pass 'drop-slight-dropout'" in str(diag)
    with pytest.raises(RuleError, match=message):  # the rule set alone
        RuleSet([rule]).apply(tiny, PassContext())


def test_a_rule_raising_a_vgraph_error_keeps_its_message(tiny):
    def refuse(g, m, ctx):
        raise PassError("pass 'drop-slight-dropout': this network needs max_rate below 0.01")
    dropout_pass([Rule("strict", P("dropout", "d"), refuse)])
    with pytest.raises(VGraphError, match="needs max_rate below 0.01") as info:
        run_pipeline(tiny, "drop-slight-dropout")
    assert "failed" not in str(info.value)  # not reported as a bug in the rule


@pytest.mark.parametrize("value,message", [
    ("x", "is not a valid float"), ("nan", "must be a finite number"), ("-inf", "must be a finite number"),
    ("1e999", "must be a finite number"), ("", "is empty"), ("2", "must be 0.0 to 1.0"),
    ("-0.5", "must be 0.0 to 1.0"), ("0.1\x1b[31m", "contains control characters"),
    ("9" * 5000, "must be a finite number"),
])
def test_bad_option_text_is_refused(value, message):
    dropout_pass([])
    with pytest.raises(PassError, match=message) as info:
        build_pipeline(f"drop-slight-dropout{{max_rate={value}}}")
    assert "option max_rate=" in str(info.value) and "\x1b" not in str(info.value)


@pytest.mark.parametrize("opts,message", [
    ({"max_rate": True}, "is not a valid float"), ({"max_rate": float("nan")}, "must be a finite number"),
    ({"label": 3}, "is not a valid str"), ({"max_rate": [0.1]}, "is not a valid float"),
])
def test_bad_option_values_from_code_are_refused(opts, message):
    cls = dropout_pass([])
    with pytest.raises(PassError, match=message):
        cls(**opts)
    assert cls(max_rate=1).opts["max_rate"] == 1.0


def test_choices_are_checked():
    opt = Option(str, "none", choices=("none", "tanh"))
    assert opt.check("p", "approximate", "tanh") == "tanh" and opt.allowed() == "one of none, tanh"
    with pytest.raises(PassError, match="must be one of none, tanh"):
        opt.check("p", "approximate", "erf")


PLUGIN = '''
from vgraph.transform.pass_api import Option, register_pass
from vgraph.transform.rewrite import P, RewritePass, Rule

def broken(graph, m, ctx):
    return {}[ctx.opts["key"]]

@register_pass
class Broken(RewritePass):
    """A rule with a bug."""
    name = "broken-rule"
    options = {"key": Option(str, "k", "looked up"), "rate": Option(float, 0.5, "a rate", min=0.0)}
    rules = [Rule("broken", P("dropout", "d"), broken)]
'''


@pytest.mark.parametrize("spec,message", [
    ("broken-rule", "rule 'broken' failed: KeyError: 'k'"),
    ("broken-rule{rate=nan}", "option rate='nan' must be a finite number"),
    ("broken-rule{rate=-1}", "option rate='-1' must be >= 0.0"),
])
def test_cli_reports_rule_and_option_errors_without_a_traceback(tmp_path, spec, message, local_passes):
    plugin = tmp_path / "broken.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "out.yml"
    done = vgraph_in_process("optimize", TINY, "--plugin", plugin, "--passes", spec, "-o", out, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
