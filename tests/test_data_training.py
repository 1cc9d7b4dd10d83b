"""Training from prepared shards: exact resume, replicas reading disjoint samples, the corpus cache, hostile data.

Evidence, not resemblance: the resumed run's weights and optimizer state are compared byte for byte with an
uninterrupted run's; the replicas' samples are recorded inside the launch workers (a --plugin spy on
TokenShards.batch) and compared with the sampler's global batches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY
from vgraph.backends.torch.training.batches import TokenShards
from vgraph.backends.torch.distributed.launcher.launch import main as launch_main
from vgraph.backends.torch.training.train import TrainConfig, train
from vgraph.cli import main
from vgraph.data.cache import cache_root
from vgraph.data.sampler import step_samples
from vgraph.data.shards import open_prepared
from vgraph.data.stdlib_corpus import default_corpus_documents

FLEET = "name: two\npnodes:\n" + "".join(
    f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A prepared corpus for the tiny networks (vocabulary 96: a character tokenizer)."""
    d = tmp_path_factory.mktemp("prepared")
    (d / "c.txt").write_text("\n<|endoftext|>\n".join(default_corpus_documents(max_bytes=40_000)), encoding="utf-8")
    assert main(["data", "prepare", str(d / "c.txt"), "-o", str(d / "corpus"), "--vocab", "96", "--quiet"]) == 0
    return d / "corpus"


def _state(run: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    latest = run / (run / "latest").read_text().strip()
    out = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        with safe_open(str(latest / name), framework="pt") as f:
            out.update({f"{name}:{k}": f.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                        for k in f.keys()})
    return out


def test_resume_from_shards_is_bitwise_exact(prepared, tmp_path) -> None:
    common = dict(network=str(TINY), data=str(prepared), batch=4, lr=3e-3, seed=7, val_every=3, val_batches=2,
                  deterministic=True, threads=1, progress=False, tensorboard=False)
    whole = train(TrainConfig(**common, steps=8, out=tmp_path / "whole"))
    train(TrainConfig(**common, steps=3, out=tmp_path / "parts"))
    resumed = train(TrainConfig(**common, steps=8, out=tmp_path / "parts", resume=True))
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history]
    a, b = _state(tmp_path / "whole"), _state(tmp_path / "parts")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    run = json.loads((tmp_path / "parts" / "run.json").read_text())
    assert run["data_digest"] == open_prepared(prepared).digest and run["data"] == str(prepared)


def test_batches_are_the_samples_the_seed_and_step_name(prepared) -> None:
    corpus = open_prepared(prepared)
    shards = TokenShards(corpus, seq_len=16, vocab=96, seed=3)
    inputs, targets = shards.batch(5, 6)
    ids = step_samples(3, 5, 6, shards.samples)
    stream = corpus.train.window(0, corpus.train.tokens)
    for row, sample in enumerate(ids):
        assert inputs[row].tolist() == stream[sample * 16:sample * 16 + 16].tolist()
        assert targets[row].tolist() == stream[sample * 16 + 1:sample * 16 + 17].tolist()
    assert torch.equal(shards.batch(5, 6, 2, 4)[0], inputs[2:4])
    val = list(shards.val_batches(4))
    flat = torch.cat([x for x, _ in val]).reshape(-1).tolist()
    assert flat == corpus.val.window(0, len(flat)).tolist()  # consecutive windows, every token scored once


SPY = '''
import json, os
from vgraph.backends.torch.training.batches import TokenShards

_batch = TokenShards.batch

def _spy(self, step, batch, lo=0, hi=None):
    with open(RECORD, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "step": step, "lo": lo, "hi": batch if hi is None else hi,
                            "ids": self.sample_ids(step, batch, lo, hi).tolist()}) + "\\n")
    return _batch(self, step, batch, lo, hi)

TokenShards.batch = _spy
'''


