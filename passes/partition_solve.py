"""The `partition` pass's heuristic: stage splits of the unit chain, then local search.

The heuristic
-------------
Units are ordered along the network (by their first VNode in topological
order), which makes the transformer blocks a chain.  For an order of the
PNodes, the chain is cut into contiguous stages, one per PNode (a PNode may
get nothing), minimising the bottleneck exactly with a dynamic programme over
segment costs (O(k n^2), vectorised), then, among splits within that
bottleneck, the cut bytes.  The cost of a segment is exact for any graph: a
segment's boundary counts every edge with one end inside.  The production
networks' embedding group holds both the first and the last VNodes, so the
chain is really a ring: the DP runs over every rotation of the chain at once
(up to `ROTATE_ALL` units; a few rotations beyond), so a stage may wrap around.
For more than `EXACT_UNITS` units the split is found by bisection on the
bottleneck with a greedy fill instead (O(k (n + edges)) per probe).

PNode orders tried: the fleet's, fastest first (every order when there are at
most 4 PNodes), then repeatedly the order given by an optimal bottleneck
assignment of PNodes to the stages found (bisection over a matching); identical
PNodes make orders equivalent and are tried once.  Up to `LOCAL_SEARCH_UNITS`
units a local search then moves single units, runs of the chain and (small
instances) swaps pairs while (bottleneck, PNodes at the bottleneck, cut)
improves; instances with VNode-level units (up to `KICK_UNITS`) also get an
iterated local search with seeded random kicks, which finds the non-contiguous
placements (a block's heads on one PNode, its residual path on another) no
stage split can express.  On the test instances (benchmarks/bench_partition.py)
the result is within 3.1% of the ILP optimum, mostly equal to it.
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import Sequence

import numpy as np

from vgraph.passes.partition_problem import Problem, better, evaluate, infeasible

EXACT_UNITS = 400  # up to this many units the stage split is an exact DP
LOCAL_SEARCH_UNITS = 400  # local search on instances this small
SWAP_UNITS = 80  # ... with pair swaps on instances this small
RUN_LENGTH = 6  # longest chain run moved as one
KICK_UNITS = 80  # ... and random restarts (iterated local search) on instances this small
ROTATE_ALL = 40  # up to this many units every rotation of the chain is tried at once


# -- stage splits on the chain ---------------------------------------------------------------------

def _segment_matrices(problem: Problem, rotation: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute, boundary and memory of every segment [i, j) of the chain rotated to start at
    unit `rotation`, as (n+1)^2 matrices.

    boundary[i, j] = cross(i) + cross(j) - 2 span(i, j), where cross(t) sums the edges
    over the cut before position t and span(i, j) those jumping over the whole segment.
    """
    n = problem.n
    perm = (np.arange(n) + rotation) % n  # rotated position -> unit
    pos = np.empty(n, dtype=np.int64)
    pos[perm] = np.arange(n)
    a, b = pos[problem.edge_p], pos[problem.edge_q]
    P, Q, W = np.minimum(a, b), np.maximum(a, b), problem.edge_w
    pc = np.concatenate([[0.0], np.cumsum(problem.compute[perm])])
    pm = np.concatenate([[0.0], np.cumsum(problem.memory[perm])])
    d = np.zeros(n + 2)
    np.add.at(d, P + 1, W)
    np.add.at(d, Q + 1, -W)
    cross = np.cumsum(d)[: n + 1]
    A = np.zeros((n + 1, n + 1))
    np.add.at(A, (P + 1, Q), W)
    S = np.cumsum(A, axis=0)[:, ::-1].cumsum(axis=1)[:, ::-1]  # edges with p < i and q >= j
    boundary = np.maximum(cross[:, None] + cross[None, :] - 2 * S, 0.0)
    compute = pc[None, :] - pc[:, None]
    memory = pm[None, :] - pm[:, None]
    if problem.ties:
        i = np.arange(n + 1)[:, None]
        j = np.arange(n + 1)[None, :]
        for pub, user, replica in problem.ties:
            pu, pp = pos[user], pos[pub]
            away = (i <= pu) & (pu < j) & ~((i <= pp) & (pp < j))
            memory = memory + np.where(away, replica, 0.0)
    return compute, boundary, memory


