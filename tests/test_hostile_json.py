"""Hostile JSON fed to every JSON reader the project has (issue 39): each answers with a diagnostic naming the
file, never a traceback; and the number defects of the same round (huge integers, subnormal and overflowing
settings, a lying probe peer, a batch past int64) stay diagnostics.

Every reader is called through the function its command calls (in-process: each case is milliseconds).
The documents come from one generator (`HOSTILE`): nesting of [ and { far past any reader's depth, an
integer of 5,000 digits (AttributeError/ValueError before) and one past every float, a lone surrogate,
NaN/Infinity, a float literal that overflows, invalid UTF-8, a BOM, an empty file, a directory in the
file's place, and a large string (valid JSON: it must be read or refused, never crash).
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import socket
import threading
from pathlib import Path
from typing import Callable

import pytest

from conftest import TINY
from vgraph.base import options
from vgraph.base.diagnostics import VGraphError
from vgraph.base.jsonio import MAX_DEPTH, jsonl_lines, loads
from vgraph.base.safeio import MANIFEST, OutputDir, read_json

DIRECTORY = b"<a directory in the file's place>"
DEEP = 100_000
HOSTILE: dict[str, bytes] = {
    "deep-lists": b"[" * DEEP + b"]" * DEEP,
    "deep-objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep-unclosed": b'{"a":[' * DEEP,
    "deep-mixed-closers": b"[{" * DEEP + b"]}" * DEEP,
    "deep-inside-valid": b'{"version": 1, "x": ' + b"[" * 70 + b"]" * 70 + b"}",
    "huge-int": b'{"version": 1, "step": ' + b"9" * 5000 + b"}",
    "int-past-float": b'{"version": 1, "step": -' + b"9" * 400 + b"}",
    "lone-surrogate": b'{"version": 1, "text": "a\\ud800b"}',
    "lone-low-surrogate-key": b'{"\\udc00": 1}',
    "nan": b'{"version": 1, "x": NaN}',
    "infinity": b'{"version": 1, "x": -Infinity}',
    "float-overflow": b'{"version": 1, "x": 1e400}',
    "invalid-utf8": b'{"version": 1, "text": "\xff\xfe"}',
    "bom": b"\xef\xbb\xbf{}",
    "empty": b"",
    "directory": DIRECTORY,
}
VALID_BUT_ODD = {"large-string": b'{"text": "' + b"x" * (1 << 20) + b'"}', "a-list": b"[1, 2]", "null": b"null"}


def _place(path: Path, doc: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if doc == DIRECTORY:
        path.mkdir()
    else:
        path.write_bytes(doc)
    return path


def _refused(call: Callable[[], object], errors: type[BaseException] | tuple, name: str) -> str:
    """The message of the diagnostic `call` raised; it must be one of `errors` and name `name`."""
    with pytest.raises(errors) as info:
        call()
    message = str(info.value)
    assert name in message, message
    return message


# -- the readers: each places the document where it reads and calls it ----------------------------------------

def _read_json(tmp: Path, doc: bytes) -> None:
    path = _place(tmp / "doc.json", doc)
    _refused(lambda: read_json(path), VGraphError, "doc.json")


def _outputs_manifest(tmp: Path, doc: bytes) -> None:
    _place(tmp / "out" / MANIFEST, doc)
    _refused(lambda: OutputDir(tmp / "out", command="partition"), VGraphError, MANIFEST)


def _partition_parts(tmp: Path, doc: bytes) -> None:
    from vgraph.placement.export import load_parts

    _place(tmp / "parts" / "placement.json", doc)
    _refused(lambda: load_parts(tmp / "parts"), VGraphError, "placement.json")


def _launch_placement(tmp: Path, doc: bytes) -> None:
    from vgraph.backends.torch.distributed.launcher.launch import read_placement, read_placement_layout

    path = _place(tmp / "plan.json", doc)
    _refused(lambda: read_placement(path), VGraphError, "plan.json")
    _refused(lambda: read_placement_layout(path), VGraphError, "plan.json")


def _job_file(tmp: Path, doc: bytes) -> None:
    from vgraph.backends.torch.distributed.job import Job, JobError

    path = _place(tmp / "job.json", doc)
    _refused(lambda: Job.read(path), JobError, "job.json")


def _prepared_manifest(tmp: Path, doc: bytes) -> None:
    from vgraph.data.shards import MANIFEST as CORPUS_MANIFEST, open_prepared

    _place(tmp / "corpus" / CORPUS_MANIFEST, doc)
    _refused(lambda: open_prepared(tmp / "corpus"), VGraphError, CORPUS_MANIFEST)  # DataError is one


def _saved_dataset_state(tmp: Path, doc: bytes) -> None:
    from vgraph.data.shards import DataError
    from vgraph.data.sources import find_sources

    _place(tmp / "dataset" / "state.json", doc)
    if doc == DIRECTORY:  # a directory named state.json is no saved dataset: the folder is searched for files
        with pytest.raises(DataError):
            find_sources([str(tmp / "dataset")])
        return
    _refused(lambda: find_sources([str(tmp / "dataset")]), DataError, "state.json")


def _jsonl_line(tmp: Path, doc: bytes) -> None:
    from vgraph.data.shards import DataError
    from vgraph.data.sources import find_sources, plan_units, read_unit

    if doc == DIRECTORY:
        _place(tmp / "corpus.jsonl", doc)
        _refused(lambda: find_sources([str(tmp / "corpus.jsonl")]), DataError, "corpus.jsonl")
        return
    path = _place(tmp / "corpus.jsonl", b'{"text": "fine"}\n' + doc + b"\n")
    sources = find_sources([str(path)])
    units = plan_units(sources, 1 << 30)

    def read() -> list[str]:
        return [d for u in units for d in read_unit(sources[u.source], u, field="text", column="text")]
    message = _refused(read, DataError, "corpus.jsonl")
    assert "corpus.jsonl:2:" in message, message  # the line


def _checkpoint_state(tmp: Path, doc: bytes) -> None:
    import torch

    from vgraph.backends.torch.training import checkpoint as C

    saved = C.save_checkpoint(tmp / "step-1", step=1, model_state={"w": torch.ones(2)},
                              optimizer_states={"w": {"step": 1}}, rng_state={}, extra={})
    for name in (C.STATE_JSON_FILE, C.OPTIMIZER_JSON_FILE):
        original = (saved / name).read_bytes()
        (saved / name).unlink()
        _place(saved / name, doc)
        _refused(lambda: C.load_checkpoint(saved), C.CheckpointError, name)
        if doc == DIRECTORY:
            (saved / name).rmdir()
        (saved / name).write_bytes(original)


def _checkpoint_aliases(tmp: Path, doc: bytes) -> None:
    import torch
    from safetensors.torch import save_file

    from vgraph.backends.torch.training import checkpoint as C

    if doc == DIRECTORY:
        pytest.skip("metadata inside a file, not a file")
    saved = C.save_checkpoint(tmp / "step-1", step=1, model_state={"w": torch.ones(2)},
                              optimizer_states={"w": {"step": 1}}, rng_state={}, extra={})
    text = doc.decode("utf-8", errors="replace")
    save_file({"w": torch.ones(2)}, str(saved / C.MODEL_FILE), metadata={"format": "pt", "vgraph_aliases": text})
    _refused(lambda: C.load_checkpoint(saved), C.CheckpointError, C.MODEL_FILE)


def _run_files(tmp: Path, doc: bytes) -> None:
    """A run's reader turns what it cannot read into notes naming the file, never an exception."""
    from vgraph.run.files import RunReader

    run = tmp / "run"
    _place(run / "run.json", doc)
    reader = RunReader(run)
    value = reader.json("run.json")  # None, or (numbers it cannot use) the rest of the document
    assert value is None or value.get("version") == 1 and list(value.values())[1:] == [None], value
    assert any("run.json" in note for note in reader.notes), reader.notes
    if doc != DIRECTORY:
        (run / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.5}\n' + doc + b"\n" + b'{"step": 2, "loss": 2}\n')
        reader = RunReader(run)
        assert [r["step"] for r in reader.metrics()] == [1, 2]
        assert doc.strip() == b"" or any("metrics.jsonl" in n and "skipped" in n for n in reader.notes), reader.notes


