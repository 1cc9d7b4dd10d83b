"""The pipeline as the workers run it: the core's schedule (vgraph/cost/schedule.py), the tasks the cost model
finds (vgraph/cost/tasks.py) and the makespan it prices (vgraph/cost/makespan.py).

- uniform chains: the simulated makespan is the closed form (M + S - 1) x (forward + backward), GPipe and 1F1B;
- the chain h0 -> h1 -> h0 (embedder and tied LM head on one rank), worked out by hand;
- the makespan against an independent, demand-driven evaluation of the same orders, on random task graphs;
- the 1F1B orders against the rule written out plainly (the oracle the heap implementation replaced);
- the torch backend's plan (plan.py) and the cost model find the same tasks, the same tensors between them,
  hence the same op lists, on random placements;
- `balanced_shares` against brute force on random nondecreasing times.
"""
from __future__ import annotations

import functools
import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph.cost.makespan import Durations, TaskEdge, compile_program, makespan
from vgraph.cost.schedule import Op, ScheduledTask, TiedPair, schedule
from vgraph.cost.stepcost import balanced_shares, batch_shares
from vgraph.cost.tasks import TaskLoads, chain_tasks


def durations(forward, backward, send=None, send_back=None, latency=None, tie=None) -> Durations:
    """Durations for one pipeline (a row) from [T, M] / [E, M] / [E] / [P] arrays."""
    forward = np.asarray(forward, dtype=float)
    E = 0 if send is None else len(send)
    M = forward.shape[1]
    return Durations(forward[None], np.asarray(backward, dtype=float)[None],
                     np.zeros((1, E, M)) if send is None else np.asarray(send, dtype=float)[None],
                     np.zeros((1, E, M)) if send_back is None else np.asarray(send_back, dtype=float)[None],
                     np.zeros((1, E)) if latency is None else np.asarray(latency, dtype=float)[None],
                     np.zeros((1, 0)) if tie is None else np.asarray(tie, dtype=float)[None])


@settings(derandomize=True, max_examples=60, deadline=None)
@given(S=st.integers(1, 8), M=st.integers(1, 8), f=st.floats(0.01, 10), more=st.floats(1, 4),
       pipeline=st.sampled_from(["1f1b", "gpipe"]))
def test_a_uniform_chain_takes_the_closed_form(S, M, f, more, pipeline):
    """A backward takes at least its forward (the cost model gives the forward at most a third of a task):
    (a forward longer than its backward makes the unit-time 1F1B orders lose a slot, e.g. S 3, M 4, f 2, b 1)."""
    b = f * more
    tasks = chain_tasks(np.ones(S), np.zeros((S, S)))
    program = compile_program(tasks.scheduled, tasks.edges, S, M, pipeline)
    E = len(tasks.edges)
    d = durations(np.full((S, M), f), np.full((S, M), b), np.zeros((E, M)), np.zeros((E, M)), np.zeros(E))
    assert makespan(program, d)[0] == pytest.approx((M + S - 1) * (f + b), rel=1e-12)


