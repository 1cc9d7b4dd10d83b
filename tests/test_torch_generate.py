"""`vgraph generate` on the torch backend (issue 38 item 5): the decode program's KV cache, batches of prompts,
speeds, the context's end.

The oracle of the cache is the network's ordinary program run on the whole context at once (what generate
recomputed for every token before): the decode program's logits at each position, prefilled and then fed a
token at a time, must equal the whole context's within float32 rounding.  Weights are drawn at a trained
network's scale (matrices N(0, 1/fan_in)): the initialisation's N(0, 0.02) keeps every softmax nearly uniform,
where a wrong position or mask would hardly show.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

import vgraph
from vgraph import VGraphError
from vgraph.backends.torch.cli import LogitsSource, _token_feed, _torch_logits
from vgraph.backends.torch.generation import CachedLogits, Speeds, WindowLogits, sample_batch
from vgraph.backends.torch.lowering.lower import compile_network, init_state
from vgraph.backends.torch.model_api import logits_output
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.setup import device_target, prepare_graph
from vgraph.cli import main

from conftest import FIXTURES, NET6, TINY, TINY_FP32

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: these are many tiny calls, which a second thread's wake-ups make 30x slower on a
    loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FIXTURE_NETS = ["tiny_1l_fp32.yml", "tiny_2l.yml", "tiny_gqa.yml", "tiny_gqa_fused.yml"]
U = 2.0**-24  # float32 unit roundoff


def network(text: str, *, fuse: bool, name: str = "net.yml") -> vgraph.Graph:
    graph = vgraph.loads(text, file=name)
    return prepare_graph(graph, passes=None, fuse=fuse, target=device_target(torch.device("cpu")))


def learned_positions(text: str) -> str:
    """The fixture with learned positions in the embedder instead of RoPE in the heads."""
    text = text.replace('position_encoding: "none"', 'position_encoding: "learned"', 1)
    return text.replace('position_encoding: "rope"', 'position_encoding: "none"')


def realistic(graph: vgraph.Graph, seed: int):
    """The module with matrices N(0, 1/fan_in) (norm weights one, biases zero), in eval mode."""
    state = init_state(graph, seed)
    generator = torch.Generator().manual_seed(seed)
    for key, tensor in state.items():
        if tensor.dim() == 2:
            state[key] = torch.randn(tensor.shape, generator=generator) / math.sqrt(tensor.shape[1])
    module = compile_network(graph, train=False, seed=seed)
    module.load_state_dict(state)
    return module


def accumulation_tolerance(graph: vgraph.Graph, module, reference: torch.Tensor) -> float:
    """Two float32 evaluations of one network differ by rounding: each layer's sums of at most n terms
    (n the widest of the model width, the hidden widths and the context) by ~n*u relative, layer after layer
    (attention blocks + the head); a wrong position, mask or cache is off by O(1) relative."""
    widest = max([t.shape[1] for t in module.state_dict().values() if t.dim() == 2] +
                 [int(graph.nodes_of_type("embedder")[0].cfg["seq_len"])])
    layers = len([n for n in graph.nodes if n.type in ("attention", "attention_head")]) + 1
    return layers * widest * U * float(reference.abs().max())


def decode_in_calls(module, graph, ids: torch.Tensor, calls: list[int]) -> torch.Tensor:
    """The decode program over `ids` in calls of `calls` positions each (a prefill, then steps): every
    position's logits, concatenated."""
    output = logits_output(graph)
    cached = CachedLogits(module, _token_feed(module, graph, output), output, pad=0)
    batch, out, start = ids.shape[0], [], 0
    cached.start([[0]] * batch)  # the empty caches' shapes, then forgotten: the first call passes them empty
    past = {name: t[:, ..., :0, :] for name, t in cached.past.items()}
    for n in calls:
        feeds = {cached.token_feed: ids[:, start:start + n], "position_ids": torch.arange(start, start + n).expand(batch, n),
                 "attention_mask": torch.ones(batch, start + n, dtype=torch.int64), **past}
        with torch.no_grad():
            results = module(feeds, want=(output,), decode=True)
        past = {name: results[name.replace("past_", "present_", 1)] for name in past}
        assert results[output].shape[1] == n  # a step computes its own positions only
        out.append(results[output])
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("fuse", [False, True], ids=["heads", "fused"])
@pytest.mark.parametrize("fixture", FIXTURE_NETS + ["learned:tiny_2l.yml"])
def test_the_cached_logits_at_every_position_equal_the_whole_context(fixture, fuse) -> None:
    text = (FIXTURES / fixture.split(":")[-1]).read_text()
    graph = network(learned_positions(text) if fixture.startswith("learned:") else text, fuse=fuse)
    module = realistic(graph, 5)
    embedder = graph.nodes_of_type("embedder")[0].cfg
    context, vocab = int(embedder["seq_len"]), int(embedder["vocab_size"])
    ids = torch.randint(0, vocab, (2, context), generator=torch.Generator().manual_seed(1))
    output = logits_output(graph)
    with torch.no_grad():
        whole = module({_token_feed(module, graph, output): ids}, want=(output,))[output]
    got = decode_in_calls(module, graph, ids, [3, 1, 1, 2, context - 7])
    tolerance = accumulation_tolerance(graph, module, whole)
    assert (got - whole).abs().max() <= tolerance
    # the premise: the positions matter (a cache that forgot them, or saw the future, would be far off)
    assert (whole[:, 1:] - whole[:, :-1]).abs().max() > 1000 * tolerance
    caches = module.decode_caches((output,))
    kinds = {graph.node(n).type for n in caches}
    assert kinds == ({"attention"} if fuse or "fused" in fixture else {"kv_head"} if "gqa" in fixture
                     else {"attention_head"})


