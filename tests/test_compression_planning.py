"""Compression in the cost model and the planner: PowerSGD's bytes and `partition{compress=auto}`.

* `--grad-compress` specs parse or are refused with a reason (hostile texts), and print back as a spec;
* which gradients PowerSGD compresses is torch's own rule (`_should_compress`), and the elements the cost
  model says a stage all-reduces are what the torch hook all-reduces for the same buckets;
* the step cost prices the PowerSGD all-reduce from the parameter shapes, by hand here;
* `partition{compress=auto}` keeps the compressed plan only when its predicted step is lower, records the
  PNode pairs, `compress-boundary{activations=auto,gradients=auto}` compresses exactly those, and the
  placement report of the compressed network predicts the step the planner chose; `vgraph launch` hands
  the choice to its workers, which rebuild the same graph.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from conftest import TINY
from vgraph import dumps, load
from vgraph.backends.torch.distributed.runtime.powersgd import PowerSGD
from vgraph.backends.torch.distributed.runtime.grad_sync import Bucket
from vgraph.backends.torch.distributed.launcher.launch import place, split_pipeline
from vgraph.cost.grad_compression import GradCompression, allreduce_numel, parse_grad_compress
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import loads_fleet
from vgraph.placement.export import placement_report
from vgraph.run.compiled_graph import apply_assignment
from vgraph.transform.pass_api import PassError
from vgraph.transform.pipeline import fingerprint, run_pipeline

BATCH = 8


@pytest.mark.parametrize("text, why", [
    ("topk", "unknown gradient compression"), ("", "empty"), ("powersgd:rank=0", "from 1 to 4096"),
    ("powersgd:rank=nan", "not a whole number"), ("powersgd:rank=1e9", "not a whole number"),
    ("powersgd:rank=99999", "from 1 to 4096"), ("powersgd:start=1", "2 plain steps"),
    ("powersgd:rank=4,rank=4", "twice"), ("powersgd:bits=2", "unknown powersgd option"),
    ("powersgd:rank", "not key=value"), ("powersgd:min_rate=inf", "finite"), ("powersgd:min_rate=-1", "finite"),
    ("none:rank=4", "takes no options"), ("powersgd:rank=\x1b[2J", "unprintable"), (4, "got int"),
])
def test_hostile_grad_compress_specs_say_why(text, why):
    with pytest.raises(ValueError, match=why):
        parse_grad_compress(text)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_text_parses_or_is_a_value_error(text):
    try:
        spec = parse_grad_compress(text)
    except ValueError:
        return
    assert parse_grad_compress(spec.text()) == spec  # what is printed parses back to the same


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.integers(1, 600), st.integers(1, 600), st.integers(1, 64), st.sampled_from([0.5, 1.0, 2.0, 7.5]))
def test_which_gradients_travel_as_factors_is_torchs_rule(n, m, rank, rate):
    spec = GradCompression("powersgd", rank=rank, min_rate=rate)
    assert spec.compressed(n, m) == _should_compress(n, m, min(n, m, rank), rate)[0]


def test_the_cost_models_elements_are_what_the_hook_all_reduces():
    shapes = [(64, 32), (32,), (96, 32), (3, 4, 5), (2, 2)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    bucket = Bucket(0, 1, params)
    spec = parse_grad_compress("powersgd:rank=4")
    ps = PowerSGD(None, spec, size=2, seed=0)
    assert ps.wire_numels(bucket) == [sum(math.prod(s) for s in shapes)]  # the first `start` steps: whole
    ps.state.iter = spec.start
    whole, p, q = allreduce_numel(shapes, spec)
    assert ps.wire_numels(bucket) == [whole, p, q]
    # By hand: [64, 32] and [96, 32] go as factors of rank 4; [32], [3, 4, 5] (3 x 20) and [2, 2] whole.
    assert (whole, p, q) == (32 + 60 + 4, 64 * 4 + 96 * 4, 32 * 4 + 32 * 4)


def two_pnodes(bandwidth: str, memory: str = "1GiB") -> str:
    return "name: two\npnodes:\n" + "".join(
        f"  - {{id: p{i}, memory: {memory}, flops: 1T, bandwidth: {bandwidth}, accelerator: cpu}}\n" for i in range(2))


def test_powersgd_is_priced_from_the_gradient_shapes():
    graph = load(TINY)
    run_pipeline(graph, f"partition{{batch={BATCH},replicas=2,grad_compress=powersgd:rank=2}}",
                 data={"fleet": loads_fleet(two_pnodes("2.5MB/s"))})
    report = placement_report(graph, loads_fleet(two_pnodes("2.5MB/s")))
    assert report["replicas"] == 2 and report["grad_compress"] == "powersgd:rank=2;start=2"
    cm = cost_model(graph, batch=BATCH)
    shapes = [s for n in graph.nodes if n.op.param_shapes(n.cfg) and n.cfg.get("optimizer") != "none"
              for s in n.op.param_shapes(n.cfg).values()]
    elements = sum(allreduce_numel(shapes, parse_grad_compress("powersgd:rank=2")))
    grad_bytes = sum(cm.nodes[n].grad_bytes for n in cm.nodes)
    element = grad_bytes // sum(math.prod(s) for s in shapes)
    (group,) = report["allreduce"]
    assert group["grad_bytes"] == elements * element  # what one member all-reduces a step
    assert report["allreduce_bytes_per_step"] == 2 * (2 - 1) * elements * element  # the ring, two members
    plain = placement_report(graph, loads_fleet(two_pnodes("2.5MB/s")), cm=cost_model(graph, batch=BATCH))
    assert plain["allreduce_bytes_per_step"] == 2 * grad_bytes > 3 * report["allreduce_bytes_per_step"]
    assert report["allreduce_seconds"] < plain["allreduce_seconds"]


def test_partition_options_are_checked():
    fleet = {"fleet": loads_fleet(two_pnodes("1GB/s"))}
    for spec, why in [("partition{compress=maybe}", "must be one of off, auto"),
                      ("partition{grad_compress=powersgd:rank=0}", "from 1 to 4096"),
                      ("partition{grad_compress=topk}", "unknown gradient compression")]:
        with pytest.raises(PassError, match=why):
            run_pipeline(load(TINY), spec, data=fleet)


def forced_cut_fleet(graph, bandwidth: str):
    need = cost_model(graph, batch=BATCH).totals()["memory_bytes"]
    return loads_fleet(two_pnodes(bandwidth, str(int(0.6 * need))))


def test_compress_auto_keeps_the_faster_plan_and_compress_boundary_follows_it():
    graph = load(TINY)
    fleet = forced_cut_fleet(graph, "2.5MB/s")  # two PNodes, each too small for the network: a cut
    plain = graph.copy()
    run_pipeline(plain, f"partition{{batch={BATCH},replicas=1}}", data={"fleet": fleet})
    auto = graph.copy()
    run_pipeline(auto, f"partition{{batch={BATCH},replicas=1,compress=auto}}", data={"fleet": fleet})
    chosen = auto.meta["placement"]["compress"]
    assert chosen["activations"] == chosen["gradients"] == "int8" and chosen["pnode_pairs"]
    assert chosen["step_seconds"] < chosen["uncompressed_step_seconds"] == pytest.approx(
        plain.meta["placement"]["step_seconds"])
    assert auto.meta["placement"]["step_seconds"] == pytest.approx(chosen["step_seconds"])
    run_pipeline(auto, "compress-boundary{activations=auto,gradients=auto}")
    where = {n.id: n.meta["pnode"] for n in auto.nodes}
    compressed = {f"{where[n.id]}->{n.cfg['peer_pnode']}" for n in auto.nodes_of_type("compress")}
    assert compressed == set(chosen["pnode_pairs"])
    # The placement report of the compressed network predicts the step the planner chose.
    assert placement_report(auto, fleet)["step_seconds"] == pytest.approx(chosen["step_seconds"], rel=1e-9)


def test_compress_auto_declines_when_nothing_is_cut():
    graph = load(TINY)
    run_pipeline(graph, f"partition{{batch={BATCH},compress=auto}}",
                 data={"fleet": loads_fleet(two_pnodes("10MB/s"))})  # one PNode holds it all: no cut
    chosen = graph.meta["placement"]["compress"]
    assert chosen["pnode_pairs"] == [] and chosen["activations"] == "none"
    before = fingerprint(graph)
    run_pipeline(graph, "compress-boundary{activations=auto,gradients=auto}")
    assert fingerprint(graph) == before and not graph.nodes_of_type("compress")


def test_launch_hands_the_choice_to_the_workers():
    graph = load(TINY)
    fleet = forced_cut_fleet(graph, "2.5MB/s")
    before, partition, after = split_pipeline(
        "dead-nodes,precision,partition{compress=auto},compress-boundary{activations=auto,gradients=auto}",
        True, {"batch": str(BATCH), "micro_batches": "2"})
    placement = place(graph, fleet, before=before, partition=partition, after=after, target="cpu", batch=BATCH,
                      micro_batches=2)
    assert placement.choices["compress"]["pnode_pairs"] and placement.graph.nodes_of_type("compress")
    rebuilt = apply_assignment(graph, before, placement.assignment, after, "cpu", placement.choices)  # a worker
    assert dumps(rebuilt) == dumps(placement.graph)  # the same VNodes, compress VNodes included
    assert {n.id: n.meta["pnode"] for n in rebuilt.nodes} == placement.final
    with pytest.raises(PassError, match="made none"):  # without the choice it cannot guess
        apply_assignment(graph, before, placement.assignment, after, "cpu")
