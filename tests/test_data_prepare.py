"""`vgraph data prepare` (vgraph/data/): inputs, tokenizer, shards and manifest, restart, hostile inputs.

The oracle for the shards is the tokenizer itself: the tokens of every document, followed by the end-of-text
id, read back from the memory-mapped shards through the document index, must equal `tokenizer.encode(doc)`
for the documents the hash rule puts in that split.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest

from vgraph.cli import main
from vgraph.data import encode
from vgraph.data.prepare import WORK_DIR, PrepareOptions, prepare
from vgraph.data.shards import DataError, open_prepared
from vgraph.data.stdlib_corpus import default_corpus_documents
from vgraph.data.tokenizer import EOT_TOKEN, PAD_TOKEN, load_tokenizer, train_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
QUIET = dict(say=lambda m: None, progress=False)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return default_corpus_documents(max_bytes=60_000)


@pytest.fixture(scope="module")
def tok_file(docs, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_tokenizer(docs, 300).to_str(), encoding="utf-8")
    return str(path)


def write_text_corpus(path: Path, documents: list[str]) -> Path:
    path.write_text("\n<|endoftext|>\n".join(documents), encoding="utf-8")
    return path


def read_documents(corpus, split: str) -> list[list[int]]:
    """Every document of a split, from the memory maps and the .idx files."""
    out = []
    for shard in corpus.manifest["splits"][split]["shards"]:
        tokens = np.memmap(corpus.root / shard["bin"], dtype=corpus.manifest["dtype"], mode="r")
        offsets = np.fromfile(corpus.root / shard["idx"], dtype="<u8", offset=16)
        out += [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    return out


def expected_split(documents: list[str], tokenizer, fraction: float, split: str) -> list[list[int]]:
    eot = tokenizer.token_to_id(EOT_TOKEN)
    keep = [d for d in documents if (encode.doc_hash(d) < fraction * 2.0**64) == (split == "val")]
    return [tokenizer.encode(d, add_special_tokens=False).ids + [eot] for d in keep]


# -- the standard library corpus ---------------------------------------------------------------------------


def test_default_corpus_is_capped_deterministic_english(docs) -> None:
    total = sum(len(doc.encode("utf-8")) for doc in docs)
    assert len(docs) > 10 and 60_000 - 4 <= total <= 60_000
    assert all(w in " ".join(docs) for w in (" the ", " is ", " of "))
    assert default_corpus_documents(max_bytes=60_000) == docs
    assert default_corpus_documents(max_bytes=120_000)[: len(docs) - 1] == docs[:-1]


def test_the_kept_walk_answers_every_size_as_a_fresh_walk(monkeypatch) -> None:
    """The walk kept for the process (a smaller request after a larger one, a larger one extending it, the same
    one again) answers as a process that never walked before, and a caller's edits do not reach the next."""
    import vgraph.data.stdlib_corpus as corpus

    monkeypatch.setattr(corpus, "_WALKS", {})
    sizes = (30_000, 8_000, 30_000, 45_001, 1)
    kept = [corpus.default_corpus_documents(max_bytes=n) for n in sizes]
    assert len(corpus._WALKS) == 1 and len(kept[0]) > 5  # the premise: the later requests read the kept walk
    kept[0].append("edited by a caller")
    kept[0][0] = "and this too"
    again = corpus.default_corpus_documents(max_bytes=30_000)
    fresh = {}
    for n in sorted(set(sizes)):
        monkeypatch.setattr(corpus, "_WALKS", {})  # a process that never walked
        fresh[n] = corpus.default_corpus_documents(max_bytes=n)
    assert kept[1:] == [fresh[n] for n in sizes[1:]] and again == fresh[30_000]
    assert 45_001 - 4 <= sum(len(d.encode("utf-8")) for d in kept[3]) <= 45_001


