"""The training options are declared once (backends/torch/training/options.py, issue 40 item 1): `train` and
`launch` take the same options with `TrainConfig`'s defaults, a library config and a job file are held to the
same checks, and a bad value is a usage error naming the option on both commands."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from conftest import TINY
from vgraph.backends.torch.cli import register_train
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, register_launch
from vgraph.backends.torch.training.config import TrainConfig, TrainingError
from vgraph.backends.torch.training.options import (TRAIN_OPTIONS, add_train_options, check_train_config,
                                                    config_problems, train_section, train_settings)
from vgraph.cli.main import main

# What launch alone has: LaunchConfig's own fields, by their option's dest (--bucket-size sets bucket_bytes).
LAUNCH_ONLY = ({f.name for f in dataclasses.fields(LaunchConfig)} - {f.name for f in dataclasses.fields(TrainConfig)}
               - {"bucket_bytes", "hold", "comm", "log", "max_nnodes"}) | {"bucket_size", "join", "join_timeout", "pnode"}
# (--nnodes MIN:MAX sets nnodes and max_nnodes; --join, --join-timeout and --pnode are a joining machine's)
NOT_TRAINING = {"help", "plugin", "command_parser", "func"}


def _parser(register) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="vgraph")
    register(top.add_subparsers(dest="command"))
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return next(iter(sub.choices.values()))


def _undeclared(parser: argparse.ArgumentParser, own: set[str]) -> set[str]:
    """The options of `parser` that are neither the table's nor in `own` (the command's own options)."""
    table = {o.dest for o in TRAIN_OPTIONS} | {"network"}
    return {a.dest for a in parser._actions} - table - own - NOT_TRAINING


@pytest.mark.parametrize("command, register, own", [("train", register_train, set()),
                                                    ("launch", register_launch, LAUNCH_ONLY)])
def test_each_command_takes_the_tables_options_with_trainconfig_defaults(command, register, own) -> None:
    parser = _parser(register)
    actions = {a.dest: a for a in parser._actions}
    assert _undeclared(parser, own) == set()  # every training option comes from the table
    declared = [o for o in TRAIN_OPTIONS if command in o.commands]
    assert len(declared) >= 20 and {"steps", "batch", "lr"} <= {o.dest for o in declared}
    field_default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for option in declared:
        action = actions[option.dest]
        assert action.option_strings == [option.flag]
        assert action.help == option.help_for(command) and "{default}" not in action.help
        if option.flag_only:  # a flag: unset means the field's default (--no-fuse unset: fuse=True)
            assert action.nargs == 0 and action.default is False
            assert field_default[option.field] is option.negated
        else:
            assert (action.type, action.choices, action.default) == (option.type, option.choices,
                                                                      field_default[option.field])
    for option in TRAIN_OPTIONS:
        assert (option.dest in actions) == (command in option.commands)


def test_no_options_given_is_trainconfigs_defaults_on_both_commands() -> None:
    for command, register in (("train", register_train), ("launch", register_launch)):
        extra = ["--fleet", "cpu2"] if command == "launch" else []
        args = _parser(register).parse_args([str(TINY), *extra])
        settings = train_settings(args, command)
        settings.pop("continue_command")
        assert settings == {**{name: getattr(TrainConfig(network=str(TINY)), name) for name in settings},
                            "network": str(TINY)}
        assert settings["steps"] == 1000 and settings["fuse"] is True and settings["progress"] is True


def test_train_and_launch_share_every_option_launch_takes() -> None:
    train, launch = _parser(register_train), _parser(register_launch)
    shared = {a.dest for a in launch._actions} - LAUNCH_ONLY - NOT_TRAINING - {"network"}  # optional: --join
    by_dest = {a.dest: a for a in train._actions}
    for action in launch._actions:
        if action.dest in shared:
            twin = by_dest[action.dest]
            assert (action.option_strings, action.type, action.default, action.choices, action.nargs) == (
                twin.option_strings, twin.type, twin.default, twin.choices, twin.nargs)
    assert {"steps", "batch", "lr", "data", "out", "resume", "no_fuse", "quiet", "no_tensorboard"} <= shared
    assert {"memory_limit", "compile", "accept_network_change"} <= {a.dest for a in train._actions} - shared


def test_an_option_added_to_one_command_only_is_caught() -> None:
    """The check above is not vacuous: an option declared beside the table, on one command, is found."""
    parser = argparse.ArgumentParser()
    add_train_options(parser, "launch")
    assert _undeclared(parser, LAUNCH_ONLY) == set()
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    assert _undeclared(parser, LAUNCH_ONLY) == {"min_lr_ratio"}


def test_help_shows_the_default_from_trainconfig() -> None:
    steps = next(o for o in TRAIN_OPTIONS if o.flag == "--steps")
    assert steps.help_for("train") == "optimizer steps in all (default 1000)"
    threads = next(o for o in TRAIN_OPTIONS if o.flag == "--threads")
    assert threads.help_for("train") != threads.help_for("launch")  # one per worker under launch
    assert "per worker" in threads.help_for("launch")


BAD = [("--steps", "-1"), ("--steps", str(2**70)), ("--steps", "1e3"), ("--steps", ""), ("--batch", "0"),
       ("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--lr", "1e-320"), ("--warmup", "-2"),
       ("--seed", "-1"), ("--seed", str(2**64)), ("--schedule", "linear"), ("--out", ""), ("--out", "a\x00b"),
       ("--data", ""), ("--val-every", "x"), ("--val-batches", "0"), ("--keep-checkpoints", "0"),
       ("--threads", "0"), ("--log-every", "0"), ("--grad-clip", "0"), ("--weight-decay", "-0.1"),
       ("--weight-decay", "nan"), ("--grad-accum", "0"), ("--corpus-bytes", "0"), ("--corpus-bytes", "1e999")]


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {"train": _parser(register_train), "launch": _parser(register_launch)}


@pytest.mark.parametrize("command", ["train", "launch"])
@pytest.mark.parametrize("option, value", BAD)
def test_a_bad_value_is_a_usage_error_on_both_commands(command: str, option: str, value: str, parsers, capsys) -> None:
    head = [str(TINY)] + (["--fleet", "cpu2"] if command == "launch" else [])
    with pytest.raises(SystemExit) as info:
        parsers[command].parse_args([*head, f"{option}={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "launch"])
def test_the_cli_exits_2_and_writes_nothing(command: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    head = [command, str(TINY)] + (["--fleet", "cpu2"] if command == "launch" else [])
    with pytest.raises(SystemExit) as info:
        main([*head, "--lr=nan"])
    assert info.value.code == 2
    assert "argument --lr" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_train_only_options_are_refused_by_launch(parsers, capsys) -> None:
    for option in ("--memory-limit=8G", "--compile", "--accept-network-change"):
        with pytest.raises(SystemExit) as info:
            parsers["launch"].parse_args([str(TINY), "--fleet", "cpu2", option])
        assert info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("change, flag", [
    ({"steps": -1}, "--steps"), ({"batch": 0}, "--batch"), ({"batch": True}, "--batch"), ({"steps": 2.5}, "--steps"),
    ({"lr": float("nan")}, "--lr"), ({"lr": float("inf")}, "--lr"), ({"lr": 0}, "--lr"),
    ({"schedule": "linear"}, "--schedule"), ({"memory_limit": 0}, "--memory-limit"), ({"seed": 2**64}, "--seed"),
    ({"grad_clip": -1.0}, "--grad-clip"), ({"threads": "4"}, "--threads"), ({"corpus_bytes": 10**30}, "--corpus-bytes"),
])
def test_a_library_config_is_held_to_the_command_lines_checks(change: dict, flag: str) -> None:
    good = TrainConfig(network=str(TINY))
    assert config_problems(good) == []
    check_train_config(good)
    with pytest.raises(TrainingError, match=f"^{flag}: "):
        check_train_config(dataclasses.replace(good, **change))


def test_the_job_files_train_section_is_json_and_drops_the_resume_hint(tmp_path: Path) -> None:
    cfg = TrainConfig(network="net.yml", out=tmp_path / "run", data=Path("corpus"), continue_command=lambda d: "x")
    section = train_section(cfg)
    assert section["out"] == str(tmp_path / "run") and section["data"] == "corpus"
    assert "continue_command" not in section
    assert set(section) == {f.name for f in dataclasses.fields(TrainConfig)} - {"continue_command"}


def test_launchs_own_options_default_to_launchconfigs() -> None:
    actions = {a.dest: a for a in _parser(register_launch)._actions}
    dest = {"bucket_bytes": "bucket_size"}
    for f in dataclasses.fields(LaunchConfig):
        name = dest.get(f.name, f.name)
        if f.name in LAUNCH_ONLY | {"bucket_bytes"} and name in actions and f.name not in ("replicas", "nnodes"):
            assert actions[name].default == f.default, f.name
    assert actions["nnodes"].default[0] == LaunchConfig(network="n").nnodes  # --nnodes N|MIN:MAX: (MIN, MAX)
    assert actions["replicas"].default == "auto" and LaunchConfig(network="n").replicas == 1  # the CLI plans
    assert actions["max_restarts"].help == f"default {LaunchConfig(network='n').max_restarts}"
