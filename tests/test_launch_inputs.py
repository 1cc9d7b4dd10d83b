"""`vgraph launch` resolves its settings once (launcher/inputs.py): `resolve_inputs` turns a `LaunchConfig` into the
`Run` the attempts, the joins, the boundaries, the failures and the job emission take, and none of those modules
reads the settings again.  The launch's behaviour is the other tests' (test_launchers, test_elastic_launch, ...); here, the
shape that keeps it readable and the defaults decided in that one place.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vgraph.backends.torch.distributed.launcher import inputs as inputs_mod
from vgraph.backends.torch.distributed.launcher.inputs import LaunchConfig, Run, resolve_inputs
from vgraph.backends.torch.distributed.launcher.membership import Machines
from vgraph.backends.torch.training.batches import default_corpus_documents
from vgraph.backends.torch.training.interrupt import StopRequest
from vgraph.run.files import RunLock

LAUNCHER = Path(inputs_mod.__file__).parent
TINY = Path(__file__).parent / "fixtures" / "tiny_2l.yml"
FLEET = "name: three\npnodes:\n" + "".join(
    f"  - {{id: p{i}, memory: 1GiB, flops: 1G, bandwidth: 1GB/s, accelerator: cpu}}\n" for i in range(3))


@pytest.mark.parametrize("module", ["attempts.py", "boundaries.py", "emission.py", "failures.py",
                                    "placing.py"])
def test_what_runs_after_the_inputs_takes_values_not_the_settings(module: str) -> None:
    """The attempt loop, the job emission, the boundaries, the failures, the joins and the placement never see
    `LaunchConfig`: no import of it, no parameter typed with it or named as a config, no `.cfg` read."""
    tree = ast.parse((LAUNCHER / module).read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(functions) >= 3  # the premise: the module is there and has its functions
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "LaunchConfig" not in imported and "TrainConfig" not in imported
    for f in functions:
        for arg in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            assert arg.arg not in ("cfg", "config") and "Config" not in annotation, (module, f.name, arg.arg)
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("cfg", "config")]


@pytest.fixture
def resolved(tmp_path: Path):
    """`resolve_inputs` of a tiny network on a 3-PNode CPU fleet, data from a small text file."""
    (tmp_path / "fleet.yml").write_text(FLEET)
    (tmp_path / "corpus.txt").write_text("\n\n".join(default_corpus_documents(max_bytes=6_000)), encoding="utf-8")
    cfg = LaunchConfig(network=str(TINY), fleet=str(tmp_path / "fleet.yml"), data=str(tmp_path / "corpus.txt"),
                       cache_dir=tmp_path / "cache", out=tmp_path / "run", steps=5, batch=8, threads=1,
                       log=lambda line: None, device="cpu")
    machines = Machines()
    try:
        with RunLock.held():
            yield cfg, resolve_inputs(cfg, StopRequest(lambda line: None), machines)
    finally:
        machines.close()


def test_the_inputs_are_resolved_once_into_values(resolved) -> None:
    cfg, got = resolved
    assert isinstance(got, Run) and not hasattr(got, "cfg")  # the settings stay behind
    assert got.fleet.ids == ["p0", "p1", "p2"]  # the fleet file read, once
    assert got.micro == min(cfg.batch, 2 * 3)  # --micro-batches' default: min(batch, 2 x PNodes)
    assert got.base_port is None  # one machine, no --master-port: a free port each attempt
    assert got.max_nnodes == 1 and not got.elastic and not got.succeeds and got.lead and got.given == (None, None)
    assert got.master_addr == cfg.master_addr and got.home is None and got.admission is None  # no state yet
    assert got.target == "cpu" and str(got.device) == "cpu"
    assert "partition" in str(got.partition) and "partition" not in str(got.before) + str(got.after)
    assert got.train.network == got.network_file == str(TINY) and got.train.steps == 5
    assert got.continue_with.startswith(f"vgraph launch {TINY} ") and "--resume" in got.continue_with
    assert got.run_info["batch"] == 8 and got.run_info["data_digest"] == got.data_digest
    for name in ("network.yml", "tokenizer.json", got.tokenizer):  # the run's files, written once here
        assert (got.run_dir / name).is_file(), name
    # The tokenizer's text kept: a rescue's checkpoint and a successor's run directory take it, not a read again
    assert got.tokenizer_json.startswith("{") and got.tokenizer_json == (got.run_dir / got.tokenizer).read_text()
    assert Path(got.data_dir).is_absolute() and Path(got.data_dir).is_dir()


def test_settings_that_cannot_run_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    """A missing fleet file is never opened when a setting alone already refuses the launch."""
    cfg = LaunchConfig(network=str(TINY), fleet=str(tmp_path / "absent.yml"), out=tmp_path / "run",
                       on_failure="retry", log=lambda line: None)
    machines = Machines()
    try:
        with RunLock.held(), pytest.raises(inputs_mod.VGraphError, match="--on-failure must be one of"):
            resolve_inputs(cfg, StopRequest(lambda line: None), machines)
    finally:
        machines.close()
    assert not (tmp_path / "run").exists()
