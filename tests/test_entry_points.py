"""Every entry point pyproject.toml declares is what the installed metadata offers, and it loads.

Tests no longer register the `partition` pass or the `onnx` exporter by hand when their entry point is
missing, so a renamed class or module behind an entry point fails here, by name, and in the tests that use it.
"""
from __future__ import annotations

import tomllib

import pytest

from conftest import ROOT
from vgraph.plugins import discover

DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
# One per distinct target: the lowering groups name one module for many op types.
BUILTIN = sorted({(group, value): name for group, eps in DECLARED.items() for name, value in eps.items()}.items())
BUILTIN = [(group, name, value) for (group, value), name in BUILTIN]


def test_every_declared_group_is_installed_as_declared() -> None:
    """pyproject and the installed metadata agree: a stale `pip install -e .` shows here."""
    for group, eps in DECLARED.items():
        installed = {p.name: p.value for p in discover(group) if p.builtin}
        assert installed == eps, group


@pytest.mark.parametrize("group, name, value", BUILTIN, ids=[f"{g}:{n}" for g, n, _ in BUILTIN])
def test_every_builtin_entry_point_loads(group: str, name: str, value: str) -> None:
    plugin = next(p for p in discover(group) if p.name == name and p.builtin)
    obj = plugin.load()
    if ":" in value:  # an object: a pass class, an exporter, a command's register function
        assert callable(obj), value
    else:  # a module whose import registers (the backends' lowering tables)
        assert obj.__name__ == value
    if group == "vgraph.passes":
        from vgraph.transform.pass_api import Pass

        assert isinstance(obj, type) and issubclass(obj, Pass) and obj.name == name


def test_partition_and_onnx_come_from_their_entry_points() -> None:
    from vgraph.backends.onnx.subgraph import export_subgraph
    from vgraph.passes.partition import Partition
    from vgraph.placement.export import find_exporter
    from vgraph.transform.pipeline import get_pass

    assert get_pass("partition") is Partition
    assert find_exporter("onnx") is export_subgraph
    from vgraph.backends.onnx import Decoder
    from vgraph.plugins import find_plugin

    assert find_plugin("vgraph.decoders", "onnx").load() is Decoder  # what `generate --backend onnx` uses
    assert find_plugin("vgraph.decoders", "no-such-backend") is None


def test_discovery_reads_the_metadata_of_vgraph_distributions_only(tmp_path, monkeypatch) -> None:
    """Every process that loads plugins (each launch worker, each command) scans every installed distribution:
    parsing each one's METADATA (an email message, README included), and vgraph's once per entry point, cost
    0.33 CPU-s a process.  Only a distribution whose entry points name a vgraph group is parsed, once, and the
    plugin still carries its distribution's name and version."""
    from importlib import metadata

    from vgraph import plugins

    def dist(name: str, entry_points: str) -> None:
        info = tmp_path / f"{name}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n\nREADME\n")
        (info / "entry_points.txt").write_text(entry_points)

    dist("ours", "[vgraph.passes]\nfirst = ours.mod:First\nsecond = ours.mod:Second\n[console_scripts]\nx = ours:x\n")
    dist("theirs", "[console_scripts]\ny = theirs:y\n")
    dist("plain", "")
    read = []
    real = metadata.PathDistribution.metadata
    monkeypatch.setattr(metadata.PathDistribution, "metadata",
                        property(lambda self: read.append(self._path.name) or real.fget(self)))
    found = plugins._entry_points.__wrapped__((str(tmp_path),))
    assert sorted(found) == ["vgraph.passes"]
    assert [(p.name, p.origin) for p in found["vgraph.passes"]] == [("first", "ours 1.2.3"), ("second", "ours 1.2.3")]
    assert read == ["ours-1.2.3.dist-info"]  # premise: three distributions on the path, one of them ours