def _progress_event(tmp: Path, doc: bytes) -> None:
    from vgraph.backends.torch.distributed.runtime.progress import EVENT_PREFIX, LaunchBar

    if doc == DIRECTORY:
        pytest.skip("a line, not a file")
    assert LaunchBar(out=lambda line: None).take(EVENT_PREFIX + doc.decode("utf-8", errors="replace")) is False


def _onnx_kv_cache(tmp: Path, doc: bytes) -> None:
    onnx = pytest.importorskip("onnx")
    from vgraph.backends.onnx.inference import Decoder

    if doc in (DIRECTORY, b"", HOSTILE["invalid-utf8"]):
        pytest.skip("metadata is text inside a model (and none is no cache), not a file")
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    onnx.helper.set_model_props(model, {"vgraph.kv_cache": doc.decode("utf-8", errors="replace")})
    path = tmp / "model.onnx"
    onnx.save(model, str(path))
    _refused(lambda: Decoder(path, logits="logits", tokens="tokens", context=4), VGraphError, "model.onnx")


READERS = {"read_json": _read_json, "outputs-manifest": _outputs_manifest, "partition-parts": _partition_parts,
           "launch-placement": _launch_placement, "job-file": _job_file, "prepared-manifest": _prepared_manifest,
           "saved-dataset-state": _saved_dataset_state, "jsonl-line": _jsonl_line,
           "checkpoint-state": _checkpoint_state, "checkpoint-aliases": _checkpoint_aliases, "run-files": _run_files,
           "progress-event": _progress_event, "onnx-kv-cache": _onnx_kv_cache}


