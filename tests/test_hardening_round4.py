"""Issue 39, part B: job files, workers' run directory and lock, --emit-job's output, every listener's address,
probe --serve's secret, a checkpoint's tokenizer against its network, a worker without its GPU, the ONNX causal
mask, and pipeline ordering.

Regression tests, each failing before its fix:
* two worker sets on one job.json both ran (300 metrics rows for 150 steps): rank 0 now takes the run lock;
* a job.json copied alone wrote metrics into whatever its relative run_dir named: the run is now found from
  where the job was written and checked by its run.json;
* `launch --emit-job DIR` overwrote a DIR/job.json of the user's;
* `--master-addr ::ffff:0.0.0.0` passed the wildcard check, and hand-started workers bound MASTER_ADDR=0.0.0.0;
* `probe --serve` listened on 0.0.0.0, died of one line of `[[[[`, and a port scan used up `--once`;
* a checkpoint's tokenizer with ids past the network's vocabulary: an IndexError in generate, nothing in
  export-onnx, check-onnx or resume;
* a job with `device: cuda` on a worker without a GPU exited 1 (a crash torchrun restarts), not 3;
* export-onnx stored a seq_len^2 causal mask (a MemoryError at seq_len 200,000);
* pipeline ordering was quadratic (30,000 passes: minutes).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ports import launch_port
import vgraph
from conftest import TINY
from hardening_util import small_corpus
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch.training import checkpoint as ckpt
from vgraph.backends.torch import cli as torch_cli
from vgraph.backends.torch.probe import cli as probe_cli
from vgraph.backends.torch.distributed.runtime.comm_choice import worker_device
from vgraph.backends.torch.distributed.job import Job, JobError
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
from vgraph.backends.torch.distributed.rendezvous import (TOKEN_ENV, RendezvousError, check_bound, check_listen_addr,
                                                          check_master_addr, rendezvous_store)
from vgraph.backends.torch.distributed.runtime.worker import main as worker_main
from vgraph.base.diagnostics import VGraphError
from vgraph.cli.main import build_parser, main
from vgraph.run.files import LOCK_FILE, METRICS_JSONL, RunLock
from vgraph.transform import pipeline as pl
from vgraph.transform.pass_api import Pass, PassError

TOKEN = "3f5a9c0e7b2d4f6a8c1e0b9d7f5a3c2e"
ROOT = Path(__file__).resolve().parent.parent


# -- one address check for every listener -------------------------------------------------------------

@pytest.mark.parametrize("addr", ["::ffff:0.0.0.0", "[::ffff:0.0.0.0]", "::ffff:0:0", "::0.0.0.0", "0x0", "00",
                                  "::%lo", "0:0::0", "0000:0000::", " 0.0.0.0 ", "[::]"])
def test_no_spelling_of_a_wildcard_passes_the_address_check(addr: str) -> None:
    with pytest.raises(RendezvousError, match="every interface"):
        check_master_addr(addr)
    with pytest.raises(RendezvousError, match="every interface"):
        check_listen_addr(addr, "--listen")


def test_a_listener_is_loopback_unless_given_an_address() -> None:
    assert check_listen_addr(None, "--listen") == "127.0.0.1"
    assert check_listen_addr("10.1.2.3", "--listen") == "10.1.2.3"
    with pytest.raises(RendezvousError, match="control characters"):
        check_listen_addr("127.0.0.1\n", "--listen")


def test_a_socket_bound_to_every_interface_is_refused_after_bind() -> None:
    """A host name resolving to 0.0.0.0 gets past a check of the text; the bound socket does not."""
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    with pytest.raises(RendezvousError, match="every interface"):
        check_bound(sock, "--listen somewhere")
    assert sock.fileno() == -1  # closed
    with socket.socket() as ok:
        ok.bind(("127.0.0.1", 0))
        check_bound(ok, "--listen 127.0.0.1")  # loopback stays


@pytest.mark.parametrize("addr", ["0.0.0.0", "::ffff:0.0.0.0", "::"])
def test_hand_started_workers_never_bind_every_interface(addr: str) -> None:
    """Rank 0 of workers started by hand or srun serves the store on MASTER_ADDR: never a wildcard."""
    from datetime import timedelta

    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(launch_port()), TOKEN_ENV: TOKEN}
    with pytest.raises(RendezvousError, match="every interface"):
        rendezvous_store(0, 1, timedelta(seconds=5), env)


def test_probe_serve_listens_on_loopback_by_default(monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    args = build_parser("probe").parse_args(["probe", "--serve"])
    assert probe_cli._checked(args)["listen"] == ("127.0.0.1", probe_cli.DEFAULT_PORT)
    for wildcard in ("0.0.0.0", "[::]", "[::ffff:0.0.0.0]"):
        args = build_parser("probe").parse_args(["probe", "--serve", "--listen", f"{wildcard}:29400"])
        with pytest.raises(VGraphError, match="every interface"):
            probe_cli._checked(args)


# -- probe --serve: the secret first, any client survived -------------------------------------------------

def _serving(once: bool, monkeypatch) -> tuple[threading.Thread, int, list]:
    monkeypatch.setattr(probe_cli, "BURST_IDLE_S", 0.01)
    monkeypatch.setattr(probe_cli, "CONNECT_PATIENCE_S", 0.5)
    port = launch_port()
    ready, failures = threading.Event(), []

    def run() -> None:
        try:
            probe_cli.serve("127.0.0.1", port, once=once, ready=ready, token=TOKEN)
        except BaseException as exc:  # noqa: BLE001 - what killed the server, for the assertion
            failures.append(exc)

    server = threading.Thread(target=run, daemon=True)
    server.start()
    assert ready.wait(30)
    return server, port, failures


def _send(port: int, data: bytes) -> bytes:
    """What the server answers `data` (b"" when it closes the connection, reset included)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            return conn.makefile("rb").read(1 << 16)
        except OSError:
            return b""


