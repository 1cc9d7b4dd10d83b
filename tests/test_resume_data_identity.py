"""A resume compares the data by what a run reads (PreparedCorpus.content_digest), not by how it was prepared.

Found by tools/same_training.py across two checkouts whose venvs had tokenizers 0.23.2 and 0.23.3: the same text
prepared under each wrote the same shards and tokenizer, but a manifest that records the tokenizers version (and a
plan that hashes it), so its digest differed, and `vgraph train --resume` refused the run ("it was trained with
data_digest=..."): a patch release of a dependency stranded a run whose every token was unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import tokenizers

from conftest import TINY
from test_data_training import _state
from vgraph.backends.torch.training.config import TrainingError
from vgraph.backends.torch.training.corpus import open_corpus
from vgraph.backends.torch.training.run_checkpoints import changed_identity
from vgraph.backends.torch.training.train import TrainConfig, train
from vgraph.data.stdlib_corpus import default_corpus_documents


@functools.cache
def text() -> str:
    """The corpus text (30 KB of the embedded corpus), made once per process and not while collecting."""
    return "\n<|endoftext|>\n".join(default_corpus_documents(max_bytes=30_000))


def _common(tmp_path: Path, data: Path) -> dict:
    return dict(network=str(TINY), data=str(data), batch=4, lr=3e-3, seed=7, val_every=3, val_batches=2,
                checkpoint_every=3, deterministic=True, threads=1, progress=False, tensorboard=False,
                cache_dir=tmp_path / "cache")


def _run(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


def test_a_corpus_prepared_again_under_another_tokenizers_version_resumes_bitwise(tmp_path, monkeypatch) -> None:
    data = tmp_path / "text.txt"
    data.write_text(text(), encoding="utf-8")
    common = _common(tmp_path, data)
    train(TrainConfig(**common, steps=6, out=tmp_path / "whole"))
    train(TrainConfig(**common, steps=3, out=tmp_path / "parts"))
    before = _run(tmp_path / "parts")
    monkeypatch.setattr(tokenizers, "__version__", tokenizers.__version__ + ".post1")  # a release installed since
    resumed = train(TrainConfig(**common, steps=6, out=tmp_path / "parts", resume=True))
    after = _run(tmp_path / "parts")
    # the premise: the corpus was prepared again (a cache entry of its own) into a manifest with another digest
    assert len([e for e in (tmp_path / "cache" / "corpora").iterdir() if e.is_dir()]) == 2  # (and their locks)
    assert after["data_digest"] != before["data_digest"] and after["data_content"] == before["data_content"]
    assert resumed.step == 6
    a, b = _state(tmp_path / "whole"), _state(tmp_path / "parts")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)  # weights and optimizer state, byte for byte


def test_other_tokens_under_the_same_name_are_still_refused(tmp_path) -> None:
    data = tmp_path / "text.txt"
    data.write_text(text(), encoding="utf-8")
    common = _common(tmp_path, data)
    train(TrainConfig(**common, steps=3, out=tmp_path / "run"))
    data.write_text(text().replace("the", "a"), encoding="utf-8")  # the same path: the run's "data" is unchanged
    with pytest.raises(TrainingError, match=r"cannot resume .*data_content=.*resuming must not change it"):
        train(TrainConfig(**common, steps=6, out=tmp_path / "run", resume=True))


def test_the_content_digest_ignores_provenance_and_sees_every_token_and_the_tokenizer(tmp_path) -> None:
    data = tmp_path / "text.txt"
    data.write_text(text(), encoding="utf-8")
    corpus, _ = open_corpus(TrainConfig(**_common(tmp_path, data)), 96, lambda line: None)
    m = corpus.manifest

    def digest_with(change) -> str:
        changed = json.loads(json.dumps(m))
        change(changed)
        return dataclasses.replace(corpus, manifest=changed).content_digest

    same = [lambda c: c.update(tokenizers_version="9.9.9", plan_sha256="0" * 64),
            lambda c: c.update(sources=[{"path": "elsewhere.txt", "kind": "file", "bytes": 1}]),
            lambda c: c["settings"].update(sample_bytes=1),
            lambda c: c["tokenizer"].update(file="moved.json")]
    assert all(digest_with(change) == corpus.content_digest for change in same)
    shard = m["splits"]["train"]["shards"][0]
    other = [lambda c: c["splits"]["train"]["shards"][0].update(bin_sha256="0" * 64),
             lambda c: c["splits"]["val"]["shards"][0].update(idx_sha256="0" * 64),
             lambda c: c["splits"]["train"]["shards"][0].update(tokens=shard["tokens"] - 1),
             lambda c: c["tokenizer"].update(sha256="0" * 64),
             lambda c: c.update(eot_id=1),
             lambda c: c.update(dtype="uint32")]
    assert len({digest_with(change) for change in other} | {corpus.content_digest}) == len(other) + 1


BEFORE = {"seed": 7, "batch": 4, "seq_len": 16, "data": "t.txt", "data_digest": "a" * 64, "data_content": "c" * 64,
          "vocab_size": 96, "tokenizer": "char"}


@pytest.mark.parametrize("now, refused", [
    ({}, None),
    ({"data_digest": "b" * 64}, None),  # prepared again, the same content
    ({"data_content": "d" * 64}, "data_content"),
    ({"data_digest": "b" * 64, "data_content": "d" * 64}, "data_content"),
    ({"seed": 8}, "seed"),
    ({"data": "u.txt"}, "data"),
])
def test_the_identity_compares_content_when_both_record_it(now, refused) -> None:
    got = changed_identity(Path("run"), BEFORE, {**BEFORE, **now})
    assert (got is None) if refused is None else (f"{refused}=" in got and got.startswith("cannot resume run:"))


def test_a_checkpoint_from_before_the_content_digest_is_compared_by_its_manifest_digest() -> None:
    old = {k: v for k, v in BEFORE.items() if k != "data_content"}
    assert changed_identity(Path("run"), old, BEFORE) is None
    assert "data_digest=" in changed_identity(Path("run"), old, {**BEFORE, "data_digest": "b" * 64})


def test_a_launch_resumes_across_the_corpus_prepared_again(tmp_path, monkeypatch, capsys) -> None:
    """The launch's rank 0 checks a resume with the same rule (rank_zero.GatheredCheckpoints)."""
    from vgraph.backends.torch.distributed.launcher.launch import main as launch_main

    data = tmp_path / "text.txt"
    data.write_text(text(), encoding="utf-8")
    (tmp_path / "fleet.yml").write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    monkeypatch.setenv("VGRAPH_CACHE_DIR", str(tmp_path / "cache"))

    def launch(steps: int, *resume: str) -> None:
        code = launch_main(["launch", str(TINY), "--fleet", str(tmp_path / "fleet.yml"), "--data", str(data),
                            "--steps", str(steps), "--batch", "4", "--replicas", "1", "--checkpoint-every", "3",
                            "--val-every", "0", "--threads", "1", "--seed", "7", "--out", str(tmp_path / "run"),
                            "--quiet", *resume])
        assert code == 0, capsys.readouterr().err[-3000:]

    launch(3)
    before = _run(tmp_path / "run")
    monkeypatch.setattr(tokenizers, "__version__", tokenizers.__version__ + ".post1")
    launch(6, "--resume")
    after = _run(tmp_path / "run")
    assert after["data_digest"] != before["data_digest"] and after["data_content"] == before["data_content"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # resumed at 3, not refused, nothing trained twice