def test_default_corpus_skips_tests_and_vendored_code(monkeypatch, tmp_path) -> None:
    stdlib = tmp_path / "lib"
    for rel, doc in {"a.py": "Alpha module documentation that is long enough to keep.",
                     "test/test_a.py": "Test docstring that must never reach the corpus at all.",
                     "site-packages/x.py": "Third-party docstring that must never reach the corpus."}.items():
        (stdlib / rel).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / rel).write_text(f'"""{doc}"""\n\nclass C:\n    """Class docstring, which is also long enough '
                                  f'to keep."""\n    def f(self):\n        "short"\n', encoding="utf-8")
    (stdlib / "broken.py").write_text("def (:\n", encoding="utf-8")
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "stdlib": str(stdlib)})
    assert default_corpus_documents(max_bytes=10_000) == [
        "Alpha module documentation that is long enough to keep.", "Class docstring, which is also long enough to keep."]


# -- the tokenizer --------------------------------------------------------------------------------------------


def test_trained_tokenizer_exact_size_specials_roundtrip_and_short_corpus(docs) -> None:
    tokenizer = train_tokenizer(docs, 300)
    assert tokenizer.get_vocab_size() == 300
    assert tokenizer.token_to_id(EOT_TOKEN) == 0 and tokenizer.token_to_id(PAD_TOKEN) == 1
    text = "Return the value.  héllo — 日本 🙂\n\tend"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a smaller tokenizer is prepare's message (tests/test_hardening_data4.py)
        small = train_tokenizer(["tiny tiny corpus"], 5000)
    assert 258 <= small.get_vocab_size() < 5000
    assert train_tokenizer(docs, 40).get_vocab_size() == 40  # characters below 258


def test_given_tokenizer_must_load_and_have_end_of_text(tmp_path, docs) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json: not a `tokenizers` JSON"):
        load_tokenizer(str(tmp_path / "bad.json"))
    from tokenizers import Tokenizer, models

    (tmp_path / "noeot.json").write_text(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).to_str())
    with pytest.raises(DataError, match="no <\\|endoftext\\|> token"):
        load_tokenizer(str(tmp_path / "noeot.json"))


# -- prepare: every input kind, the shards against the tokenizer ---------------------------------------------------


def test_text_corpus_shards_hold_every_document_in_its_split(docs, tok_file, tmp_path) -> None:
    src = write_text_corpus(tmp_path / "c.txt", docs)
    corpus = prepare([str(src)], tmp_path / "out", PrepareOptions(tokenizer=tok_file, unit_bytes=20_000), **QUIET)
    tokenizer = load_tokenizer(tok_file)
    parts = src.read_text(encoding="utf-8").split("\n<|endoftext|>\n")
    parts = [p + "\n" for p in parts[:-1]] + parts[-1:]  # the separator line takes its own newline only
    assert len(corpus.manifest["splits"]["train"]["shards"]) >= 3  # cut into units at separator lines
    for split in ("train", "val"):
        assert read_documents(corpus, split) == expected_split(parts, tokenizer, 0.05, split)
    assert corpus.manifest["dtype"] == "uint16" and corpus.manifest["val_split"] == "documents by content hash"
    assert corpus.train.documents + corpus.val.documents == len(docs)
    assert not (tmp_path / "out" / WORK_DIR).exists()


def test_jsonl_parquet_and_directories_give_the_same_documents(docs, tok_file, tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w", encoding="utf-8") as fh:
        for d in docs[:40]:
            fh.write(json.dumps({"body": d, "n": 1}) + "\n\n")
    pq.write_table(pa.table({"body": docs[40:]}), tmp_path / "in" / "b.parquet", row_group_size=7)
    corpus = prepare([str(tmp_path / "in")], tmp_path / "out",
                     PrepareOptions(tokenizer=tok_file, field="body", column="body", unit_bytes=3_000), **QUIET)
    tokenizer = load_tokenizer(tok_file)
    for split in ("train", "val"):
        assert read_documents(corpus, split) == expected_split(docs, tokenizer, 0.05, split)
    # the same files through a glob, one by one
    again = prepare([str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "in" / "*.parquet")], tmp_path / "out2",
                    PrepareOptions(tokenizer=tok_file, field="body", column="body"), **QUIET)
    assert read_documents(again, "train") == read_documents(corpus, "train")