def test_a_network_that_cannot_decode_incrementally_is_named() -> None:
    """A non-causal attention has no cache: the decode program refuses, naming every such VNode."""
    text = TINY_FP32.read_text().replace('causal: "true"', 'causal: "false"')
    graph = network(text, fuse=False)
    module = compile_network(graph, train=False)
    with pytest.raises(VGraphError) as info:
        module.decode_caches((logits_output(graph),))
    heads = [n.id for n in graph.nodes if n.type == "attention_head"]
    assert {d.node for d in info.value.diagnostics} == set(heads) and "not causal" in str(info.value)


def sample(logits, prompts, context, eot=None, **kw):
    kw = {"max_new_tokens": 12, "temperature": 0.0, "top_k": 0, "seed": 0, **kw}
    return sample_batch(logits, prompts, context=context, eot=eot, speeds=Speeds(), **kw)


def ways(graph, module):
    output = logits_output(graph)
    feed = _token_feed(module, graph, output)
    context = int(graph.nodes_of_type("embedder")[0].cfg["seq_len"])
    return (CachedLogits(module, feed, output, pad=0),
            WindowLogits(_torch_logits(module, feed, output, context, 0)), context)


def margins(module, graph, rows: list[list[int]], prompt_lens: list[int], context: int) -> float:
    """The smallest gap between the likeliest and the second likeliest logit over every greedy draw."""
    output = logits_output(graph)
    next_logits = _torch_logits(module, _token_feed(module, graph, output), output, context, 0)
    gaps = []
    for row, n in zip(rows, prompt_lens):
        for end in range(n, len(row)):
            top = torch.topk(next_logits(row[max(0, end - context):end]), 2).values
            gaps.append(float(top[0] - top[1]))
    return min(gaps)


@pytest.mark.parametrize("fixture", ["tiny_2l.yml", "tiny_gqa.yml"])
def test_greedy_tokens_equal_the_recomputed_window_also_past_the_context(fixture) -> None:
    """Prompts of 1, 5 and 14 tokens, 12 greedy tokens each (past the context of 8 or 16: the window
    slides), cached one prompt at a time and as one left-padded batch: the reference's tokens."""
    graph = network((FIXTURES / fixture).read_text(), fuse=False)
    module = realistic(graph, 7)
    cached, window, context = ways(graph, module)
    prompts = [[5], [1, 2, 3, 4, 5], list(range(20, 20 + min(14, context)))]
    want = [sample(window, [p], context)[0] for p in prompts]
    assert [sample(cached, [p], context)[0] for p in prompts] == want
    assert sample(cached, prompts, context) == want
    assert max(len(r) for r in want) > context  # the premise: the window slid
    assert len({t for r in want for t in r[len(prompts[0]):]}) > 3  # not one token repeated
    tolerance = accumulation_tolerance(graph, module, torch.ones(1))  # relative to logits of magnitude 1
    assert margins(module, graph, want, [len(p) for p in prompts], context) > 100 * tolerance


