"""The inference export (issue 23): logits only, dynamic batch and sequence, a KV-cache decoder, and
`vgraph generate --backend onnx`.

Every number is compared with the torch backend on the same weights, with check-onnx's own comparison
(`compare_outputs`, float32 tolerance).  The network is the tiny fixture with a context of 32 (so 17 is
a length between 1 and the context); the 6-layer production network's 32-token generate check is in
TESTING.md.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import vgraph
from vgraph import VGraphError
from vgraph.backends.onnx import Decoder, lower_inference
from vgraph.backends.onnx.check import (_compile, _run_module, compare_outputs, fp32_graph, random_weights,
                                        session)
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.cli import main
from vgraph.ir.builder import NetBuilder
from vgraph.transform.pipeline import run_pipeline

from conftest import TINY

FUSE = "fuse-heads,fuse-lm-head-ce"
CONTEXT = 32


def tiny32(passes: str | None = None, position_encoding: str | None = None) -> vgraph.Graph:
    """tiny_2l with a context of 32 (and optionally learned positions instead of RoPE)."""
    text = TINY.read_text().replace('seq_len: "16"', f'seq_len: "{CONTEXT}"')
    if position_encoding == "learned":
        text = text.replace('position_encoding: "none"', 'position_encoding: "learned"', 1)
        text = text.replace('position_encoding: "rope"', 'position_encoding: "none"')
    graph = vgraph.loads(text, file="tiny32.yml")
    if passes:
        run_pipeline(graph, passes)
    return fp32_graph(graph)


def torch_logits(graph, weights, ids: np.ndarray) -> np.ndarray:
    module = _compile(graph, 0, weights)
    return _run_module(module, {"embedder:in0": ids}, ["logits"])["logits"]


@pytest.mark.parametrize("passes,pe", [(None, None), (FUSE, None), (None, "learned")],
                         ids=["heads", "fused", "learned-positions"])
def test_logits_at_batch_1_and_3_and_sequence_1_17_and_the_context(passes, pe) -> None:
    graph = tiny32(passes, pe)
    weights = random_weights(graph, 3)
    model = lower_inference(graph, weights)
    onnx.checker.check_model(model, full_check=True)
    (tokens,) = [vi.name for vi in model.graph.input]  # no targets: the loss is not exported
    (logits,) = [vi.name for vi in model.graph.output]
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]
    sess = session(model)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        for length in (1, 17, CONTEXT):
            ids = rng.integers(0, 96, (batch, length))
            (got,) = sess.run([logits], {tokens: ids})
            want = torch_logits(graph, weights, ids)
            verdict = compare_outputs("logits", logits, got, want, case=f"batch {batch}, sequence {length}")
            assert verdict.ok and got.shape == (batch, length, 96), verdict


def _decode(model: onnx.ModelProto, ids: np.ndarray, steps: list[int]) -> np.ndarray:
    """Run a KV-cache decoder over `ids` in calls of `steps` positions each; the logits concatenated."""
    logits = model.graph.output[0].name
    sess = session(model)
    caches = json.loads({p.key: p.value for p in model.metadata_props}["vgraph.kv_cache"])
    state = {}
    for c in caches:
        shape = [ids.shape[0], *(0 if d == "past_sequence" else d for d in c["shape"])]
        state[c["past_key"]] = state[c["past_value"]] = np.zeros(shape, np.float32)
    out, start = [], 0
    presents = [c[k] for c in caches for k in ("present_key", "present_value")]
    for n in steps:
        results = sess.run([logits, *presents], {"embedder:in0": ids[:, start:start + n], **state})
        out.append(results[0])
        state = {c[k]: r for c, pair in zip(caches, zip(results[1::2], results[2::2]))
                 for k, r in zip(("past_key", "past_value"), pair)}
        start += n
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("passes,pe", [(None, None), (FUSE, None), (None, "learned")],
                         ids=["heads", "fused", "learned-positions"])
def test_kv_cache_decoder_equals_the_whole_context(passes, pe) -> None:
    """Prefill 5, then 1 at a time, then 10 at once, then the rest: every call's positions continue from the
    past length (RoPE angles, causal mask, learned positions), so the logits are the whole context's."""
    graph = tiny32(passes, pe)
    weights = random_weights(graph, 4)
    model = lower_inference(graph, weights, kv_cache=True)
    onnx.checker.check_model(model, full_check=True)
    caches = json.loads({p.key: p.value for p in model.metadata_props}["vgraph.kv_cache"])
    cached = {"attention_head"} if passes is None else {"attention"}
    assert {graph.node(c["node"]).type for c in caches} == cached
    assert len(caches) == len([n for n in graph.nodes if n.type in cached])
    ids = np.random.default_rng(1).integers(0, 96, (2, CONTEXT))
    got = _decode(model, ids, [5, 1, 1, 1, 10, CONTEXT - 18])
    verdict = compare_outputs("logits", "decoder", got, torch_logits(graph, weights, ids))
    assert verdict.ok, verdict


