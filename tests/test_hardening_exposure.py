"""What launch exposes and what check-onnx allocates (issue 21, the lower list and "huge check-onnx --batch").

Regression tests: `--master-addr 0.0.0.0` bound every interface although the README says never; a token of
16 spaces was accepted as the shared secret; a huge `check-onnx --batch` was numpy's MemoryError traceback.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY
from vgraph.backends.torch.distributed.rendezvous import RendezvousError, check_master_addr, check_token
from vgraph.cli.main import main


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "[::]", "0", "0.0", "", " ", "*", "0:0:0:0:0:0:0:0"])
def test_a_wildcard_master_address_is_refused(addr: str) -> None:
    with pytest.raises(RendezvousError, match="every interface"):
        check_master_addr(addr)


@pytest.mark.parametrize("addr", ["127.0.0.1", "10.0.0.2", "::1", "machine-0.local"])
def test_a_real_master_address_is_kept(addr: str) -> None:
    assert check_master_addr(addr) == addr


def test_launch_refuses_a_wildcard_master_address_before_anything_starts(tmp_path: Path, capsys) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("pnodes:\n  - {id: w0, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}\n")
    code = main(["launch", str(TINY), "--fleet", str(fleet), "--steps", "1", "--master-addr", "0.0.0.0",
                 "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "every interface" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("token", [" " * 16, " " * 40, "a" * 32, "abcdabcdabcdabcd", "abcdefgh ijklmnopq",
                                   "\tabcdefghijklmnop"])
def test_a_token_that_is_no_secret_is_refused(token: str) -> None:
    with pytest.raises(RendezvousError, match="no spaces"):
        check_token(token, 2)


def test_a_real_token_is_kept() -> None:
    token = "9f86d081884c7d659a2feaa0c55ad015"
    assert check_token(token, 2) == token


def test_a_check_onnx_batch_beyond_memory_is_a_diagnostic(capsys) -> None:
    assert main(["check-onnx", str(TINY), "--batch", str(10**11)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--batch" in err and "GiB" in err
