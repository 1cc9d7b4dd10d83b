"""The production networks: generated files, sizes, parameter counts."""
from __future__ import annotations

import pytest

from conftest import NET6, NET8, NET12, PRODUCTION
from tools import gen_networks
from vgraph import dumps, load, loads
from vgraph.cost.analyze import analyze


def test_checked_in_networks_equal_generator_output():
    for path, text in gen_networks.expected_files().items():
        assert path.read_text() == text, f"{path} is stale: run python tools/gen_networks.py"


@pytest.mark.parametrize("path,vnodes,params", [(NET6, 139, 27_185_664), (NET8, 183, 45_147_648),
                                                  (NET12, 319, 117_306_624)])
def test_production_sizes(path, vnodes, params):
    a = analyze(load(path))
    assert len(a.nodes) == vnodes
    assert a.params == params
    assert sum(g.params for g in a.groups.values()) == a.params
    assert sum(g.flops_per_sample for g in a.groups.values()) == a.flops_per_sample


@pytest.mark.parametrize("path", PRODUCTION + [NET12])
def test_round_trip(path):
    g = load(path)
    assert loads(dumps(g)) == g
    assert dumps(loads(dumps(g))) == dumps(g)


def test_production_structure(net8):
    groups = {n.group for n in net8.nodes}
    assert groups == {"token_embedding"} | {f"transformer_block_{i}" for i in range(8)}
    assert all(n.config["colocate_policy"] == "required" for n in net8.nodes)
    assert net8.attrs["precision"] == "fp16"
    assert len(net8.nodes_of_type("attention_head")) == 64
    assert net8.node("loss").config["cost_precision"] == "float32"
    assert net8.node("lm_head").config["tie_weight_alias"] == "token_embedding"
    assert [m.type for m in net8.metrics] == ["learning_rate"]


def test_next_network_structure():
    """The 124M-class network: 12 x 12 heads of 64 at 2K context, tied embeddings, required groups."""
    g = load(NET12)
    assert len(g.nodes_of_type("attention_head")) == 144
    assert {n.config["seq_len"] for n in g.nodes_of_type("attention_head")} == {2048}
    assert g.node("embedder").config["vocab_size"] == 32768
    assert g.node("head_up").config["out_dim"] == 6144
    assert g.node("lm_head").config["tie_weight_alias"] == "token_embedding"
    assert all(n.config["colocate_policy"] == "required" for n in g.nodes)
    assert g.attrs["precision"] == "fp16"
