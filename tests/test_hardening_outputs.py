"""Outputs never land on what a command reads or what a run owns; directory outputs replace only what they
wrote; one writer per run directory (issue 21, "Inputs and outputs" and "Stopping": the lock).

The rules are the core's (vgraph/base/safeio.py: `check_output`, `OutputDir`; vgraph/run/files.py: what a
run owns, `RunLock`), used by every command; tests/test_hostile_cli.py drives every command's output
options against a run's files.  These are the regression tests of the defects the review found.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import TINY
from hardening_util import small_corpus
from vgraph.base.safeio import MANIFEST, check_output
from vgraph.base.diagnostics import VGraphError
from vgraph.cli.main import main
from vgraph.run.files import LOCK_FILE, RunInUse, RunLock

FLEET2 = ("pnodes:\n  - {id: p0, memory: 600KB, flops: 10T, bandwidth: 10GB/s}\n"
          "  - {id: p1, memory: 600KB, flops: 10T, bandwidth: 10GB/s}\n")


def _fake_run(path: Path) -> Path:
    """A run directory as train and launch leave it (no training needed: the files are what matters)."""
    step = path / "step-00000003"
    step.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.safetensors", "optimizer.json", "state.safetensors"):
        (step / name).write_bytes(b"weights of " + name.encode())
    (step / "state.json").write_text('{"format": "vgraph-checkpoint"}')
    (path / "latest").write_text("step-00000003\n")
    (path / "run.json").write_text(json.dumps({"network": "tiny-2l", "seed": 0, "batch": 2, "steps": 3}))
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    (path / "network.yml").write_text(TINY.read_text())
    (path / "launch").mkdir()
    (path / "launch" / "job-0.json").write_text('{"attempt": 0}')  # an older attempt's: the report reads job-1
    (path / "launch" / "job-1.json").write_text('{"attempt": 1}')
    (path / "launch" / "tokens.safetensors").write_bytes(b"tokens")
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- defect 1: report -o inside the run's checkpoints or job files ------------------------------------------

@pytest.mark.parametrize("target", ["step-00000003/model.safetensors", "launch/job-0.json", "launch/job-9.json",
                                    "latest", "metrics.jsonl", "run.json", "step-00000003/new.html",
                                    "launch/tokens.safetensors", ".vgraph-lock", "events.out.tfevents.1.x"])
def test_report_never_writes_into_what_a_run_owns(target: str, tmp_path: Path, capsys) -> None:
    run = _fake_run(tmp_path / "run")
    before = _tree(run)
    assert main(["report", str(run), "-o", str(run / target)]) == 2
    err = capsys.readouterr().err
    assert any(why in err for why in ("part of the run", "inside the checkpoint", "overwrite an input")), err
    assert _tree(run) == before


def test_report_may_sit_beside_the_run_files(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    assert main(["report", str(run), "-o", str(run / "report.html")]) == 0
    assert main(["report", str(run), "-o", str(run / "report.html")]) == 0  # and be rewritten


def test_an_output_reached_through_a_symlink_is_resolved(tmp_path: Path, capsys) -> None:
    run = _fake_run(tmp_path / "run")
    (tmp_path / "door").symlink_to(run / "step-00000003", target_is_directory=True)
    before = _tree(run)
    for command in (["report", str(run), "-o", str(tmp_path / "door" / "model.safetensors")],
                    ["optimize", str(TINY), "-o", str(tmp_path / "door" / "x.yml")],
                    ["render", str(TINY), "-o", str(tmp_path / "door" / "x.svg")]):
        assert main(command) == 2, command
        assert "inside the checkpoint" in capsys.readouterr().err
    assert _tree(run) == before


def test_the_rule_is_checked_by_check_output_itself(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    with pytest.raises(VGraphError, match="inside the checkpoint"):
        check_output(run / "step-00000003" / "model.safetensors")
    with pytest.raises(VGraphError, match="lies inside the input directory"):
        check_output(tmp_path / "data" / "out.txt", inputs=[tmp_path])
    assert check_output(run / "notes.html") == run / "notes.html"


# -- defect 2: export-onnx writing ONNX over the checkpoint it reads -------------------------------------------

def test_export_onnx_never_writes_into_the_checkpoint_it_reads(tmp_path: Path, capsys) -> None:
    run = _fake_run(tmp_path / "run")
    before = _tree(run)
    ckpt = run / "step-00000003"
    assert main(["export-onnx", str(TINY), "--checkpoint", str(ckpt), "-o", str(ckpt / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert ("lies inside the input directory" in err or "inside the checkpoint" in err) and "Traceback" not in err
    assert _tree(run) == before


# -- defect 5: partition -o DIR deleting files it never wrote --------------------------------------------------

def test_partition_never_deletes_files_a_foreign_placement_json_lists(tmp_path: Path, capsys) -> None:
    out = tmp_path / "parts"
    out.mkdir()
    (out / "placement.json").write_text(json.dumps({"files": ["keep.yml", "notes.json", "p0.yml"]}))
    (out / "keep.yml").write_text("mine\n")
    (out / "notes.json").write_text("{}\n")
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET2)
    before = _tree(out)
    assert main(["partition", str(TINY), "--fleet", str(fleet), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "placement.json" in err and "not written there by vgraph partition" in err
    assert _tree(out) == before


def test_partition_replaces_and_removes_only_what_it_wrote(tmp_path: Path, capsys) -> None:
    out = tmp_path / "parts"
    fleet2, fleet1 = tmp_path / "two.yml", tmp_path / "one.yml"
    fleet2.write_text(FLEET2)
    fleet1.write_text("pnodes:\n  - {id: solo, memory: 1GB, flops: 10T, bandwidth: 10GB/s}\n")
    assert main(["partition", str(TINY), "--fleet", str(fleet2), "-o", str(out)]) == 0
    assert main(["partition", str(TINY), "--fleet", str(fleet2), "-o", str(out)]) == 0  # its own files: replaced
    (out / "p1.yml").write_text((out / "p1.yml").read_text() + "# edited by hand\n")
    assert main(["partition", str(TINY), "--fleet", str(fleet1), "-o", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([MANIFEST, "p1.yml", "placement.json", "solo.yml"])  # p0 removed, edited p1 kept
    assert (out / "p1.yml").read_text().endswith("# edited by hand\n")
    capsys.readouterr()
    (out / "solo.yml").write_text("# a user's file now\n")
    assert main(["partition", str(TINY), "--fleet", str(fleet1), "-o", str(out)]) == 2
    assert "solo.yml" in capsys.readouterr().err and (out / "solo.yml").read_text() == "# a user's file now\n"


@pytest.mark.parametrize("content", ["", "{", "[]", '{"files": 3}', '{"files": {"../x": "y"}}'])
def test_a_damaged_manifest_is_a_diagnostic(content: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "parts"
    out.mkdir()
    (out / MANIFEST).write_text(content)
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET2)
    code = main(["partition", str(TINY), "--fleet", str(fleet), "-o", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 2:
        assert MANIFEST in err
    else:  # a manifest listing nothing usable proves nothing: the directory was empty, so writing is fine
        assert code == 0 and (out / "p0.yml").is_file()


# -- defect 7: optimize --dump-dir over the input, -o colliding with a dump -------------------------------------

def test_dump_dir_never_overwrites_the_input(tmp_path: Path, capsys) -> None:
    dump = tmp_path / "d"
    dump.mkdir()
    net = dump / "00_input.yml"
    net.write_text("# my network, with my comments\n" + TINY.read_text())
    before = net.read_bytes()
    assert main(["optimize", str(net), "-o", str(tmp_path / "o.yml"), "--dump-dir", str(dump)]) == 2
    assert "refusing to overwrite an input" in capsys.readouterr().err
    assert net.read_bytes() == before


def test_output_inside_the_dump_dir_is_refused(tmp_path: Path, capsys) -> None:
    dump = tmp_path / "d"
    assert main(["optimize", str(TINY), "-o", str(dump / "01_dead-nodes.yml"), "--dump-dir", str(dump)]) == 2
    assert "inside --dump-dir" in capsys.readouterr().err and not dump.exists()


def test_dump_dir_replaces_only_its_own_dumps(tmp_path: Path, capsys) -> None:
    dump = tmp_path / "d"
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "o.yml"), "--dump-dir", str(dump)]) == 0
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "o.yml"), "--dump-dir", str(dump)]) == 0
    (dump / "01_dead-nodes.yml").write_text("# mine now\n")
    capsys.readouterr()
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "o.yml"), "--dump-dir", str(dump)]) == 2
    assert "01_dead-nodes.yml" in capsys.readouterr().err
    assert (dump / "01_dead-nodes.yml").read_text() == "# mine now\n"


# -- train --out into a directory that is not a run (lower list) ---------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("data"))


QUICK = ["--steps", "1", "--batch", "2", "--val-every", "0", "--quiet", "--threads", "1", "--no-tensorboard"]


def test_train_out_refuses_a_directory_whose_files_it_would_replace(tmp_path: Path, corpus: str, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "metrics.jsonl").write_text("my own measurements\n")
    (out / "network.yml").write_text("my own network\n")
    before = _tree(out)
    assert main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 2
    err = capsys.readouterr().err
    assert "is not a vgraph run" in err and "metrics.jsonl" in err and "Traceback" not in err
    assert _tree(out) == before and not (out / LOCK_FILE).exists()


def test_train_out_may_share_a_directory_with_unrelated_files(tmp_path: Path, corpus: str) -> None:
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["train", str(TINY), "--data", corpus, "--out", str(out), *QUICK]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "latest").is_file()


@pytest.mark.parametrize("inside", ["step", "launch", "data"])
def test_train_out_inside_a_run_or_an_input_is_refused(inside: str, tmp_path: Path, corpus: str, capsys) -> None:
    run = _fake_run(tmp_path / "run")
    before = _tree(run)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(corpus, data / "c.txt")
    out = {"step": run / "step-00000003" / "sub", "launch": run / "launch" / "sub", "data": data / "run"}[inside]
    assert main(["train", str(TINY), "--data", str(data), "--out", str(out), *QUICK]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert _tree(run) == before and not out.exists()


# -- defect 6: one writer per run directory ------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from vgraph.run.files import RunLock
    lock = RunLock.acquire(Path(sys.argv[1]), "vgraph train")
    print("held", flush=True)
    sys.stdin.read()
""")