def test_a_runtime_that_reads_only_the_cache_metadata_decodes_the_whole_context() -> None:
    """An external runtime knows a cache only by the model's `vgraph.kv_cache` entry: it allocates the empty
    past from `shape` (per sample) with a 0 at `axis` of the batched tensor, and keeps only the positions a call
    added, cut from its present along `axis` and appended to its own past.  Batch 2, so an axis one off (the
    per-sample index: the batch or the heads axis) cuts the wrong positions.  Its logits are the whole
    context's."""
    graph = tiny32()
    weights = random_weights(graph, 5)
    model = lower_inference(graph, weights, kv_cache=True)
    caches = json.loads({p.key: p.value for p in model.metadata_props}["vgraph.kv_cache"])
    assert caches  # the premise: there are caches to grow
    sess = session(model)
    ids = np.random.default_rng(2).integers(0, 96, (2, CONTEXT))
    past = {}
    for c in caches:
        shape = [2, *c["shape"]]
        shape[c["axis"]] = 0
        past[c["past_key"]] = past[c["past_value"]] = np.zeros([int(d) for d in shape], np.float32)
    out, start = [], 0
    for n in (3, 1, 12, CONTEXT - 16):
        names = [model.graph.output[0].name] + [c[k] for c in caches for k in ("present_key", "present_value")]
        results = sess.run(names, {"embedder:in0": ids[:, start:start + n], **past})
        out.append(results[0])
        for i, c in enumerate(caches):
            for j, which in enumerate(("key", "value")):
                present, mine = results[1 + 2 * i + j], past[c[f"past_{which}"]]
                added = np.take(present, range(start, start + n), axis=c["axis"])
                past[c[f"past_{which}"]] = np.concatenate([mine, added], axis=c["axis"])
        start += n
    verdict = compare_outputs("logits", "runtime", np.concatenate(out, axis=1), torch_logits(graph, weights, ids))
    assert verdict.ok, verdict


def test_decoder_feeds_only_what_its_cache_lacks_and_starts_over_past_the_context() -> None:
    graph = tiny32()
    weights = random_weights(graph, 5)
    dec = Decoder.for_network(graph, weights, kv_cache=True, logits_output="logits")
    full = Decoder.for_network(graph, weights, kv_cache=False, logits_output="logits")
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 96, CONTEXT + 3)]
    for t in range(4, CONTEXT + 4):
        context = ids[max(0, t - CONTEXT):t]
        assert compare_outputs("last", "", dec.last_logits(context), full.last_logits(context)).ok
    # 4 positions at first, 1 per token up to the context, then the whole (slid) context each time
    assert dec.positions_run == 4 + (CONTEXT - 4) + 3 * CONTEXT
    with pytest.raises(VGraphError, match="1 to 32 tokens"):
        dec.last_logits([])
    with pytest.raises(VGraphError, match="1 to 32 tokens"):
        dec.last_logits(ids[: CONTEXT + 1])


def _refused(graph, match: str, **kw) -> None:
    with pytest.raises(VGraphError, match=match):
        lower_inference(graph, random_weights(graph), **kw)


def test_a_kv_cache_is_refused_where_new_positions_alone_are_not_enough() -> None:
    text = TINY.read_text()
    graph = vgraph.loads(text.replace('causal: "true"', 'causal: "false"', 1), file="t.yml")
    _refused(graph, r"'block0_head0'.*without a causal mask", kv_cache=True)
    lower_inference(graph, random_weights(graph))  # the logits-only model serves it
    b = NetBuilder("masked")
    b.node("m", "mask", causal=True)
    b.graph.node("m").input_shapes = ((8, 8),)
    b.output("y", "m")
    _refused(b.build(), r"'m'.*neither positionwise=True", kv_cache=True)
    _refused(vgraph.load(TINY), "returns logits only", kv_cache=True, with_loss=True)


