"""The baseline the replica planner is compared with: an evolutionary search over allocations.

In the manner of Yuan et al., "Decentralized Training of Foundation Models in
Heterogeneous Environments" (NeurIPS 2022): the parallel layout (S pipeline
stages x R data-parallel replicas) is fixed, and a genetic algorithm searches
which device takes which of the R x S slots, judged by a cost model; here the
same cost model the planner uses (`vgraph.cost.stepcost`, batch shares included),
so only the search differs.

A genome is a permutation of the fleet's PNodes; its first R x S entries,
row by row, are the slots.  Tournament selection, order crossover (OX1, which
keeps a permutation a permutation), swap mutation (a slot with another slot
or with an idle PNode), elitism.  Seeded: a run is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vgraph.cost.stepcost import FleetArrays, StageLoads
from vgraph.passes.partition_replicas import price_layout

__all__ = ["EvolutionResult", "evolve"]


@dataclass
class EvolutionResult:
    step_seconds: float
    idx: np.ndarray  # [R, S] fleet indices of the best allocation
    evaluations: int


def evolve(loads: StageLoads, fa: FleetArrays, R: int, batch: int, micro: int, *, population: int = 40,
           generations: int = 60, mutation: float = 0.4, elite: int = 2, seed: int = 0) -> EvolutionResult:
    """The best allocation of R replicas of the `loads` pipeline the search finds (inf when none fits)."""
    rng = np.random.default_rng(seed)
    K, S = len(fa.pnodes), loads.stages
    slots = R * S
    if slots > K:
        raise ValueError(f"{R} x {S} slots need {slots} PNodes; the fleet has {K}")
    evaluations = 0

    def fitness(genome: np.ndarray) -> float:
        nonlocal evaluations
        evaluations += 1
        priced = price_layout(loads, fa, genome[:slots].reshape(R, S), batch, micro)
        return priced[1].step_seconds if priced is not None else np.inf

    pop = [rng.permutation(K) for _ in range(population)]
    score = np.array([fitness(g) for g in pop])
    for _ in range(generations):
        order = np.argsort(score)
        children = [pop[i].copy() for i in order[:elite]]
        child_scores = [score[i] for i in order[:elite]]
        while len(children) < population:
            a, b = (_tournament(score, rng) for _ in range(2))
            child = _order_crossover(pop[a], pop[b], rng)
            if rng.random() < mutation:
                i = int(rng.integers(slots))
                j = int(rng.integers(K))
                child[i], child[j] = child[j], child[i]
            children.append(child)
            child_scores.append(fitness(child))
        pop, score = children, np.array(child_scores)
    best = int(np.argmin(score))
    return EvolutionResult(float(score[best]), pop[best][:slots].reshape(R, S), evaluations)


def _tournament(score: np.ndarray, rng: np.random.Generator, size: int = 3) -> int:
    pick = rng.choice(len(score), size=min(size, len(score)), replace=False)
    return int(pick[np.argmin(score[pick])])


def _order_crossover(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """OX1: a slice of parent a, the rest in parent b's order."""
    n = len(a)
    i, j = sorted(rng.choice(n + 1, size=2, replace=False))
    child = np.full(n, -1)
    child[i:j] = a[i:j]
    taken = np.zeros(n, dtype=bool)
    taken[a[i:j]] = True
    rest = b[~taken[b]]
    child[:i] = rest[:i]
    child[j:] = rest[i:]
    return child