def test_the_first_rank_at_both_ends_by_hand():
    """Embedder e and tied head h on rank 0, the blocks b on rank 1: e -> b -> h.  Forward e 1, b 2, h 3
    (backward twice that); every tensor 0.5 on its sender's link.  1F1B with two micro-batches keeps at
    most two in flight; its orders are rank 0: Fe0 Fe1 Fh0 Bh0 Fh1 Be0 Bh1 Be1, rank 1: Fb0 Fb1 Bb0 Bb1.

    rank 0: Fe0 0-1 (to b at 1.5), Fe1 1-2 (at 2.5)      rank 1: Fb0 1.5-3.5 (to h at 4), Fb1 3.5-5.5 (at 6)
    rank 0: Fh0 4-7, Bh0 7-13 (to b at 13.5), Fh1 13-16 rank 1: Bb0 13.5-17.5 (to e at 18)
    rank 0: Be0 18-20, Bh1 20-26 (to b at 26.5)         rank 1: Bb1 26.5-30.5 (to e at 31)
    rank 0: Be1 31-33.

    33, where (M + S - 1) / M x the slower rank's 24 gives 36; with one micro-batch everything runs one
    after another (20); with four, the cap makes the step 65 against the formula's 60."""
    tasks = [ScheduledTask("e", 0, (), ("b",)), ScheduledTask("h", 0, ("b",), ()),
             ScheduledTask("b", 1, ("e",), ("h",))]
    edges = [TaskEdge(0, 2, True), TaskEdge(2, 1, True)]
    ops = schedule(tasks, 2, 2, train=True)
    assert [(o.kind, o.task, o.micro) for o in ops[0]] == [
        ("fwd", "e", 0), ("fwd", "e", 1), ("fwd", "h", 0), ("bwd", "h", 0), ("fwd", "h", 1), ("bwd", "e", 0),
        ("bwd", "h", 1), ("bwd", "e", 1)]
    assert [(o.kind, o.task, o.micro) for o in ops[1]] == [("fwd", "b", 0), ("fwd", "b", 1), ("bwd", "b", 0),
                                                            ("bwd", "b", 1)]
    for M, expected in ((1, 20.0), (2, 33.0), (4, 65.0)):
        forward = np.array([[1.0], [3.0], [2.0]]).repeat(M, axis=1)
        d = durations(forward, 2 * forward, np.full((2, M), 0.5), np.full((2, M), 0.5), np.zeros(2))
        assert makespan(compile_program(tasks, edges, 2, M), d)[0] == pytest.approx(expected)


def test_a_tie_waits_for_both_ranks_and_their_links():
    """Two stages, one micro-batch, a tied pair synced for 0.25 after both ranks and links are done."""
    tasks = chain_tasks(np.ones(2), np.zeros((2, 2)))
    ties = (TiedPair(0, (0, 1)),)
    program = compile_program(tasks.scheduled, tasks.edges, 2, 1, "1f1b", ties)
    d = durations([[1.0], [2.0]], [[2.0], [4.0]], [[0.5]], [[0.5]], [0.125], [0.25])
    # F0 1, activations 0.5 + 0.125, F1 2 and B1 4, gradients 0.5 + 0.125, B0 2: 10.25; the sync 0.25
    assert makespan(program, d)[0] == pytest.approx(10.5)


@st.composite
def task_graphs(draw):
    """Random task DAGs: tasks in forward order by index, each on a rank, reading from earlier tasks."""
    T = draw(st.integers(1, 7))
    ranks = draw(st.integers(1, 4))
    rank = [draw(st.integers(0, ranks - 1)) for _ in range(T)]
    edges = sorted({(a, b) for b in range(T) for a in draw(st.sets(st.integers(0, max(0, b - 1)), max_size=2))
                    if a < b})
    grads = [draw(st.booleans()) for _ in edges]
    return rank, ranks, [TaskEdge(a, b, g) for (a, b), g in zip(edges, grads)]


def as_scheduled(rank, edges) -> list[ScheduledTask]:
    return [ScheduledTask(str(t), rank[t], tuple(str(e.src) for e in edges if e.dst == t),
                          tuple(str(e.dst) for e in edges if e.src == t and e.grad)) for t in range(len(rank))]


