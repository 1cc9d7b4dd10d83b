"""Where a worker stands under vgraph launch, torchrun and srun (launchers.py), and the job file it reads (job.py).

Slurm's compressed node lists are expanded by hand (no scontrol on a compute node): examples from Slurm's
hostlist syntax, every malformed shape refused with a message, and a property test that compresses random
host lists the way Slurm writes them and expands them back.  The job file is checked field by field on
read: a job `--emit-job` wrote reads back equal; a damaged, edited or other-version job is a JobError
naming the file and the field, and the worker exits 3 with that message and no traceback.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import vgraph
from tools.gen_networks import TransformerSpec, transformer
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.distributed.job import JOB_VERSION, Job, JobError
from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch, main as launch_main
from vgraph.backends.torch.distributed.runtime.launchers import LauncherError, expand_nodelist, worker_place
from vgraph.backends.torch.distributed.runtime.worker import main as worker_main
from vgraph.base.diagnostics import VGraphError


# -- node lists ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("localhost", ["localhost"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("node[9-11]", ["node9", "node10", "node11"]),
    ("node[09-11]", ["node09", "node10", "node11"]),
    ("gpu-[1-2]-ib", ["gpu-1-ib", "gpu-2-ib"]),
    ("rack[1-2]-n[01,03]", ["rack1-n01", "rack1-n03", "rack2-n01", "rack2-n03"]),
    ("n[7]", ["n7"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_compressed_node_lists_expand_in_order(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("", "an empty name"), ("a,,b", "an empty name"), ("node[01-04", "'\\[' without '\\]'"),
    ("node01]", "without '\\['"), ("node[3-1]", "runs backwards"), ("node[a-b]", "not a list of numbers"),
    ("node[[1]]", "nested"), ("node[1-]", "not a list of numbers"), ("node[0-1000000]", "more than"),
    ("bad name", "is not a host name"), ("no\x1bde", "is not a host name"), ("../etc", "is not a host name"),
    ("n[1-400]x[1-400]", "more than"),
])
def test_malformed_node_lists_are_refused_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        expand_nodelist(text)


def _compress(hosts: list[tuple[str, int, int]]) -> str:
    """Slurm's way: consecutive hosts with one prefix and width fold into prefix[a-b,c]."""
    parts, i = [], 0
    while i < len(hosts):
        prefix, width, _ = hosts[i]
        numbers = []
        while i < len(hosts) and hosts[i][:2] == (prefix, width):
            numbers.append(hosts[i][2])
            i += 1
        ranges, start = [], numbers[0]
        for a, b in zip(numbers, numbers[1:] + [None]):
            if b != a + 1:
                ranges.append(f"{start:0{width}d}" if a == start else f"{start:0{width}d}-{a:0{width}d}")
                start = b
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["node", "gpu-", "a", "rack2-n"]), st.integers(1, 3),
                          st.integers(0, 999)), min_size=1, max_size=30))
def test_a_compressed_list_expands_to_its_hosts(raw) -> None:
    hosts = [(p, w, min(n, 10**w - 1)) for p, w, n in raw]
    hosts = sorted(set(hosts), key=lambda h: (h[0], h[1], h[2]))
    assert expand_nodelist(_compress(hosts)) == [f"{p}{n:0{w}d}" for p, w, n in hosts]


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.text(alphabet="ab01-9[],.- \x00", max_size=20))
def test_any_text_expands_or_is_refused_cleanly(text: str) -> None:
    try:
        hosts = expand_nodelist(text)
    except LauncherError:
        return
    assert hosts and all(h and "[" not in h and "," not in h for h in hosts)


# -- the environment -------------------------------------------------------------------------------

