"""`vgraph probe` (backends/torch/probe/measure.py, probe_cli.py): the calibration's arithmetic on known timings, a real
probe of the tiny network written as a fleet entry that the cost model reads, the link measured against a
`--serve` peer, appending to a fleet, and mistakes refused before anything is measured.  Timings are shortened
(one repetition of a few milliseconds): these tests check what is measured and written, not the figures."""
from __future__ import annotations

import json
import socket
import threading

import pytest

import vgraph
from conftest import TINY_FP32
from vgraph.backends.torch import prepare_graph
from vgraph.backends.torch.probe import measure as P
from vgraph.backends.torch.probe import cli as C
from vgraph.backends.torch.probe.cli import burst_of, measure_link, serve
from vgraph.cli.main import main
from vgraph.cost.fleet import load_fleet, loads_fleet
from vgraph.cost.op_kinds import KINDS, op_kind


@pytest.fixture(autouse=True)
def _shared_secret(monkeypatch):
    """--serve and --peer need the shared secret (VGRAPH_LAUNCH_TOKEN), as launch across machines does."""
    monkeypatch.setenv("VGRAPH_LAUNCH_TOKEN", "5b7d9f1a3c5e7092b4d6f8a0c2e4a6b8")


@pytest.fixture()
def quick(monkeypatch):
    monkeypatch.setattr(P, "REPEATS", 1)
    monkeypatch.setattr(P, "MIN_REPEAT_S", 0.002)
    monkeypatch.setattr(P, "PROGRAM_REPEAT_S", 0.002)


def test_calibration_scales_the_vnodes_to_the_whole_program() -> None:
    graph = prepare_graph(vgraph.load(TINY_FP32), target="cpu")
    nodes = P.training_nodes(graph)
    flops = P.forward_flops(graph)
    # Every VNode alone: 100 us fixed + 10 us per sample; the whole program: twice both.
    sizes = (1, 8)
    per_vnode = tuple({n.id: 1e-4 + m * 1e-5 for n in nodes} for m in sizes)
    whole = (2 * 1e-4 * len(nodes), 2 * 1e-5 * len(nodes))  # the whole program's line: fixed, per sample
    peak = 1e10
    eff = P.calibrate(graph, per_vnode, whole, sizes, peak)  # type: ignore[arg-type]
    kinds = {n.id: op_kind(n.type, flops[n.id]) for n in nodes}
    for kind, cost in eff.kinds:
        assert cost.overhead == pytest.approx(2e-4)  # each VNode's fixed time, scaled by 2
        mine = [v for v, k in kinds.items() if k == kind]
        if kind == "structural":
            assert cost.of_peak is None
            continue
        # per-sample seconds of the kind (structural VNodes' time joins the elementwise ones'), scaled by 2
        timed = len(mine) + (sum(k == "structural" for k in kinds.values()) if kind == "elementwise" else 0)
        expected = sum(3 * flops[v] for v in mine) / (2 * 1e-5 * timed) / peak
        assert cost.of_peak == pytest.approx(min(1.0, expected))
    assert [k for k, _ in eff.kinds] == [k for k in KINDS if k in set(kinds.values())]


def test_calibration_scales_overheads_and_per_sample_times_each_by_their_own_factor() -> None:
    """The whole program's fixed time 3x the VNodes' and its per-sample time half of theirs: overheads scale
    by 3 and the per-sample seconds (so the shares of peak) by 1/2.  With equal factors (the test above) a
    calibration that scaled overheads by the per-sample factor could not be told apart (issue 41)."""
    graph = prepare_graph(vgraph.load(TINY_FP32), target="cpu")
    nodes = P.training_nodes(graph)
    flops = P.forward_flops(graph)
    kinds = {n.id: op_kind(n.type, flops[n.id]) for n in nodes}
    sizes = (1, 8)
    per_vnode = tuple({n.id: 1e-4 + m * 1e-5 for n in nodes} for m in sizes)  # 100 us + 10 us a sample each
    whole = (3 * 1e-4 * len(nodes), 0.5 * 1e-5 * len(nodes))
    peak = 1e10
    eff = dict(P.calibrate(graph, per_vnode, whole, sizes, peak).kinds)  # type: ignore[arg-type]
    assert set(eff) == set(kinds.values()) and "matmul" in eff
    structural = sum(k == "structural" for k in kinds.values())
    for kind, cost in eff.items():
        assert cost.overhead == pytest.approx(3e-4)  # 100 us x 3 a VNode, whatever its kind
        if kind == "structural":
            continue
        timed = sum(k == kind for k in kinds.values()) + (structural if kind == "elementwise" else 0)
        seconds = timed * 0.5e-5  # the kind's VNodes' 10 us a sample, halved
        work = sum(3 * flops[v] for v, k in kinds.items() if k == kind)
        assert cost.of_peak == pytest.approx(min(1.0, work / seconds / peak))


