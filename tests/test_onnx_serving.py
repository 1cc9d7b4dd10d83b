"""`vgraph export-onnx --serving` (issue 38 item 4): the decoder in the layout Optimum's ORTModelForCausalLM and
onnxruntime-genai read, the files beside it, left-padded batches, the context limit, and docs/serving.md's loop.

Numbers are compared with the torch backend on the same weights (check-onnx's `compare_outputs`, float32
tolerance); tokens with `vgraph generate`'s greedy ones.  onnxruntime-genai is in the `dev` extra, so CI loads
the export with it; Optimum's check (its own environment: optimum-onnx pins transformers<4.58) is in TESTING.md.
"""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

import vgraph
from vgraph import VGraphError
from vgraph.backends.onnx.check import compare_outputs, fp32_graph, random_weights
from vgraph.backends.onnx.serving import ServingDecoder, lower_serving, past_names
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.cli import main

from conftest import FIXTURES, ROOT, TINY
from test_onnx_inference import FUSE, tiny32, torch_logits

DOC = ROOT / "docs" / "serving.md"


def _graph(name: str) -> vgraph.Graph:
    if name in ("gqa", "gqa_fused"):
        return fp32_graph(vgraph.load(FIXTURES / f"tiny_{name}.yml"))
    return {"heads": lambda: tiny32(), "fused": lambda: tiny32(FUSE),
            "learned": lambda: tiny32(None, "learned")}[name]()


def _padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


# ---------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.mark.parametrize("fixture,heads,kv_heads,head_dim", [("tiny_2l", 2, 2, 16), ("tiny_gqa", 4, 2, 8),
                                                             ("tiny_gqa_fused", 4, 2, 8)])
def test_export_writes_optimum_and_genai_names_with_a_blocks_heads_grouped(tmp_path, capsys, fixture, heads,
                                                                           kv_heads, head_dim) -> None:
    out = tmp_path / "served"
    assert main(["export-onnx", str(FIXTURES / f"{fixture}.yml"), "--random-weights", "--serving", "-o",
                 str(out)]) == 0
    assert "2 blocks" in capsys.readouterr().out
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    inputs = {vi.name: _dims(vi) for vi in model.graph.input}
    outputs = {vi.name: _dims(vi) for vi in model.graph.output}
    vocab = outputs["logits"][-1]
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                            "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert inputs["input_ids"] == inputs["position_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"] == ["batch", "total_sequence"]
    assert inputs["past_key_values.1.value"] == ["batch", kv_heads, "past_sequence", head_dim]
    assert list(outputs) == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert outputs["present.0.key"] == ["batch", kv_heads, "total_sequence", head_dim]
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["vocab_size"]) == (2, heads, kv_heads, head_dim, vocab)
    assert config["hidden_size"] // config["num_attention_heads"] == head_dim  # Optimum's head size
    genai = json.loads((out / "genai_config.json").read_text())["model"]
    assert genai["context_length"] == config["max_position_embeddings"] == vgraph.load(
        FIXTURES / f"{fixture}.yml").nodes_of_type("embedder")[0].cfg["seq_len"]
    assert genai["decoder"]["inputs"]["past_key_names"] % 1 == "past_key_values.1.key"
    assert genai["decoder"]["outputs"]["present_value_names"] % 0 == "present.0.value"
    assert (genai["decoder"]["head_size"], genai["decoder"]["num_key_value_heads"]) == (head_dim, kv_heads)
    assert not (out / "tokenizer.json").exists()  # random weights from a YAML carry no tokenizer


@pytest.mark.parametrize("name", ["heads", "fused", "learned", "gqa", "gqa_fused"])
def test_a_left_padded_batch_gives_each_prompt_its_logits_alone(name) -> None:
    """Prompts of 3 and 6 tokens in one padded call, then one more token each through the cache: every real
    position's logits are torch's on that prompt alone (without the mask and positions they are not)."""
    graph = _graph(name)
    weights = random_weights(graph, 3)
    model, shape = lower_serving(graph, weights)
    decoder = ServingDecoder(model)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, shape.vocab, 3)), list(rng.integers(0, shape.vocab, 6))]
    ids, mask, positions = _padded(prompts)
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1]  # the premise: the short prompt is padded
    past = {n: np.zeros((2, shape.kv_heads, 0, shape.head_dim), np.float32)
            for i in range(shape.layers) for n in past_names(i)}
    first, past = decoder.step(ids, mask, positions, past)
    nxt = np.array([[5], [7]], np.int64)
    second, _ = decoder.step(nxt, np.concatenate([mask, np.ones_like(nxt)], 1), positions[:, -1:] + 1, past)
    for i, p in enumerate(prompts):
        want = torch_logits(graph, weights, np.array([p + [int(nxt[i, 0])]]))[0]
        got = np.concatenate([first[i, 6 - len(p):], second[i]])
        verdict = compare_outputs("logits", "logits", got, want, case=f"{name}, prompt {i}")
        assert verdict.ok, verdict