def test_a_worker_finds_its_place_under_each_launcher() -> None:
    vg = worker_place({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
                       "MASTER_PORT": "29400"})
    assert (vg.launcher, vg.rank, vg.world, vg.local_rank, vg.master_addr, vg.master_port, vg.restart) == \
        ("vgraph", 1, 4, 1, "10.0.0.2", 29400, 0)
    tr = worker_place({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                       "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (tr.launcher, tr.rank, tr.restart) == ("torchrun", 3, 2)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-06]",
             "SLURM_JOB_ID": "123456"}
    sl = worker_place(slurm)
    assert (sl.launcher, sl.rank, sl.world, sl.local_rank, sl.master_addr, sl.master_port) == \
        ("slurm", 5, 8, 1, "gpu03", 29500 + 123456 % 2000)
    sl = worker_place({**slurm, "MASTER_ADDR": "login1", "MASTER_PORT": "4242"})
    assert (sl.master_addr, sl.master_port) == ("login1", 4242)


@pytest.mark.parametrize("env, message", [
    ({}, "WORLD_SIZE is not set"),
    ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_PORT": "1"}, "not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "outside 0..1"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "outside"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "outside 1..65535"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-"}, "without"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "SLURM_LOCALID": "0"}, "outside 1.."),
])
def test_a_broken_environment_is_named(env: dict, message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        worker_place(env)


# -- the job file ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> Path:
    """A job written by `vgraph launch --emit-job` (2 PNodes, tiny network): the run directory and DIR/job.json."""
    d = tmp_path_factory.mktemp("job")
    vgraph.save(transformer(TransformerSpec("tiny-job", layers=1, vocab=64, seq_len=16, dim=32, heads=2, ffn=64,
                                            head_up=64, precision=None)), d / "net.yml")
    (d / "fleet.yml").write_text("name: two\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(2)))
    (d / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=8_000)), encoding="utf-8")
    lines: list[str] = []
    result = launch(LaunchConfig(network=str(d / "net.yml"), fleet=str(d / "fleet.yml"), data=str(d / "corpus.txt"),
                                 steps=3, batch=4, out=d / "run", threads=1, replicas=2, emit_job=d / "jobs",
                                 log=lines.append))
    assert result.step == 0 and result.placement["replicas"] == 2
    assert any("torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d" in line for line in lines)
    return d


def test_emit_job_prepares_the_run_and_trains_nothing(emitted: Path) -> None:
    run = emitted / "run"
    for name in ("network.yml", "tokenizer.json", "run.json", "placement.json", "launch/tokenizer.json"):
        assert (run / name).is_file(), name
    assert not (run / "metrics.jsonl").exists() and not (run / "latest").exists()
    data = json.loads((emitted / "jobs" / "job.json").read_text())
    assert data["run_dir"] == "../run" and data["tokenizer"] == "launch/tokenizer.json"  # relative: it moves
    assert Path(data["data_dir"]).is_absolute() and len(data["data_digest"]) == 64  # the corpus stays put
    assert data["version"] == JOB_VERSION and data["train"]["steps"] == 3 and "path" not in data
    job = Job.read(emitted / "jobs" / "job.json")
    assert job.run_path == run and job.path_of(job.tokenizer).is_file() and (job.data_path / "manifest.json").is_file()
    assert Job.read(emitted / "jobs" / "job.json") == job  # reads back equal
    assert job.machines == {"w0": 0, "w1": 0}  # --nnodes 1: both workers on machine 0 (rank 0's rows say 1)
    moved = emitted / "moved"
    (moved / "jobs").mkdir(parents=True)
    (moved / "jobs" / "job.json").write_text((emitted / "jobs" / "job.json").read_text())
    assert Job.read(moved / "jobs" / "job.json").run_path == moved / "run"  # the run directory travels with it


def _edit(emitted: Path, tmp_path: Path, change) -> Path:
    data = json.loads((emitted / "jobs" / "job.json").read_text())
    change(data)
    path = tmp_path / "job.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(version=2), "job format 2, but this vgraph reads format 1"),
    (lambda d: d.pop("version"), "job format null"),
    (lambda d: d.update(extra=1), "unknown field.*extra"),
    (lambda d: d.pop("ranks"), "missing field.*ranks"),
    (lambda d: d.update(ranks="w0"), "ranks: expected a list"),
    (lambda d: d.update(ranks=[1, 2]), r"ranks\[0\]: expected a string"),
    (lambda d: d.update(batch_shares=[2, "2"]), r"batch_shares\[1\]: expected an integer"),
    (lambda d: d.update(batch_shares=[3, 3]), "add up to train.batch 4"),
    (lambda d: d.update(batch_shares=[4, 0]), "must be positive"),
    (lambda d: d.update(batch_shares=[4]), "are not 1 replica"),
    (lambda d: d.update(micro_batches=True), "micro_batches: expected an integer"),
    (lambda d: d.update(micro_batches=0), "micro_batches: must be at least 1"),
    (lambda d: d.update(micro_batches=2**70), "out of range"),
    (lambda d: d.update(bucket_bytes=-5), "must be >= 0"),
    (lambda d: d.update(comm_timeout=0), "comm_timeout: must be greater than 0"),
    (lambda d: d.update(comm_timeout="300"), "comm_timeout: expected a number"),
    (lambda d: d.update(comm_timeout=1e308 * 10), "Infinity is not a number"),
    (lambda d: d.update(comm_timeout=1e301), "not a finite number"),
    (lambda d: d.update(backend="mpi"), "backend: 'mpi' is not one of gloo, nccl"),
    (lambda d: d.update(pipeline="zb"), "pipeline: 'zb' is not one of"),
    (lambda d: d.update(stage_through_cpu=1), "stage_through_cpu: expected true or false"),
    (lambda d: d.update(tokenizer="../../etc/passwd"), "tokenizer: .* stay inside it"),
    (lambda d: d.update(tokenizer="/etc/passwd"), "tokenizer: .* stay inside it"),
    (lambda d: d.update(tokenizer="a\x00b"), "tokenizer: .* control characters"),
    (lambda d: d.update(tokenizer=""), "tokenizer: .* empty"),
    (lambda d: d.update(data_dir=""), "data_dir: .* empty"),
    (lambda d: d.update(data_digest="abc"), "data_digest: .* not a SHA-256"),
    # the train section is held to the command line's own checks (training/options.py)
    (lambda d: d["train"].update(lr=-1), "train.lr: expected a finite number > 0"),
    (lambda d: d["train"].update(lr=1e-320), "train.lr: .*subnormal"),
    (lambda d: d["train"].update(batch=0), "train.batch: expected a positive integer"),
    (lambda d: d["train"].update(val_batches=0), "train.val_batches: expected a positive integer"),
    (lambda d: d["train"].update(threads=0), "train.threads: expected a positive integer"),
    (lambda d: d["train"].update(corpus_bytes=0), "train.corpus_bytes: expected a positive integer"),
    (lambda d: d["train"].update(grad_clip=-2.5), "train.grad_clip: expected a finite number > 0"),
    (lambda d: d["train"].update(weight_decay=-0.1), "train.weight_decay: expected a finite number >= 0"),
    (lambda d: d["train"].update(steps="many"), "train: steps: expected an integer"),
    (lambda d: d["train"].update(bogus=1), "unknown field.*bogus"),
    (lambda d: d["train"].update(schedule="linear"), "train.schedule"),
    (lambda d: d["run_info"].update(seq_len=0), "run_info.seq_len"),
    (lambda d: d.update(hold={"rank": 0}), "hold"),
    (lambda d: d.update(machines={"w0": 0}), "machines: expected every PNode of ranks"),
    (lambda d: d.update(machines={"w0": 0, "w1": -1}), "machines.w1: must be >= 0"),
    (lambda d: d.update(machines={"w0": 0, "w1": "1"}), "machines.w1: expected an integer"),
    (lambda d: d.update(machines=[0, 1]), "machines: expected an object"),
    (lambda d: d.update(train=[]), "train: expected an object"),
])
def test_a_damaged_job_is_refused_naming_its_field(emitted: Path, tmp_path: Path, change, message: str) -> None:
    path = _edit(emitted, tmp_path, change)
    with pytest.raises(JobError, match=message) as exc:
        Job.read(path)
    assert str(path) in str(exc.value)
    received = tmp_path / "received" / "job-1.json"  # a follower's: the bytes fetched from machine 0, never written
    with pytest.raises(JobError, match=message) as exc:
        Job.loads(path.read_bytes(), received)
    assert str(received) in str(exc.value) and not received.parent.exists()