def test_a_timing_is_the_time_of_one_call_not_of_a_repetition(monkeypatch) -> None:
    """A fake clock that each call of `fast` advances by 1 ms (`slow` by 3 ms; binary fractions of a second,
    so the sums are exact): every repetition loops until 10 ms have passed, and one call takes 1 ms (3 ms),
    however many calls a repetition made."""
    ms = 2.0 ** -10
    now = [0.0]

    def tick(seconds: float):
        def fn() -> None:
            now[0] += seconds
        return fn

    monkeypatch.setattr(P, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: now[0])}))
    fast, slow = tick(ms), tick(3 * ms)
    assert P.timed_in_turn([fast, slow], P.torch.device("cpu"), repeats=3, least=10 * ms) == [ms, 3 * ms]
    # the premise: a warm-up call each, then three repetitions of 10 calls (10 ms) and 4 calls (12 ms)
    assert now[0] == 4 * ms + 3 * (10 * ms + 12 * ms)
    monkeypatch.setattr(P, "MIN_REPEAT_S", 5 * ms)
    assert P.timed(fast, P.torch.device("cpu"), repeats=2) == ms


def test_a_probe_writes_a_fleet_entry_the_cost_model_prices(quick, tmp_path, capsys) -> None:
    out = tmp_path / "h0.yml"
    assert main(["probe", str(TINY_FP32), "--id", "h0", "--bandwidth", "20Mbit/s", "--threads", "1",
                 "-o", str(out)]) == 0
    err = capsys.readouterr().err
    fleet = load_fleet(out)
    (p,) = fleet.pnodes
    assert (p.id, p.accelerator, p.bandwidth) == ("h0", "cpu", 2.5e6) and p.memory > 0 and p.flops > 1e6
    assert {k for k, _ in p.efficiency.kinds} == {"matmul", "attention", "elementwise", "structural"}
    assert all(c.overhead >= 0 and (c.of_peak is None or 0 < c.of_peak <= 1) for _, c in p.efficiency.kinds)
    # --quick times once: the update, a difference of two timings (after the program, less the program), is
    # noise there and may put all of it in one part; its floor (the same work alone) still prices a step
    assert p.update is not None and p.update.fixed >= 0 and p.update.per_param >= 0 and p.update.seconds(1e5) > 0
    assert "a step's batch draw and optimizer update:" in err and "the whole program" in err
    assert "at float32: matmul" in err and "at bfloat16: matmul" in err  # the table per precision
    assert out.read_text().startswith("# vgraph probe of network 'tiny-1l-fp32'")
    # The cost model now charges the network's small ops their measured cost, not FLOPs at the GEMM's peak.
    assert main(["analyze", str(TINY_FP32), "--fleet", str(out)]) == 0
    shown = capsys.readouterr().out
    plain = tmp_path / "plain.yml"
    plain.write_text(out.read_text().split(", efficiency:")[0] + "}\n")
    assert main(["analyze", str(TINY_FP32), "--fleet", str(plain)]) == 0
    step = lambda text: float(text.split("predicted step ")[1].split(" s")[0])  # noqa: E731
    slower = any(c.overhead > 0 or (c.of_peak or 1) < 1 for _, c in p.efficiency.kinds)
    assert step(shown) > step(capsys.readouterr().out) if slower else step(shown) == step(capsys.readouterr().out)


