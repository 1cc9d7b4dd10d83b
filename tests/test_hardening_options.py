"""Every numeric option is checked when it is parsed (issue 11, items 8 and 11): a usage error naming the
option, exit 2, before anything is read, run or written."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from conftest import TINY
from vgraph.base import options
from vgraph.cli.main import main

BAD = {
    ("train", "--lr"): ["-1", "0", "nan", "inf", "-inf", "1e999", "x"],
    ("train", "--grad-clip"): ["-1", "0", "nan", "inf"],
    ("train", "--seed"): ["-1", "99999999999999999999999", "1.5", "nan"],
    ("train", "--memory-limit"): ["inf", "nan", "-1G", "0", "1e400", "8Q"],
    ("train", "--steps"): ["-1", "1e3", str(2**70)],
    ("train", "--batch"): ["0", "-3", "nan"],
    ("generate", "--temperature"): ["nan", "inf", "-0.5"],
    ("generate", "--seed"): ["-1", str(2**64)],
    ("generate", "--top-k"): ["-1"],
    ("launch", "--master-port"): ["0", "70000", "-1", "http"],
    ("launch", "--comm-timeout"): ["0", "-5", "nan", "inf"],
    ("launch", "--lr"): ["-1", "nan"],
    ("launch", "--nnodes"): ["0", "2:1", "65537", "1e9", "nan", "inf", "a:b", "1: 2", "1:2:3", ""],
    ("launch", "--join"): ["host", "host:0", "host:70000", "a b:1", "[::1]", "h\x1b:1", ""],
    ("launch", "--join-timeout"): ["0", "-1", "nan", "inf"],
    ("check-onnx", "--rtol"): ["nan", "-1", "inf"],
    ("check-onnx", "--batch"): ["0", "-2"],
    ("export-onnx", "--seed"): ["-1", "1e3"],
    ("analyze", "--batch"): ["0", "nan"],
    ("partition", "--micro-batches"): ["0"],
}


def _args(command: str, option: str, value: str, tmp: Path) -> list[str]:
    head = {"generate": [command, str(tmp)], "launch": [command, str(TINY), "--fleet", str(TINY)],
            "export-onnx": [command, str(TINY), "--random-weights", "-o", str(tmp / "m.onnx")],
            "partition": [command, str(TINY), "--fleet", str(TINY), "-o", str(tmp / "p")]}
    return [*head.get(command, [command, str(TINY)]), f"{option}={value}"]


@pytest.mark.parametrize("command,option,value", [(c, o, v) for (c, o), vs in BAD.items() for v in vs])
def test_bad_numbers_are_usage_errors(command: str, option: str, value: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(_args(command, option, value, tmp_path))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("parse,good", [(options.positive_float, ["1e-9", "3e-3", "1"]),
                                        (options.seed, ["0", str(2**63 - 1), "1_000"]),
                                        (options.port, ["1", "65535"]),
                                        (options.non_negative_float, ["0", "0.8"]),
                                        (options.byte_size, ["1", "512M", "1.5GiB", "8g"])])
def test_good_numbers_still_parse(parse, good: list[str]) -> None:
    for text in good:
        parse(text)
    with pytest.raises(argparse.ArgumentTypeError):
        parse("")