def test_saved_datasets_directory_is_read_with_pyarrow(docs, tok_file, tmp_path) -> None:
    """tests/fixtures/hf_saved/ was written by `datasets` (Dataset.from_dict({"text": ...}).save_to_disk)."""
    pytest.importorskip("pyarrow")
    saved = FIXTURES / "hf_saved"
    corpus = prepare([str(saved)], tmp_path / "out", PrepareOptions(tokenizer=tok_file), **QUIET)
    texts = json.loads((saved / "texts.json").read_text(encoding="utf-8"))
    tokenizer = load_tokenizer(tok_file)
    # (20 documents: the hash may leave validation empty, and then one document moves there)
    assert sorted(read_documents(corpus, "train") + read_documents(corpus, "val")) == \
        sorted(expected_split(texts, tokenizer, 0.05, "train") + expected_split(texts, tokenizer, 0.05, "val"))
    assert corpus.val.documents >= 1
    with pytest.raises(DataError, match="no column 'body'.*--column"):
        prepare([str(saved)], tmp_path / "o2", PrepareOptions(tokenizer=tok_file, column="body"), **QUIET)


def test_vocab_over_65536_is_uint32(tmp_path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {EOT_TOKEN: 0, **{f"w{i}": i + 1 for i in range(70_000)}, "[U]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[U]"))
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "t.json").write_text(tok.to_str())
    write_text_corpus(tmp_path / "c.txt", ["w69999 w1 w2", "w3 w69000", "w5 w6 w7", "w8"] * 10)
    corpus = prepare([str(tmp_path / "c.txt")], tmp_path / "out", PrepareOptions(tokenizer=str(tmp_path / "t.json")),
                     **QUIET)
    assert corpus.manifest["dtype"] == "uint32"
    assert 70_000 in corpus.train.window(0, corpus.train.tokens).tolist() + corpus.val.window(0, corpus.val.tokens).tolist()


