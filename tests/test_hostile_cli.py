"""Every subcommand against hostile values for each of its options and arguments (issue 11, "Beyond the list").

The table is built from the command line's own parsers (`vgraph.cli.main.build_parser`), so a new command or
option is covered the day it is added: an option this file cannot classify fails
`test_every_option_has_a_hostile_table`, which is the point.  Each case runs in-process and must end with
exit status 2, a message on stderr, no traceback, no terminal escape, a bounded message, and nothing
changed outside the output the command was asked for (the inputs, the trained run it reads and the working
directory are snapshotted before and after).
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import TINY
from vgraph.cli.main import build_parser, main

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0

# -- hostile values by kind ---------------------------------------------------------------------------------

NUMBERS = {
    "positive_int": ["-1", "0", "nan", "inf", "1e3", "2.5", str(2**70), "abc", ""],
    "non_negative_int": ["-1", "nan", "inf", "2.5", str(2**70), "abc", ""],
    "seed": ["-1", "nan", str(2**64), "2.5", "abc", ""],
    "port": ["0", "-1", "65536", "abc", ""],
    "positive_float": ["0", "-1", "nan", "inf", "-inf", "1e999", "1e-320", "abc", ""],
    "non_negative_float": ["-1", "nan", "inf", "-inf", "1e-320", "abc", ""],
    "batch": ["0", "-1", "nan", "2.5", str(2**31 + 1), str(10**16), "abc", ""],  # 1e16 overflowed the fit check
    "temperature": ["-1", "nan", "inf", "1e-300", "1e-320", "1e31", "abc", ""],  # 1e-300: a traceback in torch
    "byte_size": ["0", "-1", "nan", "inf", "1e400", "8Q", ""],
    "replicas": ["0", "-1", "nan", "abc", ""],
    "fraction": ["0", "1", "-0.5", "1.5", "nan", "inf", "abc", ""],
    "name": [""],  # a JSONL field or column name: any text but none
    "pattern": ["", "a/b", "..", "x\x1b[2J"],  # data prepare --include: a file name pattern
    "token_ids": ["", ",", "1,,2", "-1", "a", "1.5", "nan", str(2**70), "1;2"],
}
# Paths are names of entries the `world` fixture creates (see _hostile_path).
INPUT_FILE = ["missing", "dir", "fifo", "/dev/zero", "empty", "binary", "newline", "", "unreadable", "non-utf8",
              "unknown-name", "dotdot-name", "escape-name"]  # the last three: not a shipped name either
INPUT_FILE_OR_DIR = ["missing", "empty-dir", "fifo", "/dev/zero", "binary", "newline", "", "unreadable", "non-utf8"]
# Outputs inside what a run owns (issue 21): the trained run's checkpoint, its metrics, its launch folder.
OUTPUT_FILE = ["dir", "below-file", "/dev/null", "the-input", "", "checkpoint-file", "run-metrics"]
OUTPUT_DIR = ["file", "below-file", "/dev/null", "", "checkpoint-dir", "run-launch-dir"]
NON_UTF8 = "x\udcffy"  # what Python makes of an argument that is not UTF-8 (the byte 0xff)
# Device types torch knows that no test machine has (issue 21: each was a traceback), and CUDA where absent.
ABSENT_DEVICES = ["meta", "xpu", "mps", "hpu", "xla", "lazy", "ipu", "mtia", "vulkan", "xpu:1", "mps:0"]
PASSES = ["no-such-pass", "fuse-heads{", "fuse-heads{nope=1}", "precision{target=nan}", "x\x1b[2J"]

# Options that take a string, by destination (command-specific first).
STRING_KINDS: dict[tuple[str | None, str], str] = {
    (None, "file"): "input-file", (None, "files"): "input-file", (None, "network"): "input-file",
    (None, "fleet"): "input-file", (None, "placement"): "input-file", (None, "plugin"): "plugin",
    (None, "checkpoint"): "input-file-or-dir", (None, "data"): "input-file-or-dir",
    ("report", "run"): "input-file-or-dir", ("export hf", "run"): "input-file-or-dir",
    ("import hf", "src"): "input-file-or-dir", (None, "token_ids"): "input-file",
    ("data prepare", "inputs"): "input-file-or-dir", ("data prepare", "output"): "output-dir",
    (None, "tokenizer"): "input-file",
    ("partition", "output"): "output-dir", (None, "output"): "output-file",
    (None, "out"): "output-dir", (None, "dump_dir"): "output-dir", ("launch", "emit_job"): "output-dir",
    (None, "passes"): "passes", (None, "device"): "device", (None, "target"): "target",
    (None, "master_addr"): "address",
    (None, "prompt"): "free-text",  # any text is a prompt
    ("new", "name"): "free-text",  # a network's name: printable text (control characters are refused)
    ("probe", "id"): "pnode-id", ("probe", "append"): "fleet-to-append", ("probe", "peer"): "endpoint",
    ("probe", "listen"): "endpoint", ("probe", "bandwidth"): "bandwidth",
    (None, "grad_compress"): "grad-compress",
    ("generate", "prompts_file"): "input-file", ("launch", "pnode"): "input-file",
}
STRING_VALUES = {
    "input-file": INPUT_FILE, "plugin": [v for v in INPUT_FILE if v != "empty"],  # an empty plugin is valid
    "input-file-or-dir": INPUT_FILE_OR_DIR, "output-file": OUTPUT_FILE, "output-dir": OUTPUT_DIR,
    "passes": PASSES + [NON_UTF8], "device": ["gpu7", "cuda:99", "cpu:x", "", NON_UTF8, *ABSENT_DEVICES],
    "target": ["cuda-sm", "tpu-v9", "", NON_UTF8], "address": ["not-an-address", "203.0.113.7", NON_UTF8],
    "free-text": [NON_UTF8],  # any text is a prompt, if it is text
    "pnode-id": ["../x", "a/b", ".hidden", "-x", "x\x1b[2J", "", "a" * 300],
    "fleet-to-append": OUTPUT_FILE + ["empty", "binary", "fifo", "newline"],
    "endpoint": ["nohost", "host:", ":80", "h:0", "h:99999", "h:abc", "", "x\x1b[2J:1"],
    "bandwidth": ["fast", "-1", "0", "nan", "inf", "1e400Gbit/s", ""],
    "grad-compress": ["topk", "powersgd:rank=0", "powersgd:rank=nan", "powersgd:rank=1e9", "powersgd:rank=2.5",
                      "powersgd:start=1", "powersgd:rank=4,rank=4", "powersgd:bits=2", "powersgd:min_rate=inf",
                      "none:rank=4", "powersgd:rank=\x1b[2J", ""],
    "op-type": ["no-such-op", "x\x1b[2J", "two words", "", "../gelu", "a" * 201],
    "nnodes": ["0", "-1", "2:1", "a:b", "1:2:3", "1 :2", "nan", "inf", "", "99999999999", "1:99999999999",
               "x\x1b[2J"],
}


def _baseline(command: str, w: Path, out: Path) -> tuple[list[str], dict[str, str | None]] | None:
    """Valid positionals and options of `command` that run fast: hostile cases change one of them."""
    net, fleet, corpus, run = str(w / "net.yml"), str(w / "fleet.yml"), str(w / "corpus.txt"), str(w / "run")
    train = {"--data": corpus, "--steps": "1", "--batch": "2", "--val-every": "0", "--out": str(out / "run"),
             "--quiet": None, "--threads": "1"}
    table = {
        "validate": ([net], {}), "analyze": ([net], {}), "passes": ([], {}), "ops": ([], {}), "networks": ([], {}),
        "optimize": ([net], {"-o": str(out / "o.yml")}), "render": ([net], {"-o": str(out / "o.svg")}),
        "partition": ([net], {"--fleet": fleet, "-o": str(out / "parts")}),
        "export-onnx": ([net], {"-o": str(out / "o.onnx"), "--random-weights": None}), "check-onnx": ([net], {}),
        "generate": ([run], {"--max-new-tokens": "1"}),
        "train": ([net], train), "launch": ([net], {"--fleet": fleet, **train}),
        "report": ([run], {"-o": str(out / "report.html")}),
        "probe": ([net], {"--id": "h0", "--bandwidth": "1Gbit/s", "--threads": "1", "--no-precisions": None,
                          "-o": str(out / "pnode.yml")}),
        "data prepare": ([corpus], {"-o": str(out / "prepared"), "--vocab": "96", "--quiet": None}),
        "eval": ([run], {"--token-ids": str(w / "ids.npy")}),
        "import hf": ([str(w / "hf")], {"-o": str(out / "imported")}),
        "export hf": ([str(w / "hfrun")], {"-o": str(out / "exported")}),
        "new": ([], {"-o": str(out / "new.yml"), "--layers": "1", "--dim": "32", "--heads": "2", "--vocab": "64",
                     "--context": "8"}),
    }
    return table.get(command)


# -- discovering the commands and their options ---------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's own parser (plugin commands built with their real options); a command with
    subcommands of its own (`data prepare`) by each of them."""
    out = {}
    for name in _subparsers(build_parser(None)):
        parser = _subparsers(build_parser(name))[name]
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        out.update({f"{name} {sub}": p for sub, p in nested[0].choices.items()} if nested else {name: parser})
    return out