def test_two_replicas_read_disjoint_samples_none_twice_in_an_epoch(prepared, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "fleet.yml").write_text(FLEET)
    record = tmp_path / "samples.jsonl"
    spy = tmp_path / "spy.py"
    spy.write_text(f"RECORD = {str(record)!r}\n" + SPY)
    monkeypatch.setattr(TokenShards, "batch", TokenShards.batch)  # the launcher imports the spy here too
    code = launch_main(["launch", str(TINY), "--fleet", str(tmp_path / "fleet.yml"), "--data", str(prepared),
                        "--steps", "6", "--batch", "4", "--replicas", "2", "--val-every", "0", "--threads", "1",
                        "--seed", "11", "--plugin", str(spy), "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    reads = [json.loads(line) for line in record.read_text().splitlines()]
    by_worker: dict[int, list[dict]] = {}
    for r in reads:
        by_worker.setdefault(r["pid"], []).append(r)
    assert len(by_worker) == 2 and all(len(v) == 6 for v in by_worker.values())
    shares = sorted({(r["lo"], r["hi"]) for r in reads})
    assert shares == [(0, 2), (2, 4)]  # each replica asks for its own positions only
    n = TokenShards(open_prepared(prepared), seq_len=16, vocab=96, seed=11).samples
    assert n > 24  # the 6 steps x 4 samples lie in the first epoch
    for step in range(1, 7):
        mine = [r["ids"] for r in reads if r["step"] == step]
        assert not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == sorted(step_samples(11, step, 4, n).tolist())
    every = [i for r in reads for i in r["ids"]]
    assert len(every) == len(set(every)) == 24  # none read twice (by anybody) in the epoch


def test_the_embedded_corpus_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    code = ("import sys\nfrom vgraph.data.cache import default_corpus\n"
            "c = default_corpus(30000, 96, lambda m: print(m, flush=True))\nprint('tokens', c.train.tokens)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("data: building the cache" in o for o in outs) == 1, outs  # concurrent: one builds, one waits
    assert sum("another process is building" in o for o in outs) <= 1
    assert len({o.splitlines()[-1] for o in outs}) == 1
    said: list[str] = []
    from vgraph.data.cache import default_corpus

    corpus = default_corpus(30000, 96, said.append)
    assert any("from the cache" in s for s in said) and not any("building" in s for s in said)
    # damaged: a shard truncated -> rebuilt, never trusted
    shard = corpus.root / corpus.manifest["splits"]["train"]["shards"][0]["bin"]
    shard.write_bytes(shard.read_bytes()[:-2])
    said.clear()
    again = default_corpus(30000, 96, said.append)
    assert any("is damaged" in s and "rebuilding" in s for s in said)
    assert again.digest == corpus.digest and (again.root / shard.name).stat().st_size == shard.stat().st_size
    assert cache_root() == tmp_path / "cache"


def test_a_cache_lock_file_planted_as_a_symlink_is_refused_and_nothing_is_made_at_its_target(tmp_path) -> None:
    """The cache's lock is opened as prepare's is (prepare.exclusive): without following a link, so a symlink
    planted where the lock goes cannot make the cache create a file elsewhere; the user is told which file."""
    from vgraph.data.cache import cached, embedded_recipe
    from vgraph.data.shards import DataError

    recipe = embedded_recipe(30000, 96)
    name = recipe.entry_name
    corpora = tmp_path / "cache" / "corpora"
    corpora.mkdir(parents=True)
    target = tmp_path / "elsewhere" / "planted"
    target.parent.mkdir()
    (corpora / f".{name}.lock").symlink_to(target)
    with pytest.raises(DataError, match=r"cannot open the lock file .*symbolic link"):
        cached(recipe, lambda line: None, tmp_path / "cache")
    assert not target.exists() and not (corpora / name).exists()


def test_cache_root_honours_xdg_and_vgraph_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("VGRAPH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "vgraph"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "vgraph"
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "v"))
    assert cache_root() == tmp_path / "v"


def test_first_run_says_it_builds_the_cache_and_every_phase_its_time(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["train", str(TINY), "--steps", "2", "--batch", "2", "--corpus-bytes", "30000", "--val-every", "0",
            "--threads", "1", "--no-tensorboard"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().err
    assert "building the cache of the embedded corpus" in first and "built the cache" in first
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    second = capsys.readouterr().err
    assert "building" not in second and "from the cache" in second
    for phase in ("setup: network loaded", "setup: memory estimate", "setup: data: ", "setup: compiled"):
        assert phase in second, second
    # captured (not a terminal): progress comes as lines (tools/main.sh), the first step's and the last's
    assert "train: step 1/2 (50%) loss=" in second and "train: step 2/2 (100%)" in second, second


# -- hostile data: a diagnostic naming the file, exit 2, the run directory untouched ------------------------------


def test_hostile_prepared_corpora_are_refused_before_training(prepared, tmp_path, capsys) -> None:
    import shutil

    def run(data: Path, net: Path = TINY) -> str:
        out = tmp_path / f"run-{data.name}"
        code = main(["train", str(net), "--data", str(data), "--steps", "1", "--batch", "2", "--out", str(out),
                     "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert not (out / "latest").exists()
        return err

    truncated = tmp_path / "truncated"
    shutil.copytree(prepared, truncated)
    shard = truncated / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert "train-00000.bin" in run(truncated) and "truncated" in run(truncated)
    lying = tmp_path / "lying"
    shutil.copytree(prepared, lying)
    m = json.loads((lying / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["bin_sha256"] = "0" * 64
    (lying / "manifest.json").write_text(json.dumps(m))
    assert "train-00000.bin: its SHA-256 differs from the manifest's" in run(lying)
    wide = tmp_path / "wide"
    assert main(["data", "prepare", str(prepared.parent / "c.txt"), "-o", str(wide), "--vocab", "300", "--quiet"]) == 0
    assert "prepared with a tokenizer of 300 tokens, but the network's vocabulary is 96" in run(wide)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("\n\n")
    assert "the corpus is empty" in run(tmp_path / "empty")


def test_text_given_to_data_is_found_once_so_the_cache_key_names_the_files_prepared(tmp_path) -> None:
    """The cache keys `--data` text by the content of the files it found; prepare reads those files, not a
    second look at the directory (a file added in between would be in an entry keyed without it)."""
    from vgraph.data.cache import cached, files_recipe

    folder = tmp_path / "text"
    folder.mkdir()
    docs = default_corpus_documents(max_bytes=6_000)
    (folder / "a.txt").write_text("\n<|endoftext|>\n".join(docs[:10]), encoding="utf-8")
    (folder / "logo.png").write_bytes(b"\x89PNG not text")
    recipe = files_recipe([str(folder)], 64)
    assert [Path(s.path).name for s in recipe.sources] == ["a.txt"] and len(recipe.skipped) == 1
    (folder / "b.txt").write_text("\n<|endoftext|>\n".join(docs[10:20]), encoding="utf-8")  # after the key
    said: list[str] = []
    corpus = cached(recipe, said.append, tmp_path / "cache")
    assert [Path(s["path"]).name for s in corpus.manifest["sources"]] == ["a.txt"]
    assert json.loads((corpus.root / "cache-key.json").read_text())["content"] == recipe.key["content"]
    assert said.count(recipe.skipped[0]) == 1  # the skipped file is said when the entry is built ...
    said.clear()
    again = cached(files_recipe([str(folder)], 64), said.append, tmp_path / "cache")  # b.txt now: another key
    assert again.root != corpus.root and len(again.manifest["sources"]) == 2
    said.clear()
    cached(recipe, said.append, tmp_path / "cache")
    assert any("from the cache" in s for s in said) and not any("skipp" in s for s in said)  # ... not when read


def test_a_run_loads_the_tokenizer_it_checked_without_reading_the_file_again(prepared, tmp_path, monkeypatch) -> None:
    """Opened in full, a corpus keeps its tokenizer's text as its ids were checked; the run's tokenizer is
    built from that text (a file swapped after the check is never what the run tokenizes with)."""
    import vgraph.data.tokenizer as tokenizer_module
    from vgraph.backends.torch.training.corpus import prepare_data

    text = (prepared / "tokenizer.json").read_text(encoding="utf-8")
    assert open_prepared(prepared, verify="full").tokenizer_json == text
    assert open_prepared(prepared, verify="size").tokenizer_json is None  # a worker's open reads no tokenizer
    reads: list[str] = []
    real = tokenizer_module.read_input
    monkeypatch.setattr(tokenizer_module, "read_input", lambda path, **kw: reads.append(str(path)) or real(path, **kw))
    data = prepare_data(TrainConfig(network=str(TINY), data=str(prepared)), 96, 16)
    assert reads == []
    assert data.tokenizer.to_str() == tokenizer_module.load_tokenizer(str(prepared / "tokenizer.json")).to_str()
    assert reads == [str(prepared / "tokenizer.json")]  # the premise: load_tokenizer reads through read_input