@pytest.mark.parametrize("doc", HOSTILE, ids=str)
@pytest.mark.parametrize("reader", READERS, ids=str)
def test_every_reader_refuses_hostile_json_with_a_diagnostic_naming_the_file(reader: str, doc: str,
                                                                               tmp_path: Path) -> None:
    if reader == "jsonl-line" and doc in ("empty", "deep-inside-valid") or reader == "run-files" and doc == "empty":
        pytest.skip("valid there: a blank JSONL line is skipped, and depth 70 is refused only as a whole file")
    READERS[reader](tmp_path, HOSTILE[doc])


@pytest.mark.parametrize("doc", VALID_BUT_ODD, ids=str)
@pytest.mark.parametrize("reader", [r for r in READERS if r not in ("run-files", "progress-event", "read_json")],
                         ids=str)
def test_valid_json_of_the_wrong_shape_is_a_diagnostic_too(reader: str, doc: str, tmp_path: Path) -> None:
    if reader in ("jsonl-line", "launch-placement") and doc == "large-string":
        pytest.skip("valid there: a corpus line; an assignment of VNode 'text' to a PNode")
    READERS[reader](tmp_path, VALID_BUT_ODD[doc])


def test_hostile_documents_are_what_they_claim() -> None:
    """The premise: Python's own reader fails (or mis-reads) each of them, so each case tests something."""
    import sys

    for name, doc in HOSTILE.items():
        if doc == DIRECTORY or name == "deep-inside-valid":
            continue
        try:
            value = json.loads(doc)
        except (ValueError, RecursionError):
            continue
        if name in ("int-past-float",):
            assert abs(value["step"]) > sys.float_info.max  # parses, then float() overflows
        else:
            assert name in ("lone-surrogate", "lone-low-surrogate-key", "nan", "infinity", "float-overflow", "bom"), name
    assert json.loads(HOSTILE["deep-inside-valid"])["version"] == 1


