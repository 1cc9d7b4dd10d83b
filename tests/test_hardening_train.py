"""`vgraph train` and `generate` against careless and hostile use (issue 11 items 1, 7, 8)."""
from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest

from conftest import TINY
from hardening_util import modes_against_umask, signal_after_rows, widened_head
from vgraph.backends.torch.training import checkpoint as ckpt
from vgraph.backends.torch import cli
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.run_files import run_slug

QUICK = ["--steps", "2", "--batch", "2", "--val-every", "0", "--quiet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 0
    return out


def _named(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "net.yml"
    path.write_text(TINY.read_text().replace("name: tiny-2l", f"name: {json.dumps(name)}", 1))
    return path


# -- 1: the default run directory ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["..", ".", "../../escape", "a/../../b", "/abs", "\x1b[2J", "", ".hidden",
                                  "x" * 300])
def test_run_slug_is_one_new_directory_inside_runs(name: str) -> None:
    slug = run_slug(name)
    assert slug and "/" not in slug and not slug.startswith(".") and len(slug) <= 100
    assert (Path("runs") / slug).resolve().parent == Path("runs").resolve()


def test_a_network_named_dotdot_trains_inside_runs(tmp_path: Path, corpus: str, monkeypatch) -> None:
    net = _named(tmp_path, "..")
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert cli.main(["train", str(net), "--data", corpus, *QUICK]) == 0
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "runs"]
    (run,) = (work / "runs").iterdir()
    assert run.name == "network" and (run / "latest").is_file()


# -- 7: Ctrl-C and SIGTERM ------------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_first_interrupt_checkpoints_and_says_how_to_resume(signum: int, tmp_path: Path, corpus: str,
                                                            capsys) -> None:
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a job a shell started with `&`
    with signal_after_rows(out / "metrics.jsonl", 2, signum):
        code = cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), "--steps", "1000000", "--batch",
                         "2", "--val-every", "0", "--checkpoint-every", "0", "--quiet"])
    err = capsys.readouterr().err
    assert code == 128 + signum
    assert f" train {TINY} --data {corpus} " in err and "Traceback" not in err  # the command as typed
    assert f"--out {out} --resume" in err
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None
    step = ckpt.load_checkpoint(latest).step
    assert step >= 2 and f"stopped at step {step}" in err
    assert signal.getsignal(signal.SIGINT) is before  # handlers are put back
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), "--steps", str(step + 1), "--batch",
                     "2", "--val-every", "0", "--resume", "--quiet"]) == 0


# -- 8: diagnostics, not tracebacks ---------------------------------------------------------------------

def test_a_read_only_run_directory_is_a_diagnostic(tmp_path: Path, corpus: str, capsys) -> None:
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("running as root: permissions do not stop writes")
        assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 2
        err = capsys.readouterr().err
        assert str(out) in err and "Permission denied" in err and "Traceback" not in err
    finally:
        out.chmod(0o700)


def test_a_run_directory_that_is_a_file_is_a_diagnostic(tmp_path: Path, corpus: str, capsys) -> None:
    out = tmp_path / "file"
    out.write_text("not a directory")
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 2
    assert "Traceback" not in capsys.readouterr().err and out.read_text() == "not a directory"


@pytest.mark.parametrize("content", [b"\xff\xfe\x00bad", b"..\n", b"../../etc\n", b"step\x1b[2J\n",
                                     b"x" * 100_000])
def test_a_bad_latest_pointer_is_a_diagnostic(content: bytes, tmp_path: Path, trained: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for item in trained.iterdir():
        if item.is_file():
            (run / item.name).write_bytes(item.read_bytes())
    (run / "latest").write_bytes(content)
    assert cli.main(["generate", str(run), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "latest" in err and "Traceback" not in err and len(err) < 1000 and "\x1b" not in err


@pytest.mark.parametrize("damage", ["aliases", "state-json", "state-type"])
def test_bad_checkpoint_metadata_is_a_diagnostic(damage: str, tmp_path: Path, trained: Path, capsys) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    step = tmp_path / "step"
    shutil.copytree(ckpt.latest_checkpoint(trained), step)
    if damage == "aliases":
        model = step / ckpt.MODEL_FILE
        save_file(load_file(model), model, metadata={"format": "pt", "vgraph_aliases": "{not json"})
    else:
        state = json.loads((step / ckpt.STATE_JSON_FILE).read_text())
        state["extra"] = {"__dict__": 7} if damage == "state-json" else {"__float__": [1]}
        (step / ckpt.STATE_JSON_FILE).write_text(json.dumps(state))
    assert cli.main(["generate", str(step), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert str(step) in err and "Traceback" not in err


def test_resuming_with_a_network_of_other_shapes_is_a_diagnostic(tmp_path: Path, corpus: str, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 0
    wider = tmp_path / "wider.yml"
    wider.write_text(widened_head(TINY.read_text()))  # a valid network of other shapes (the old edit was not)
    code = cli.main(["train", str(wider), "--data", corpus, "--out", str(out), "--steps", "3", "--batch", "2",
                     "--val-every", "0", "--resume", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "size mismatch" not in err
    assert "trained on another network" in err and "head_up" in err


@pytest.mark.parametrize("data", ["/dev/zero", "fifo", "dir-empty"])
def test_data_that_is_not_a_readable_text_file_is_a_diagnostic(data: str, tmp_path: Path, capsys) -> None:
    if data == "fifo":
        data = str(tmp_path / "fifo")
        os.mkfifo(data)
    elif data == "dir-empty":
        data = str(tmp_path / "empty")
        os.mkdir(data)
    assert cli.main(["train", str(TINY), "--data", data, "--out", str(tmp_path / "run"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and data in err


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_run_files_respect_the_umask(tmp_path: Path, corpus: str, umask: int) -> None:
    """Every file of the run, checkpoints included (safetensors writes its files 0600 by itself)."""
    old = os.umask(umask)
    try:
        out = tmp_path / "run"
        assert cli.main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 0
    finally:
        os.umask(old)
    names = {p.name for p in out.rglob("*")}
    assert {"latest", "network.yml", "run.json", "metrics.jsonl", "model.safetensors", "state.json"} <= names
    assert modes_against_umask(out, umask) == []


# -- devices this machine lacks (issue 21) ----------------------------------------------------------------------

@pytest.mark.parametrize("name,why", [("meta", "holds shapes but no data"), ("xpu", "no xpu device"),
                                     ("mps:0", "no mps device"), ("cuda:1", "1 cuda device"),
                                     ("nonsense", "not a torch device")])
def test_a_device_this_machine_lacks_is_refused_by_name(name: str, why: str, monkeypatch) -> None:
    """The CUDA index rule on any machine: CUDA is made to look present with one device."""
    import torch

    from vgraph.backends.torch.training.config import TrainingError
    from vgraph.backends.torch.training.setup import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TrainingError, match=why):
        resolve_device(name)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and resolve_device("cpu") == torch.device("cpu")