def demand_driven(ops, tasks, edges, d) -> float:
    """The makespan evaluated backwards from each op (memoised recursion), as its own check of the pass."""
    index = {t.id: i for i, t in enumerate(tasks)}
    rank_of = [t.rank for t in tasks]
    where = {(r, op): i for r, seq in ops.items() for i, op in enumerate(seq)}
    sends = {}  # rank -> [(op position, edge, grad?)] in sending order
    for r, seq in ops.items():
        out = []
        for i, op in enumerate(seq):
            t = index[op.task]
            if op.kind == "fwd":
                out += [(i, e, False) for e, x in enumerate(edges) if x.src == t and rank_of[x.dst] != r]
            else:
                out += [(i, e, True) for e, x in enumerate(edges) if x.dst == t and x.grad and rank_of[x.src] != r]
        sends[r] = out

    @functools.lru_cache(maxsize=None)
    def finish(r, i):
        op = ops[r][i]
        t, m = index[op.task], op.micro
        start = finish(r, i - 1) if i else 0.0
        if op.kind == "fwd":
            for e, x in enumerate(edges):
                if x.dst == t:
                    start = max(start, arrival(e, False, m))
            return start + d.forward[0, t, m]
        for e, x in enumerate(edges):
            if x.src == t and x.grad:
                start = max(start, arrival(e, True, m))
        return start + d.backward[0, t, m]

    @functools.lru_cache(maxsize=None)
    def link_free(r, k):  # when rank r's k-th message has left its link
        i, e, grad = sends[r][k]
        m = ops[r][i].micro
        leave = max(finish(r, i), link_free(r, k - 1) if k else 0.0)
        return leave + (d.send_back if grad else d.send)[0, e, m]

    def arrival(e, grad, m):
        x = edges[e]
        r = rank_of[x.dst] if grad else rank_of[x.src]
        producer = where[(r, Op("bwd" if grad else "fwd", str(x.dst if grad else x.src), m))]
        if rank_of[x.src] == rank_of[x.dst]:
            return finish(r, producer)
        k = next(k for k, s in enumerate(sends[r]) if s[0] == producer and s[1] == e and s[2] == grad)
        return link_free(r, k) + d.latency[0, e]

    return max((finish(r, len(seq) - 1) for r, seq in ops.items() if seq), default=0.0)


@settings(derandomize=True, max_examples=80, deadline=None)
@given(graph=task_graphs(), M=st.integers(1, 4), pipeline=st.sampled_from(["1f1b", "gpipe"]), seed=st.integers(0, 99))
def test_the_makespan_is_the_longest_path_of_the_orders(graph, M, pipeline, seed):
    rank, ranks, edges = graph
    tasks = as_scheduled(rank, edges)
    rng = np.random.default_rng(seed)
    T, E = len(tasks), len(edges)
    d = durations(rng.uniform(0.1, 2, (T, M)), rng.uniform(0.1, 4, (T, M)), rng.uniform(0, 1, (E, M)),
                  rng.uniform(0, 1, (E, M)), rng.uniform(0, 0.2, E))
    got = makespan(compile_program(tasks, edges, ranks, M, pipeline), d)[0]
    ops = schedule(tasks, ranks, M, train=True, pipeline=pipeline)
    assert got == pytest.approx(demand_driven(ops, tasks, edges, d), rel=1e-12)
    per_rank = max(d.forward[0, [t for t in range(T) if rank[t] == r]].sum()
                   + d.backward[0, [t for t in range(T) if rank[t] == r]].sum() for r in set(rank))
    everything = d.forward.sum() + d.backward.sum() + d.send.sum() + d.send_back.sum() + 2 * M * d.latency.sum()
    assert per_rank * (1 - 1e-12) <= got <= everything * (1 + 1e-12)


