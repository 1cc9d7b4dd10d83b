"""`vgraph import hf` / `export hf` / `eval` / `generate --prompt-ids` / `load_model` on GPT-2, end to end.

The oracle is transformers itself on the same weights (hf_util.py: tiny models from configs, nothing
downloaded).  Tolerances: float32 logits through the same math in another order differ by ~1e-6 here; the
issue's bound is 1e-4 absolute, and a wrong mapping (a transposed Conv1D, swapped Q/K) moves logits by O(1).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_util import POSITIONS, VOCAB, gpt2, vg
from vgraph.backends.torch import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the HF model, its directory, the per-head run, the fused-attention run)."""
    d = tmp_path_factory.mktemp("gpt2")
    model = gpt2(d / "src")
    assert vg("import", "hf", d / "src", "-o", d / "run") == 0
    assert vg("import", "hf", d / "src", "-o", d / "fused", "--fused-attention") == 0
    return model, d / "src", d / "run", d / "fused"


def ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", ["run", "fused"])
def test_load_model_computes_transformers_logits(imported, form) -> None:
    model, _, run, fused = imported
    lm = load_model(run if form == "run" else fused)
    assert not lm.training
    x = ids(3, POSITIONS)
    with torch.no_grad():
        want = model(x).logits
        assert want.abs().max() > 1  # logits large enough that a wrong mapping shows
        assert (lm(x) - want).abs().max() <= 1e-4
        assert (lm(x[:, :9]) - model(x[:, :9]).logits).abs().max() <= 1e-4  # a shorter sequence as is
    nodes = {n.type for n in lm.graph.nodes}
    assert ("attention" in nodes) == (form == "fused") or form == "run"


def test_the_network_is_laid_out_as_the_production_networks(imported) -> None:
    import vgraph

    graph = vgraph.load(imported[2] / "network.yml")
    groups = {n.id: n.config.get("colocate_group") for n in graph.nodes}
    assert groups["block1_head1"] == groups["block1_ffn_down"] == "transformer_block_1"
    assert groups["embedder"] == groups["lm_head"] == groups["final_norm"] == "token_embedding"
    assert [n.id for n in graph.nodes_of_type("attention_head")] == [f"block{i}_head{h}" for i in (0, 1)
                                                                     for h in (0, 1)]
    assert graph.node("block0_ffn_act").cfg["approximate"] == "tanh"  # gelu_new
    assert vg("validate", imported[2] / "network.yml") == 0


def test_eval_loss_is_transformers_loss(imported, tmp_path, capsys) -> None:
    model, _, run, _ = imported
    rows = ids(3, POSITIONS, seed=4)
    np.save(tmp_path / "rows.npy", rows.numpy())
    np.save(tmp_path / "one.npy", rows[0].numpy().astype(np.int32))
    with torch.no_grad():
        want = [float(model(r[None], labels=r[None]).loss) for r in rows]
    capsys.readouterr()
    assert vg("eval", run, "--token-ids", tmp_path / "one.npy", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == POSITIONS - 1
    assert got["loss"] == pytest.approx(want[0], rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(got["loss"]), rel=1e-12)
    assert vg("eval", run, "--token-ids", tmp_path / "rows.npy", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == 3 * (POSITIONS - 1) and got["loss"] == pytest.approx(np.mean(want), rel=1e-5)
    assert vg("eval", run, "--token-ids", tmp_path / "one.npy") == 0
    assert "perplexity" in capsys.readouterr().out


def test_eval_cuts_a_long_sequence_into_windows_predicting_every_token_once(imported, tmp_path, capsys) -> None:
    model, _, run, _ = imported
    seq = ids(1, 2 * POSITIONS + 5, seed=5)[0]
    np.save(tmp_path / "long.npy", seq.numpy())
    total, count = 0.0, 0
    with torch.no_grad():  # windows of POSITIONS + 1 ids overlapping by one
        for start in range(0, len(seq) - 1, POSITIONS):
            w = seq[start:start + POSITIONS + 1][None]
            logits = model(w[:, :-1]).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits, w[0, 1:], reduction="sum"))
            count += w.shape[1] - 1
    capsys.readouterr()
    assert vg("eval", run, "--token-ids", tmp_path / "long.npy", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == len(seq) - 1 == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)


def test_greedy_generate_by_ids_is_transformers_generate(imported, capsys) -> None:
    model, _, run, _ = imported
    prompt = [5, 17, 42]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                          pad_token_id=0)[0].tolist()
    assert len(want) == 23
    capsys.readouterr()
    for backend in ("torch", "onnx"):  # the run's checkpoint folder given directly, too
        assert vg("generate", run / "step-00000000", "--prompt-ids", "5,17,42", "--temperature", "0",
                  "--max-new-tokens", "20", "--backend", backend) == 0
        assert [int(t) for t in capsys.readouterr().out.strip().split(",")] == want, backend