# -- the one reader itself ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, why", [
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper than 64"),
    ("[{" * 40 + "}]" * 40, "nested deeper than 64"),  # 80 levels of two kinds
    ("[[]" * 5000, "nested deeper than 64"),  # no run of 65 opens, still 5000 deep
    ("1" * 4301, "an integer of 4,301 digits"),
    ("-" + "9" * 310, "an integer of 310 digits"),
    ('"\\ud800"', "lone surrogate"), ('"\\udfff\\ud800"', "lone surrogate"), ('["\\ud83d"]', "lone surrogate"),
    ("NaN", "NaN is not a number"), ("Infinity", "Infinity is not a number"), ("[1e999]", "beyond any float"),
    ('{"a": 1,}', "not JSON"), ("", "not JSON"), ("\ufeff{}", "not JSON"),
])
def test_the_reader_refuses_with_file_and_line(text: str, why: str) -> None:
    with pytest.raises(VGraphError, match=why) as info:
        loads("\n\n" + text, "f.json", line=7)
    assert str(info.value).startswith("f.json:"), str(info.value)


def test_a_byte_order_mark_is_named() -> None:
    with pytest.raises(VGraphError, match="f.json:1: not JSON: starts with a byte-order mark"):
        loads(b"\xef\xbb\xbf{}", "f.json")


@pytest.mark.parametrize("text", ["[" * MAX_DEPTH + "]" * MAX_DEPTH, '"\\ud83d\\ude00"', '"\\\\ud800"',
                                  '["[[[[' + "[" * 100 + '"]', "9" * 309, "1e-320", '{"k": "\\u2028"}'])
def test_the_reader_accepts_what_is_valid(text: str) -> None:
    assert loads(text, "f.json") == json.loads(text)


def test_unbalanced_brackets_get_the_parsers_message_or_the_bound() -> None:
    with pytest.raises(VGraphError, match="not JSON"):
        loads("[[[[}", "f.json")  # shallow: the parser says where
    with pytest.raises(VGraphError, match="nested deeper"):
        loads("[" * 1000 + "}", "f.json")


def test_nonfinite_numbers_only_where_allowed_and_lenient_readers_count_them() -> None:
    assert loads('[NaN, -Infinity]', "m", allow_nonfinite=True)[1] == float("-inf")
    seen: list[str] = []
    assert loads('[1e999, ' + "9" * 400 + ', NaN, 2]', "m", on_bad_number=seen.append) == [None, None, None, 2]
    assert len(seen) == 3


def test_jsonl_lines_split_on_newline_only() -> None:
    text = '{"t": "a\u2028b\u2029c\x85d"}\r\n\n{"t": 2}\n'
    assert len(text.splitlines()) == 6  # the premise: splitlines cuts the first record three times
    assert [(n, loads(line, "x")) for n, line in jsonl_lines(text)] == [(1, {"t": "a\u2028b\u2029c\x85d"}), (3, {"t": 2})]


# -- JSONL corpora -------------------------------------------------------------------------------------------

def _corpus_documents(path: Path) -> list[str]:
    from vgraph.data.sources import find_sources, plan_units, read_unit

    sources = find_sources([str(path)])
    return [d for u in plan_units(sources, 1 << 30) for d in read_unit(sources[u.source], u, field="text",
                                                                          column="text")]