class _QuotaCpu:
    """A CPU under a quota, as the step cost models one (vgraph/cost/cpu_quota.py), with a clock: a call of
    the probe's small ops takes `each` seconds at the quota's average rate, `speedup` times faster while its
    bucket lasts; idling fills the bucket (`bucket` seconds of work at the CPU's own speed); the first call
    after idling also pays `cold` seconds (caches), which the model has no term for."""

    def __init__(self, each: float, speedup: float, bucket: float, cold: float) -> None:
        self.each, self.speedup, self.bucket, self.cold = each, speedup, bucket, cold
        self.now, self.tokens, self.idled = 0.0, 0.0, False

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.tokens, self.idled = self.bucket, True

    def call(self) -> None:
        import numpy as np

        from vgraph.cost.cpu_quota import burst_seconds

        took, left = burst_seconds(np.array([self.each]), np.array([self.tokens]), np.array([self.speedup]))
        self.now += float(took[0]) + (self.cold if self.idled else 0.0)
        self.tokens, self.idled = float(left[0]), False


@pytest.mark.parametrize("each, speedup, bucket", [(2e-3, 4.0, 1.5e-3), (1e-3, 2.5, 2e-3), (0.5e-3, 6.0, 0.4e-3)])
def test_the_cpu_burst_fitted_from_runs_after_idling_is_the_quotas(monkeypatch, each, speedup, bucket) -> None:
    """Runs of 1 call to 30 ms of calls after idling, on a simulated quota'd CPU whose first call after each idle
    also pays cold caches: the fit reads the quota's own speedup and bucket back (within the fit grid's steps:
    0.02 of speedup, 6% of bucket), the cold caches taken off first."""
    from vgraph.cost.cpu_quota import CpuBurst

    cpu = _QuotaCpu(each, speedup, bucket, cold=0.6 * each / speedup)
    monkeypatch.setattr(P, "_small_ops", lambda: cpu.call)
    monkeypatch.setattr(P, "timed_in_turn", lambda fns, device, repeats=None, least=None: [each])
    monkeypatch.setattr(P.time, "sleep", cpu.sleep)
    monkeypatch.setattr(P.time, "perf_counter", lambda: cpu.now)
    got = P.cpu_burst(repeats=3)
    assert isinstance(got, CpuBurst)
    assert got.speedup == pytest.approx(speedup, abs=0.03)
    assert got.bucket == pytest.approx(bucket, rel=0.07)


def test_a_cpu_as_fast_after_idling_as_in_a_loop_has_no_burst(monkeypatch) -> None:
    """No quota: every call takes its loop time after idling too (the first one's cold caches aside)."""
    cpu = _QuotaCpu(1e-3, 1.0, 0.0, cold=0.4e-3)
    monkeypatch.setattr(P, "_small_ops", lambda: cpu.call)
    monkeypatch.setattr(P, "timed_in_turn", lambda fns, device, repeats=None, least=None: [1e-3])
    monkeypatch.setattr(P.time, "sleep", cpu.sleep)
    monkeypatch.setattr(P.time, "perf_counter", lambda: cpu.now)
    assert P.cpu_burst(repeats=3) is None


@pytest.mark.parametrize("one, two, cold", [(1.0, 1.6, 0.4), (1.0, 2.0, 0.0), (1.0, 3.0, 0.0), (1.0, 1.0, 0.0),
                                           (1.0, 0.9, 0.0)])
def test_the_cold_caches_are_the_first_calls_time_over_the_seconds(one, two, cold) -> None:
    """1 call 1.0, 2 calls 1.6: the second took 0.6, so the first paid 0.4 for its caches; a second call as
    long or longer: nothing; runs of two no longer than one (a hiccup): nothing either, never a negative run."""
    assert P.cold_caches(one, two) == pytest.approx(cold)


def test_the_small_ops_run_forward_and_backward_and_leave_no_gradient_behind() -> None:
    call = P._small_ops()
    call()
    call()  # a second call would fail or accumulate if the first had left its graph or gradient