class _Segments:
    """Segment matrices of the chain under several rotations, stacked: [R, n+1, n+1].

    A rotation lets a stage wrap around the chain's ends: the production
    networks' embedding group holds both the first and the last VNodes, so the
    chain is really a ring.
    """

    def __init__(self, problem: Problem, rotations: Sequence[int]) -> None:
        self.n = problem.n
        self.rotations = list(rotations)
        mats = [_segment_matrices(problem, r) for r in self.rotations]
        self.compute = np.stack([m[0] for m in mats])
        self.boundary = np.stack([m[1] for m in mats])
        self.memory = np.stack([m[2] for m in mats])
        self.upper = np.triu(np.ones((self.n + 1, self.n + 1), dtype=bool))
        self._times: dict[tuple, np.ndarray] = {}

    def times(self, pnode: PNode) -> np.ndarray:
        """Stage time of every segment on `pnode` (inf: over memory; 0: empty)."""
        key = (pnode.flops, pnode.bandwidth, pnode.memory)  # identical PNodes share it
        t = self._times.get(key)
        if t is None:
            t = self.compute / pnode.flops + self.boundary / pnode.bandwidth
            t = np.where(self.upper & (self.memory <= pnode.memory), t, np.inf)
            idx = np.arange(self.n + 1)
            t[:, idx, idx] = 0.0
            self._times[key] = t
        return t


def _split_exact(seg: _Segments, problem: Problem, order: Sequence[int]
                 ) -> tuple[int, list[int]] | None:
    """(rotation, segment ends) for PNodes in `order`: min bottleneck over all rotations, then
    min cut among the splits that reach it.  A DP over stages, vectorised over (rotation, i, j)."""
    n, R = seg.n, len(seg.rotations)
    times = [seg.times(problem.pnodes[p]) for p in order]
    f = np.full((R, n + 1), np.inf)
    f[:, 0] = 0.0
    for t in times:
        f = np.min(np.maximum(f[:, :, None], t), axis=1)
    best = float(f[:, n].min())
    if not np.isfinite(best):
        return None
    limit = best * (1 + 1e-9) + 1e-300
    g = np.full((R, n + 1), np.inf)
    g[:, 0] = 0.0
    back = []
    half = seg.boundary / 2
    cols = np.arange(n + 1)
    rows = np.arange(R)[:, None]
    for t in times:
        cost = np.where(t <= limit, g[:, :, None] + half, np.inf)
        arg = np.argmin(cost, axis=1)  # [R, n+1]
        g = cost[rows, arg, cols[None, :]]
        back.append(arg)
    r = int(np.argmin(g[:, n]))
    ends = [n]
    for arg in reversed(back[1:]):
        ends.append(int(arg[r, ends[-1]]))
    return seg.rotations[r], list(reversed(ends))


class _Chain:
    """Prefix sums that price the segments [i, j), j = i..n, of the unit chain in O(n + edges)."""

    def __init__(self, problem: Problem) -> None:
        n = problem.n
        self.n = n
        self.pc = np.concatenate([[0.0], np.cumsum(problem.compute)])
        self.pm = np.concatenate([[0.0], np.cumsum(problem.memory)])
        P, Q, W = problem.edge_p, problem.edge_q, problem.edge_w
        d = np.zeros(n + 2)
        np.add.at(d, P + 1, W)
        np.add.at(d, Q + 1, -W)
        self.cross = np.cumsum(d)[: n + 1]
        order = np.argsort(P, kind="stable")
        self.P, self.Q, self.W = P[order], Q[order], W[order]
        self.ties = problem.ties

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = np.searchsorted(self.P, i, side="left")  # edges with p < i
        span = np.bincount(self.Q[:c], weights=self.W[:c], minlength=self.n + 1)[::-1].cumsum()[::-1]
        j = np.arange(i, self.n + 1)
        boundary = self.cross[i] + self.cross[j] - 2 * span[j]
        compute = self.pc[j] - self.pc[i]
        memory = self.pm[j] - self.pm[i]
        for pub, user, replica in self.ties:
            if i <= user:
                away = (user < j) & ~((i <= pub) & (pub < j))
                memory = memory + np.where(away, replica, 0.0)
        return compute, np.maximum(boundary, 0.0), memory


