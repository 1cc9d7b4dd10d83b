"""`Pipeline`: the pass pipeline as a value that code builds; its text form is only input and what run files hold."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from vgraph.ir.builder import NetBuilder
from vgraph.transform.pass_api import PassError
from vgraph.transform.pipeline import (DEFAULT_PIPELINE, Pipeline, Step, build_pipeline, parse_pipeline,
                                       run_pipeline)

_NAME = st.text(alphabet="aZ09_.-", min_size=1, max_size=10)
_KEY = st.text(alphabet="ak_1 ", min_size=1, max_size=6).map(str.strip).filter(bool)  # no space at the ends
_VALUE = st.text(alphabet="aZ1 =.;:/_-~é", max_size=8).map(str.strip)  # '' too: `k=`
_STEP = st.builds(lambda name, opts: Step(name, tuple(opts.items())), _NAME,
                  st.dictionaries(_KEY, _VALUE, max_size=3))
_PIPELINE = st.builds(lambda steps: Pipeline(tuple(steps)), st.lists(_STEP, max_size=6))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_PIPELINE)
def test_the_text_form_parses_back_to_the_same_value(p: Pipeline) -> None:
    text = str(p)
    assert Pipeline.parse(text) == p
    assert [name for name, _ in parse_pipeline(text)] == p.names  # the manager reads the same passes


def test_text_and_values() -> None:
    p = Pipeline.parse(" fuse-heads, precision{target=cuda-sm80} ,remat{budget=auto,policy=x=y}")
    assert p.names == ["fuse-heads", "precision", "remat"]
    assert p.steps[2].opts == {"budget": "auto", "policy": "x=y"}
    assert str(p) == "fuse-heads,precision{target=cuda-sm80},remat{budget=auto,policy=x=y}"
    assert str(Pipeline()) == "" and Pipeline.parse("") == Pipeline() and not Pipeline()
    assert "precision" in p and "partition" not in p and len(p) == 3
    assert str(DEFAULT_PIPELINE) == "dead-nodes,precision,fuse-heads,fuse-lm-head-ce"
    assert str(Pipeline.of("a") + Pipeline.of("b")) == "a,b"
    with pytest.raises(TypeError):
        Pipeline.of("a") + "b"  # text is read with Pipeline.parse, never glued on
    with pytest.raises(PassError, match="holds Steps, not str"):
        Pipeline(("a", "b"))
    steps = [Step("a")]
    held = Pipeline(steps)
    steps.append(Step("b"))
    assert held == Pipeline.of("a") and hash(held) == hash(Pipeline.of("a"))  # immutable, a dict key too


def test_insert_places_a_pass_and_writes_its_options() -> None:
    p = Pipeline.of("dead-nodes", "precision", "fuse-heads")
    assert str(p.insert("partition", after="precision", batch=8, replicas="auto")) == \
        "dead-nodes,precision,partition{batch=8,replicas=auto},fuse-heads"
    assert str(p.insert("x", after=("dead-nodes", "precision"))) == "dead-nodes,precision,x,fuse-heads"
    assert str(p.insert("x", before="fuse-heads")) == "dead-nodes,precision,x,fuse-heads"
    assert str(p.insert("x", before=("fuse-heads", "precision"))) == "dead-nodes,x,precision,fuse-heads"
    assert str(p.insert("x", after="absent", before="dead-nodes")) == "x,dead-nodes,precision,fuse-heads"
    assert str(p.insert("x", after="absent")) == "dead-nodes,precision,fuse-heads,x"  # the end
    assert str(p.insert("x", flag=True, rate=0.5)) == "dead-nodes,precision,fuse-heads,x{flag=true,rate=0.5}"
    assert str(p) == "dead-nodes,precision,fuse-heads"  # a value: insert made a new one


def test_with_options_without_and_split() -> None:
    p = Pipeline.parse("a,partition{fleet=x.yml,batch=2},b")
    q = p.with_options("partition", batch=8, micro_batches=4)
    assert str(q) == "a,partition{fleet=x.yml,batch=8,micro_batches=4},b"
    before, step, after = q.split("partition")
    assert (str(before), str(step), str(after)) == ("a", "partition{fleet=x.yml,batch=8,micro_batches=4}", "b")
    assert str(p.without("partition")) == "a,b"
    with pytest.raises(PassError, match="no pass 'c'"):
        p.with_options("c", x=1)
    with pytest.raises(PassError, match="no pass 'c'"):
        p.split("c")


@pytest.mark.parametrize("name, options, why", [
    ("", (), "letters, digits"),
    ("a/b", (), "letters, digits"),
    ("..", (("k", "v"),), None),  # dots are pass-name characters: the value is fine, nothing raises
    ("a", (("k", "v,w"),), "could not carry it"),
    ("a", (("k", "v}"),), "could not carry it"),
    ("a", (("k", " v"),), "could not carry it"),
    ("a", (("k", "v\n"),), "could not carry it"),
    ("a", (("", "v"),), "option name"),
    ("a", (("k=j", "v"),), "option name"),
    ("a", (("k", "1"), ("k", "2")), "given twice"),
    ("a", (("k", 1),), "could not carry it"),
    (3, (), "letters, digits"),
])
def test_a_step_the_text_could_not_carry_is_refused(name, options, why) -> None:
    if why is None:
        assert Pipeline((Step(name, options),)) == Pipeline.parse(str(Pipeline((Step(name, options),))))
        return
    with pytest.raises(PassError, match=why):
        Step(name, options)


def test_parse_refuses_bad_text_as_before() -> None:
    for text in ("a,,b", "a{k}", "a{k=1,k=2}", "a{", "a\x00"):
        with pytest.raises(PassError):
            Pipeline.parse(text)


def _tiny():
    b = NetBuilder("t")
    b.node("tok", "tokenizer", pad_length=4, vocab_size=16)
    b.node("emb", "embedder", vocab_size=16, dim=8, seq_len=4)
    b.chain("tok", "emb")
    b.output("y", "emb")
    return b.build()


def test_the_manager_runs_a_value_as_it_runs_its_text() -> None:
    value = Pipeline.of("dead-nodes").insert("precision", target="cpu")
    assert [p.spec() for p in build_pipeline(value)] == [p.spec() for p in build_pipeline(str(value))] == [
        "dead-nodes", "precision{target=cpu}"]
    assert [r.name for r in run_pipeline(_tiny(), value).records] == ["dead-nodes", "precision"]
    passes = build_pipeline("dead-nodes,precision{target=cpu}")
    assert Pipeline.of_passes(passes) == value  # the passes' own options, defaults left out
    with pytest.raises(PassError, match="unknown pass"):
        build_pipeline(Pipeline.of("no-such-pass"))