COMMANDS = _commands()


def _options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]


def _kind(command: str, action: argparse.Action) -> str | None:
    if action.nargs == 0:
        return "flag"
    if action.choices is not None:
        return "choice"
    name = getattr(action.type, "__name__", "")
    if name == "compile_target":
        return "target"
    if name == "op_type":
        return "op-type"
    if name == "host_port":
        return "endpoint"
    if name == "nnodes":
        return "nnodes"
    if action.type is not None and name not in ("path", "network_file", "fleet_file"):
        return name if name in NUMBERS else None  # a bare int/float is an unchecked number: unclassified
    return STRING_KINDS.get((command, action.dest)) or STRING_KINDS.get((None, action.dest))


def _values(kind: str) -> list[str]:
    if kind in NUMBERS:
        return NUMBERS[kind]
    if kind == "choice":
        return ["not-a-choice", ""]
    return STRING_VALUES.get(kind, [])


def _cases() -> list:
    cases = []
    for command, sub in COMMANDS.items():
        if _baseline(command, Path("w"), Path("o")) is None:
            continue  # test_every_option_has_a_hostile_table says so
        for action in _options(sub):
            kind = _kind(command, action)
            if kind is None or kind == "flag":
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            values = list(_values(kind))
            if action.required:
                values.append("<missing>")
            for value in values:
                cases.append(pytest.param(command, action.dest, value, id=f"{command}-{name}-{value!r}"))
    return cases