def _split_greedy(chain: _Chain, problem: Problem, order: Sequence[int]) -> list[int] | None:
    """Segment ends by bisection on the bottleneck with a greedy fill of each PNode in turn."""
    F, BW, M = problem.speeds()
    rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def fill(limit: float) -> list[int] | None:
        i, ends = 0, []
        for p in order:
            if i < chain.n:
                if i not in rows:
                    rows[i] = chain.row(i)
                c, b, m = rows[i]
                ok = np.flatnonzero((c / F[p] + b / BW[p] <= limit) & (m <= M[p]))
                i += int(ok[-1]) if len(ok) else 0
            ends.append(i)
        return ends if i == chain.n else None

    lo = float(chain.pc[-1] / F.sum())
    hi = max(lo, 1e-12)
    for _ in range(200):
        if fill(hi) is not None:
            break
        hi *= 2
    else:
        return None
    for _ in range(40):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        if fill(mid) is not None:
            hi = mid
        else:
            lo = mid
    return fill(hi)


def _assignment(problem: Problem, order: Sequence[int], ends: Sequence[int], rotation: int = 0) -> np.ndarray:
    assign = np.empty(problem.n, dtype=np.int64)
    perm = (np.arange(problem.n) + rotation) % problem.n
    start = 0
    for p, end in zip(order, ends):
        assign[perm[start:end]] = p
        start = end
    return assign


def bottleneck_order(problem: Problem, assign: np.ndarray, order: Sequence[int]) -> list[int]:
    """PNodes re-matched to the current stages so the slowest stage is as fast as possible."""
    stages: list[np.ndarray] = []
    for p in order:
        members = np.flatnonzero(assign == p)
        if len(members):
            stages.append(members)
    F, BW, M = problem.speeds()
    k = problem.k
    cost = np.full((len(stages), k), np.inf)
    for s, members in enumerate(stages):
        inside = np.zeros(problem.n, dtype=bool)
        inside[members] = True
        boundary = problem.edge_w[inside[problem.edge_p] != inside[problem.edge_q]].sum()
        compute = problem.compute[members].sum()
        mem = problem.memory[members].sum()
        for pub, user, replica in problem.ties:
            if inside[user] and not inside[pub]:
                mem += replica
        ok = mem <= M
        cost[s, ok] = compute / F[ok] + boundary / BW[ok]
    values = np.unique(cost[np.isfinite(cost)])
    match = None
    lo, hi = 0, len(values) - 1
    while lo <= hi:  # smallest threshold with a perfect matching of stages
        mid = (lo + hi) // 2
        m = _match(cost <= values[mid])
        if m is not None:
            match, hi = m, mid - 1
        else:
            lo = mid + 1
    if match is None:
        return list(order)
    used = [match[s] for s in range(len(stages))]
    return used + [p for p in order if p not in used]


def _match(allowed: np.ndarray) -> list[int] | None:
    """Kuhn's augmenting paths: stage -> PNode, every stage matched, or None."""
    stages, k = allowed.shape
    owner = [-1] * k
    options = [np.flatnonzero(allowed[s]).tolist() for s in range(stages)]

    def augment(s: int, seen: list[bool]) -> bool:
        for p in options[s]:
            if not seen[p]:
                seen[p] = True
                if owner[p] < 0 or augment(owner[p], seen):
                    owner[p] = s
                    return True
        return False

    for s in range(stages):
        if not augment(s, [False] * k):
            return None
    out = [0] * stages
    for p, s in enumerate(owner):
        if s >= 0:
            out[s] = p
    return out


