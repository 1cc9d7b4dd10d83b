"""The exact oracle for the `partition` pass: the same objective as an ILP (PuLP + CBC).

Small instances only (tests and benchmarks/bench_partition.py compare the
pass's plan with it); the pass itself never calls it.
"""
from __future__ import annotations

import numpy as np

from vgraph.passes.partition_problem import PartitionError, Problem, evaluate


def solve_ilp(problem: Problem, *, time_limit: float = 60.0, cut_phase: bool = True,
              warm_start: np.ndarray | None = None) -> tuple[np.ndarray, float, float, str]:
    """The same objective solved exactly with PuLP/CBC: (assignment, bottleneck, cut, status).

    Binary x[u,p] (unit u on PNode p), y[e,p] >= |x[a,p] - x[b,p]| (edge e
    touches p and is cut), r[t,p] >= x[user,p] - x[pub,p] (a replica of a tied
    weight on p).  Phase 1 minimises z >= time(p) for all p; phase 2 fixes
    z <= z* (1 + 1e-6) and minimises the cut bytes (sum of w_e y[e,p] / 2).
    Identical PNodes are symmetry-broken (unit j may use only the first j+1
    PNodes of its class), which keeps every optimum reachable.  `warm_start`
    (an assignment) gives CBC an incumbent; it cannot change the optimum.
    """
    import warnings

    import pulp

    with warnings.catch_warnings():  # PuLP 3.x announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_ilp(pulp, problem, time_limit, cut_phase, warm_start)


def _solve_ilp(pulp, problem: Problem, time_limit: float, cut_phase: bool, warm_start: np.ndarray | None
               ) -> tuple[np.ndarray, float, float, str]:
    F, BW, M = problem.speeds()
    n, k = problem.n, problem.k
    classes: dict[tuple, list[int]] = {}
    for p, pn in enumerate(problem.pnodes):
        classes.setdefault((pn.memory, pn.flops, pn.bandwidth), []).append(p)
    scale_t = max(float(problem.compute.sum() / F.max()), 1e-30)  # keep coefficients near 1
    scale_w = max(float(problem.edge_w.max()) if len(problem.edge_w) else 1.0, 1.0)
    lp = pulp.LpProblem("placement", pulp.LpMinimize)
    x = {(u, p): pulp.LpVariable(f"x_{u}_{p}", cat="Binary") for u in range(n) for p in range(k)}
    edges = list(zip(problem.edge_p.tolist(), problem.edge_q.tolist(), problem.edge_w.tolist()))
    y = {(e, p): pulp.LpVariable(f"y_{e}_{p}", lowBound=0, upBound=1) for e in range(len(edges))
         for p in range(k)}
    r = {(t, p): pulp.LpVariable(f"r_{t}_{p}", lowBound=0, upBound=1) for t in range(len(problem.ties))
         for p in range(k)}
    z = pulp.LpVariable("z", lowBound=0)
    lp += z
    for u in range(n):
        lp += pulp.lpSum(x[u, p] for p in range(k)) == 1
    for members in classes.values():
        for rank, p in enumerate(members):
            for u in range(min(rank, n)):
                lp += x[u, p] == 0
    for e, (a, b, _) in enumerate(edges):
        for p in range(k):
            lp += y[e, p] >= x[a, p] - x[b, p]
            lp += y[e, p] >= x[b, p] - x[a, p]
    for t, (pub, user, _) in enumerate(problem.ties):
        for p in range(k):
            lp += r[t, p] >= x[user, p] - x[pub, p]
    for p in range(k):
        lp += (pulp.lpSum(float(problem.memory[u]) * x[u, p] for u in range(n))
               + pulp.lpSum(float(rep) * r[t, p] for t, (_, _, rep) in enumerate(problem.ties))) <= float(M[p])
        lp += (pulp.lpSum(float(problem.compute[u] / F[p] / scale_t) * x[u, p] for u in range(n))
               + pulp.lpSum(float(w / BW[p] / scale_t) * y[e, p] for e, (_, _, w) in enumerate(edges))) <= z
    if warm_start is not None:  # an incumbent only speeds up the proof; the optimum is CBC's own
        for u in range(n):
            for p in range(k):
                x[u, p].setInitialValue(1 if warm_start[u] == p else 0)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=1e-7, warmStart=warm_start is not None)
    lp.solve(solver)
    status = pulp.LpStatus[lp.status]
    if status != "Optimal":
        raise PartitionError(f"ILP: {status}")

    def read() -> np.ndarray:
        return np.array([max(range(k), key=lambda p: x[u, p].value()) for u in range(n)], dtype=np.int64)

    assign = read()
    if cut_phase and edges:
        zstar = z.value()
        lp += z <= zstar * (1 + 1e-6) + 1e-12
        lp.setObjective(pulp.lpSum(float(w / scale_w) * y[e, p] for e, (_, _, w) in enumerate(edges)
                                   for p in range(k)))
        lp.solve(solver)
        if pulp.LpStatus[lp.status] == "Optimal":
            assign = read()
    ev = evaluate(problem, assign)
    return assign, ev.bottleneck, ev.cut, status