def test_every_option_has_a_hostile_table() -> None:
    """A new option must say what hostile input looks like for it (and numbers need a checked type)."""
    missing = [f"{c} {a.option_strings or a.dest} (type {getattr(a.type, '__name__', a.type)})"
               for c, sub in COMMANDS.items() for a in _options(sub) if _kind(c, a) is None]
    assert not missing, "classify these options in tests/test_hostile_cli.py: " + "; ".join(missing)
    assert not [c for c in COMMANDS if _baseline(c, Path("w"), Path("o")) is None], \
        "give every command a fast valid baseline in tests/test_hostile_cli.py"


# -- the world every case runs in ---------------------------------------------------------------------------

FLEET = "name: two\npnodes:\n" + "".join(
    f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Inputs (a network, a fleet, a corpus, a trained run) and the hostile entries."""
    from vgraph.backends.torch.training.batches import default_corpus_documents

    w = tmp_path_factory.mktemp("world")
    shutil.copy(TINY, w / "net.yml")
    (w / "fleet.yml").write_text(FLEET)
    (w / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    assert main(["train", str(w / "net.yml"), "--data", str(w / "corpus.txt"), "--steps", "1", "--batch", "2",
                 "--val-every", "0", "--out", str(w / "run"), "--quiet"]) == 0
    np.save(w / "ids.npy", np.arange(20) % 96)
    _hf_model(w / "hf")
    assert main(["import", "hf", str(w / "hf"), "-o", str(w / "hfrun")]) == 0
    h = w / "hostile"
    h.mkdir()
    (h / "dir").mkdir()
    (h / "empty-dir").mkdir()
    os.mkfifo(h / "fifo")
    (h / "empty").write_text("")
    (h / "binary").write_bytes(b"\xff\xfe\x00\x9c" * 64)
    (h / "file").write_text("a file where a directory is expected")
    (h / "unreadable").write_text("name: secret\n")
    (h / "unreadable").chmod(0)
    return w


def _hf_model(path: Path) -> None:
    """A tiny GPT-2 directory (config.json, model.safetensors), random weights, without transformers."""
    import json

    import torch
    from safetensors.torch import save_file

    from vgraph.backends.hf.families import read_spec
    from vgraph.backends.hf.weights import hf_prefix, hf_shapes

    config = {"model_type": "gpt2", "vocab_size": 96, "n_positions": 16, "n_embd": 16, "n_layer": 1, "n_head": 2,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    spec = read_spec(config, "config.json")
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({hf_prefix(spec) + k: torch.randn(shape) for k, shape in hf_shapes(spec).items()},
              str(path / "model.safetensors"))


def _hostile_path(value: str, w: Path) -> str:
    h = w / "hostile"
    step = next((w / "run").glob("step-*"))
    named = {"missing": str(h / "missing.yml"), "newline": str(h / "new\nline\x1b[2J.yml"),
             "below-file": str(h / "file" / "below"), "the-input": str(w / "net.yml"),
             # names, not paths: looked up among the shipped networks and fleets, and refused naming them; with
             # '..' or a control character a name is a path like any other (never a way into the package)
             "unknown-name": "no_such_network_or_fleet", "dotdot-name": "../t4x4",
             "escape-name": "t4x4\x1b[2J",
             "non-utf8": str(h / f"{NON_UTF8}.yml"), "checkpoint-file": str(step / "model.safetensors"),
             "checkpoint-dir": str(step / "sub"), "run-metrics": str(w / "run" / "metrics.jsonl"),
             "run-launch-dir": str(w / "run" / "launch" / "sub")}
    if value in named:
        return named[value]
    if value in ("dir", "empty-dir", "fifo", "empty", "binary", "file", "unreadable"):
        return str(h / value)
    return value  # '/dev/zero', '/dev/null', ''


def _snapshot(*roots: Path) -> dict[str, tuple]:
    seen = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                st = p.lstat()
                seen[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command,dest,value", _cases())
def test_hostile_value_is_a_diagnostic(command: str, dest: str, value: str, world: Path, tmp_path: Path,
                                       monkeypatch, capsys) -> None:
    if value == "unreadable" and ROOT_USER:
        pytest.skip("running as root: file permissions do not stop reads")
    out = tmp_path / "out"
    out.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    positionals, options = _baseline(command, world, out)  # type: ignore[misc]
    action = next(a for a in _options(COMMANDS[command]) if a.dest == dest)
    kind = _kind(command, action)
    given = _hostile_path(value, world) if kind in ("input-file", "plugin", "input-file-or-dir", "output-file",
                                                    "output-dir", "fleet-to-append") else value
    if value == "the-input":  # the output named like the command's own input
        if not positionals or not Path(positionals[0]).is_file():  # (`new` reads nothing)
            pytest.skip(f"{command} reads {'a directory' if positionals else 'no input'}: no file of it to name as "
                        f"the output")
        given = positionals[0]
    argv = command.split()
    exclusive = {o for g in COMMANDS[command]._mutually_exclusive_groups if action in g._group_actions
                 for a in g._group_actions for o in a.option_strings}  # a baseline option ours excludes
    if not action.option_strings:  # a positional: ours is the only one, or the first of them
        argv += ([] if value == "<missing>" else [given]) + positionals[1:]
    else:
        argv += positionals
        for opt, v in options.items():
            if opt in action.option_strings or opt in exclusive:
                continue
            argv += [opt] if v is None else [opt, v]
        if value != "<missing>":
            argv.append(f"{action.option_strings[-1]}={given}")
    before = _snapshot(world, cwd)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, f"{argv!r} exited {code}: {err[-2000:]}"
    assert err.strip() and "Traceback" not in err and "\x1b" not in err, err[-2000:]
    assert len(err) < 20_000, "a diagnostic must not quote unbounded input"
    assert _snapshot(world, cwd) == before, f"{argv!r} changed files outside its output"


# -- symlinked run files (issue 21): every reader of a run reads only the run's own regular files -----------

SECRET = "SECRET-d41d8"


def _linked_run(world: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A copy of the trained run whose `name` is a symlink to a copy outside the run (which would work if
    followed: the test is that it is not), and that outside copy."""
    run = tmp_path / "run"
    shutil.copytree(world / "run", run, symlinks=True)
    step = next(p for p in run.iterdir() if p.name.startswith("step-"))
    inside = {"latest": run / "latest", "step": step, "model": step / "model.safetensors",
              "state": step / "state.json", "network.yml": run / "network.yml",
              "metrics.jsonl": run / "metrics.jsonl", "run.json": run / "run.json"}[name]
    outside = tmp_path / "elsewhere" / inside.name
    outside.parent.mkdir()
    shutil.move(str(inside), str(outside))
    if outside.is_file() and outside.suffix in (".json", ".jsonl", ".yml", ""):
        with open(outside, "a", encoding="utf-8") as f:  # a marker that must never reach a page
            f.write("" if name == "latest" else f"\n# {SECRET}\n" if name == "network.yml" else "")
    inside.symlink_to(outside, target_is_directory=outside.is_dir())
    return run, outside


@pytest.mark.parametrize("name", ["latest", "step", "model", "state"])
@pytest.mark.parametrize("command", ["generate", "train-resume"])
def test_a_symlinked_checkpoint_is_a_diagnostic(command: str, name: str, world: Path, tmp_path: Path,
                                                capsys) -> None:
    run, outside = _linked_run(world, tmp_path, name)
    before = _snapshot(outside.parent)
    argv = (["generate", str(run), "--max-new-tokens", "1"] if command == "generate" else
            ["train", str(world / "net.yml"), "--data", str(world / "corpus.txt"), "--steps", "2", "--batch", "2",
             "--val-every", "0", "--out", str(run), "--resume", "--quiet", "--threads", "1"])
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "symbolic link" in err
    assert _snapshot(outside.parent) == before


@pytest.mark.parametrize("name", ["latest", "network.yml", "metrics.jsonl", "run.json", "model"])
def test_report_never_follows_a_symlinked_run_file(name: str, world: Path, tmp_path: Path, capsys) -> None:
    run, outside = _linked_run(world, tmp_path, name)
    before = _snapshot(outside.parent)
    out = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    page = out.read_text()
    assert SECRET not in page and (name == "model" or "symbolic link" in page)
    assert _snapshot(outside.parent) == before