def test_a_jsonl_string_may_hold_line_separators(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 are valid inside a JSON string; `splitlines()` cut the record there."""
    docs = ["one\u2028two", "three\u2029four", "five\x85six", "seven\x1cand\x1deight"]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs) + "not json\n",
                    encoding="utf-8")
    from vgraph.data.shards import DataError

    with pytest.raises(DataError, match=r"c\.jsonl:5: not JSON"):  # and the line numbers stay right
        _corpus_documents(path)
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    assert _corpus_documents(path) == docs


def test_a_lone_surrogate_in_a_jsonl_line_is_refused_naming_the_line(tmp_path: Path) -> None:
    from vgraph.data.shards import DataError

    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "bad \\ud800 half"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: a string holds the lone surrogate"):
        _corpus_documents(path)


def test_a_long_document_is_encoded_in_pieces_with_the_same_ids(monkeypatch, tmp_path: Path) -> None:
    """One 32 MB JSONL line peaked at 6.5 GB (the same text as lines: 0.8 GB): the tokenizer held the whole
    document's encoding.  Now no encode call sees more than a piece, and the shard holds the whole's ids."""
    import random

    import numpy as np
    from tokenizers import Regex, pre_tokenizers

    from vgraph.data import encode
    from vgraph.data.tokenizer import char_tokenizer, train_tokenizer

    rng = random.Random(3)
    parts = ["word", "é字", "12", " ", "  ", "\t", "\n", "\n\n", "-", "'s", ".", "😀", " \u2028", "-" * 40]
    doc = "".join(rng.choice(parts) for _ in range(6000))
    bpe = train_tokenizer([doc], 300)
    capped = train_tokenizer([doc], 300)  # a BPE whose words are cut into runs of 16 bytes
    capped.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False),
                                                    pre_tokenizers.Split(Regex("[\\s\\S]{1,16}"), "isolated")])
    monkeypatch.setattr(encode, "PIECE_CHARS", 200)
    for number, tokenizer in enumerate((bpe, char_tokenizer([doc], 100), capped)):
        whole = [e.ids for e in tokenizer.encode_batch_fast([doc, "a b"], add_special_tokens=False)]
        seen: list[int] = []

        def spy(texts, *, tokenizer=tokenizer, **kwargs):
            seen.extend(len(t) for t in texts)
            return tokenizer.encode_batch_fast(texts, **kwargs)

        wrapped = type("Spy", (), {"encode_batch_fast": staticmethod(spy), "to_str": tokenizer.to_str})()
        out = tmp_path / str(number)
        out.mkdir()
        task = {"unit": 0, "span": {"source": 0, "start": 0, "end": 2}, "field": "text", "column": "text",
                "source": {"path": "corpus.jsonl", "kind": "jsonl", "size": len(doc), "mtime_ns": 0},
                "dtype": "uint16", "eot_id": 0, "val_fraction": 0.0, "bytes": len(doc), "out": str(out)}
        record = encode.encode_unit(task, tokenizer=wrapped, documents=[doc, "a b"])
        tokens = np.fromfile(out / record["train"]["bin"], dtype="<u2").tolist()
        assert tokens == whole[0] + [0] + whole[1] + [0]
        assert len(seen) > 10 and max(seen) < len(doc) / 4, (len(seen), max(seen))


def test_the_tokenizer_is_trained_on_a_long_document_in_pieces(monkeypatch) -> None:
    """The trainer, too, held a whole document's pre-tokenization: the sample is cut the way encoding is."""
    from vgraph.data import encode, prepare
    from vgraph.data.sources import Unit

    monkeypatch.setattr(encode, "PIECE_CHARS", 100)
    doc = "the quick brown fox jumps " * 400
    sample = prepare._sample([], [Unit(0, 0, 2)], prepare.PrepareOptions(vocab=300, sample_bytes=6000),
                             documents=[doc, "short"])
    assert "".join(sample) == doc[:6000] and len(sample) > 50 and max(map(len, sample)) <= 100


def test_a_long_document_with_a_tokenizer_that_may_not_be_cut_is_encoded_whole(monkeypatch) -> None:
    from tokenizers import normalizers, pre_tokenizers

    from vgraph.data import encode
    from vgraph.data.tokenizer import train_tokenizer

    doc = "the quick brown fox " * 200
    monkeypatch.setattr(encode, "PIECE_CHARS", 100)
    for change in (lambda t: setattr(t, "normalizer", normalizers.Strip()),
                   lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace()),
                   lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(use_regex=False))):
        tokenizer = train_tokenizer([doc], 300)
        change(tokenizer)
        sizes: list[int] = []
        encode._in_pieces(tokenizer, [doc], lambda texts: sizes.extend(map(len, texts)) or [[] for _ in texts])
        assert sizes == [len(doc)]


# -- numbers: options, pass options, generate, the fit check ---------------------------------------------------

