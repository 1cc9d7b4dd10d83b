"""Tests for the default corpus, tokenizer and token batches (vgraph.backends.torch.data)."""

from __future__ import annotations

import sysconfig
import warnings

import pytest
import torch

from vgraph.backends.torch import data as D

SMALL_CORPUS_BYTES = 40_000


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return D.default_corpus_documents(max_bytes=SMALL_CORPUS_BYTES)


@pytest.fixture(scope="module")
def tokenizer(corpus: list[str], tmp_path_factory: pytest.TempPathFactory):
    return D.train_bpe_tokenizer(corpus, 300, tmp_path_factory.mktemp("tok"))


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def test_default_corpus_is_capped_deterministic_english(corpus: list[str]) -> None:
    assert len(corpus) > 10
    assert all(isinstance(doc, str) and doc for doc in corpus)
    total = sum(len(doc.encode("utf-8")) for doc in corpus)
    assert SMALL_CORPUS_BYTES - 4 <= total <= SMALL_CORPUS_BYTES
    text = " ".join(corpus)
    for word in (" the ", " is ", " of "):
        assert word in text
    assert D.default_corpus_documents(max_bytes=SMALL_CORPUS_BYTES) == corpus
    # A larger cap extends the same sequence of documents.
    bigger = D.default_corpus_documents(max_bytes=2 * SMALL_CORPUS_BYTES)
    assert bigger[: len(corpus) - 1] == corpus[:-1]


def test_default_corpus_skips_tests_and_vendored_code(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    stdlib = tmp_path / "lib"
    for rel, doc in {
        "a.py": "Alpha module documentation that is long enough to keep.",
        "pkg/b.py": "Beta package module documentation, long enough to keep.",
        "test/test_a.py": "Test docstring that must never reach the corpus at all.",
        "site-packages/x.py": "Third-party docstring that must never reach the corpus.",
        "idlelib/y.py": "IDLE docstring that must never reach the corpus at all.",
    }.items():
        path = stdlib / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f'"""{doc}"""\n\nclass C:\n    """Class docstring, which is also long enough to keep."""\n\n'
            "    def f(self):\n        'short'\n",
            encoding="utf-8",
        )
    (stdlib / "broken.py").write_text("def (:\n", encoding="utf-8")
    real = sysconfig.get_paths

    def fake_paths(*args, **kwargs):
        paths = dict(real(*args, **kwargs))
        paths["stdlib"] = str(stdlib)
        return paths

    monkeypatch.setattr(sysconfig, "get_paths", fake_paths)
    D._default_corpus_cached.cache_clear()
    try:
        docs = D.default_corpus_documents(max_bytes=10_000)
    finally:
        D._default_corpus_cached.cache_clear()
    assert docs == [
        "Alpha module documentation that is long enough to keep.",
        "Class docstring, which is also long enough to keep.",
        "Beta package module documentation, long enough to keep.",
        "Class docstring, which is also long enough to keep.",
    ]


# --------------------------------------------------------------------------
# Text files
# --------------------------------------------------------------------------


