"""`vgraph probe --collectives` (backends/torch/probe/collectives.py): two processes on this machine measure the
table and rank 0 writes it into a fleet (and replaces it the second time), the table written into fleets of
every layout or refused, and every mistake refused before anyone joins a rendezvous."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_FP32

from ports import launch_port
from vgraph.backends.torch.probe import collectives as PC
from vgraph.cli.main import main
from vgraph.cost.collectives import collectives_of
from vgraph.cost.fleet import loads_fleet
from zygote import STDOUT, popen

TOKEN = "probe-collectives-test-0123456789"
VGRAPH = str(Path(sys.executable).with_name("vgraph"))
FLEET = "# measured\nname: lab\npnodes:\n  - {id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n" \
        "  - {id: b, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}\n"


def _probe_all(world: int, fleet: str, rounds: int = 3) -> list[subprocess.CompletedProcess]:
    port = launch_port()
    env = dict(os.environ, VGRAPH_LAUNCH_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    # the installed script in forks of the zygote (tests/zygote.py): a process each, torch imported once
    procs = [popen([VGRAPH, "probe", "--collectives", "--nnodes",
                    str(world), "--node-rank", str(i), "--master-addr", "127.0.0.1", "--master-port",
                    str(port), "--rounds", str(rounds), *(["--append", fleet] if i == 0 else [])],
                   env=env, stderr=STDOUT)
             for i in range(world)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


def test_two_processes_measure_the_table_and_rank_0_replaces_the_fleets_with_it(tmp_path):
    """One run (what replacing a table does to every layout: test_the_table_goes_into_fleets_of_every_layout)."""
    fleet = tmp_path / "fleet.yml"
    fleet.write_text(FLEET.replace("name: lab\n", "name: lab\ncollectives:\n  - {ranks: 3, control: 9ms, hop: 1ms}\n"))
    done = _probe_all(2, str(fleet))
    assert [d.returncode for d in done] == [0, 0], [d.stdout[-2000:] for d in done]
    table = loads_fleet(fleet.read_text(), str(fleet)).collectives
    assert [n for n, _, _ in table.rows] == [1, 2]
    (_, alone, none), (_, control, hop) = table.rows
    assert none == 0.0 and 0 < alone < 5.0 and 0 < hop < 5.0 and 0 < control < 5.0  # medians: no order under load
    assert "1 host: control" in done[0].stdout and "2 hosts: control" in done[0].stdout
    assert "control collectives" not in done[1].stdout  # rank 0 reports and writes
    text = fleet.read_text()
    assert text.startswith("# measured\nname: lab\ncollectives:\n  - {ranks: 1, ") and text.count("collectives:") == 1
    assert loads_fleet(text).collectives.ring(2) > 1e6  # loopback: the 1 MiB all-reduce at more than 1 MB/s
    assert text.endswith(FLEET.split("name: lab\n")[1])  # the PNodes as they were


def test_the_table_goes_into_fleets_of_every_layout():
    table = collectives_of([(2, 1e-3, 1e-4), (4, 1.2e-2, 1e-3)])
    for text in (FLEET, FLEET.replace("name: lab\n", "name: lab\ncollectives:\n  - {ranks: 3, control: 9ms, hop: 1ms}\n"),
                 FLEET.replace("name: lab\n", "name: lab\ncollectives: [{ranks: 3, control: 9ms, hop: 1ms}]\n"),
                 FLEET + "collectives:\n  - {ranks: 3, control: 9ms, hop: 1ms}\n# the end\n"):
        new = PC.with_collectives(text, "f.yml", table)
        got = loads_fleet(new, "f.yml")
        assert got.collectives.rows == table.rows and got.ids == ["a", "b"], new  # exact in ms at 6 digits
        assert new.count("collectives:") == 1 and "# measured" in new
    flow = "{name: lab, pnodes: [{id: a, memory: 1GiB, flops: 1T, bandwidth: 1Gbit/s}]}\n"
    with pytest.raises(Exception, match="add it by hand"):
        PC.with_collectives(flow, "f.yml", table)


def test_known_all_reduce_times_give_the_hop_and_the_ring_rate_by_hand(monkeypatch):
    """Rank 0 of 3 measures against a fake process group and a fake clock: an all-reduce of 8 numbers among
    k ranks takes small[k], of 1 MiB big[k], a control step's all-reduce 0.2 ms (the metrics gather runs at
    sync points about once a second, not every step, and is not timed).  A ring all-reduce runs 2 (k - 1) hops,
    so at k = 3 the hop is small[3] / 4 (not / 2: that would price every message twice), and the ring rate is
    the bytes it moves, 2 (k - 1) / k MiB, over the time its hops do not take."""
    import torch.distributed as dist

    from vgraph.backends.torch.distributed import rendezvous
    from vgraph.backends.torch.distributed.runtime import comm

    small, big = {2: 1e-3, 3: 4e-3}, {2: 0.011, 3: 0.024}
    now = [0.0]

    class Control:
        def __init__(self, rank, world, group=None):
            self.world = world

        def all_reduce(self, values):
            now[0] += 2e-4
            return values

        def gather(self, obj):
            now[0] += 3e-4
            return [obj] * self.world

    def all_reduce(tensor, group=None):
        now[0] += (small if tensor.numel() == 8 else big)[len(group)]

    monkeypatch.setattr(PC, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(comm, "ControlGroup", Control)
    monkeypatch.setattr(rendezvous, "rendezvous_store", lambda *a, **k: None)
    monkeypatch.setattr(rendezvous, "gloo_environment", lambda *a, **k: {})
    for name, fake in (("init_process_group", lambda *a, **k: None), ("new_group", lambda ranks: list(ranks)),
                       ("all_reduce", all_reduce), ("barrier", lambda *a, **k: None),
                       ("destroy_process_group", lambda *a, **k: None)):
        monkeypatch.setattr(dist, name, fake)
    table = PC.measure(0, 3, rounds=3, env={})
    assert [n for n, _, _ in table.rows] == [1, 2, 3]
    (_, c1, h1), (_, c2, h2), (_, c3, h3) = table.rows
    assert (c1, c2, c3) == (pytest.approx(2e-4),) * 3 and h1 == 0.0
    assert h2 == pytest.approx(1e-3 / 2) and h3 == pytest.approx(4e-3 / 4)  # 2 and 4 ring hops
    mib = 2 ** 20
    assert table.ring(2) == pytest.approx(mib / (0.011 - 2 * 0.5e-3))
    assert table.ring(3) == pytest.approx(4 / 3 * mib / (0.024 - 4 * 1e-3))


def test_the_host_counts_measured():
    assert PC.rank_counts(2) == [1, 2]
    assert PC.rank_counts(4) == [1, 2, 3, 4]
    assert PC.rank_counts(16) == list(range(1, 17))
    assert PC.rank_counts(100) == [*range(1, 17), 32, 64, 100]


@pytest.mark.parametrize("argv, env, message", [
    (["--collectives"], TOKEN, "needs --nnodes N, --node-rank I and --master-addr"),
    (["--collectives", "--nnodes", "1", "--node-rank", "0", "--master-addr", "h"], TOKEN, "--nnodes from 2"),
    (["--collectives", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], TOKEN, "--node-rank from 0"),
    (["--collectives", "--nnodes", "2000000", "--node-rank", "0", "--master-addr", "h"], TOKEN, "--nnodes from 2"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--rounds", "1000001"], TOKEN,
     "--rounds of at most"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--rounds", "0"], TOKEN,
     "positive integer"),
    (["--collectives", "--nnodes", "2", "--node-rank", "-1", "--master-addr", "h"], TOKEN, "integer from 0"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "0.0.0.0"], TOKEN, "every interface"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], None, "shared secret"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], "s" * 32, "at least"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--master-port", "70000"], TOKEN,
     "TCP port"),
    (["NET", "--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], TOKEN, "takes no network"),
    (["--collectives", "-o", "x.yml", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], TOKEN,
     "takes no network, -o"),
    (["--collectives", "--serve", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], TOKEN, "--serve"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--append", "DIR"], TOKEN,
     "DIR"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--append", "missing.yml"], TOKEN,
     "no such fleet file"),
    (["--collectives", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--append", "bad.yml"], TOKEN,
     "bad.yml:1"),
    (["NET", "--bandwidth", "1Gbit/s", "--nnodes", "2"], TOKEN, "go with --collectives"),
])
def test_mistakes_are_refused_before_any_rendezvous(argv, env, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(PC, "measure", lambda *a, **k: pytest.fail("joined although the command was wrong"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    (tmp_path / "bad.yml").write_text("not: a fleet\n")
    if env is None:
        monkeypatch.delenv("VGRAPH_LAUNCH_TOKEN", raising=False)
    else:
        monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", env)
    try:
        code = main(["probe", *[str(TINY_FP32) if a == "NET" else a for a in argv]])
    except SystemExit as exc:  # argparse's usage error for a value its type refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_host_that_finds_nobody_is_a_diagnostic_not_a_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(PC, "RENDEZVOUS_S", 0.5)
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", TOKEN)
    port = launch_port()  # nobody serves the rendezvous there
    assert main(["probe", "--collectives", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--master-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "did not all meet at 127.0.0.1:" in err and "Traceback" not in err, err