def test_a_received_job_reads_as_its_file_does(emitted: Path, tmp_path: Path) -> None:
    path = emitted / "jobs" / "job.json"
    received = Job.loads(path.read_bytes(), tmp_path / "job-0.json")
    assert received.path == tmp_path / "job-0.json" and received.ranks == Job.read(path).ranks
    assert received == Job.read(path)  # every field but where it came from


@pytest.mark.parametrize("text, message", [
    ('{"version": 1, "comm_timeout": NaN}', "NaN is not a number"),
    ('{"version": 1, "comm_timeout": Infinity}', "Infinity is not a number"),
    ("", "not JSON"), ("[1, 2]", "expected a JSON object"), ("{", "not JSON"),
])
def test_a_job_that_is_not_json_or_holds_nan_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "job.json"
    path.write_text(text)
    with pytest.raises(JobError, match=message):
        Job.read(path)
    with pytest.raises(JobError, match=message):
        Job.loads(text.encode(), path)


@pytest.mark.parametrize("what", ["directory", "fifo", "missing", "binary"])
def test_a_job_path_that_is_no_job_file_is_refused(tmp_path: Path, what: str) -> None:
    path = tmp_path / "job.json"
    if what == "directory":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "binary":
        path.write_bytes(b"\xff\xfe{")
    with pytest.raises(VGraphError, match="job.json"):
        Job.read(path)