class _Loads:
    """Per-PNode compute, boundary and memory of an assignment, updated move by move."""

    def __init__(self, problem: Problem, assign: np.ndarray) -> None:
        F, BW, M = problem.speeds()
        self.F, self.BW, self.M = F.tolist(), BW.tolist(), M.tolist()
        self.k = problem.k
        self.adj = problem.adjacency()
        self.unit_comp, self.unit_mem = problem.compute.tolist(), problem.memory.tolist()
        self.ties_of: dict[int, list[tuple[int, int, int]]] = {}
        for t in problem.ties:
            self.ties_of.setdefault(t[0], []).append(t)
            self.ties_of.setdefault(t[1], []).append(t)
        ev = evaluate(problem, assign)
        self.a = assign.tolist()
        self.comp, self.bnd, self.mem = ev.compute.tolist(), ev.boundary.tolist(), ev.memory.tolist()
        self.cut = ev.cut
        self.feasible = ev.feasible

    def key(self, comp, bnd, cut) -> tuple[float, int, float]:
        """Search key: bottleneck, then how many PNodes sit at it (to leave plateaus), then cut."""
        times = [comp[p] / self.F[p] + bnd[p] / self.BW[p] for p in range(self.k)]
        top = max(times)
        at_top = sum(1 for t in times if t >= top * (1 - 1e-9))
        return (top, at_top, cut)

    def moved(self, moves: list[tuple[int, int]]):
        """Loads after moving each (unit, PNode) in turn, or None if memory overflows."""
        a = self.a
        comp, bnd, mem, cut = self.comp[:], self.bnd[:], self.mem[:], self.cut
        undo = []
        grown = set()  # PNodes whose memory grew: the only ones that can overflow
        for u, dst in moves:
            src = a[u]
            grown.add(dst)
            comp[src] -= self.unit_comp[u]
            comp[dst] += self.unit_comp[u]
            mem[src] -= self.unit_mem[u]
            mem[dst] += self.unit_mem[u]
            for v, w in self.adj[u]:
                c = a[v]
                if c != src:
                    bnd[src] -= w
                    bnd[c] -= w
                    cut -= w
                if c != dst:
                    bnd[dst] += w
                    bnd[c] += w
                    cut += w
            for pub, user, replica in self.ties_of.get(u, ()):
                if a[user] != a[pub]:
                    mem[a[user]] -= replica
            undo.append((u, src))
            a[u] = dst
            for pub, user, replica in self.ties_of.get(u, ()):
                if a[user] != a[pub]:
                    mem[a[user]] += replica
                    grown.add(a[user])
        for u, src in reversed(undo):
            a[u] = src
        if any(mem[p] > self.M[p] * (1 + 1e-12) for p in grown):
            return None
        return comp, bnd, mem, cut

    def apply(self, moves: list[tuple[int, int]], state) -> None:
        for u, dst in moves:
            self.a[u] = dst
        self.comp, self.bnd, self.mem, self.cut = state


def _local_search(problem: Problem, assign: np.ndarray, max_sweeps: int = 50, swaps: bool = True,
                  runs: bool = True) -> np.ndarray:
    """Single-unit moves, then moves of chain runs, then pair swaps, while the search key
    improves (each accepted step lowers it, so this ends).

    Only steps that can lower the key are priced: a step that touches no PNode at the
    bottleneck can only help through the cut, so it must move a unit next to a neighbour;
    of several empty identical PNodes only one is tried.
    """
    search = _Descent(problem, assign)
    if not search.loads.feasible:
        return assign
    for _ in range(max_sweeps):
        if not (search.unit_moves() or (runs and search.run_moves()) or (swaps and search.swaps())):
            break
    return np.array(search.loads.a, dtype=np.int64)