def test_export_loads_back_in_transformers_with_the_same_logits(imported, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    model, src, run, fused = imported
    x = ids(2, POSITIONS, seed=7)
    for source in (run, fused):
        out = tmp_path / source.name
        assert vg("export", "hf", source, "-o", out, "--check") == 0
        assert "check: transformers' logits within" in capsys.readouterr().out
        back = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert (back(x).logits - model(x).logits).abs().max() <= 1e-5
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu_new"
        assert sorted(p.name for p in out.iterdir()) == [".vgraph-outputs.json", "config.json", "model.safetensors"]
    # Exporting again into the same directory replaces what it wrote; a file it did not write is refused.
    assert vg("export", "hf", run, "-o", tmp_path / "run") == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert vg("export", "hf", run, "-o", tmp_path / "mine") == 2
    assert (tmp_path / "mine" / "config.json").read_text() == "{}"
    assert not (tmp_path / "mine" / "model.safetensors").exists()


def test_a_tokenizer_travels_through_import_generate_and_export(tmp_path, capsys) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "src"
    gpt2(src)
    words = ["<|endoftext|>"] + [f"w{i}" for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    assert vg("import", "hf", src, "-o", tmp_path / "run") == 0
    assert (tmp_path / "run" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    capsys.readouterr()
    assert vg("generate", tmp_path / "run", "--prompt", "w3 w9", "--temperature", "0", "--max-new-tokens", "4") == 0
    assert capsys.readouterr().out.startswith("w3 w9")
    assert vg("export", "hf", tmp_path / "run", "-o", tmp_path / "out") == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


# -- mistakes: a message and exit 2, nothing written --------------------------------------------------------


def test_prompt_ids_and_eval_inputs_are_checked(imported, tmp_path, capsys) -> None:
    run = imported[2]
    for bad in ("", "1,,2", "-1", "a", "1.5", "nan", "9" * 30):
        with pytest.raises(SystemExit) as exc:
            vg("generate", run, "--prompt-ids", bad)
        assert exc.value.code == 2, bad
    assert vg("generate", run, "--prompt-ids", f"1,{VOCAB}") == 2
    assert "outside the network's vocabulary of 64" in capsys.readouterr().err
    assert vg("generate", run, "--prompt", "text") == 2  # no tokenizer in this run
    assert "--prompt-ids" in capsys.readouterr().err
    cases = {"float.npy": np.zeros(5, dtype=np.float32), "big.npy": np.array([1, VOCAB]),
             "neg.npy": np.array([3, -1]), "cube.npy": np.zeros((2, 2, 2), dtype=np.int64),
             "one.npy": np.array([3])}
    for name, array in cases.items():
        np.save(tmp_path / name, array)
        assert vg("eval", run, "--token-ids", tmp_path / name) == 2, name
    (tmp_path / "text.npy").write_text("not numpy")
    assert vg("eval", run, "--token-ids", tmp_path / "text.npy") == 2
    assert vg("eval", run, "--token-ids", tmp_path) == 2  # a directory
    assert vg("eval", run, "--data", tmp_path) == 2  # not a prepared corpus
    with pytest.raises(SystemExit):
        vg("eval", run)  # neither --data nor --token-ids
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not a prepared corpus" in err


def _refused(src: Path, out: Path, capsys, *phrases: str, extra: tuple[str, ...] = ()) -> None:
    capsys.readouterr()
    assert vg("import", "hf", src, "-o", out, *extra) == 2
    err = capsys.readouterr().err
    for phrase in phrases:
        assert phrase in err, (phrase, err)
    assert "Traceback" not in err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".tmp-import-" in p.name]


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_hostile_model_directories_are_refused_and_nothing_is_written(tmp_path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    good = tmp_path / "good"
    gpt2(good)
    out = tmp_path / "run"

    def copy(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        return d

    from hf_util import edit_config

    lying = copy("lying")
    edit_config(lying, n_embd=48, n_head=2)  # the weights are 32 wide
    _refused(lying, out, capsys, "has shape [64, 32], but config.json says [64, 48]")
    tensors = load_file(good / "model.safetensors")
    missing = copy("missing")
    save_file({k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.bias"},
              missing / "model.safetensors")
    _refused(missing, out, capsys, "missing 1 tensor(s)", "h.1.mlp.c_fc.bias")
    extra = copy("extra")
    save_file({**tensors, "transformer.h.2.ln_1.weight": torch.ones(32)}, extra / "model.safetensors")
    _refused(extra, out, capsys, "1 tensor(s) this config has no place for: h.2.ln_1.weight")
    nan = copy("nan")
    poisoned = dict(tensors)
    poisoned["transformer.h.0.attn.c_proj.weight"] = poisoned["transformer.h.0.attn.c_proj.weight"].clone()
    poisoned["transformer.h.0.attn.c_proj.weight"][3, 4] = float("nan")
    save_file(poisoned, nan / "model.safetensors")
    _refused(nan, out, capsys, "transformer.h.0.attn.c_proj.weight", "1 NaN or infinite")
    outside = copy("outside")
    header, data = _header(good / "model.safetensors")
    header["transformer.wte.weight"]["data_offsets"][1] += 10**9
    _write(outside / "model.safetensors", header, data)
    _refused(outside, out, capsys, "outside the file's")
    overlap = copy("overlap")
    header, data = _header(good / "model.safetensors")
    names = [k for k in header if k != "__metadata__"]
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    _write(overlap / "model.safetensors", header, data)
    _refused(overlap, out, capsys, "overlap")
    long_header = copy("long_header")
    raw = (good / "model.safetensors").read_bytes()
    (long_header / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + raw[8:])
    _refused(long_header, out, capsys, "the header claims")
    arch = copy("arch")
    edit_config(arch, model_type="bert", architectures=["BertForMaskedLM"])
    _refused(arch, out, capsys, "model_type 'bert'", "GPT-2", "Llama", "Qwen2")
    unknown_key = copy("unknown_key")
    edit_config(unknown_key, attn_logit_softcapping=30.0)
    _refused(unknown_key, out, capsys, "attn_logit_softcapping", "refused")
    act = copy("act")
    edit_config(act, activation_function="quick_gelu")
    _refused(act, out, capsys, "activation_function 'quick_gelu'", "gelu_new")
    inverse = copy("inverse")
    edit_config(inverse, scale_attn_by_inverse_layer_idx=True)
    _refused(inverse, out, capsys, "scale_attn_by_inverse_layer_idx")
    for key, value in (("n_layer", float("nan")), ("n_layer", -1), ("n_layer", "2"), ("n_layer", 2**40),
                       ("layer_norm_epsilon", float("inf")), ("n_positions", True)):
        bad = copy(f"bad_{key}_{len(list(tmp_path.iterdir()))}")
        edit_config(bad, **{key: value})
        _refused(bad, out, capsys, key)
    notjson = copy("notjson")
    (notjson / "config.json").write_text("{")
    _refused(notjson, out, capsys, "not JSON")
    pickle = copy("pickle")
    (pickle / "model.safetensors").rename(pickle / "pytorch_model.bin")
    _refused(pickle, out, capsys, "pickles")


def test_links_out_of_the_model_directory_are_refused(tmp_path, capsys) -> None:
    good = tmp_path / "good"
    gpt2(good)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").write_bytes((good / "config.json").read_bytes())
    os.symlink(good / "model.safetensors", linked / "model.safetensors")
    _refused(linked, tmp_path / "run", capsys, "outside the model directory")
    os.symlink("/etc/passwd", linked / "tokenizer.json")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    _refused(linked, tmp_path / "run", capsys, "tokenizer.json: a symbolic link to /etc/passwd")
    # The hub cache's own layout (snapshots/REV/x -> ../../blobs/HASH) is a model directory.
    cache = tmp_path / "models--tiny"
    (cache / "blobs").mkdir(parents=True)
    snap = cache / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (cache / "blobs" / f"h-{f}").write_bytes((good / f).read_bytes())
        os.symlink(f"../../blobs/h-{f}", snap / f)
    assert vg("import", "hf", snap, "-o", tmp_path / "cached") == 0


def test_the_output_is_checked_before_anything_is_read(tmp_path, capsys) -> None:
    src = tmp_path / "src"
    gpt2(src)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert vg("import", "hf", src, "-o", busy) == 2
    assert "not empty" in capsys.readouterr().err and (busy / "notes.txt").read_text() == "mine"
    assert vg("import", "hf", src, "-o", src / "run") == 2  # inside the input
    assert not (src / "run").exists()
    assert vg("import", "hf", src / "config.json", "-o", tmp_path / "r") == 2  # a file, not a directory
    assert vg("import", "hf", tmp_path / "nowhere", "-o", tmp_path / "r") == 2
    for bad in ("0", "-3", "nan", "1e3"):
        with pytest.raises(SystemExit):
            vg("import", "hf", src, "-o", tmp_path / "r", "--seq-len", bad)
    assert vg("import", "hf", src, "-o", tmp_path / "r", "--seq-len", str(POSITIONS + 1)) == 2
    assert "longer than the model's 32 positions" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert vg("import", "hf", src, "-o", empty, "--seq-len", "8") == 0  # an empty directory is fine
    assert load_model(empty).seq_len == 8
    assert not (tmp_path / "r").exists()


def test_an_import_interrupted_while_writing_leaves_no_run(tmp_path, monkeypatch) -> None:
    from vgraph.backends.hf import importer

    src = tmp_path / "src"
    gpt2(src)
    calls = []

    def interrupted(path, data, **kw):
        calls.append(Path(path).name)
        raise KeyboardInterrupt  # Ctrl-C after the checkpoint, while the run's files are written

    monkeypatch.setattr(importer, "atomic_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        importer.import_hf(src, tmp_path / "run")
    assert calls == ["network.yml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no run, no temporary beside it
