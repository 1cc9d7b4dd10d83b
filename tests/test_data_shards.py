"""Property tests of the prepared-corpus reader (vgraph/data/shards.py) and the sampler (vgraph/data/sampler.py).

Generated corpora (documents of any length, uint16 or uint32 ids, any number of shards) read back exactly,
window by window, across shard boundaries; a manifest, index or shard changed in any way (a flipped byte,
a truncation, a field of the wrong type, a name with '..', '/' or control characters, counts that lie)
either still describes the files exactly or is refused with a DataError naming a file, never another
exception.  The sampler is a bijection per epoch, a pure function of (seed, step), and splits a step's
batch between replicas without overlap.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgraph.data.encode import _write_shard
from vgraph.data.sampler import permute, sample_count, step_samples
from vgraph.data.shards import FORMAT, FORMAT_VERSION, DataError, open_prepared

SETTINGS = settings(derandomize=True, max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

documents = st.lists(st.lists(st.integers(0, 2**16 - 2), min_size=0, max_size=12), min_size=1, max_size=12)


def write_corpus(root: Path, shards: dict[str, list[list[list[int]]]], vocab: int = 2**16) -> dict:
    """A prepared directory of `shards` (split -> shards -> documents, each followed by eot id 0 here)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text("{}")
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    splits = {}
    unit = 0
    for split, parts in shards.items():
        entries = []
        for docs in parts:
            lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
            tokens = np.array([t for d in docs for t in d + [0]], dtype=np.int64)
            entries.append(_write_shard(str(root), split, unit, tokens, lengths, dtype))
            unit += 1
        splits[split] = {"tokens": sum(e["tokens"] for e in entries), "documents": sum(e["documents"] for e in entries),
                         "shards": entries}
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "vocab_size": vocab, "eot_id": 0,
                "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(b"{}").hexdigest()}, "splits": splits}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@SETTINGS
@given(train=st.lists(documents, min_size=1, max_size=4), val=st.lists(documents, min_size=1, max_size=2),
       wide=st.booleans(), data=st.data())
def test_generated_corpora_read_back_exactly(tmp_path_factory, train, val, wide, data) -> None:
    root = tmp_path_factory.mktemp("c")
    write_corpus(root, {"train": train, "val": val}, vocab=2**17 if wide else 2**16)
    corpus = open_prepared(root)
    stream = [t for docs in train for d in docs for t in d + [0]]
    assert corpus.train.tokens == len(stream) and corpus.train.documents == sum(map(len, train))
    assert corpus.manifest["dtype"] == ("uint32" if wide else "uint16")
    start = data.draw(st.integers(0, len(stream)))
    length = data.draw(st.integers(0, len(stream) - start))
    assert corpus.train.window(start, length).tolist() == stream[start:start + length]
    with pytest.raises(IndexError):
        corpus.train.window(start, len(stream) - start + 1)


def _mutations(manifest: dict) -> list:
    shard = ["splits", "train", "shards", 0]
    return [
        (["format"], "other"), (["version"], 2), (["version"], "1"), (["dtype"], "int8"), (["dtype"], "uint32"),
        (["vocab_size"], 2**16 + 1), (["vocab_size"], -1), (["vocab_size"], True), (["vocab_size"], 1e400),
        (["eot_id"], 2**16), (["tokenizer", "sha256"], "0" * 64), (["tokenizer"], None),
        (shard + ["bin"], "../train-00000.bin"), (shard + ["bin"], "/etc/passwd"), (shard + ["bin"], "train-0\x1b.bin"),
        (shard + ["bin"], "val-00001.bin"), (shard + ["idx"], "train-00009.idx"), (shard + ["tokens"], 1),
        (shard + ["tokens"], 10**30), (shard + ["documents"], 0), (shard + ["documents"], "2"),
        (shard + ["bin_sha256"], "f" * 64), (shard + ["idx_sha256"], "x"), (["splits", "train", "tokens"], 0),
        (["splits", "val", "documents"], 99), (["splits", "val"], []), (["splits"], {"train": {}}),
        (["splits", "train", "shards"], [None]),
    ]


def _set(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


@SETTINGS
@given(docs=st.lists(documents, min_size=1, max_size=2), pick=st.integers(0, 10**6))
def test_a_manifest_that_lies_is_refused(tmp_path_factory, docs, pick) -> None:
    root = tmp_path_factory.mktemp("m")
    manifest = write_corpus(root, {"train": docs, "val": docs[:1]})
    path, value = _mutations(manifest)[pick % len(_mutations(manifest))]
    _set(manifest, path, value)
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=str(root)):
        open_prepared(root)


@SETTINGS
@given(docs=st.lists(documents, min_size=1, max_size=3), file=st.sampled_from(["bin", "idx", "manifest.json"]),
       cut=st.integers(0, 10**6), flip=st.booleans(), byte=st.integers(0, 255))
def test_damaged_files_are_refused_or_still_exact(tmp_path_factory, docs, file, cut, flip, byte) -> None:
    root = tmp_path_factory.mktemp("d")
    write_corpus(root, {"train": docs, "val": docs[:1]})
    stream = [t for d in docs for doc in d for t in doc + [0]]
    target = root / (file if file == "manifest.json" else f"train-00000.{file}")
    raw = bytearray(target.read_bytes())
    if flip and raw:
        raw[cut % len(raw)] ^= byte or 1
    else:
        raw = raw[: cut % max(1, len(raw))]  # truncated
    target.write_bytes(bytes(raw))
    for verify in ("full", "size"):
        try:
            corpus = open_prepared(root, verify=verify)
        except DataError as exc:
            assert str(root) in str(exc)
            continue
        if verify == "size" and file == "bin":  # a same-size change of tokens escapes a size check (only)
            assert corpus.train.tokens == len(stream)
        else:  # opened: then it describes the files exactly (the change touched nothing that counts)
            assert corpus.train.window(0, corpus.train.tokens).tolist() == stream