@pytest.mark.parametrize("parse, text", [
    (options.positive_float, "1e-320"), (options.non_negative_float, "-1e-320"), (options.temperature, "1e-300"),
    (options.temperature, "1e-39"), (options.temperature, "nan"), (options.temperature, "1e31"),
    (options.batch, str(2**31 + 1)), (options.batch, str(10**16)), (options.batch, "0"),
])
def test_options_refuse_subnormals_tiny_temperatures_and_huge_batches(parse, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


def test_options_accept_the_edges() -> None:
    assert options.temperature("0") == 0 and options.temperature(str(2.0**-126)) == 2.0**-126
    assert options.batch(str(2**31)) == 2**31 and options.positive_float("2.3e-308") == 2.3e-308


def test_sampling_at_the_smallest_temperature_is_greedy_not_nan() -> None:
    torch = pytest.importorskip("torch")
    from vgraph.backends.torch.generation import draw as _draw

    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 3.0, 2.5, -1e30], dtype=torch.float32)
    assert {_draw(logits, options.MIN_TEMPERATURE, 0, generator) for _ in range(20)} == {1}
    assert {_draw(logits, 1e30, 2, generator) for _ in range(50)} == {1, 2}  # top-2 of a flat distribution


def test_generate_refuses_a_temperature_its_parser_would() -> None:
    from vgraph.backends.torch.cli import generate_ids

    for bad in (1e-300, 5e-324, float("nan"), -1.0):
        with pytest.raises(VGraphError, match="--temperature"):
            generate_ids("/nonexistent-checkpoint", "hi", temperature=bad)


@pytest.mark.parametrize("spec", ["batch=9223372036854775808", "micro_batches=100000000000000000000000",
                                  "batch=2147483649", "micro_batches=0"])