class _Descent:
    """The state of one local search: the loads, how many units each PNode holds, the current key."""

    def __init__(self, problem: Problem, assign: np.ndarray) -> None:
        self.loads = loads = _Loads(problem, assign)
        self.n, self.k = problem.n, problem.k
        kind: dict[tuple, int] = {}
        self.cls = [kind.setdefault((p.flops, p.bandwidth, p.memory), len(kind)) for p in problem.pnodes]
        self.count = [0] * self.k
        for p in loads.a:
            self.count[p] += 1
        self.current = loads.key(loads.comp, loads.bnd, loads.cut) if loads.feasible else None

    def top(self) -> set[int]:
        """The PNodes at the bottleneck."""
        loads = self.loads
        times = [loads.comp[p] / loads.F[p] + loads.bnd[p] / loads.BW[p] for p in range(self.k)]
        peak = max(times)
        return {p for p in range(self.k) if times[p] >= peak * (1 - 1e-9)}

    def targets(self, units: Sequence[int], peak: set[int]) -> list[int]:
        """PNodes worth moving `units` to."""
        a = self.loads.a
        if any(a[u] in peak for u in units):
            seen_empty: set[int] = set()
            out = []
            for p in range(self.k):
                if self.count[p] == 0:
                    if self.cls[p] in seen_empty:
                        continue
                    seen_empty.add(self.cls[p])
                out.append(p)
            return out
        return sorted({a[v] for u in units for v, _ in self.loads.adj[u]})

    def attempt(self, moves: list[tuple[int, int]]) -> bool:
        """Apply `moves` if they fit and lower the key."""
        loads = self.loads
        state = loads.moved(moves)
        if state is None:
            return False
        key = loads.key(state[0], state[1], state[3])
        if not _key_better(key, self.current):
            return False
        for u, dst in moves:
            self.count[loads.a[u]] -= 1
            self.count[dst] += 1
        loads.apply(moves, state)
        self.current = key
        return True

    def unit_moves(self) -> bool:
        improved = False
        for u in range(self.n):
            for dst in self.targets([u], self.top()):
                if dst != self.loads.a[u] and self.attempt([(u, dst)]):
                    improved = True
        return improved

    def run_moves(self) -> bool:
        """A run of the chain (a branch, half a block) to another PNode."""
        improved = False
        for length in range(2, RUN_LENGTH + 1):
            for first in range(0, self.n - length + 1):
                units = range(first, first + length)
                for dst in self.targets(units, self.top()):
                    moves = [(u, dst) for u in units if self.loads.a[u] != dst]
                    if moves and self.attempt(moves):
                        improved = True
        return improved

    def swaps(self) -> bool:
        improved = False
        a = self.loads.a
        for u in range(self.n):
            if a[u] not in self.top():
                continue
            for v in range(self.n):
                au, av = a[u], a[v]
                if au != av and self.attempt([(u, av), (v, au)]):
                    improved = True
                    break
        return improved


def _key_better(a: tuple[float, int, float], b: tuple[float, int, float]) -> bool:
    if a[0] < b[0] * (1 - 1e-9):
        return True
    if a[0] > b[0] * (1 + 1e-9):
        return False
    if a[1] != b[1]:
        return a[1] < b[1]
    return a[2] < b[2] * (1 - 1e-9) - 1e-9


def solve(problem: Problem, *, local_search: bool | None = None) -> tuple[np.ndarray, str]:
    """The heuristic: best stage split over PNode orders (and chain rotations), then local search.

    Returns (assignment, method)."""
    found, method = _stage_splits(problem)
    if not found:
        assign = _first_fit(problem)
        if assign is None:
            raise infeasible(problem)
        found = [(evaluate(problem, assign).key(), assign, list(range(problem.k)))]
        method = "first-fit"
    if local_search if local_search is not None else problem.n <= LOCAL_SEARCH_UNITS:
        return _refine(problem, found, method)
    return found[0][1], method


Candidate = tuple[tuple, np.ndarray, list[int]]  # (evaluation key, assignment, PNode order), best first


def _stage_splits(problem: Problem) -> tuple[list[Candidate], str]:
    """Contiguous stage splits of the unit chain over candidate PNode orders, best first: the fleet's order, by
    speed, every order of a few PNodes, and re-matched orders of the best plans (`bottleneck_order`)."""
    n, k = problem.n, problem.k
    exact = n <= EXACT_UNITS
    F = problem.speeds()[0]
    kind = {}
    signature = [kind.setdefault((p.flops, p.bandwidth, p.memory), len(kind)) for p in problem.pnodes]
    orders = [list(range(k)), sorted(range(k), key=lambda p: (-F[p], p))]
    if k <= 4 and n <= ROTATE_ALL:  # few PNodes: every order (at most 24) is cheap to try
        orders += [list(o) for o in itertools.permutations(range(k))]
    seg = _Segments(problem, range(n) if n <= ROTATE_ALL else [0]) if exact else None
    chain = None if exact else _Chain(problem)
    found: list[Candidate] = []
    tried: set[tuple[int, ...]] = set()
    limit = max(8, len(orders))  # candidate orders, plus a few re-matched ones
    while orders and len(tried) < limit:
        order = orders.pop(0)
        sig = tuple(signature[p] for p in order)
        if sig in tried:
            continue
        tried.add(sig)
        if exact:
            split = _split_exact(seg, problem, order)
            assign = None if split is None else _assignment(problem, order, split[1], split[0])
        else:
            ends = _split_greedy(chain, problem, order)
            assign = None if ends is None else _assignment(problem, order, ends)
        if assign is None:
            continue
        key = evaluate(problem, assign).key()
        if not found or better(key, found[0][0]):
            orders.append(bottleneck_order(problem, assign, order))
        found.append((key, assign, order))
        found.sort(key=lambda f: f[0])
    if exact and n > ROTATE_ALL and found:
        _add_rotations(problem, found)
    return found, "dp" if exact else "bisect-greedy"


