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