def test_the_cpu_burst_is_written_only_when_asked(quick, tmp_path, capsys, monkeypatch) -> None:
    from vgraph.cost.cpu_quota import CpuBurst

    asked = []
    monkeypatch.setattr(P, "cpu_burst", lambda repeats=None: asked.append(1) or CpuBurst(2.5, 2e-3))
    args = ["probe", str(TINY_FP32), "--bandwidth", "1Gbit/s", "--threads", "1", "--no-precisions"]
    assert main([*args, "--id", "plain", "-o", str(tmp_path / "plain.yml")]) == 0
    assert not asked and load_fleet(tmp_path / "plain.yml").pnodes[0].cpu_burst is None
    assert main([*args, "--id", "quota", "--cpu-burst", "-o", str(tmp_path / "quota.yml")]) == 0
    assert asked and load_fleet(tmp_path / "quota.yml").pnodes[0].cpu_burst == CpuBurst(2.5, pytest.approx(2e-3))
    assert "right after idling the CPU computes 2.5x as fast for 2 ms" in capsys.readouterr().err


def test_quick_times_once_briefly_and_leaves_the_settings_as_they_were(tmp_path, monkeypatch) -> None:
    """--quick (tests, smoke runs): every timing one short repetition; the entry is still whole, and the
    module's settings are back afterwards (a later probe in this process measures properly)."""
    seen = []
    real = P.timed_in_turn
    monkeypatch.setattr(P, "timed_in_turn", lambda fns, device, repeats=None, least=None: seen.append(
        (repeats or P.REPEATS, least if least is not None else P.MIN_REPEAT_S)) or real(fns, device, repeats, least))
    settings = (P.REPEATS, P.MIN_REPEAT_S, P.PROGRAM_REPEAT_S)
    out = tmp_path / "q.yml"
    assert main(["probe", str(TINY_FP32), "--id", "q", "--bandwidth", "1Gbit/s", "--threads", "1", "--no-precisions",
                 "--quick", "-o", str(out)]) == 0
    (p,) = load_fleet(out).pnodes
    assert p.efficiency is not None and p.update is not None
    assert seen and all(r == 1 and least <= 0.002 for r, least in seen)
    assert (P.REPEATS, P.MIN_REPEAT_S, P.PROGRAM_REPEAT_S) == settings


@pytest.mark.parametrize("busy", [False, True])
def test_the_update_is_the_workers_batch_draw_and_optimizer_step(monkeypatch, busy) -> None:
    """`update_costs` times, right after a run of the program (as a worker meets them), a batch draw plus every
    optimizer over all the network's parameters against a batch draw plus Adam over its smallest tensor, and
    the program alone in the same turns: taken off both, the difference per parameter is the rate, what is
    left of the small one is fixed.  The same two without the program are the floor (`busy`: a busy machine
    made the differences vanish; a --quick probe wrote 0 and 0).  The timed calls must really run the program,
    step those parameters and draw a batch."""
    import torch

    from vgraph.backends.torch.training.batches import TokenShards
    from vgraph.backends.torch.lowering.lower import compile_network

    graph = prepare_graph(vgraph.load(TINY_FP32), target="cpu")
    module = compile_network(graph, device=torch.device("cpu"), train=True, seed=0)
    params = [p for p in module.parameters() if p.requires_grad]
    total, smallest = sum(p.numel() for p in params), min(p.numel() for p in params)
    drawn = []
    real_batch = TokenShards.batch
    monkeypatch.setattr(TokenShards, "batch", lambda self, step, batch, *a: drawn.append((step, batch)) or
                        real_batch(self, step, batch, *a))
    programs = []
    real_program = P._program_run

    def counted_program(*args):
        run = real_program(*args)
        return lambda: programs.append(1) or run()

    monkeypatch.setattr(P, "_program_run", counted_program)
    moved, ran = [], []

    def fake_timing(fns, device, repeats=None, least=None):
        for fn in fns:
            before, runs = [p.detach().clone() for p in params], len(programs)
            fn()
            moved.append(sum(int(not torch.equal(a, p)) for a, p in zip(before, params)))
            ran.append(len(programs) - runs)
        alone = [1.5e-3 + 3e-9 * (total - smallest), 1.5e-3]  # the update in a loop of its own: the floor
        if busy:  # the program's own timing came out slow: both differences at or below zero
            return [5e-3, 5e-3 - 1e-4, 5e-3 - 2e-4, *alone]
        return [5e-3, 5e-3 + 2e-3 + 1e-9 * (total - smallest), 5e-3 + 2e-3, *alone]

    monkeypatch.setattr(P, "timed_in_turn", fake_timing)
    update = P.update_costs(graph, module, torch.device("cpu"), lambda: __import__("contextlib").nullcontext(), 4)
    assert ran == [1, 1, 1, 0, 0]  # the program alone, then before each update; the floors without it
    # the whole step moved every parameter, the other only the smallest (with and without the program)
    assert moved == [0, len(params), 1, len(params), 1]
    assert [b for _, b in drawn] == [4] * 4 and len({s for s, _ in drawn}) == 4  # a batch of 4 each, other steps
    if busy:
        assert update.per_param == pytest.approx(3e-9) and update.fixed == pytest.approx(1.5e-3 - 3e-9 * smallest)
    else:
        assert update.per_param == pytest.approx(1e-9) and update.fixed == pytest.approx(2e-3 - 1e-9 * smallest)