def _add_rotations(problem: Problem, found: list[Candidate]) -> None:
    """A few rotations of the chain, at the best plan's stage starts (the exact split tries them all only for
    short chains)."""
    n = problem.n
    best_assign, best_order = found[0][1], found[0][2]
    starts = [u for u in range(1, n) if best_assign[u] != best_assign[u - 1]]
    more = sorted(set(starts + [n // 4, n // 2, 3 * n // 4]) - {0})[:8]
    split = _split_exact(_Segments(problem, more), problem, best_order) if more else None
    if split is not None:
        assign = _assignment(problem, best_order, split[1], split[0])
        found.append((evaluate(problem, assign).key(), assign, best_order))
        found.sort(key=lambda f: f[0])


def _refine(problem: Problem, found: list[Candidate], method: str) -> tuple[np.ndarray, str]:
    """Local search from the best distinct candidates (three when units are single VNodes), then, on small
    VNode-level instances, iterated local search; the method names what improved the plan."""
    n = problem.n
    best_key, best = found[0][0], found[0][1]
    starts, seen = [], set()
    for _, assign, _ in found:
        if assign.tobytes() not in seen:
            seen.add(assign.tobytes())
            starts.append(assign)
    fine = any(u.kind in ("vnode", "kv_group") for u in problem.units)
    for start in starts[:3] if fine else starts[:1]:
        improved = _local_search(problem, start, swaps=n <= SWAP_UNITS)
        key = evaluate(problem, improved).key()
        if better(key, best_key):
            best_key, best = key, improved
            method = method.split("+")[0] + "+local"
    if n <= KICK_UNITS and problem.k > 1 and fine:
        kicked = _iterated_local_search(problem, best)
        key = evaluate(problem, kicked).key()
        if better(key, best_key):
            best_key, best = key, kicked
            method = method.split("+")[0] + "+kicks"
    return best, method


def _iterated_local_search(problem: Problem, start: np.ndarray, kicks: int = 60) -> np.ndarray:
    """Perturb a few units at random and descend again, keeping the best (seeded: deterministic).

    Small instances with VNode-level units only: it is what finds the non-contiguous
    placements (a block's heads on one PNode, its residual path on another) that no stage
    split of the chain can express; whole groups are placed well by the splits.
    """
    rng = np.random.default_rng(0)
    current, current_key = start, evaluate(problem, start).key()
    best, best_key = current, current_key
    for _ in range(kicks):
        trial = current.copy()
        if rng.random() < 0.5:  # a run of the chain to one PNode (a branch, a half block) ...
            first = int(rng.integers(0, problem.n))
            trial[first:first + int(rng.integers(2, 7))] = int(rng.integers(0, problem.k))
        else:  # ... or a few units anywhere
            units = rng.choice(problem.n, size=min(problem.n, int(rng.integers(2, 5))), replace=False)
            trial[units] = rng.integers(0, problem.k, size=len(units))
        if not evaluate(problem, trial).feasible:
            continue
        trial = _local_search(problem, trial, swaps=False)
        key = evaluate(problem, trial).key()
        if not better(current_key, key):  # accept equal or better: lets the search drift on plateaus
            current, current_key = trial, key
            if better(key, best_key):
                best, best_key = trial, key
    return _local_search(problem, best, swaps=problem.n <= SWAP_UNITS)


def _first_fit(problem: Problem) -> np.ndarray | None:
    """Any assignment that fits memory: biggest units first, each on the emptiest PNode it fits."""
    M = problem.speeds()[2]
    free = M.copy()
    assign = np.full(problem.n, -1, dtype=np.int64)
    replica = Counter()
    for pub, user, r in problem.ties:
        replica[user] += r  # conservative: as if every tie were split
    for u in np.argsort(-problem.memory, kind="stable"):
        need = problem.memory[u] + replica[int(u)]
        fits = np.flatnonzero(free >= need)
        if not len(fits):
            return None
        p = fits[np.argmax(free[fits])]
        assign[u] = p
        free[p] -= need
    return assign