def test_the_same_batch_without_its_attention_mask_differs() -> None:
    """The other side of the padding test: the mask is what makes it hold (a model ignoring it would pass)."""
    graph = _graph("heads")
    model, shape = lower_serving(graph, random_weights(graph, 3))
    decoder = ServingDecoder(model)
    ids, mask, positions = _padded([[5, 9, 11], [3, 4, 5, 6, 7, 8]])
    past = {n: np.zeros((2, shape.kv_heads, 0, shape.head_dim), np.float32)
            for i in range(shape.layers) for n in past_names(i)}
    masked, _ = decoder.step(ids, mask, positions, past)
    unmasked, _ = decoder.step(ids, np.ones_like(mask), positions, past)
    assert np.abs(masked[0, -1] - unmasked[0, -1]).max() > 1e-3
    assert np.array_equal(masked[1], unmasked[1])  # the unpadded prompt is the same either way


def test_batched_greedy_tokens_equal_each_prompt_alone() -> None:
    graph = _graph("gqa")
    decoder = ServingDecoder(lower_serving(graph, random_weights(graph, 5))[0])
    prompts = [[7], [3, 4, 5, 6]]
    together = decoder.greedy(prompts, 4)
    assert together == [decoder.greedy([p], 4)[0] for p in prompts] and all(len(t) == 4 for t in together)


# ---------------------------------------------------------------------------
# The context, and refusals
# ---------------------------------------------------------------------------


def test_a_context_overflow_is_a_vgraph_error_before_onnxruntime_runs() -> None:
    graph = _graph("gqa")  # context 8
    decoder = ServingDecoder(lower_serving(graph, random_weights(graph, 5))[0])
    assert len(decoder.greedy([[1, 2, 3]], 6)[0]) == 6  # 3 + 6 - 1 = 8 positions: fits exactly
    with pytest.raises(VGraphError, match=r"prompt 1: 4 tokens and 6 new ones need 9 positions, past the model's "
                                          r"context of 8"):
        decoder.greedy([[1, 2, 3], [1, 2, 3, 4]], 6)
    with pytest.raises(VGraphError, match="prompt 0 is empty"):
        decoder.greedy([[]], 1)
    past = {n: np.zeros((1, 2, 0, 8), np.float32) for i in range(2) for n in past_names(i)}
    ids = np.arange(9, dtype=np.int64)[None]
    with pytest.raises(VGraphError, match="position 8 is past the model's context of 8"):
        decoder.step(ids, np.ones_like(ids), ids.copy(), past)


def test_a_model_that_is_not_a_serving_export_is_refused(tmp_path) -> None:
    assert main(["export-onnx", str(TINY), "--random-weights", "--kv-cache", "-o", str(tmp_path / "m.onnx")]) == 0
    with pytest.raises(VGraphError, match="not a serving export"):
        ServingDecoder(tmp_path / "m.onnx")


@pytest.mark.parametrize("extra,message", [(["--with-loss"], "exclude each other"),
                                           (["--no-weights"], "exclude each other")])