def test_partition_options_past_their_range_are_diagnostics(spec: str, tmp_path: Path, capsys) -> None:
    from vgraph.base.shipped import resolve
    from vgraph.cli.main import main

    code = main(["optimize", str(TINY), "--passes", f"partition{{fleet={resolve('t4x4', 'fleet')},{spec}}}",
                 "-o", str(tmp_path / "o.yml")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "option" in err, err
    assert not (tmp_path / "o.yml").exists()


def test_an_undeclared_range_still_holds_no_count_past_2_62() -> None:
    from vgraph.transform.pass_api import Option, PassError

    with pytest.raises(PassError, match="at most"):
        Option(int, 1).check("p", "n", str(2**63))
    with pytest.raises(PassError, match="subnormal"):
        Option(float, 1.0).check("p", "x", "1e-320")
    assert Option(int, 1).check("p", "n", "12") == 12


@pytest.mark.parametrize("command", ["analyze", "partition"])
def test_a_batch_past_2_31_is_a_usage_error(command: str, tmp_path: Path, capsys) -> None:
    from vgraph.cli.main import main

    argv = [command, str(TINY), "--fleet", "t4x4", "--batch", str(10**16)] + (
        ["-o", str(tmp_path / "p")] if command == "partition" else [])
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "--batch" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_the_fit_check_does_not_wrap_at_a_huge_batch() -> None:
    """int64 bytes wrapped at batch 1e16: a network needing 4e8 TiB 'fit' 16 GiB and was planned."""
    import vgraph
    from vgraph.base.shipped import resolve
    from vgraph.cost.fleet import load_fleet
    from vgraph.passes.partition_problem import build_problem

    problem = build_problem(vgraph.load(TINY), load_fleet(resolve("t4x4", "fleet")), batch=10**16)
    assert problem.memory.max() > 10**16  # at least a byte a sample, and no wrap to a negative or small size
    assert (problem.memory >= 0).all()


# -- the probe's peer ----------------------------------------------------------------------------------------

def _lying_peer(reply: bytes) -> int:
    """A peer that reads what it is sent, to the end, and answers `reply`; its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        with listener:
            for _ in range(4):
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    while conn.recv(1 << 20):
                        pass
                    conn.sendall(reply)
    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


@pytest.mark.parametrize("reply", [b'{"bytes": 1e300, "seconds": 1e-300}\n', b'{"bytes": 10000000000000, "seconds": 1}\n',
                                   b'{"bytes": 1000, "seconds": 5e-324}\n', b'{"bytes": 1000, "seconds": 1e9}\n',
                                   b'{"bytes": 1000, "seconds": 0}\n', b'{"bytes": 1000.5, "seconds": 1}\n']
                         + [doc + b"\n" for name, doc in HOSTILE.items() if doc not in (DIRECTORY, b"")],
                         ids=lambda r: r[:40].decode("utf-8", "replace"))
def test_a_lying_probe_peer_is_a_diagnostic(reply: bytes) -> None:
    from vgraph.backends.torch.probe.cli import measure_link

    port = _lying_peer(reply)
    with pytest.raises(VGraphError, match=f"--peer 127.0.0.1:{port}: no measurement came back"):
        measure_link("127.0.0.1", port, 0.05, token="a-shared-secret")


def test_a_probe_peer_claiming_a_huge_rate_never_sizes_an_allocation(monkeypatch) -> None:
    """1 KB counted in 1 us is 1e9 B/s: the burst is capped by what the stream carried, sent from one buffer."""
    from vgraph.backends.torch.probe import cli as probe_cli

    sizes: list[int] = []
    monkeypatch.setattr(probe_cli, "burst_of", lambda reply, size: sizes.append(size) or 0.0)
    monkeypatch.setattr(probe_cli, "BURST_IDLE_S", 0.0)
    port = _lying_peer(b'{"bytes": 1048576, "seconds": 1e-4}\n')
    rate, _ = probe_cli.measure_link("127.0.0.1", port, 0.05, token="a-shared-secret")
    assert rate == 1048576 / 1e-4 and sizes and max(sizes) == 1 << 20  # not 0.25 s at 1e10 B/s: 2.5 GB


# -- the launchers' channel -----------------------------------------------------------------------------------

def test_the_channel_checks_the_seal_before_it_parses(monkeypatch) -> None:
    from vgraph.backends.torch.distributed.launcher import membership
    from vgraph.backends.torch.distributed.launcher.membership import Machines, _digest
    from ports import launch_port

    parsed: list[bytes] = []
    real = membership.loads
    monkeypatch.setattr(membership, "loads", lambda body, where: parsed.append(body) or real(body, where))
    port = launch_port()
    m0 = Machines()
    m0.open("127.0.0.1", port, "secret", 0, 2, link_timeout=5.0, rejoin_timeout=1.0)
    try:
        key = _digest("secret")

        def send(line: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(line)
                conn.shutdown(socket.SHUT_WR)
                return conn.makefile("rb").readline()

        for doc in HOSTILE.values():
            if doc != DIRECTORY:
                assert send(doc + b"\n") == b""  # no seal: dropped unread
                assert send(b"0" * 64 + b" " + doc + b"\n") == b""  # a wrong seal: dropped unread
        assert parsed == []
        for doc in HOSTILE.values():  # sealed (a peer with the secret and a bug): refused, the server lives
            if doc != DIRECTORY:
                seal = hmac.new(key.encode(), doc, hashlib.sha256).hexdigest().encode()
                assert send(seal + b" " + doc + b"\n") == b""
        assert parsed
        body = json.dumps({"op": "beat", "machine": 1, "attempt": 0}).encode()
        answer = send(hmac.new(key.encode(), body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n")
        seal, _, reply = answer.rstrip(b"\n").partition(b" ")
        assert hmac.compare_digest(seal, hmac.new(key.encode(), reply, hashlib.sha256).hexdigest().encode())
        # the coordinator answers with its table of machines (succession.py: who would take over)
        assert json.loads(reply) == {"abort": False, "coordinator": 0, "machines": {"0": "127.0.0.1"}}
        assert b"secret" not in body and key.encode() not in body  # the secret never travels
    finally:
        m0.close()