def test_probe_serve_survives_hostile_clients(monkeypatch, capsys) -> None:
    server, port, failures = _serving(False, monkeypatch)
    assert _send(port, b"[" * 1024 + b"\n") == b""  # no secret: closed unanswered, nothing parsed
    assert _send(port, probe_cli.auth_line(TOKEN) + b"[" * 1000 + b"\n") == b""  # the secret, then nesting
    assert _send(port, probe_cli.auth_line(TOKEN) + b"\xff\xfe{\n") == b""
    assert _send(port, b"vgraph-probe " + b"0" * 64 + b"\n" + b'{"seconds": 0}\n') == b""  # a wrong secret
    rate, _ = probe_cli.measure_link("127.0.0.1", port, 0.05, token=TOKEN)  # and it still measures
    assert server.is_alive() and not failures and rate > 0
    assert "without the shared secret" in capsys.readouterr().err


def test_a_port_scan_does_not_use_up_serve_once(monkeypatch) -> None:
    server, port, failures = _serving(True, monkeypatch)
    for _ in range(3):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # a scanner's connect
    _send(port, b"GET / HTTP/1.0\r\n\r\n")
    _send(port, probe_cli.auth_line("another-secret-0123456789abcdef") + b'{"seconds": 0, "more": 0}\n')
    assert server.is_alive()  # none of those was a probe
    probe_cli.measure_link("127.0.0.1", port, 0.05, token=TOKEN)
    server.join(timeout=30)
    assert not server.is_alive() and not failures  # the one real probe used it up


def test_probe_serve_and_peer_need_the_secret(monkeypatch, capsys) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main(["probe", "--serve", "--once", "--listen", f"127.0.0.1:{launch_port()}"]) == 2
    assert TOKEN_ENV in capsys.readouterr().err
    assert main(["probe", str(TINY), "--peer", "127.0.0.1:9", "--quick"]) == 2
    assert TOKEN_ENV in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, "a" * 20)  # no secret (one letter repeated)
    assert main(["probe", "--serve", "--listen", f"127.0.0.1:{launch_port()}"]) == 2
    assert "no spaces" in capsys.readouterr().err


# -- the job, its run, its output --------------------------------------------------------------------

@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> Path:
    """`vgraph launch --emit-job` of a 2-worker job (tiny network): DIR/run, DIR/jobs/job.json."""
    d = tmp_path_factory.mktemp("emit")
    vgraph.save(transformer(TransformerSpec("tiny-r4", layers=1, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                            head_up=64, precision=None)), d / "net.yml")
    (d / "fleet.yml").write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (d / "corpus.txt").write_text(Path(small_corpus(d)).read_text(encoding="utf-8"), encoding="utf-8")
    launch(LaunchConfig(network=str(d / "net.yml"), fleet=str(d / "fleet.yml"), data=str(d / "corpus.txt"),
                        steps=3, batch=4, out=d / "run", threads=1, replicas=2, emit_job=d / "jobs",
                        device="cpu", log=lambda line: None))
    return d


