"""The remat pass, its shared cost model (vgraph/cost/remat.py) and its exact ILP oracle."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import NET12, TINY
from vgraph import dumps, load, loads
from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import cost_model
from vgraph.cost.remat import RECOMPUTE, is_marked, marked_ids, remat_cost, remat_layout
from vgraph.cost.remat import candidates as remat_candidates, closed, pnode_static_bytes
from vgraph.passes.remat import Remat, RematScope, parse_budget, plain_activation, plan_scope, scopes_of
from vgraph.passes.remat_ilp import solve_remat_ilp
from vgraph.transform.pass_api import PassContext, PassError
from vgraph.transform.pipeline import run_pipeline


def prepared(passes="dead-nodes,precision"):
    g = load(TINY)
    run_pipeline(g, passes, target="cpu")
    return g


def scope_at(g, cm, fraction):
    """The whole graph with room for `fraction` of its activations (per resident sample)."""
    base = scopes_of(g, cm, 10**15, None)[0]
    act = sum(plain_activation(cm).values())
    return RematScope("test", base.ids, base.static_bytes + int(act * fraction) * base.resident,
                      base.static_bytes, base.resident)


def exact(g, cm, marks, ids):
    flops = dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))
    return remat_cost(remat_layout(g, marks), plain_activation(cm), flops, ids)


# -- the marking format ---------------------------------------------------------------------------

def test_remat_key_validates_and_round_trips():
    g = load(TINY)
    g.node("block0_ffn_gelu").set_config(remat=RECOMPUTE)
    again = loads(dumps(g))
    assert is_marked(again.node("block0_ffn_gelu"))
    bad = dumps(g).replace('remat: "recompute"', 'remat: "later"').replace("remat: recompute", "remat: later")
    with pytest.raises(VGraphError, match="remat"):
        loads(bad)


@pytest.mark.parametrize("text", ["", "auto!", "-1GiB", "0", "nan", "inf", "1e400GiB", "16 potatoes", "../x",
                                  "16GiB\x07", "/dev/zero"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(PassError, match="budget"):
        Remat(budget=text)


def test_budget_parses_like_the_fleet():
    assert parse_budget("auto") is None and parse_budget("AUTO") is None
    assert parse_budget("16GiB") == 16 * 2**30
    assert parse_budget("512MB") == 512 * 10**6
    assert parse_budget("1024") == 1024


@pytest.mark.parametrize("opt", [{"batch": 0}, {"batch": -3}, {"batch": "x"}, {"micro_batches": 0},
                                 {"batch": 2**50}])
def test_bad_batch_options_are_refused(opt):
    with pytest.raises(PassError):
        Remat(**opt)


def test_cli_refuses_a_bad_budget_with_exit_2(tmp_path, capsys):
    from vgraph.cli.main import main

    code = main(["optimize", str(TINY), "-o", str(tmp_path / "o.yml"), "--passes", "remat{budget=lots}"])
    err = capsys.readouterr().err
    assert code == 2 and "budget" in err and "Traceback" not in err
    assert not (tmp_path / "o.yml").exists()


# -- the pass -------------------------------------------------------------------------------------

def test_a_budget_that_holds_everything_marks_nothing():
    g = prepared()
    ctx = PassContext()
    Remat(budget="1TiB", batch=2).run(g, ctx)
    assert not marked_ids(g)
    assert "fits without remat" in ctx.notes[-1]


def test_a_tight_budget_marks_and_fits_and_clears_old_marks():
    g = prepared()
    g.node("head_up").set_config(remat=RECOMPUTE)  # a stale mark the pass must own
    cm = cost_model(g, batch=4)
    sc = scope_at(g, cm, 0.7)
    ctx = PassContext()
    counts = Remat(budget=str(sc.capacity), batch=4).run(g, ctx)
    marks = marked_ids(g)
    assert marks and counts["recomputed"] == len(marks) and "recomputed" in ctx.notes[-1]
    cost = exact(g, cost_model(g, batch=4), marks, sc.ids)
    assert cost.peak_bytes <= sc.per_sample
    assert cost_model(g, batch=4).totals()["memory_bytes"] <= sc.capacity


def test_a_budget_too_small_is_a_clear_error():
    g = prepared()
    with pytest.raises(PassError, match="even with every candidate recomputed"):
        Remat(budget="1000", batch=4).run(g, PassContext())


def test_marks_never_touch_endpoints_losses_or_cross_group_readers():
    g = prepared()
    cm = cost_model(g, batch=4)
    marks, _, _ = plan_scope(g, cm, scope_at(g, cm, 0.56), {n.id: None for n in g.nodes})
    ends = {ep.node for ep in g.iter_endpoints()}
    for nid in marks:
        n = g.node(nid)
        assert nid not in ends and not n.op.is_cost and n.group is not None
        assert all(g.node(e.dst).group == n.group for e in g.out_edges(nid))


def test_auto_budget_after_partition_uses_each_pnodes_memory():
    g = load(NET12)
    run_pipeline(g, "dead-nodes,precision{target=cuda-sm75},fuse-heads,fuse-lm-head-ce,"
                    "partition{fleet=networks/fleets/t4x4.yml,batch=32,replicas=1},remat")
    placement = g.meta["placement"]
    cm = cost_model(g, batch=32)
    for pid, info in placement["pnodes"].items():
        ids = [n.id for n in g.nodes if n.meta["pnode"] == pid]
        assert cm.totals(ids)["memory_bytes"] <= info["capacity_bytes"]


# -- the cost model -------------------------------------------------------------------------------

def test_cost_model_counts_kept_bytes_and_recompute_flops():
    g = prepared()
    before = cost_model(g, batch=4)
    g.node("block0_ffn_gelu").set_config(remat=RECOMPUTE)
    after = cost_model(g, batch=4)
    gelu, down = after.nodes["block0_ffn_gelu"], after.nodes["block0_ffn_down"]
    assert gelu.activation_bytes == 0 and gelu.recompute_bytes == before.nodes["block0_ffn_gelu"].activation_bytes
    assert gelu.recompute_flops == gelu.flops and down.recompute_flops == down.flops  # the reader runs again
    assert after.transient_bytes() == gelu.recompute_bytes
    t0, t1 = before.totals(), after.totals()
    assert t1["activation_bytes"] == t0["activation_bytes"] - gelu.recompute_bytes * after.micro_batch
    assert t1["transient_bytes"] == gelu.recompute_bytes * after.micro_batch
    assert t1["flops_per_step"] == t0["flops_per_step"] + (gelu.flops + down.flops) * 4
    assert t1["recompute_flops_per_step"] == (gelu.flops + down.flops) * 4
    assert after.to_json()["nodes"][[n["id"] for n in after.to_json()["nodes"]].index("block0_ffn_gelu")][
        "remat"] == "recompute"


def test_a_marked_node_read_through_a_kept_broadcast_is_kept():
    g = prepared()
    # attn_residual feeds `mid`, a broadcast also read by ffn_residual far outside the region
    g.node("block0_attn_residual").set_config(remat=RECOMPUTE)
    layout = remat_layout(g)
    assert "block0_attn_residual" not in layout.recomputed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sets(st.integers(0, 38)))
def test_regions_are_contiguous_and_bytes_are_conserved(picks):
    g = prepared()
    order = [n.id for n in g.topo_order()]
    marks = {order[i] for i in picks if i < len(order)}
    layout = remat_layout(g, marks)
    pos = {nid: i for i, nid in enumerate(order)}
    for members in layout.regions:
        idx = sorted(pos[m] for m in members)
        assert idx == list(range(idx[0], idx[0] + len(idx)))  # contiguous, hence convex
        assert len({g.node(m).group for m in members}) == 1
    assert layout.recomputed <= marks and layout.recomputed <= layout.reexecuted
    cm = cost_model(g, batch=2)
    act = plain_activation(cm)
    flops = dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))
    cost = remat_cost(layout, act, flops)
    assert cost.kept_bytes + sum(act[n] for n in layout.recomputed) == sum(act.values())
    assert cost.recompute_flops == sum(flops[n] for n in layout.reexecuted)


# -- the oracle ----------------------------------------------------------------------------------

@pytest.mark.parametrize("passes", ["dead-nodes,precision", "dead-nodes,precision,fuse-heads,fuse-lm-head-ce"])
@pytest.mark.parametrize("fraction", [0.95, 0.8, 0.65])
def test_policy_within_5_percent_of_the_ilp_optimum(passes, fraction):
    g = prepared(passes)
    cm = cost_model(g, batch=4)
    sc = scope_at(g, cm, fraction)
    where = {n.id: None for n in g.nodes}
    marks, chosen, _ = plan_scope(g, cm, sc, where)
    ilp_marks, optimum, status = solve_remat_ilp(g, cm, sc, where)
    assert status == "Optimal" and chosen is not None
    policy = exact(g, cm, marks, sc.ids)
    oracle = exact(g, cm, ilp_marks, sc.ids)
    assert policy.peak_bytes <= sc.per_sample and oracle.peak_bytes <= sc.per_sample
    assert oracle.recompute_flops == pytest.approx(optimum)
    assert policy.recompute_flops <= 1.05 * optimum
    assert math.isfinite(optimum) and optimum > 0


def test_with_replicas_the_pass_plans_for_the_largest_batch_share():
    g = prepared()
    for n in g.nodes:
        n.meta["pnode"] = "a"
    g.meta["placement"] = {"batch": 8, "batch_shares": [3, 5], "stages": ["a"],
                           "pnodes": {"a": {"capacity_bytes": 2**40}}}
    ctx = PassContext()
    Remat().run(g, ctx)
    assert "(batch 5)" in ctx.notes[-1] and "PNode 'a': fits without remat" in ctx.notes[-1]


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 1.2), st.integers(1, 6))
def test_any_budget_either_fits_or_is_refused_clearly(fraction, batch):
    g = prepared("dead-nodes,precision,fuse-heads,fuse-lm-head-ce")
    cm = cost_model(g, batch=batch)
    budget = scope_at(g, cm, fraction).capacity
    try:
        Remat(budget=str(max(budget, 1)), batch=batch).run(g, PassContext())
    except PassError as exc:
        assert "even with every candidate recomputed" in str(exc)
        return
    marks = marked_ids(g)
    for node in g.nodes:  # a broadcast is marked exactly when its input is (its outputs alias it)
        if node.type == "broadcast" and g.input_edge(node.id, 0) is not None:
            assert (node.id in marks) == (g.input_edge(node.id, 0).src in marks)
    assert cost_model(g, batch=batch).totals()["memory_bytes"] <= max(budget, 1)


def test_auto_budget_reads_the_device_memory_a_backend_gives():
    g = prepared()
    cm = cost_model(g, batch=4)
    ctx = PassContext(data={"device_memory": scope_at(g, cm, 0.7).capacity})
    Remat(batch=4).run(g, ctx)
    assert marked_ids(g) and "recomputed" in ctx.notes[-1]
    roomy = prepared()
    Remat(batch=4).run(roomy, PassContext())  # this machine's available memory: the tiny network fits
    assert not marked_ids(roomy)


def test_host_memory_is_known_here():
    from vgraph.cost.host_memory import available_host_memory

    found, source = available_host_memory()
    assert found is None or found > 0
    assert source


def test_an_unread_vnode_does_not_hide_the_markable_ones_after_it():
    """Without dead-nodes first, a VNode no one reads (here a GELU after the first block's LayerNorm) is no
    candidate, and every markable VNode after it still is: the candidates are those of the same graph with
    the dead VNode removed (a mutant stopping at the first unread VNode marked nothing after it)."""
    text = TINY.read_text(encoding="utf-8")
    dead = ("  - id: block0_unread\n    type: gelu\n    config:\n      colocate_group: \"transformer_block_0\"\n"
            "      colocate_policy: \"required\"\n")
    text = text.replace("  - id: block0_heads\n", dead + "  - id: block0_heads\n", 1)
    text = text.replace("  - {from: block0_ln1, to: block0_heads}\n",
                        "  - {from: block0_ln1, to: block0_heads}\n  - {from: block0_ln1, to: block0_unread}\n", 1)
    with_dead = loads(text)
    run_pipeline(with_dead, "precision", target="cpu")
    assert "block0_unread" in {n.id for n in with_dead.nodes}
    clean = prepared()
    got = remat_candidates(with_dead, cost_model(with_dead, batch=4), [n.id for n in with_dead.nodes],
                           {n.id: None for n in with_dead.nodes})
    want = remat_candidates(clean, cost_model(clean, batch=4), [n.id for n in clean.nodes],
                            {n.id: None for n in clean.nodes})
    assert got == want and sum(map(len, want.values())) > 10


def test_a_pnode_holding_a_tied_weights_user_counts_its_replica():
    """The LM head on another PNode than the embedder it shares a weight with keeps a replica of that weight
    (and its gradient): its static bytes count it, the embedder's PNode's do not, whatever the PNodes' names
    (a comparison of ids instead of equality dropped the replica from the PNode sorting last)."""
    g = prepared()
    cm = cost_model(g, batch=4)
    (tie,) = cm.ties
    assert (tie.user, tie.publisher) == ("lm_head", "embedder") and tie.replica_bytes > 0
    for pub, user in (("p0", "p1"), ("p1", "p0")):
        pnode_of = {n.id: (user if n.id == "lm_head" else pub) for n in g.nodes}
        ids_of = {p: [n for n, q in pnode_of.items() if q == p] for p in (pub, user)}
        plain = {p: pnode_static_bytes(cm, ids_of[p], pnode_of, None) for p in (pub, user)}
        assert pnode_static_bytes(cm, ids_of[user], pnode_of, user) == plain[user] + tie.replica_bytes
        assert pnode_static_bytes(cm, ids_of[pub], pnode_of, pub) == plain[pub]


def test_a_broadcast_of_a_recomputed_tensor_is_recomputed_with_it():
    """A broadcast's outputs alias its input, so marking the input marks every broadcast reading it (and only
    those); with nothing marked nothing is rebuilt (no region, no transient bytes, no FLOPs run again)."""
    g = prepared()
    for b in (n for n in g.nodes if n.type == "broadcast"):
        src = g.input_edge(b.id, 0).src
        assert closed(g, {src}) == {src} | {n.id for n in g.nodes if n.type == "broadcast"
                                            and g.input_edge(n.id, 0).src == src}
    cm = cost_model(g, batch=4)
    nothing = remat_cost(remat_layout(g, set()), plain_activation(cm),
                         dict(zip(cm.node_columns["id"], cm.node_columns["flops"])))
    assert (nothing.transient_bytes, nothing.recompute_flops) == (0, 0)
    assert nothing.kept_bytes == sum(plain_activation(cm).values())
