"""`vgraph launch`'s rendezvous (issue 11 items 2, 16): bound to the master address, keys behind a shared
secret, the port checked when parsed and probed before any worker starts."""
from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import TINY
from hardening_util import signal_after_rows
from ports import launch_port
from vgraph.backends.torch.distributed.launcher.launch import main as launch_main
from vgraph.backends.torch.distributed.rendezvous import (TOKEN_ENV, RendezvousError, check_token,
                                                          probe_port, rendezvous_store)
from vgraph.backends.torch.training.batches import default_corpus_documents

FLEET = "name: two\npnodes:\n" + "".join(
    f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2))


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) that listen on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_the_store_listens_on_the_master_address_only_and_hides_keys_without_the_token() -> None:
    port = launch_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), TOKEN_ENV: "s3cret-token-of-the-run"}
    server = rendezvous_store(0, 2, timedelta(seconds=5), env)
    server.set("rank0", "hello")
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
    peer = rendezvous_store(1, 2, timedelta(seconds=5), env)
    assert peer.get("rank0") == b"hello"
    intruder = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=5))
    assert not intruder.check(["rank0"])
    guess = rendezvous_store(1, 2, timedelta(seconds=5), {**env, TOKEN_ENV: "another-token-entirely"})
    assert not guess.check(["rank0"])


def test_a_token_is_required_for_several_machines_and_must_be_long_enough() -> None:
    assert len(check_token(None, 1)) >= 16  # one machine: a fresh secret
    assert check_token(None, 1) != check_token(None, 1)
    with pytest.raises(RendezvousError, match=TOKEN_ENV):
        check_token(None, 2)
    with pytest.raises(RendezvousError, match="at least 16"):
        check_token("short", 2)
    assert check_token("0123456789abcdef" * 2, 3) == "0123456789abcdef" * 2


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"port {port} on 127.0.0.1 is in use"):
            probe_port("127.0.0.1", port)
        code = launch_main(["launch", str(TINY), "--fleet", str(fleet), "--master-port", str(port), "--steps", "1",
                            "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"port {port} on 127.0.0.1 is in use" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # no worker, no restart, no run directory


def test_the_supervisor_probes_the_port_it_hosts_before_any_worker_starts(tmp_path: Path) -> None:
    """Each attempt's port (--master-port + attempt) is probed where the workers' rendezvous is built, on the
    machine that hosts it: a port taken since the launch began is a diagnostic, not a burnt restart."""
    from vgraph.backends.torch.distributed.launcher.supervisor import Supervisor

    supervisor = Supervisor(lambda line: None)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"port {port} on 127.0.0.1 is in use"):
            supervisor.run(tmp_path / "job-3.json", [0], ["w0"], "127.0.0.1", port, 1, hosts=True,
                           pids=(tmp_path / "workers.json", 3))
    assert supervisor.workers == [] and not (tmp_path / "workers.json").exists()


def test_several_machines_without_a_token_is_a_diagnostic(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET)
    code = launch_main(["launch", str(TINY), "--fleet", str(fleet), "--nnodes", "2", "--node-rank", "0",
                        "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and TOKEN_ENV in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("addr", ["203.0.113.7", "not-an-address"])
def test_a_master_address_that_is_not_this_machine_is_a_diagnostic(addr: str) -> None:
    with pytest.raises(RendezvousError):
        probe_port(addr, 29999)


def test_a_restart_past_the_last_port_is_a_diagnostic() -> None:
    with pytest.raises(RendezvousError, match="outside 1..65535"):
        probe_port("127.0.0.1", 65536)


def test_launch_trains_through_the_bound_store(tmp_path: Path, capsys) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    code = launch_main(["launch", str(TINY), "--fleet", str(fleet), "--data", str(corpus), "--steps", "2",
                        "--batch", "2", "--val-every", "0", "--threads", "1", "--out", str(tmp_path / "run"),
                        "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "latest").is_file()


def test_first_interrupt_stops_every_worker_after_one_step_with_a_checkpoint(tmp_path: Path, capsys) -> None:
    import signal

    from vgraph.backends.torch.training.checkpoint import latest_checkpoint, load_checkpoint

    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus_documents(max_bytes=20_000)), encoding="utf-8")
    out = tmp_path / "run"
    args = ["launch", str(TINY), "--fleet", str(fleet), "--data", str(corpus), "--batch", "2", "--val-every", "0",
            "--checkpoint-every", "0", "--log-every", "1", "--threads", "1", "--out", str(out), "--quiet"]
    with signal_after_rows(out / "metrics.jsonl", 2, signal.SIGINT):
        code = launch_main([*args, "--steps", "1000000"])
    err = capsys.readouterr().err
    assert code == 130 and f"Continue with: python -m vgraph.backends.torch.distributed.launcher.launch launch {TINY} --fleet" in err \
        and "Traceback" not in err, err
    step = load_checkpoint(latest_checkpoint(out)).step
    assert step >= 2
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn with the interrupt's checkpoint
    assert launch_main([*args, "--steps", str(step + 1), "--resume"]) == 0


@pytest.mark.parametrize("placement", ["/dev/zero", "fifo", "dir", "binary"])
def test_a_placement_that_is_not_a_json_file_is_a_diagnostic(placement: str, tmp_path: Path, capsys) -> None:
    import os

    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET)
    path = {"/dev/zero": Path("/dev/zero"), "dir": tmp_path}.get(placement, tmp_path / "placement.json")
    if placement == "fifo":
        os.mkfifo(path)
    elif placement == "binary":
        path.write_bytes(b"\xff\xfe{")
    code = launch_main(["launch", str(TINY), "--fleet", str(fleet), "--placement", str(path), "--steps", "1",
                        "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and "Traceback" not in err