def test_each_prompt_of_a_sampled_batch_draws_its_own_run_and_a_finished_row_leaves() -> None:
    """Temperature 0.9, top-k 5: every row draws from its own generator seeded alike, so a batch gives each
    prompt's single run; a row that draws end-of-text stops while the others go on."""
    graph = network(TINY.read_text(), fuse=True)
    module = realistic(graph, 11)
    cached, window, context = ways(graph, module)
    prompts = [[3, 9], [40, 41, 42, 43, 44, 45], [7]]
    kw = {"temperature": 0.9, "top_k": 5, "seed": 4, "max_new_tokens": 10}
    alone = [sample(window, [p], context, **kw)[0] for p in prompts]
    eot = alone[1][len(prompts[1]) + 3]  # the second prompt's fourth new token ends it
    alone = [sample(window, [p], context, eot=eot, **kw)[0] for p in prompts]
    assert len(alone[1]) == len(prompts[1]) + 3 and eot not in alone[1][len(prompts[1]):]
    assert sample(cached, prompts, context, eot=eot, **kw) == alone
    assert len({tuple(r[len(p):]) for r, p in zip(alone, prompts)}) == 3


def test_the_production_network_decodes_as_its_whole_context(net6) -> None:
    """The 6-layer network's shape (fused, 128 positions, 8 heads of 64, RoPE): a 120-token prefill and 8
    steps against the whole context, then greedy tokens from a prompt at the context's end (the window
    slides after 3)."""
    graph = prepare_graph(net6, passes=None, fuse=True, target=device_target(torch.device("cpu")))
    module = realistic(graph, 2)
    context = int(graph.nodes_of_type("embedder")[0].cfg["seq_len"])
    ids = torch.randint(0, 10_000, (1, context), generator=torch.Generator().manual_seed(3))
    output = logits_output(graph)
    with torch.no_grad():
        whole = module({_token_feed(module, graph, output): ids}, want=(output,))[output]
    got = decode_in_calls(module, graph, ids, [context - 8] + [1] * 8)
    assert (got - whole).abs().max() <= accumulation_tolerance(graph, module, whole)
    cached, window, _ = ways(graph, module)
    prompt = ids[0, : context - 3].tolist()
    want = sample(window, [prompt], context, max_new_tokens=6)
    assert sample(cached, [prompt], context, max_new_tokens=6) == want and len(want[0]) == context + 3