def one_f_one_b_plainly(tasks, ranks, M):
    """The 1F1B rule as first written (plan.py before the heaps): scan every task and micro-batch each unit."""
    cap = max(1, min(M, ranks))
    mine = {r: [t for t in tasks if t.rank == r] for r in range(ranks)}
    fwd_done, bwd_done, order = set(), set(), {r: [] for r in range(ranks)}
    in_flight, next_start = {r: set() for r in range(ranks)}, dict.fromkeys(range(ranks), 0)
    left = {(r, m): len(mine[r]) for r in range(ranks) for m in range(M)}
    while sum(map(len, order.values())) < 2 * M * len(tasks):
        chosen = []
        for r in range(ranks):
            op = next((Op("bwd", t.id, m) for m in sorted(in_flight[r]) for t in reversed(mine[r])
                       if (t.id, m) not in bwd_done and (t.id, m) in fwd_done
                       and all((x, m) in bwd_done for x in t.grads_from)), None)
            if op is None:
                cands = sorted(in_flight[r]) + ([next_start[r]] if next_start[r] < M and len(in_flight[r]) < cap
                                                else [])
                op = next((Op("fwd", t.id, m) for m in cands for t in mine[r]
                           if (t.id, m) not in fwd_done and (m == 0 or (t.id, m - 1) in fwd_done)
                           and all((x, m) in fwd_done for x in t.reads)), None)
            if op is not None:
                chosen.append((r, op))
        assert chosen
        for r, op in chosen:
            order[r].append(op)
            if op.kind == "fwd":
                fwd_done.add((op.task, op.micro))
                if op.micro not in in_flight[r]:
                    in_flight[r].add(op.micro)
                    next_start[r] += 1
            else:
                bwd_done.add((op.task, op.micro))
                left[(r, op.micro)] -= 1
                if not left[(r, op.micro)]:
                    in_flight[r].discard(op.micro)
    return order


@settings(derandomize=True, max_examples=150, deadline=None)
@given(graph=task_graphs(), M=st.integers(1, 6))
def test_one_f_one_b_follows_the_rule(graph, M):
    rank, ranks, edges = graph
    tasks = as_scheduled(rank, edges)
    ops = schedule(tasks, ranks, M, train=True)
    assert {r: ops.get(r, []) for r in range(ranks)} == one_f_one_b_plainly(tasks, ranks, M)


def test_schedule_refuses_what_it_cannot_run():
    tasks = chain_tasks(np.ones(2), np.zeros((2, 2))).scheduled
    with pytest.raises(ValueError, match="one of 1f1b, gpipe"):
        schedule(tasks, 2, 2, train=True, pipeline="zero-bubble")
    with pytest.raises(ValueError, match="at least one micro-batch"):
        schedule(tasks, 2, 0, train=True)


@settings(derandomize=True, max_examples=120, deadline=None)
@given(st.data())
def test_balanced_shares_are_optimal(data):
    R = data.draw(st.integers(1, 4))
    batch = data.draw(st.integers(R, 16))
    caps = [data.draw(st.integers(1, batch)) for _ in range(R)]
    steps = [[data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for _ in range(batch + 1)] for _ in range(R)]
    times = np.array([np.cumsum(s) + data.draw(st.floats(0, 5)) for s in steps])  # nondecreasing in the share
    guess = batch_shares(batch, [data.draw(st.floats(0.1, 10)) for _ in range(R)], caps=caps)
    if guess is None:
        return
    shares, seconds = balanced_shares(lambda rows, b: times[rows, b], batch, guess, caps)
    assert sum(shares) == batch and all(1 <= b <= c for b, c in zip(shares, caps))
    assert seconds.tolist() == [times[r, shares[r]] for r in range(R)]
    best = min(max(times[r, b[r]] for r in range(R)) for b in itertools.product(*(range(1, c + 1) for c in caps))
               if sum(b) == batch)
    assert max(times[r, shares[r]] for r in range(R)) == best