@settings(derandomize=True, max_examples=80, deadline=None)
@given(st.data())
def test_any_edit_of_a_job_reads_or_is_a_job_error(emitted: Path, tmp_path_factory, data) -> None:
    """A field replaced by any JSON value: the job reads, or a JobError says why; never another exception."""
    original = json.loads((emitted / "jobs" / "job.json").read_text())
    key = data.draw(st.sampled_from(sorted(original)))
    value = data.draw(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                   allow_infinity=False) | st.text(max_size=5),
                                   lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3),
                                                                                             kids, max_size=3),
                                   max_leaves=5))
    path = tmp_path_factory.mktemp("edit") / "job.json"
    path.write_text(json.dumps({**original, key: value}))
    try:
        Job.read(path)
    except JobError:
        pass


def test_the_worker_says_what_is_wrong_with_its_job_and_exits_3(emitted: Path, tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29999")
    path = _edit(emitted, tmp_path, lambda d: d.update(version=7))
    assert worker_main([str(path)]) == 3
    err = capsys.readouterr().err
    assert "job format 7" in err and "Traceback" not in err
    assert worker_main([]) == 2 and worker_main(["--help"]) == 2
    monkeypatch.delenv("WORLD_SIZE")
    assert worker_main([str(emitted / "jobs" / "job.json")]) == 3
    assert "WORLD_SIZE is not set" in capsys.readouterr().err


def test_emit_job_options_are_checked(emitted: Path, tmp_path: Path, capsys) -> None:
    args = ["launch", str(emitted / "net.yml"), "--fleet", str(emitted / "fleet.yml"), "--out", str(tmp_path / "r")]
    assert launch_main([*args, "--emit-job", str(tmp_path / "j"), "--node-rank", "1", "--nnodes", "2"]) == 2
    assert "--emit-job writes the job once, on machine 0" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert launch_main([*args, "--emit-job", str(tmp_path / "file"), "--data", str(emitted / "corpus.txt")]) == 2
    assert "file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch_main([*args, "--emit-job", ""])


def test_a_worker_set_of_the_wrong_size_is_told_how_many_to_start(emitted: Path, capsys, monkeypatch) -> None:
    """srun with three tasks for a job of two workers: refused before any rendezvous, naming SLURM_NTASKS."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
                        "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "9"}.items():
        monkeypatch.setenv(name, value)
    assert worker_main([str(emitted / "jobs" / "job.json")]) == 3
    err = capsys.readouterr().err
    assert "SLURM_NTASKS is 3 but the job places 2 workers" in err and "start 2 processes" in err
    assert "Traceback" not in err