# -- the command ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("generate")
    corpus = d / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["train", str(TINY), "--data", str(corpus), "--steps", "3", "--batch", "2", "--val-every", "0",
                 "--out", str(d / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0
    return d / "run"


def generate(run, *argv):
    return main(["generate", str(run), "--temperature", "0", *argv])


def test_generate_prints_each_prompt_and_the_speeds(run, capsys) -> None:
    capsys.readouterr()
    assert generate(run, "--prompt", "def ", "--max-new-tokens", "5") == 0
    single = capsys.readouterr()
    assert single.out.startswith("def ") and "torch, KV cache" in single.err
    speeds = re.search(r"prefill (\d+) tokens in [\d.]+ s \([\d,.]+ tokens/s\); decode (\d+) tokens in [\d.]+ s "
                       r"\([\d,.]+ tokens/s\)", single.err)
    prompt_tokens = len(LogitsSource(str(run)).encode("def "))
    assert speeds and int(speeds[1]) == prompt_tokens and int(speeds[2]) <= 4, single.err
    assert generate(run, "--prompt", "def ", "--prompt", "The", "--max-new-tokens", "5") == 0
    batch = capsys.readouterr()
    lines = [json.loads(line) for line in batch.out.splitlines()]
    assert lines[0] == single.out.rstrip("\n") and lines[1].startswith("The") and "2 prompts" in batch.err
    assert generate(run, "--prompt", "def ", "--max-new-tokens", "5", "--no-kv-cache") == 0
    recomputed = capsys.readouterr()
    assert recomputed.out == single.out and "window recomputed" in recomputed.err


def test_generate_past_the_context_says_the_window_slides(run, capsys) -> None:
    capsys.readouterr()
    assert generate(run, "--prompt-ids", "1,2,3", "--max-new-tokens", "20") == 0
    out = capsys.readouterr()
    assert len(out.out.strip().split(",")) == 23
    assert out.err.count("sliding window") == 1 and "context of 16" in out.err
    assert generate(run, "--prompt-ids", "1,2,3", "--prompt-ids", "4", "--max-new-tokens", "2") == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and rows[0].startswith("1,2,3,") and rows[1].startswith("4,")


def test_the_onnx_backend_samples_a_batch_one_prompt_after_another(run, capsys) -> None:
    argv = ["--prompt-ids", "1,2,3", "--prompt-ids", "4", "--max-new-tokens", "5"]
    capsys.readouterr()
    assert generate(run, *argv) == 0
    torch_rows = capsys.readouterr().out
    assert generate(run, *argv, "--backend", "onnx") == 0
    onnx = capsys.readouterr()
    assert onnx.out == torch_rows and "2 prompts, onnxruntime, KV cache" in onnx.err


def test_a_prompts_file_is_one_batch(run, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \r\nThe\tend\n", encoding="utf-8")
    capsys.readouterr()
    assert generate(run, "--prompts-file", str(prompts), "--max-new-tokens", "3") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and lines[0].startswith("def ") and lines[1].startswith("The\tend")


@pytest.mark.parametrize("content,message", [
    ("", "holds no prompts"),
    ("def \n\nThe\n", "prompts.txt:2: a blank line"),
    ("def \n   \n", "prompts.txt:2: a blank line"),
    ("ok\nbad\x1b[2Jescape\n", "prompts.txt:2: control character U+001B"),
    ("nul\x00\n", "prompts.txt:1: control character U+0000"),
    ("x " * 40 + "\n", "prompts.txt:1: the prompt is"),
])
def test_a_bad_prompts_file_is_named_by_line(run, tmp_path, capsys, content, message) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(content, encoding="utf-8")
    capsys.readouterr()
    assert generate(run, "--prompts-file", str(prompts), "--max-new-tokens", "1") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_prompts_file_that_is_not_a_text_file_is_refused(run, tmp_path, capsys) -> None:
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(65 * 2**20)  # sparse: larger than a prompts file may be
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    for path, message in ((tmp_path, "is a directory"), (tmp_path / "x" / ".." / "missing.txt", "no such"),
                          (huge, "prompts file"), (latin, "UTF-8")):
        capsys.readouterr()
        assert generate(run, "--prompts-file", str(path), "--max-new-tokens", "1") == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (path, err)


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "a", "--prompt", "b\x07"], "--prompt 2: control character U+0007"),
    (["--prompt", "x " * 40], "the prompt is"),
    (["--prompt-ids", ",".join(["1"] * 17)], "--prompt-ids 1: the prompt is 17 tokens"),
    (["--prompt-ids", "1", "--prompt-ids", "96"], "--prompt-ids 2: token id 96"),
])
def test_bad_prompts_are_named(run, capsys, argv, message) -> None:
    capsys.readouterr()
    assert generate(run, *argv, "--max-new-tokens", "1") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prompts_come_from_one_option(run, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        generate(run, "--prompt", "a", "--prompts-file", "p.txt")
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_too_many_prompts_are_refused(run, tmp_path, capsys) -> None:
    prompts = tmp_path / "many.txt"
    prompts.write_text("a\n" * 1025, encoding="utf-8")
    capsys.readouterr()
    assert generate(run, "--prompts-file", str(prompts), "--max-new-tokens", "1") == 2
    assert "at most 1,024 run as one batch" in capsys.readouterr().err


def test_kv_cache_on_a_network_without_one(tmp_path, capsys) -> None:
    """Non-causal attention: --kv-cache refuses naming the heads; the default recomputes and says why."""
    net = tmp_path / "bidirectional.yml"
    net.write_text(TINY_FP32.read_text().replace('causal: "true"', 'causal: "false"'))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["train", str(net), "--data", str(corpus), "--steps", "1", "--batch", "2", "--val-every", "0",
                 "--out", str(tmp_path / "run"), "--quiet", "--threads", "1", "--no-tensorboard"]) == 0
    capsys.readouterr()
    assert generate(tmp_path / "run", "--kv-cache", "--max-new-tokens", "2") == 2
    err = capsys.readouterr().err
    assert "not causal" in err and "node 'block0_attention'" in err and "--no-kv-cache" in err
    assert "Traceback" not in err
    assert generate(tmp_path / "run", "--max-new-tokens", "2") == 0
    assert "no KV cache, the context is recomputed" in capsys.readouterr().err
    source = LogitsSource(str(tmp_path / "run"))
    assert source.batched is None and source.way == "torch, window recomputed"
