"""The networks and fleets that ship with vgraph (`vgraph.networks`), `vgraph networks`, and the one resolver
every command uses for a network or fleet argument (vgraph/base/shipped.py): a file wins, a bare name is looked
up, anything else is a path like any other."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import NETWORKS, ROOT
from vgraph.base.diagnostics import VGraphError
from vgraph.base.shipped import is_bare_name, resolve, shipped
from vgraph.cli.main import main

NET6 = "distributed_attention_example_6_swiglu_head"
FLEET_NAMES = sorted(p.stem for p in (NETWORKS / "fleets").glob("*.yml"))
NETWORK_NAMES = sorted(p.stem for p in NETWORKS.glob("*.yml"))


def test_every_network_and_fleet_of_the_checkout_ships() -> None:
    assert list(shipped("network")) == NETWORK_NAMES and len(NETWORK_NAMES) == 3
    assert list(shipped("fleet")) == FLEET_NAMES and "t4x4" in FLEET_NAMES
    for kind, folder in (("network", NETWORKS), ("fleet", NETWORKS / "fleets")):
        for name, path in shipped(kind).items():
            assert path.read_bytes() == (folder / f"{name}.yml").read_bytes()


def test_a_bare_name_is_the_shipped_file_with_or_without_its_suffix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve(NET6, "network") == resolve(f"{NET6}.yml", "network") == str(shipped("network")[NET6])
    assert resolve("t4x4", "fleet") == str(shipped("fleet")["t4x4"])
    with pytest.raises(VGraphError) as refused:  # the kinds are apart: a fleet is not a network
        resolve("t4x4", "network")
    assert "no network of that name ships with vgraph" in str(refused.value)
    assert all(name in str(refused.value) for name in NETWORK_NAMES)


def test_a_file_of_that_name_wins_over_the_shipped_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("t4x4.yml").write_text("name: mine\npnodes: []\n")
    assert resolve("t4x4.yml", "fleet") == "t4x4.yml"
    Path("t4x4").mkdir()  # a directory too: the reader then says it is one
    assert resolve("t4x4", "fleet") == "t4x4"
    os.symlink("nowhere", "t4x1")  # and a dangling link: an entry of that name exists
    assert resolve("t4x1", "fleet") == "t4x1"


def test_an_unknown_name_is_refused_naming_the_choices(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VGraphError) as refused:
        resolve("t4x5", "fleet")
    assert str(refused.value) == ("t4x5: no such file, and no fleet of that name ships with vgraph (shipped fleets: "
                                  f"{', '.join(FLEET_NAMES)}; `vgraph networks` lists them)")


@pytest.mark.parametrize("text", ["../t4x4", "./t4x4", "fleets/t4x4", "/t4x4", "t4x4/", "..", "t4x4..yml",
                                  "t4x4\x1b[2J", "t4x4\n", " t4x4", "-t4x4", ".t4x4", "t4x4 ", "t" * 201, ""])
def test_what_is_not_a_bare_name_is_a_path_like_any_other(text: str, tmp_path: Path, monkeypatch) -> None:
    """'..', '/', control characters, spaces, leading dots or dashes: never looked up in the package."""
    monkeypatch.chdir(tmp_path)
    assert not is_bare_name(text) and resolve(text, "fleet") == text


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text(max_size=40))
def test_any_text_is_itself_a_shipped_file_or_refused(text: str) -> None:
    try:
        out = resolve(text, "network")
    except VGraphError as exc:
        assert is_bare_name(text) and not os.path.lexists(text)
        assert str(exc).isprintable() and "vgraph networks" in str(exc)
        return
    shipped_files = {str(p) for p in shipped("network").values()}
    assert out == text or (is_bare_name(text) and out in shipped_files)


def test_vgraph_networks_lists_them(capsys) -> None:
    assert main(["networks"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in NETWORK_NAMES + FLEET_NAMES)
    assert f"{NET6}                       139 VNodes, 27.2M parameters" in text
    assert main(["networks", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [n["name"] for n in found["networks"]] == NETWORK_NAMES
    assert {f["name"]: f["pnodes"] for f in found["fleets"]}["t4x4"] == 4


def test_commands_take_the_names(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["validate", NET6]) == 0
    assert main(["partition", NET6, "--fleet", "t4x4", "-o", "parts"]) == 0
    assert (tmp_path / "parts" / "placement.json").is_file()
    assert main(["render", f"{NET6}.yml", "--fleet", "t4x4", "-o", "net.svg"]) == 0
    capsys.readouterr()
    assert main(["analyze", "no_such_network"]) == 2
    assert "no_such_network: no such file, and no network of that name" in capsys.readouterr().err
    assert main(["analyze", NET6, "--fleet", "../t4x4"]) == 2  # a path: no such file, like any other
    assert "../t4x4: no such fleet file" in capsys.readouterr().err
    assert not (ROOT / "networks" / "parts").exists()