def test_missing_shard_and_symlinked_shard_are_refused(tmp_path) -> None:
    write_corpus(tmp_path / "a", {"train": [[[1, 2], [3]]], "val": [[[4]]]})
    (tmp_path / "a" / "val-00001.bin").unlink()
    with pytest.raises(DataError, match="val-00001.bin: missing"):
        open_prepared(tmp_path / "a")
    write_corpus(tmp_path / "b", {"train": [[[1, 2], [3]]], "val": [[[4]]]})
    (tmp_path / "b" / "val-00001.idx").unlink()
    (tmp_path / "b" / "val-00001.idx").symlink_to(tmp_path / "b" / "train-00000.idx")
    with pytest.raises(DataError, match="not a regular file"):
        open_prepared(tmp_path / "b")
    with pytest.raises(DataError, match="not a directory"):
        open_prepared(tmp_path / "nothing")


# -- the sampler -------------------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 10**6))
def test_every_epoch_is_a_permutation(n, seed, epoch) -> None:
    assert sorted(permute(np.arange(n), n, seed, epoch).tolist()) == list(range(n))


@SETTINGS
@given(n=st.integers(1, 300), batch=st.integers(1, 40), seed=st.integers(0, 2**63 - 1), shares=st.data())
def test_steps_cover_each_epoch_once_and_replicas_split_a_step(n, batch, seed, shares) -> None:
    steps = -(-2 * n // batch)  # two epochs
    positions = np.concatenate([step_samples(seed, s, batch, n) for s in range(1, steps + 1)])
    assert sorted(positions[:n].tolist()) == list(range(n))  # the first epoch: every sample once
    assert sorted(positions[n:2 * n].tolist()) == list(range(n))
    step = shares.draw(st.integers(1, 10**9))
    cut = shares.draw(st.integers(0, batch))
    whole = step_samples(seed, step, batch, n)
    assert np.concatenate([step_samples(seed, step, batch, n, 0, cut),
                           step_samples(seed, step, batch, n, cut, batch)]).tolist() == whole.tolist()


def test_sample_count_and_bad_arguments() -> None:
    assert sample_count(17, 16) == 1 and sample_count(16, 16) == 0 and sample_count(33, 16) == 2
    with pytest.raises(ValueError):
        step_samples(0, 0, 4, 10)
    with pytest.raises(ValueError):
        step_samples(0, 1, 4, 10, 3, 2)
    with pytest.raises(ValueError):
        step_samples(0, 1, 4, 0)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux) to see the mappings")
def test_windows_are_read_without_mapping_the_shards(tmp_path: Path) -> None:
    """Training's resident memory must not follow the corpus: a memory map's touched (and read-ahead) pages
    count in it (474-646 MB more on a 2 GB corpus, docs/benchmarks-history.md), so windows are read, not mapped."""
    write_corpus(tmp_path / "c", {"train": [[[5, 6, 7]] * 40, [[8, 9]] * 30], "val": [[[1]]]})
    corpus = open_prepared(tmp_path / "c")
    got = [corpus.train.window(i, 7) for i in range(0, corpus.train.tokens - 7, 5)]
    assert got[0].tolist() == [5, 6, 7, 0, 5, 6, 7] and all(w.dtype == np.int64 for w in got)
    assert str(tmp_path / "c") not in Path("/proc/self/maps").read_text()


def test_a_shard_truncated_after_opening_is_a_data_error_naming_it(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c", {"train": [[[5, 6, 7]] * 40], "val": [[[1]]]})
    corpus = open_prepared(tmp_path / "c")
    shard = tmp_path / "c" / corpus.manifest["splits"]["train"]["shards"][0]["bin"]
    with open(shard, "r+b") as fh:
        fh.truncate(20)
    assert corpus.train.window(0, 10).tolist() == [5, 6, 7, 0, 5, 6, 7, 0, 5, 6]
    with pytest.raises(DataError, match=f"{shard.name}: ends before token 100"):
        corpus.train.window(90, 10)


@pytest.mark.parametrize("change", ["removed", "symlink"])
def test_a_shard_removed_or_replaced_by_a_link_after_opening_is_a_data_error(tmp_path: Path, change: str) -> None:
    write_corpus(tmp_path / "c", {"train": [[[5, 6, 7]] * 40], "val": [[[1]]]})
    (tmp_path / "elsewhere.bin").write_bytes(b"\0" * 4096)
    corpus = open_prepared(tmp_path / "c")
    shard = tmp_path / "c" / corpus.manifest["splits"]["train"]["shards"][0]["bin"]
    shard.unlink()
    if change == "symlink":
        shard.symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(DataError, match=f"{shard.name}: cannot read: .*prepare the corpus again"):
        corpus.train.window(0, 10)


def test_an_opened_corpus_reads_the_same_after_pickling(tmp_path: Path) -> None:
    """A stream sent to another process (pickled) reopens its shards there instead of reusing this
    process's descriptor numbers."""
    import pickle

    write_corpus(tmp_path / "c", {"train": [[[5, 6, 7]] * 40, [[8, 9]] * 30], "val": [[[1]]]})
    corpus = open_prepared(tmp_path / "c")
    first = corpus.train.window(100, 30)
    copy = pickle.loads(pickle.dumps(corpus.train))
    assert all(s._identity is None for s in copy.shards)  # re-learned from the file it opens there
    assert copy.window(100, 30).tolist() == first.tolist()