def test_load_text_documents_file_dir_and_glob(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.md").write_text("first", encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text("third", encoding="utf-8")
    (tmp_path / "ignored.py").write_text("nope", encoding="utf-8")

    assert D.load_text_documents(tmp_path / "b.txt") == ["second"]
    assert D.load_text_documents(tmp_path) == ["first", "second", "third"]
    assert D.load_text_documents(str(tmp_path / "**" / "*.txt")) == ["second", "third"]


def test_load_text_documents_errors_name_the_path(tmp_path) -> None:
    with pytest.raises(D.DataError, match="nothing-here"):
        D.load_text_documents(tmp_path / "nothing-here" / "*.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(D.DataError, match="empty"):
        D.load_text_documents(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(D.DataError, match="bad.txt"):
        D.load_text_documents(bad)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def test_tokenizer_exact_size_specials_and_roundtrip(tokenizer) -> None:
    assert tokenizer.get_vocab_size() == 300
    assert tokenizer.token_to_id(D.EOT_TOKEN) is not None
    assert tokenizer.token_to_id(D.PAD_TOKEN) is not None
    text = "Return the value.  héllo — 日本 🙂\n\tend"
    ids = tokenizer.encode(text).ids
    assert max(ids) < 300
    assert tokenizer.decode(ids) == text


def test_tokenizer_cache_hit_skips_training(corpus, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = D.train_bpe_tokenizer(corpus[:50], 280, tmp_path)
    cached = list(tmp_path.glob("bpe-*.json"))
    assert len(cached) == 1

    def boom(*args, **kwargs):
        raise AssertionError("retrained despite a cache hit")

    monkeypatch.setattr(D, "_train_fresh", boom)
    second = D.train_bpe_tokenizer(corpus[:50], 280, tmp_path)
    assert second.get_vocab() == first.get_vocab()
    # Different inputs are a cache miss.
    with pytest.raises(AssertionError, match="retrained"):
        D.train_bpe_tokenizer(corpus[:50], 281, tmp_path)
    with pytest.raises(AssertionError, match="retrained"):
        D.train_bpe_tokenizer(corpus[:49], 280, tmp_path)


def test_tokenizer_reports_smaller_real_size(tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = D.train_bpe_tokenizer(["tiny tiny corpus"], 5000, tmp_path)
    assert tok.get_vocab_size() < 5000
    assert any(str(tok.get_vocab_size()) in str(w.message) for w in caught)


def test_tokenizer_rejects_vocab_below_byte_alphabet(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 258"):
        D.train_bpe_tokenizer(["text"], 100, tmp_path)


# --------------------------------------------------------------------------
# TokenDataset
# --------------------------------------------------------------------------


def test_dataset_stream_and_split(corpus, tokenizer) -> None:
    ds = D.TokenDataset(corpus, tokenizer, seq_len=16)
    assert ds.tokens.dtype == torch.int64
    assert int((ds.tokens == ds.eot_id).sum()) == len(corpus)
    assert int(ds.tokens[-1]) == ds.eot_id
    assert torch.equal(torch.cat([ds.train_tokens, ds.val_tokens]), ds.tokens)
    assert ds.val_tokens.numel() >= 17
    assert ds.val_tokens.numel() == pytest.approx(0.05 * ds.tokens.numel(), abs=1)
    again = D.TokenDataset(corpus, tokenizer, seq_len=16)
    assert torch.equal(again.val_tokens, ds.val_tokens)


def test_dataset_val_holds_at_least_one_window(tokenizer) -> None:
    docs = ["A short document about the sea and the sky."] * 10
    ds = D.TokenDataset(docs, tokenizer, seq_len=32)
    assert ds.val_tokens.numel() >= 33
    assert len(list(ds.val_batches(4, 32))) == 1
    with pytest.raises(D.DataError, match="corpus too small"):
        D.TokenDataset(docs[:1], tokenizer, seq_len=32)


def test_batches_are_shifted_windows_and_resumable(corpus, tokenizer) -> None:
    ds = D.TokenDataset(corpus, tokenizer, seq_len=16)
    gen = torch.Generator().manual_seed(123)
    it = ds.batches("train", 4, 16, gen)
    inputs, targets = next(it)
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    stream = ds.train_tokens.tolist()
    for row_in, row_tg in zip(inputs.tolist(), targets.tolist()):
        assert any(
            stream[s : s + 16] == row_in and stream[s + 1 : s + 17] == row_tg
            for s in range(len(stream) - 16)
        )

    state = gen.get_state()
    expected = [next(it) for _ in range(3)]
    resumed_gen = torch.Generator()
    resumed_gen.set_state(state)
    resumed = ds.batches("train", 4, 16, resumed_gen)
    for (ei, et), (ri, rt) in zip(expected, (next(resumed) for _ in range(3))):
        assert torch.equal(ei, ri) and torch.equal(et, rt)

    val_in, _ = next(ds.batches("validation", 2, 8, torch.Generator().manual_seed(0)))
    assert set(val_in.flatten().tolist()) <= set(ds.val_tokens.tolist())
    with pytest.raises(ValueError, match="unknown split"):
        ds.batches("test", 2, 8, gen)


def test_val_batches_deterministic_non_overlapping(corpus, tokenizer) -> None:
    ds = D.TokenDataset(corpus, tokenizer, seq_len=16)
    batches = list(ds.val_batches(3, 16))
    again = list(ds.val_batches(3, 16))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    windows = (ds.val_tokens.numel() - 1) // 16
    assert inputs.shape == (windows, 16)
    assert all(b[0].shape[0] == 3 for b in batches[:-1])
    # Consecutive, non-overlapping input windows covering the split prefix.
    assert torch.equal(inputs.flatten(), ds.val_tokens[: windows * 16])
    assert torch.equal(targets.flatten(), ds.val_tokens[1 : windows * 16 + 1])