def _holder(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_one_is_recognised(tmp_path: Path, corpus: str,
                                                                                    capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", str(TINY), "--data", corpus, "--out", str(run), *QUICK]) == 0
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = _holder(run)
    try:
        capsys.readouterr()
        code = main(["train", str(TINY), "--data", corpus, "--out", str(run), *QUICK[2:], "--steps", "3",
                     "--resume"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert f"pid {proc.pid} on host {socket.gethostname()}" in err and "in use by vgraph train" in err
        assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing written by the refused writer
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The holder was killed: its lock is stale (the kernel released it) and is taken over, with a note.
    assert main(["train", str(TINY), "--data", corpus, "--out", str(run), *QUICK[2:], "--steps", "3",
                 "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"pid {proc.pid}" in err and "no longer running" in err
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    assert (run / LOCK_FILE).read_text() == ""  # released at the end: nobody named


def test_a_lock_of_another_host_is_not_taken_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "command": "vgraph launch",
                                             "since": "then"}))
    with pytest.raises(RunInUse, match="another machine.*remove"):
        RunLock.acquire(run, "vgraph train")


def test_locks_are_counted_within_a_process_and_released_by_their_scope(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with RunLock.held():
        first = RunLock.acquire(run, "vgraph train")
        assert RunLock.acquire(run, "vgraph train") is first
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert first.fd is None and (run / LOCK_FILE).read_text() == ""
    proc = _holder(run)  # another process can take it now
    proc.send_signal(signal.SIGKILL)
    proc.wait()