def _serving_once() -> tuple[threading.Thread, int]:
    """A `vgraph probe --serve --once` on a free loopback port, listening (its thread, its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port), kwargs={"once": True, "ready": ready},
                              daemon=True)
    server.start()
    assert ready.wait(30)
    return server, port


def test_the_link_is_measured_against_a_serving_peer(quick, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(C, "BURST_IDLE_S", 0.01)
    server, port = _serving_once()
    out = tmp_path / "fleet.yml"
    assert main(["probe", str(TINY_FP32), "--id", "h1", "--peer", f"127.0.0.1:{port}", "--seconds", "0.5",
                 "--threads", "1", "--no-precisions", "--append", str(out)]) == 0
    server.join(timeout=30)
    assert not server.is_alive()  # --once: the stream and the probe's burst transfers, then it stops
    (p,) = load_fleet(out).pnodes
    assert p.bandwidth > 1e6  # loopback: far more than a megabyte a second
    assert 0 <= p.burst <= max(1 << 20, p.bandwidth * C.BURST_SECONDS)
    assert load_fleet(out).name == "fleet"


def test_appending_adds_to_a_fleet_and_refuses_a_taken_id(quick, tmp_path, capsys) -> None:
    fleet = tmp_path / "fleet.yml"
    fleet.write_text("# ours\nname: lab\npnodes:\n  - {id: h0, memory: 1GiB, flops: 1G, bandwidth: 1GB/s}\n")
    args = ["probe", str(TINY_FP32), "--bandwidth", "1Gbit/s", "--threads", "1", "--no-precisions"]
    assert main([*args, "--id", "h1", "--append", str(fleet)]) == 0
    text = fleet.read_text()
    assert text.startswith("# ours\n") and loads_fleet(text).ids == ["h0", "h1"]
    capsys.readouterr()
    assert main([*args, "--id", "h0", "--append", str(fleet)]) == 2
    assert "already has a PNode 'h0'" in capsys.readouterr().err and fleet.read_text() == text


@pytest.mark.parametrize("argv, message", [
    ([], "needs a network FILE"),
    (["NET"], "measured against a peer"),
    (["NET", "--peer", "h:1", "--bandwidth", "1Gbit/s"], "one of the two"),
    (["NET", "--bandwidth", "1Gbit/s", "-o", "a.yml", "--append", "b.yml"], "either -o or --append"),
    (["NET", "--bandwidth", "1Gbit/s", "-o", "NET"], "refusing to overwrite an input"),
    (["NET", "--bandwidth", "1Gbit/s", "--append", "NET"], "refusing to overwrite an input"),
    (["NET", "--bandwidth", "1Gbit/s", "--append", "NOTFLEET"], "notfleet.yml:1: fleet:"),
    (["NET", "--serve"], "--serve takes no network"),
    (["--serve", "--quick"], "--serve takes no network, output, --peer, --quick or --cpu-burst"),
    (["--serve", "--cpu-burst"], "--serve takes no network, output, --peer, --quick or --cpu-burst"),
    (["--collectives", "--cpu-burst", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], "--cpu-burst"),
    (["--collectives", "--quick", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], "--quick"),
    (["--serve", "--listen", "nowhere"], "--listen: expected HOST:PORT"),
    (["NET", "--peer", "h:70000"], "--peer: expected HOST:PORT"),
    (["NET", "--bandwidth", "0"], "--bandwidth must be positive"),
    (["NET", "--bandwidth", "1Gbit/s", "--id", "../up"], "--id '../up'"),
    (["NET", "--bandwidth", "1Gbit/s", "--batch", "5000"], "--batch is at most 4096"),
])
def test_mistakes_are_refused_before_anything_is_measured(argv, message, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(P, "probe", lambda *a, **k: pytest.fail("measured although the command was wrong"))
    (tmp_path / "notfleet.yml").write_text("not: a fleet\n")
    swap = {"NET": str(TINY_FP32), "NOTFLEET": str(tmp_path / "notfleet.yml")}
    monkeypatch.chdir(tmp_path)
    assert main(["probe", *[swap.get(a, a) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_peer_that_does_not_answer_is_a_diagnostic(monkeypatch) -> None:
    monkeypatch.setattr(C, "CONNECT_PATIENCE_S", 0.5)  # retried, then the diagnostic
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens
    with pytest.raises(vgraph.VGraphError, match="is `vgraph probe --serve` running there"):
        measure_link("127.0.0.1", port, 0.1)


def test_the_burst_is_what_arrived_ahead_of_the_transfers_steady_rate() -> None:
    size = 1_000_000
    rate = 2.5e6  # bytes/s; 16 KiB at once, then the rate
    curve = [[0.0, 16384]] + [[t / 100, min(size, 16384 + int(rate * t / 100))] for t in range(1, 40)]
    assert burst_of({"curve": curve}, size) == pytest.approx(16384, rel=0.01)
    steady = [[t / 100, int(rate * t / 100) + 1500] for t in range(0, 40)]  # no bucket: one packet ahead
    assert burst_of({"curve": steady}, size) == pytest.approx(1500, abs=10)
    assert burst_of({"curve": [[0.0, size]]}, size) == 0.0  # one point: nothing to fit
    assert burst_of({"curve": [[0.0, 1], [0.0, size]]}, size) == 0.0  # no time passed


@pytest.mark.parametrize("reply", [{}, {"curve": "fast"}, {"curve": [[0, "1"]]}, {"curve": [[0, 1, 2]]},
                                   {"curve": [[float("nan"), 1]]}, {"curve": [[True, 1]]}, {"curve": [3]}])
def test_a_malformed_arrival_curve_is_a_diagnostic(reply) -> None:
    with pytest.raises(vgraph.VGraphError, match="arrival times are malformed"):
        burst_of(reply, 1 << 20)


@pytest.mark.parametrize("answer", [b"garbage\n", b'{"bytes": "many", "seconds": 1}\n', b'{"bytes": 1e999}\n',
                                    b'{"bytes": -5, "seconds": 1}\n', b"[1, 2]\n", b""])
def test_a_peer_that_answers_nonsense_is_a_diagnostic(answer) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def answer_once() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(answer)

        threading.Thread(target=answer_once, daemon=True).start()
        with pytest.raises(vgraph.VGraphError, match="no measurement came back|measurement failed"):
            measure_link("127.0.0.1", port, 0.05)


@pytest.mark.parametrize("more", [0, -1, "3", True, None, 10**9])
def test_a_serve_once_stops_after_a_connection_that_announces_no_more_or_too_many(more) -> None:
    server, port = _serving_once()
    connections = C.MAX_ROUNDS if more == 10**9 else 1  # a large count is honoured up to MAX_ROUNDS
    for _ in range(connections):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(C.auth_line("5b7d9f1a3c5e7092b4d6f8a0c2e4a6b8") + json.dumps({"seconds": 0, "more": more})
                         .encode() + b"\n" + b"x" * 1000)
            conn.shutdown(socket.SHUT_WR)
            assert json.loads(conn.makefile("rb").readline())["bytes"] >= 1
    server.join(timeout=10)
    assert not server.is_alive()