def test_the_plan_and_the_cost_model_find_the_same_tasks():
    """On random placements of the tiny network (non-contiguous ones included), plan.py's tasks and the cost
    model's have the same ranks, depths, tensors (bytes each way) and so the same op lists."""
    pytest.importorskip("torch")
    from test_distributed import placed, tiny
    from vgraph.run.step_plan import make_plan, scheduled_tasks, schedule_ops
    from vgraph.cost.costmodel import cost_model
    from vgraph.cost.stepcost import stage_loads
    from vgraph.ops.boundary import wire_bytes

    graph = placed(tiny(True), 3).graph
    rng = random.Random(0)
    seen = {"remote ties": 0, "ranks with several tasks": 0}
    for trial in range(20):
        k = rng.randint(1, 4)
        assignment = {n.id: f"w{rng.randrange(k)}" for n in graph.nodes}
        plan = make_plan(graph, assignment)
        stage_of = {v: plan.ranks.index(p) for v, p in assignment.items()}
        loads = stage_loads(cost_model(graph, batch=8), stage_of, plan.world_size)
        tasks = loads.task_view()
        name = {f"{plan.ranks.index(t.pnode)}#{t.depth}": t.id for t in plan.tasks.values()}
        mine = [ScheduledTask(name[t.id], t.rank, tuple(name[x] for x in t.reads),
                              tuple(name[x] for x in t.grads_from)) for t in tasks.scheduled]
        theirs = scheduled_tasks(plan)
        assert sorted(mine, key=lambda t: t.id) == sorted(theirs, key=lambda t: t.id), trial
        for M in (1, 3):
            theirs_ops = schedule_ops(plan, M, train=True)
            assert schedule(mine, plan.world_size, M, train=True) == {
                r: [op for op in seq if op.kind != "tie_grad"] for r, seq in theirs_ops.items()}, trial
        # tied weights: the cost model syncs per pair of stages what the plan syncs per tie
        _, pairs = TaskLoads.tied_pairs(loads.sync)
        assert set(pairs) == {tuple(sorted((t.owner_rank, t.replica_rank))) for t in plan.ties if t.remote}
        seen["remote ties"] += bool(pairs)
        seen["ranks with several tasks"] += len(set(tasks.stage.tolist())) < tasks.count
        ids = [t.id for t in tasks.scheduled]
        for e, act, grad in zip(tasks.edges, tasks.act, tasks.grad):
            crossing = [tr for tr in plan.transfers
                        if (name[ids[e.src]], name[ids[e.dst]]) == (tr.src_task, tr.dst_task)]
            assert act == sum(wire_bytes(tr.shape, tr.dtype, "none", "token") for tr in crossing)
            assert grad == sum(wire_bytes(tr.shape, tr.dtype, "none", "token") for tr in crossing if tr.grad)
            assert e.grad == any(tr.grad for tr in crossing)
        assert len(tasks.edges) == len({(tr.src_task, tr.dst_task) for tr in plan.transfers})
    assert min(seen.values()) > 0, seen  # the cases that matter were drawn


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.data())
def test_depths_in_any_node_order(data):
    """A VNode's depth (stage changes on the longest path reaching it, plan.py's `stages`) does not depend on
    the order the cost model lists VNodes in: the index sorts them topologically when the edges run backwards."""
    from vgraph.cost.tasks import TaskGraphIndex

    n = data.draw(st.integers(1, 12))
    edges = sorted(data.draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20)))
    edges = [(a, b) for a, b in edges if a < b]  # a DAG in the order 0..n-1
    where = np.array([data.draw(st.integers(0, 2)) for _ in range(n)])
    perm = np.array(data.draw(st.permutations(range(n))))  # VNode v is listed at perm[v]
    src = np.array([perm[a] for a, _ in edges], dtype=np.int64)
    dst = np.array([perm[b] for _, b in edges], dtype=np.int64)
    depth = TaskGraphIndex(n, src, dst).depth(where[np.argsort(perm)])
    expected = [0] * n
    for v in range(n):  # 0..n-1 is a topological order of the unpermuted DAG
        expected[v] = max((expected[a] + (where[a] != where[v]) for a, b in edges if b == v), default=0)
    assert [int(depth[perm[v]]) for v in range(n)] == expected


def test_a_cycle_is_refused():
    from vgraph.cost.tasks import TaskGraphIndex

    with pytest.raises(ValueError, match="cycle"):
        TaskGraphIndex(3, np.array([0, 1, 2]), np.array([1, 2, 0]))
