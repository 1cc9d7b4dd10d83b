"""Planning pipeline x data-parallel replicas: the issue's eight-PNode acceptance case, placement.json's
replica fields, heterogeneous batch shares, hard constraints, the --replicas option and its mistakes."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from tools.gen_fleet import heterogeneous, to_yaml
from tools.gen_networks import TransformerSpec, transformer
from vgraph.cli.main import main
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, PNode
from vgraph.passes.partition import plan_partition
from vgraph.passes.partition_problem import PartitionError
from vgraph.passes.partition_replicas import parse_replicas, plan_replicas
from vgraph.placement.export import placement_report
from vgraph.transform.pass_api import PassError
from vgraph.transform.pipeline import run_pipeline
from vgraph.yamlio import load, save

GIB = 2 ** 30
TINY = ROOT / "tests" / "fixtures" / "tiny_2l.yml"


@pytest.fixture(scope="module")
def held_out():
    """A 3-block network no checked-in file has (production: 6 and 8 blocks)."""
    return transformer(TransformerSpec("held-out-3", layers=3, vocab=10000, seq_len=128))


@pytest.fixture(scope="module")
def weak8(held_out):
    """Eight weak PNodes (100 GFLOP/s) with fast links, each holding ~60% of the network: compute-bound."""
    need = cost_model(held_out, batch=8, micro_batches=8).totals()["memory_bytes"]
    return Fleet.of("weak8", *[PNode(f"weak{i}", int(0.6 * need), 100e9, 10e9 / 8) for i in range(8)])


def test_acceptance_eight_weak_pnodes_use_replicas(held_out, weak8):
    single, _ = plan_replicas(held_out, weak8, batch=8, micro_batches=8, replicas=1)
    auto, _ = plan_replicas(held_out, weak8, batch=8, micro_batches=8)
    assert single.replicas == 1 and single.stages >= 2  # the network does not fit one PNode
    assert auto.replicas >= 2
    assert auto.cost.step_seconds <= 0.6 * single.cost.step_seconds
    assert auto.pipeline_only.step_seconds == pytest.approx(single.cost.step_seconds)
    assert sum(auto.shares) == 8 and auto.cost.fits
    used = [p for row in auto.pnodes for p in row]
    assert len(used) == len(set(used)) == auto.replicas * auto.stages


def test_placement_json_has_replicas_and_every_replicas_parts(held_out, weak8, tmp_path, capsys):
    net, fleet = tmp_path / "net.yml", tmp_path / "fleet.yml"
    save(held_out, net)
    fleet.write_text(to_yaml(weak8))
    out = tmp_path / "out"
    assert main(["partition", str(net), "--fleet", str(fleet), "--micro-batches", "8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "replicas x" in text.replace("replica ", "") or "replicas" in text
    pl = json.loads((out / "placement.json").read_text())
    R, rows = pl["replicas"], pl["replica_pnodes"]
    assert R >= 2 and len(rows) == R and sum(pl["batch_shares"]) == 8
    assert pl["step_seconds"] == pytest.approx(pl["pipeline_seconds"] + pl["allreduce_seconds"])
    assert pl["allreduce_seconds"] > 0 and len(pl["allreduce"]) == len(rows[0])
    assert len(pl["replica_assignments"]) == R and pl["replica_assignments"][0] == pl["assignment"]
    for r, assign in enumerate(pl["replica_assignments"]):
        assert set(assign.values()) == set(rows[r])
    written = {p.stem for p in out.glob("*.yml")}
    assert written == {p for row in rows for p in row}
    assert pl["bytes_per_step"] == pytest.approx(pl["cut_bytes_per_step"] + pl["allreduce_bytes_per_step"])
    # What each worker sends (its boundary tensors, tie syncs and its ring share) adds up to the step's bytes.
    assert sum(info["bytes_sent_per_step"] for info in pl["pnodes"].values()) == pytest.approx(pl["bytes_per_step"])
    for pid, info in pl["pnodes"].items():
        if info["vnodes"]:
            assert info["memory_bytes"] <= info["capacity_bytes"], pid


def test_one_replica_keeps_the_old_placement(held_out, weak8):
    old, _ = plan_partition(held_out, weak8, batch=8, micro_batches=2)
    g = held_out.copy()
    run_pipeline(g, "partition{batch=8,micro_batches=2,replicas=1}", data={"fleet": weak8})
    pl = g.meta["placement"]
    legacy = old.summary(held_out, cost_model(held_out, batch=8, micro_batches=2), weak8)
    for key in legacy:
        assert pl[key] == legacy[key], key
    assert pl["replicas"] == 1 and pl["batch_shares"] == [8] and pl["replica_pnodes"] == [legacy["stages"]]
    report = placement_report(g, weak8)
    assert report["step_seconds"] == pytest.approx(pl["step_seconds"])
    assert report["bytes_per_step"] == report["cut_bytes_per_step"]
    assert sum(p["bytes_sent_per_step"] for p in report["pnodes"].values()) == report["bytes_per_step"]
    # Each cut edge counted in both its PNodes' boundary bytes (in + out), once in what they send.
    assert sum(p["boundary_bytes_per_step"] for p in report["pnodes"].values()) == 2 * report["bytes_per_step"]


def test_unequal_replicas_get_unequal_shares():
    fast = [PNode(f"fast{i}", 64 * GIB, 40e12, 100e9 / 8) for i in range(2)]
    slow = [PNode(f"slow{i}", 64 * GIB, 10e12, 100e9 / 8) for i in range(2)]
    fleet = Fleet.of("mixed", *fast, *slow)
    g = load(TINY)
    plan, _ = plan_replicas(g, fleet, batch=40, micro_batches=1, replicas=4)
    share = {row[0]: s for row, s in zip(plan.pnodes, plan.shares)}
    assert plan.stages == 1 and sum(plan.shares) == 40
    assert share["fast0"] == share["fast1"] == 16 and share["slow0"] == share["slow1"] == 4


def test_required_groups_stay_whole_in_every_replica(held_out, weak8):
    plan, _ = plan_replicas(held_out, weak8, batch=8, micro_batches=8)
    for r in range(plan.replicas):
        where = defaultdict(set)
        for v, p in plan.assignment(r).items():
            group = held_out.node(v).config.get("colocate_group")
            if group:
                where[group].add(p)
        assert all(len(p) == 1 for p in where.values())


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1e11, 1e12, 4e12]), st.sampled_from([1e7, 1e8, 1e9]),
                          st.sampled_from([2 ** 22, 2 ** 24, 2 ** 30])), min_size=1, max_size=9),
       st.integers(1, 24), st.integers(1, 4))
def test_any_fleet_gets_a_feasible_plan_no_slower_than_one_pipeline(specs, batch, micro):
    g = load(TINY)
    fleet = Fleet.of("random", *[PNode(f"p{i}", m, f, b) for i, (f, b, m) in enumerate(specs)])
    micro = min(micro, batch)
    try:
        single, _ = plan_replicas(g, fleet, batch=batch, micro_batches=micro, replicas=1)
    except PartitionError:
        single = None
    try:
        plan, _ = plan_replicas(g, fleet, batch=batch, micro_batches=micro)
    except PartitionError:
        assert single is None
        return
    assert plan.cost.fits and sum(plan.shares) == batch and min(plan.shares) >= 1
    if single is not None:
        assert plan.cost.step_seconds <= single.cost.step_seconds * (1 + 1e-9)


def test_a_large_heterogeneous_fleet_is_planned():
    fleet = heterogeneous(200, seed=1)
    g = load(ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml")
    plan, _ = plan_replicas(g, fleet, batch=256, micro_batches=8)
    assert plan.cost.fits and sum(plan.shares) == 256
    assert plan.cost.step_seconds <= plan.pipeline_only.step_seconds


@pytest.mark.parametrize("text, value", [("auto", None), ("AUTO", None), ("1", 1), ("12", 12), (3, 3), (None, None)])
def test_parse_replicas(text, value):
    assert parse_replicas(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5", "", "nan", "inf", "1e3", "99999999", True, "../1"])
def test_bad_replicas_are_refused(text):
    with pytest.raises(ValueError, match="replicas must be"):
        parse_replicas(text)


@pytest.mark.parametrize("value", ["0", "-2", "many", "", "1.5", "nan", "\x07"])
def test_cli_refuses_a_bad_replicas_option(value, tmp_path, capsys):
    fleet = tmp_path / "f.yml"
    fleet.write_text(to_yaml(heterogeneous(4)))
    with pytest.raises(SystemExit) as exc:
        main(["partition", str(TINY), "--fleet", str(fleet), "--replicas", value, "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--replicas" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_more_replicas_than_pnodes_or_samples(tmp_path, capsys):
    fleet = tmp_path / "f.yml"
    fleet.write_text(to_yaml(heterogeneous(4)))
    code = main(["partition", str(TINY), "--fleet", str(fleet), "--replicas", "5", "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "5 replicas need 5 PNodes and 5 samples" in err and "Traceback" not in err
    with pytest.raises(PassError, match="replicas must be"):
        run_pipeline(load(TINY), "partition{replicas=zero}", data={"fleet": heterogeneous(2)})


def test_analyze_shows_the_plan(held_out, weak8, tmp_path, capsys):
    net, fleet = tmp_path / "net.yml", tmp_path / "fleet.yml"
    save(held_out, net)
    fleet.write_text(to_yaml(weak8))
    assert main(["analyze", str(net), "--fleet", str(fleet), "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    assert "plan on fleet 'weak8'" in out and "all-reduce stage 0" in out and "one pipeline over the fleet" in out
    assert main(["analyze", str(net), "--fleet", str(fleet), "--json", "--replicas", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["replicas"] == 2 and doc["plan"]["step_seconds"] > 0


def test_replicated_parts_stitch_back_to_the_network(held_out, weak8, tmp_path):
    from vgraph.placement.export import export_partition, load_parts, stitch

    g = held_out.copy()
    run_pipeline(g, "partition{batch=8,micro_batches=8}", data={"fleet": weak8})
    assert g.meta["placement"]["replicas"] >= 2
    export_partition(g, weak8, tmp_path / "out")
    parts, placement = load_parts(tmp_path / "out")
    assert set(parts) == set(placement["replica_pnodes"][0])
    whole = stitch(parts, placement)
    assert sorted(whole.node_ids()) == sorted(held_out.node_ids())


def test_analyze_says_when_no_plan_fits(tmp_path, capsys):
    fleet = tmp_path / "f.yml"
    fleet.write_text("pnodes:\n  - {id: tiny, memory: 1KiB, flops: 1T, bandwidth: 1Gbit/s}\n")
    assert main(["analyze", str(TINY), "--fleet", str(fleet)]) == 0
    out = capsys.readouterr().out
    assert "no plan on fleet 'f':" in out and "needs" in out


def test_gen_fleet_writes_a_fleet_and_refuses_bad_arguments(tmp_path, capsys):
    from tools.gen_fleet import main as gen_main
    from vgraph.cost.fleet import load_fleet

    out = tmp_path / "world.yml"
    assert gen_main(["16", "-o", str(out), "--world", "--seed", "2"]) == 0
    fleet = load_fleet(out)
    assert len(fleet) == 16 and len(fleet.links.regions) == 8 and len(fleet.links.pairs) == 28
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file
    for bad in (["0", "-o", str(out)], ["2000000", "-o", str(out)], ["4", "-o", str(tmp_path)], ["x", "-o", "y"]):
        with pytest.raises(SystemExit) as exc:
            gen_main(bad)
        assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