def test_serving_refuses_options_that_cannot_serve(tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "served"
    argv = ["export-onnx", str(TINY), "--serving", "-o", str(out), *extra]
    assert main(argv + ([] if "--no-weights" in extra else ["--random-weights"])) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not out.exists()


def test_serving_without_weights_is_refused_and_a_foreign_file_is_never_replaced(tmp_path, capsys) -> None:
    out = tmp_path / "served"
    assert main(["export-onnx", str(TINY), "--serving", "-o", str(out)]) == 2
    assert "no trained weights given" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    (out / "config.json").write_text("mine\n")
    assert main(["export-onnx", str(TINY), "--serving", "--random-weights", "-o", str(out)]) == 2
    assert "was not written there by vgraph" in capsys.readouterr().err
    assert (out / "config.json").read_text() == "mine\n" and not (out / "model.onnx").exists()
    (out / "config.json").unlink()
    for _ in range(2):  # its own files are replaced on a second run
        assert main(["export-onnx", str(TINY), "--serving", "--random-weights", "-o", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_an_interrupted_export_leaves_no_config_and_the_next_run_finishes_it(tmp_path, monkeypatch) -> None:
    """config.json is written last (its presence marks a complete model); the files written before an interrupt
    are recorded as this command's, so the rerun replaces them instead of refusing."""
    from vgraph.base.safeio import OutputDir

    out = tmp_path / "served"
    write = OutputDir.write

    def interrupted(self, name, data):
        if name == "config.json":
            raise KeyboardInterrupt
        return write(self, name, data)

    monkeypatch.setattr(OutputDir, "write", interrupted)
    assert main(["export-onnx", str(TINY), "--serving", "--random-weights", "-o", str(out)]) == 130  # Ctrl-C
    assert (out / "model.onnx").is_file() and not (out / "config.json").exists()
    monkeypatch.setattr(OutputDir, "write", write)
    assert main(["export-onnx", str(TINY), "--serving", "--random-weights", "-o", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 96
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "config.json", "genai_config.json", "generation_config.json", "model.onnx"]


def test_serving_output_must_be_a_directory(tmp_path, capsys) -> None:
    (tmp_path / "plain").write_text("x")
    assert main(["export-onnx", str(TINY), "--serving", "--random-weights", "-o", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and "Traceback" not in err
    assert (tmp_path / "plain").read_text() == "x"


def test_a_directory_name_with_a_control_character_is_printed_escaped(tmp_path, capsys) -> None:
    out = tmp_path / "a\x07b"
    assert main(["export-onnx", str(TINY), "--serving", "--random-weights", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "model.onnx").is_file() and "\x07" not in printed and "a\\x07b" in printed


def test_a_network_whose_blocks_differ_cannot_state_one_config() -> None:
    """A 2-block network whose second block has one head fewer: refused, naming the blocks' numbers."""
    text = (FIXTURES / "tiny_2l.yml").read_text()
    graph = fp32_graph(vgraph.loads(text, file="x.yml"))
    heads = [n for n in graph.nodes if n.type == "attention_head"]
    assert len(heads) == 4  # the premise: 2 blocks of 2 heads
    from vgraph.backends.onnx import serving

    caches = [{"node": h.id, "shape": ["past_sequence", 16]} for h in heads[:3]]
    layers = serving._layers(graph, caches)
    assert [len(layer) for layer in layers] == [2, 1]
    with pytest.raises(VGraphError, match="the blocks' caches differ"):
        serving._shape(graph, layers)


# ---------------------------------------------------------------------------
# A trained run: onnxruntime-genai, docs/serving.md's loop, and vgraph generate
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    corpus = d / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=40_000)), encoding="utf-8")
    assert main(["train", str(TINY), "--data", str(corpus), "--steps", "30", "--batch", "4", "--val-every", "0",
                 "--out", str(d / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0
    assert main(["export-onnx", str(d / "run"), "--serving", "-o", str(d / "served")]) == 0
    return d


PROMPTS = ["x = ", "def main"]


@pytest.fixture(scope="module")
def generated(served) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy new ids) of `vgraph generate RUN --temperature 0 --max-new-tokens 8` per prompt."""
    from vgraph.backends.torch.cli import generate_ids

    out = []
    for prompt in PROMPTS:
        ids, n, _ = generate_ids(str(served / "run"), prompt, max_new_tokens=8, temperature=0.0, backend="torch")
        out.append((ids[:n], ids[n:]))
    return out


def test_the_export_carries_the_runs_tokenizer_and_its_special_ids(served) -> None:
    from tokenizers import Tokenizer

    out = served / "served"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tok.token_to_id("<|endoftext|>") is not None
    assert config["pad_token_id"] == tok.token_to_id("<|pad|>") is not None
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == config["eos_token_id"]
    assert json.loads((out / "tokenizer_config.json").read_text())["padding_side"] == "left"


def test_onnxruntime_genai_generates_vgraph_generates_greedy_tokens_for_a_padded_batch(served, generated) -> None:
    og = _genai()
    out = served / "served"
    want = generated
    prompts = [ids for ids, _ in want]
    assert len(set(map(len, prompts))) == 2  # the premise: different lengths, so one is padded
    pad = json.loads((out / "genai_config.json").read_text())["model"]["pad_token_id"]
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    tokens = _genai_greedy(og, out, prompts, 8, pad)
    for i, (_, new) in enumerate(want):
        got = tokens[i][: tokens[i].index(eos)] if eos in tokens[i] else tokens[i]
        assert got == new, (i, got, new)
    assert any(len(new) == 8 for _, new in want)  # tokens were generated, not an immediate end-of-text


def _genai():
    if _genai_optional():
        pytest.importorskip("onnxruntime_genai")
    import onnxruntime_genai as og

    return og


def _genai_greedy(og, directory, prompts: list[list[int]], new: int, pad: int) -> list[list[int]]:
    """onnxruntime-genai's greedy new tokens for a batch, padded on the right as genai reads padding."""
    model = og.Model(str(directory))
    width = max(map(len, prompts))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=width + new, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)[width:]] for i in range(len(prompts))]


@pytest.mark.parametrize("fixture,new", [("tiny_2l", 8), ("tiny_gqa", 3)])
def test_onnxruntime_genai_gives_a_padded_batch_each_prompts_tokens_alone(tmp_path, fixture, new) -> None:
    """Weights at a trained network's scale (random_weights), so greedy tokens vary with the context: genai's
    for a padded batch equal vgraph's for each prompt alone (whose logits the test above checks against torch)."""
    og = _genai()
    graph = fp32_graph(vgraph.load(FIXTURES / f"{fixture}.yml"))
    model, shape = lower_serving(graph, random_weights(graph, 3))
    from vgraph.backends.onnx.serving import serving_files

    tmp_path.joinpath("model.onnx").write_bytes(model.SerializeToString())
    for name, text in serving_files(shape, network=graph.name, tokenizer_json=None).items():
        tmp_path.joinpath(name).write_text(text)
    prompts = [[5, 9, 11], [3, 4, 5, 6, 7]]
    alone = [ServingDecoder(model).greedy([p], new)[0] for p in prompts]
    assert len({t for row in alone for t in row}) > 2  # the premise: tokens that depend on the context
    assert _genai_greedy(og, tmp_path, prompts, new, pad=0) == alone


def _genai_optional() -> bool:
    """onnxruntime-genai is in the dev extra where it has wheels (x86-64 Linux and Windows): required there."""
    import platform
    import sys

    return not ((sys.platform == "linux" and platform.machine() == "x86_64")
                or (sys.platform == "win32" and platform.machine() == "AMD64"))


def test_docs_serving_onnxruntime_loop_runs_as_written_and_matches_vgraph_generate(served, generated, monkeypatch,
                                                                                     capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    (loop,) = [b for b in blocks if "ort.InferenceSession" in b]
    assert len(loop.splitlines()) <= 40
    monkeypatch.chdir(served)
    namespace: dict = {}
    exec(compile(loop, str(DOC), "exec"), namespace)  # noqa: S102 - the documented example, verbatim
    printed = capsys.readouterr().out.splitlines()
    eos = json.loads((served / "served" / "config.json").read_text())["eos_token_id"]
    for text, row, line, (prompt, new) in zip(PROMPTS, namespace["out"], printed, generated):
        assert namespace["tokenizer"].encode(text).ids == prompt
        assert (row[: row.index(eos)] if eos in row else row) == new
        assert line == repr(namespace["tokenizer"].decode(prompt + new))
    assert len(printed) == len(PROMPTS)


def test_serving_into_the_run_it_reads_is_refused(served, capsys) -> None:
    run = served / "run"
    before = sorted(p.name for p in run.iterdir())
    assert main(["export-onnx", str(run), "--serving", "-o", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(run) in err
    assert sorted(p.name for p in run.iterdir()) == before


def test_vgraph_serving_decoder_reads_the_directory_and_agrees(served, generated) -> None:
    config = json.loads((served / "served" / "config.json").read_text())
    decoder = ServingDecoder(served / "served", pad=config["pad_token_id"])
    want = generated
    got = decoder.greedy([ids for ids, _ in want], 8, eos=config["eos_token_id"])
    assert [g[:-1] if g and g[-1] == config["eos_token_id"] else g for g in got] == [new for _, new in want]