def test_a_single_document_gives_validation_its_tail(tok_file, tmp_path, docs) -> None:
    (tmp_path / "one.txt").write_text(" ".join(docs[:20]), encoding="utf-8")
    corpus = prepare([str(tmp_path / "one.txt")], tmp_path / "out", PrepareOptions(tokenizer=tok_file), **QUIET)
    assert corpus.manifest["val_split"] == "tail of the only document"
    whole = load_tokenizer(tok_file).encode(" ".join(docs[:20]), add_special_tokens=False).ids + [0]
    assert corpus.train.window(0, corpus.train.tokens).tolist() + corpus.val.window(0, corpus.val.tokens).tolist() \
        == whole
    assert corpus.val.tokens == -(-len(whole) * 5 // 100)


def test_few_documents_still_give_each_split_one(tok_file, tmp_path, docs) -> None:
    write_text_corpus(tmp_path / "c.txt", docs[:3])
    corpus = prepare([str(tmp_path / "c.txt")], tmp_path / "out", PrepareOptions(tokenizer=tok_file), **QUIET)
    assert corpus.train.documents >= 1 and corpus.val.documents >= 1
    assert corpus.train.documents + corpus.val.documents == 3


# -- restart, atomicity ----------------------------------------------------------------------------------------------


def test_killed_prepare_resumes_and_other_settings_start_clean(docs, tok_file, tmp_path) -> None:
    src = write_text_corpus(tmp_path / "c.txt", docs)
    opts = PrepareOptions(tokenizer=tok_file, unit_bytes=15_000)
    reference = prepare([str(src)], tmp_path / "ref", opts, **QUIET).manifest
    out = tmp_path / "out"
    code = ("import sys, os\nfrom vgraph.data import encode, prepare as P\nreal = encode.encode_unit\n"
            "def dying(task, *a, **k):\n    if task['unit'] == 2: os._exit(9)\n    return real(task, *a, **k)\n"
            "encode.encode_unit = dying\n"
            f"P.prepare([{str(src)!r}], {str(out)!r}, P.PrepareOptions(tokenizer={tok_file!r}, unit_bytes=15_000), "
            "say=lambda m: None, progress=False)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9  # killed mid-way, units 0 and 1 done
    assert not (out / "manifest.json").exists() and len(list((out / WORK_DIR).glob("unit-*.json"))) == 2
    said: list[str] = []
    resumed = prepare([str(src)], out, opts, say=said.append, progress=False)
    assert any("resuming: 2 of" in s for s in said)
    assert resumed.manifest["splits"] == reference["splits"]
    # the same again: nothing to do; other settings over a finished corpus: refused, nothing touched
    said.clear()
    prepare([str(src)], out, opts, say=said.append, progress=False)
    assert any("already holds this corpus" in s for s in said)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(DataError, match="other inputs or settings"):
        prepare([str(src)], out, PrepareOptions(tokenizer=tok_file, val_fraction=0.2), **QUIET)
    assert sorted(p.name for p in out.iterdir()) == before
    # an unfinished prepare of other settings is ours to clear
    (out / "manifest.json").unlink()
    (out / WORK_DIR).mkdir()
    (out / WORK_DIR / "plan.json").write_text("{}")
    said.clear()
    again = prepare([str(src)], out, PrepareOptions(tokenizer=tok_file, val_fraction=0.2), say=said.append,
                    progress=False)
    assert any("starting clean" in s for s in said) and again.manifest["settings"]["val_fraction"] == 0.2


def test_parallel_workers_write_what_one_process_writes(docs, tok_file, tmp_path) -> None:
    src = write_text_corpus(tmp_path / "c.txt", docs * 60)  # > 8 MB would be needed for the pool by size
    import vgraph.data.prepare as P

    opts = dict(tokenizer=tok_file, unit_bytes=400_000)
    one = prepare([str(src)], tmp_path / "one", PrepareOptions(**opts, workers=1), **QUIET)
    old = P._IN_PROCESS_BYTES
    P._IN_PROCESS_BYTES = 0
    try:
        two = prepare([str(src)], tmp_path / "two", PrepareOptions(**opts, workers=2), **QUIET)
    finally:
        P._IN_PROCESS_BYTES = old
    assert two.manifest["splits"] == one.manifest["splits"] and len(two.manifest["splits"]["train"]["shards"]) > 2


# -- hostile inputs: a diagnostic naming the file (and line), exit 2, nothing written --------------------------------


def run_cli(*argv: str, capsys) -> tuple[int, str]:
    code = main(["data", "prepare", *argv, "--quiet"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("lines", "message"), [
    (['{"text": "ok"}', "not json"], ":2: not JSON"),
    (['{"text": "ok"}', '{"body": "x"}'], ":2: no field 'text' .*--field"),
    (['{"text": "ok"}', "", '[1, 2]'], ":3: a JSON list, not an object"),
    (['{"text": 5}'], ":1: field 'text' is a int, not text"),
])
def test_bad_jsonl_line_names_file_and_line(lines, message, tmp_path, tok_file, capsys) -> None:
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    code, err = run_cli(str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "out"), "--tokenizer", tok_file,
                        capsys=capsys)
    assert code == 2 and "Traceback" not in err
    assert __import__("re").search("d.jsonl" + message, err), err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_hostile_outputs_and_inputs_are_refused_and_nothing_changes(tmp_path, tok_file, docs, capsys) -> None:
    (tmp_path / "in").mkdir()
    src = write_text_corpus(tmp_path / "in" / "c.txt", docs[:30])
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    (run / "network.yml").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe")
    cases = [
        ([str(src), "-o", str(tmp_path / "in")], "is, holds or lies inside the input"),
        ([str(tmp_path / "in"), "-o", str(tmp_path / "in" / "out")], "lies inside the input"),
        ([str(src), "-o", str(run / "data")], "inside the training run"),
        ([str(src), "-o", str(tmp_path / "full")], "not empty and not a corpus being prepared"),
        ([str(src), "-o", str(tmp_path / "ctl\x1b[2J")], "printable"),
        ([str(src), "-o", str(src)], "not a directory|lies inside"),
        ([str(tmp_path / "empty.txt"), "-o", str(tmp_path / "o1")], "the corpus is empty"),
        ([str(tmp_path / "bad.txt"), "-o", str(tmp_path / "o2")], "bad.txt:2: not UTF-8"),
        ([str(tmp_path / "nothing" / ".." / "*.txt"), "-o", str(tmp_path / "o3")], "no such file"),
        ([str(tmp_path / "x.parquet"), "-o", str(tmp_path / "o4")], "no such file"),
    ]
    for argv, message in cases:
        before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
        code, err = run_cli(*argv, "--tokenizer", tok_file, capsys=capsys)
        assert code == 2 and "Traceback" not in err and "\x1b" not in err, (argv, err)
        assert __import__("re").search(message, err), (argv, err)
        assert {p: p.stat().st_mtime_ns for p in before if p.exists()} == before, argv
        assert not any(tmp_path.rglob("manifest.json")), argv
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep me"


def test_parquet_without_the_column_and_a_saved_datasetdict(tmp_path, tok_file, capsys) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a text", "another"], "n": [1, 2]}), tmp_path / "t.parquet")
    code, err = run_cli(str(tmp_path / "t.parquet"), "-o", str(tmp_path / "o"), "--tokenizer", tok_file, capsys=capsys)
    assert code == 2 and "t.parquet: no column 'text' (columns: body, n" in err
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    code, err = run_cli(str(tmp_path / "n.parquet"), "-o", str(tmp_path / "o"), "--tokenizer", tok_file, capsys=capsys)
    assert code == 2 and "column 'text' holds int64, not text" in err
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (tmp_path / "dd" / "train" / "state.json").write_text("{}")
    code, err = run_cli(str(tmp_path / "dd"), "-o", str(tmp_path / "o"), "--tokenizer", tok_file, capsys=capsys)
    assert code == 2 and "a saved DatasetDict (splits train): give one split's directory" in err
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text('{"_data_files": [{"filename": "../../etc/passwd.arrow"}]}')
    code, err = run_cli(str(tmp_path / "ds"), "-o", str(tmp_path / "o"), "--tokenizer", tok_file, capsys=capsys)
    assert code == 2 and "is not an .arrow name inside the dataset directory" in err


def test_pyarrow_missing_is_named_with_the_extra(tmp_path, tok_file, monkeypatch, capsys) -> None:
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    code, err = run_cli(str(tmp_path / "t.parquet"), "-o", str(tmp_path / "o"), "--tokenizer", tok_file, capsys=capsys)
    assert code == 2 and "needs pyarrow: pip install 'vgraph[data]'" in err


def test_the_command_never_imports_torch(tmp_path, tok_file, docs) -> None:
    write_text_corpus(tmp_path / "c.txt", docs[:30])
    code = ("import sys\nfrom vgraph.cli import main\n"
            f"rc = main(['data', 'prepare', {str(tmp_path / 'c.txt')!r}, '-o', {str(tmp_path / 'o')!r}, '--tokenizer', "
            f"{tok_file!r}, '--quiet'])\nassert rc == 0 and 'torch' not in sys.modules, sorted(sys.modules)[:5]\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert (tmp_path / "o" / "manifest.json").is_file()
    shutil.rmtree(tmp_path / "o")