def test_a_model_without_a_sequence_axis_is_refused_naming_the_node() -> None:
    b = NetBuilder("merge")
    b.node("r", "reshape", target_shape=[128])
    b.graph.node("r").input_shapes = ((8, 16),)
    b.output("y", "r")
    _refused(b.build(), r"'r'.*changes the sequence axis")
    b = NetBuilder("vector")
    b.node("l", "linear", in_dim=16, out_dim=16)
    b.graph.node("l").input_shapes = ((16,),)
    b.output("y", "l")
    _refused(b.build(), r"'l'.*per-sample shape \[16\].*\[sequence, features\]")
    b = NetBuilder("nothing")
    b.node("l", "linear", in_dim=16, out_dim=16)
    b.graph.node("l").input_shapes = ((8, 16),)
    _refused(b.build(), "declares no outputs")


# ---------------------------------------------------------------------------
# vgraph generate --backend onnx
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    corpus = d / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=40_000)), encoding="utf-8")
    assert main(["train", str(TINY), "--data", str(corpus), "--steps", "40", "--batch", "4", "--val-every", "0",
                 "--out", str(d / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0
    return d / "run"


def test_generate_onnx_gives_the_torch_greedy_tokens_with_and_without_the_cache(trained) -> None:
    """32 tokens from a 16-token context: the window slides, so the cache is used and then restarted."""
    from vgraph.backends.torch.cli import generate_ids

    runs = {}
    for backend, cache in (("torch", None), ("onnx", True), ("onnx", False)):
        ids, n, _ = generate_ids(str(trained), "def ", max_new_tokens=32, temperature=0.0, backend=backend,
                                 kv_cache=cache)
        runs[(backend, cache)] = ids
    assert len(runs[("torch", None)]) > n + 16  # no end-of-text before the window slid
    assert runs[("onnx", True)] == runs[("torch", None)] == runs[("onnx", False)]
    sampled = [generate_ids(str(trained), "", max_new_tokens=12, temperature=0.8, top_k=5, seed=3,
                            backend=b)[0] for b in ("torch", "onnx")]
    assert sampled[0] == sampled[1]  # equal logits, the same draw on the same generator


def test_generate_onnx_without_the_decoder_entry_point_says_so(trained, monkeypatch, capsys) -> None:
    """The torch backend reaches the ONNX Decoder only through the `vgraph.decoders` entry point."""
    import vgraph.plugins

    real = vgraph.plugins.find_plugin
    monkeypatch.setattr(vgraph.plugins, "find_plugin",
                        lambda group, name: None if group == "vgraph.decoders" else real(group, name))
    assert main(["generate", str(trained), "--backend", "onnx", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "entry point 'onnx' in 'vgraph.decoders'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--backend", "onnx", "--device", "cpu"], "--device applies to --backend torch"),
])
def test_generate_refuses_options_of_the_other_backend(trained, argv, message, capsys) -> None:
    assert main(["generate", str(trained), "--max-new-tokens", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_export_onnx_kv_cache_writes_a_decoder_and_refuses_with_loss(tmp_path, capsys) -> None:
    out = tmp_path / "decoder.onnx"
    assert main(["export-onnx", str(TINY), "--kv-cache", "--random-weights", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "past keys and values of 4 attention VNodes" in printed and "sequence 1 to 16" in printed
    model = onnx.load(str(out))
    names = [vi.name for vi in model.graph.input]
    assert "past_key:block0_head0" in names and "loss:in1" not in names
    assert main(["export-onnx", str(TINY), "--kv-cache", "--with-loss", "--random-weights", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "exclude each other" in capsys.readouterr().err and not (tmp_path / "x.onnx").exists()


def test_learned_positions_run_in_torch_at_a_shorter_sequence() -> None:
    """The torch backend adds the positions a shorter call covers (what the ONNX window does)."""
    graph = tiny32(position_encoding="learned")
    weights = random_weights(graph, 6)
    ids = np.random.default_rng(3).integers(0, 96, (1, CONTEXT))
    whole = torch_logits(graph, weights, ids)
    part = torch_logits(graph, weights, ids[:, :9])
    np.testing.assert_allclose(part, whole[:, :9], rtol=1e-5, atol=1e-6)


def test_generate_onnx_on_a_network_without_a_cache_says_how_to_sample(tmp_path, capsys) -> None:
    """Attention without a causal mask has no KV cache: the default refuses naming the node and the way out."""
    from conftest import TINY_FP32

    net = tmp_path / "bidirectional.yml"
    net.write_text(TINY_FP32.read_text().replace('causal: "true"', 'causal: "false"'))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["train", str(net), "--data", str(corpus), "--steps", "2", "--batch", "2", "--val-every", "0",
                 "--out", str(tmp_path / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--backend", "onnx", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "without a causal mask" in err and "--no-kv-cache" in err and "Traceback" not in err
    assert main(["generate", str(tmp_path / "run"), "--backend", "onnx", "--no-kv-cache",
                 "--max-new-tokens", "2"]) == 0