def _config(d: Path, jobs: Path, out: Path) -> LaunchConfig:
    return LaunchConfig(network=str(d / "net.yml"), fleet=str(d / "fleet.yml"), data=str(d / "corpus.txt"),
                        steps=3, batch=4, out=out, threads=1, replicas=2, emit_job=jobs, device="cpu",
                        log=lambda line: None)


def test_emit_job_refuses_a_job_json_it_did_not_write(emitted: Path, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "job.json").write_text("my own notes\n")
    with pytest.raises(VGraphError, match="was not written there by vgraph launch --emit-job"):
        launch(_config(emitted, jobs, tmp_path / "run"))
    assert (jobs / "job.json").read_text() == "my own notes\n"
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_emit_job_replaces_its_own_job_json(emitted: Path, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    launch(_config(emitted, jobs, tmp_path / "run"))
    first = Job.read(jobs / "job.json")
    launch(_config(emitted, jobs, tmp_path / "run2"))  # its own file, unchanged since: replaced
    assert Job.read(jobs / "job.json").run_dir == "../run2" != first.run_dir
    assert first.written_in == str((tmp_path / "jobs").resolve())


def _copy_run(emitted: Path, where: Path) -> Path:
    """A private copy of the emitted run and its job (the lock of one test must not meet another's)."""
    shutil.copytree(emitted / "run", where / "run", symlinks=True)
    (where / "jobs").mkdir(parents=True)
    job = Job.read(emitted / "jobs" / "job.json")
    job.write(where / "jobs" / "job.json")
    return where / "jobs" / "job.json"


def _worker_env(monkeypatch, world: int = 2) -> None:
    for name in ("SLURM_PROCID", "TORCHELASTIC_RUN_ID", "VGRAPH_RUN_LOCK_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(launch_port()), TOKEN_ENV: TOKEN}.items():
        monkeypatch.setenv(name, value)


def test_a_second_worker_set_on_one_job_is_refused(emitted: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Another worker set's rank 0 holds the run (a process of its own): this set's rank 0 is refused, naming
    the run and the holder, before any rendezvous (WORLD_SIZE is wrong on purpose: it would be said next)."""
    job = _copy_run(emitted, tmp_path)
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from vgraph.run.files import RunLock\n"
        "RunLock.acquire(Path(sys.argv[1]), 'vgraph worker (rank 0 of 2, torchrun)'); print('held', flush=True)\n"
        "time.sleep(60)"), str(run)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        _worker_env(monkeypatch, world=3)
        assert worker_main([str(job)]) == 3
        err = capsys.readouterr().err
        assert "is in use by" in err and str(run) in err and f"pid {holder.pid}" in err and "Traceback" not in err
        assert not (run / METRICS_JSONL).exists() and not list((run / "launch").glob("error-*"))  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert worker_main([str(job)]) == 3  # the holder gone: this set takes the run and goes on (to WORLD_SIZE)
    assert "WORLD_SIZE is 3 but the job places 2 workers" in capsys.readouterr().err


def test_the_launchers_workers_share_its_lock_and_no_one_else(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with RunLock.held():
        lock = RunLock.acquire(run, "vgraph launch")
        assert RunLock.shares(run, lock.key) and not RunLock.shares(run, "0" * 32) and not RunLock.shares(run, "")
        assert lock.key not in (run / LOCK_FILE).read_text()  # only its digest is written
    assert not RunLock.shares(run, lock.key)  # released: nobody holds it


def test_a_job_copied_alone_finds_its_run_and_never_writes_elsewhere(emitted: Path, tmp_path: Path,
                                                                     monkeypatch, capsys) -> None:
    job_file = _copy_run(emitted, tmp_path / "home")
    away = tmp_path / "away"
    (away / "jobs").mkdir(parents=True)
    (away / "run").mkdir()
    (away / "run" / "notes.txt").write_text("not a run\n")
    shutil.copy(job_file, away / "jobs" / "job.json")  # its run_dir, ../run, now names a directory of the user's
    job = Job.read(away / "jobs" / "job.json")
    assert job.locate_run() == tmp_path / "home" / "run"  # from where it was written
    shutil.rmtree(tmp_path / "home" / "run")  # the run is gone too: refused, naming both places
    job = Job.read(away / "jobs" / "job.json")
    with pytest.raises(JobError, match="not the run it was written for") as caught:
        job.locate_run()
    assert str(away / "run") in str(caught.value) and str(tmp_path / "home" / "run") in str(caught.value)
    _worker_env(monkeypatch)
    assert worker_main([str(away / "jobs" / "job.json")]) == 3
    assert "not the run it was written for" in capsys.readouterr().err
    assert sorted(p.name for p in (away / "run").iterdir()) == ["notes.txt"]  # nothing written there


def test_a_job_moved_with_its_run_still_runs_there(emitted: Path, tmp_path: Path) -> None:
    job_file = _copy_run(emitted, tmp_path / "a")
    shutil.move(str(tmp_path / "a"), str(tmp_path / "b"))  # the whole tree moves (another mount point)
    assert Job.read(tmp_path / "b" / "jobs" / "job.json").locate_run() == tmp_path / "b" / "run"
    assert not job_file.exists()


@pytest.mark.parametrize("written_in", ["relative/dir", "/tmp/a\nb"])
def test_a_job_whose_written_in_is_not_an_absolute_path_is_refused(emitted: Path, tmp_path: Path,
                                                                  written_in: str) -> None:
    data = json.loads((emitted / "jobs" / "job.json").read_text())
    data["written_in"] = written_in
    (tmp_path / "job.json").write_text(json.dumps(data))
    with pytest.raises(JobError, match="written_in: .* not an absolute path"):
        Job.read(tmp_path / "job.json")


# -- a worker without the GPU its job asks for ---------------------------------------------------------

def test_a_cuda_job_on_a_worker_without_a_gpu_is_a_user_error(emitted: Path, tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    with pytest.raises(VGraphError, match="sees no GPU"):
        worker_device("cuda", 1, 0)
    job_file = _copy_run(emitted, tmp_path)
    data = json.loads(job_file.read_text())
    data["device"] = "cuda"
    job_file.write_text(json.dumps(data))
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    _worker_env(monkeypatch)
    assert worker_main([str(job_file)]) == 3  # 3: the launcher (and the docs' torchrun recipe) do not restart
    err = capsys.readouterr().err
    assert "sees no GPU" in err and "--device cpu" in err and "Traceback" not in err


# -- a checkpoint's tokenizer against its network -------------------------------------------------------

QUICK = ["--batch", "2", "--val-every", "0", "--quiet", "--threads", "1", "--no-tensorboard"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def wide_tokenizer_run(tmp_path_factory, corpus: str) -> Path:
    """A trained run whose latest checkpoint carries a tokenizer with ids past the network's vocabulary (96)."""
    from tokenizers import Tokenizer

    run = tmp_path_factory.mktemp("wide") / "run"
    assert torch_cli.main(["train", str(TINY), "--data", corpus, "--out", str(run), "--steps", "1", *QUICK]) == 0
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(run))
    tokenizer = Tokenizer.from_str(saved.extra["tokenizer_json"])
    tokenizer.add_tokens([f"<far{i}>" for i in range(200)])  # ids up to ~300
    extra = dict(saved.extra, tokenizer_json=tokenizer.to_str())
    ckpt.save_checkpoint(saved.path, step=saved.step, model_state=saved.model_state,
                         optimizer_states=saved.optimizer_states, rng_state=saved.rng_state, extra=extra)
    return run


def test_generate_refuses_a_tokenizer_past_the_vocabulary(wide_tokenizer_run: Path, capsys) -> None:
    assert torch_cli.main(["generate", str(wide_tokenizer_run), "--prompt", "<far199>", "--max-new-tokens",
                           "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "vocabulary is 96" in err and "token ids" in err


@pytest.mark.parametrize("command", ["export-onnx", "check-onnx"])
def test_onnx_commands_refuse_a_tokenizer_past_the_vocabulary(wide_tokenizer_run: Path, tmp_path: Path,
                                                              command: str, capsys) -> None:
    out = ["-o", str(tmp_path / "m.onnx")] if command == "export-onnx" else []
    assert main([command, str(TINY), "--checkpoint", str(wide_tokenizer_run), *out]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "vocabulary is 96" in err
    assert not (tmp_path / "m.onnx").exists()


def test_resume_refuses_a_tokenizer_past_the_vocabulary(wide_tokenizer_run: Path, corpus: str, tmp_path: Path,
                                                        capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(wide_tokenizer_run, run, symlinks=True)
    assert torch_cli.main(["train", str(TINY), "--data", corpus, "--out", str(run), "--steps", "2", "--resume",
                           *QUICK]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "vocabulary is 96" in err


def test_a_tokenizer_that_fits_passes_and_an_unreadable_one_is_named() -> None:
    from tokenizers import Tokenizer, models

    small = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).to_str()
    assert ckpt.checked_tokenizer(small, 3, "ckpt").get_vocab_size() == 3
    with pytest.raises(VGraphError, match="3 token ids .* vocabulary is 2"):
        ckpt.checked_tokenizer(small, 2, "ckpt")
    gap = Tokenizer(models.WordLevel({"a": 0, "z": 500, "[UNK]": 1}, unk_token="[UNK]")).to_str()
    with pytest.raises(VGraphError, match="501 token ids"):  # ids, not the count of tokens, must fit
        ckpt.checked_tokenizer(gap, 96, "ckpt")
    with pytest.raises(VGraphError, match="ckpt: its tokenizer cannot be read"):
        ckpt.checked_tokenizer("{not a tokenizer", 96, "ckpt")


# -- the ONNX causal mask is computed, not stored ------------------------------------------------------

def _exported_bytes(tmp_path: Path, seq_len: int) -> tuple[int, int]:
    """(file size, largest initializer's elements) of export-onnx --no-weights of a 1-layer network."""
    import onnx

    net = tmp_path / f"net{seq_len}.yml"
    vgraph.save(transformer(TransformerSpec(f"long{seq_len}", layers=1, vocab=64, seq_len=seq_len, dim=32, heads=2,
                                            ffn=64, head_up=64, precision=None)), net)
    out = tmp_path / f"m{seq_len}.onnx"
    assert main(["export-onnx", str(net), "--no-weights", "-o", str(out)]) == 0
    model = onnx.load(str(out))
    largest = max((int(onnx.numpy_helper.to_array(t).size) for t in model.graph.initializer), default=0)
    return out.stat().st_size, largest


def test_export_onnx_does_not_grow_with_the_square_of_the_context(tmp_path: Path) -> None:
    """seq_len 200,000 was a MemoryError (a 160 GB mask); now the file grows with seq_len (RoPE tables) only."""
    small, _ = _exported_bytes(tmp_path, 64)
    big, largest = _exported_bytes(tmp_path, 200_000)
    assert largest < 200_000 * 64  # no seq_len x seq_len table: the largest is RoPE's seq_len x head_dim
    assert big - small < 200_000 * 16 * 4 * 2 * 2  # cos and sin, seq_len x head_dim float32, with room to spare


# -- pipeline ordering: the same order, in linear time ---------------------------------------------------

def _old_order(passes: list, applied=()) -> list:
    """The quadratic ordering this replaced, kept as the oracle (the smallest index whose predecessors ran)."""
    names = [p.name for p in passes]
    for p in passes:
        missing = [r for r in p.requires if r not in names and r not in set(applied)]
        if missing:
            raise PassError("missing")
    preds = {i: {j for j, q in enumerate(passes) if j != i and pl.must_follow(p, q)} for i, p in enumerate(passes)}
    order: list[int] = []
    remaining = list(range(len(passes)))
    while remaining:
        ready = next((i for i in remaining if not preds[i] - set(order)), None)
        if ready is None:
            raise PassError("pass dependencies form a cycle among: " + " -> ".join(passes[i].name for i in remaining))
        order.append(ready)
        remaining.remove(ready)
    return [passes[i] for i in order]


_COUNT = {"reads": 0}
NAMES = ["a", "b", "c", "d", "e"]


def _counted(value):
    def get(self):
        _COUNT["reads"] += 1
        return value
    return property(get)


_CLASSES: dict = {}


def _pass(name: str, requires=(), after=(), before=()) -> Pass:
    """A pass instance whose declarations count their reads (one class per distinct declaration)."""
    key = (name, tuple(requires), tuple(after), tuple(before))
    if key not in _CLASSES:
        _CLASSES[key] = type(f"P_{name}", (Pass,), {
            "name": name, "__doc__": "test", "run": lambda self, g, ctx: None, "requires": _counted(key[1]),
            "after": _counted(key[2]), "before": _counted(key[3])})
    return _CLASSES[key]()


_spec = st.tuples(st.sampled_from(NAMES), st.lists(st.sampled_from(NAMES), max_size=2),
                  st.lists(st.sampled_from(NAMES), max_size=2), st.lists(st.sampled_from(NAMES), max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.lists(_spec, max_size=12))
def test_pipeline_order_is_the_one_it_always_was(specs) -> None:
    passes = [_pass(*s) for s in specs]
    try:
        expected = [id(p) for p in _old_order(passes, applied=NAMES)]
    except PassError as exc:
        with pytest.raises(PassError) as caught:
            pl.order_pipeline(passes, applied=NAMES)
        assert str(caught.value) == str(exc)  # the same cycle, named alike
        return
    ordered = pl.order_pipeline(passes, applied=NAMES)
    assert [id(p) for p in ordered] == expected
    at = {id(p): k for k, p in enumerate(ordered)}
    inverted = [(p, q) for i, p in enumerate(passes) for q in passes[i + 1:] if at[id(q)] < at[id(p)]]
    notes = pl.order_notes(passes, ordered)
    assert notes[:pl.MAX_ORDER_NOTES] == [
        f"pipeline order: {q.spec()!r} runs before {p.spec()!r}, although written after it: "
        f"{pl.must_follow(p, q) or 'through the order other passes in the pipeline declare'}"
        for p, q in inverted[:pl.MAX_ORDER_NOTES]]
    assert len(notes) == len(inverted) + (len(inverted) > pl.MAX_ORDER_NOTES) - max(
        0, len(inverted) - pl.MAX_ORDER_NOTES)


def test_pipeline_ordering_reads_each_declaration_a_bounded_number_of_times() -> None:
    """5,000 passes, each after the one before it and written in reverse (the worst order): the work is
    counted in reads of `requires`/`after`/`before`, which the quadratic ordering did 2.5 x 10^7 times."""
    n = 5_000
    passes = [_pass(f"p{i}", after=(f"p{i - 1}",) if i else ()) for i in range(n)][::-1]
    _COUNT["reads"] = 0
    ordered = pl.order_pipeline(passes)
    assert [p.name for p in ordered] == [f"p{i}" for i in range(n)]
    notes = pl.order_notes(passes, ordered)
    assert _COUNT["reads"] <= 10 * n
    assert len(notes) == pl.MAX_ORDER_NOTES + 1  # n(n-1)/2 pairs run in reverse: 20 named, the rest counted
    assert notes[-1].startswith(f"pipeline order: {n * (n - 1) // 2 - pl.MAX_ORDER_NOTES:,} more pair(s)")


def test_many_passes_of_one_name_do_not_multiply_into_pairs() -> None:
    """10,000 'b' that each require 'a' and 10,000 'a': 10^8 pairs of passes, one group each way."""
    n = 10_000
    passes = [_pass("b", requires=("a",)) for _ in range(n)] + [_pass("a") for _ in range(n)]
    _COUNT["reads"] = 0
    ordered = pl.order_pipeline(passes)
    assert [p.name for p in ordered] == ["a"] * n + ["b"] * n
    assert _COUNT["reads"] <= 10 * 2 * n


def test_a_pipeline_of_more_passes_than_any_run_needs_is_refused_at_once(tmp_path: Path, capsys) -> None:
    """A run naming 30,000 passes: refused while parsing, before anything runs or is ordered."""
    assert len(pl.build_pipeline(",".join(["dead-nodes"] * pl.MAX_PIPELINE_PASSES))) == pl.MAX_PIPELINE_PASSES
    with pytest.raises(PassError, match=f"more than {pl.MAX_PIPELINE_PASSES} passes"):
        pl.parse_pipeline(",".join(["dead-nodes"] * 30_000))
    assert main(["optimize", str(TINY), "--passes", ",".join(["dead-nodes"] * 30_000), "-o",
                 str(tmp_path / "o.yml")]) == 2
    assert "more than 1000 passes" in capsys.readouterr().err
