"""The graph a training run compiled, rebuilt from what its run directory stores.

Why in the core: `vgraph train` and `vgraph launch` (backends) build that
graph before their first step, and `vgraph report` (core, no torch) draws it
afterwards from the run's files; both must run the same passes in the same
order, so the rules live here once:

* `training_spec`: the pipeline a run's `--passes` / `--no-fuse` mean;
* `preserving_spec`: a pipeline without the passes that change what the
  network computes (a run whose pass changed the function stores the changed
  network, on which only the others run again);
* `apply_assignment`: a partitioned run's graph: the passes up to the
  partition, its VNode -> PNode assignment (and the choices of the partition
  that passes after it read: `PLAN_CHOICES`), the passes after it (fusions
  after the partition respect the placement);
* `network_changes`: the changes that make a partitioned run's network
  another than its definition: every pass that changed what it computes but
  those that declare `keeps_weights` (compress-boundary, whose `compress`
  VNodes hold no weights and only round what crosses a cut;
  `weight_keeping_changes` lists those), so the run's checkpoints are
  checkpoints of the network as given.
* `plugin_distributions`: the installed plugin distributions that graph used
  (run.json's "plugin_distributions", `vgraph.plugins.missing_plugins`).
"""
from __future__ import annotations

from typing import Any, Mapping

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.ir.graph import Graph
from vgraph.plugins import distributions_used
from vgraph.transform.pipeline import (APPLIED, SEMANTIC_CHANGES, Pipeline, available_passes, build_pipeline,
                                       options_naming_files, run_pipeline)

__all__ = ["NO_FUSE_PIPELINE", "training_spec", "preserving_spec", "definition_spec", "apply_assignment",
           "refuse_files_named", "PLAN_CHOICES", "network_changes", "weight_keeping_changes", "plugin_distributions"]

NO_FUSE_PIPELINE = Pipeline.of("dead-nodes", "precision")  # what --no-fuse runs
PLAN_CHOICES = ("compress",)  # graph.meta["placement"] keys a partition decides and passes after it read


def training_spec(passes: str | Pipeline | None, fuse: bool) -> Pipeline | None:
    """The pipeline a run prepares its graph with: `passes` as given (text is read here; empty runs nothing),
    else the production pipeline (None), or the production pipeline without fusions under `--no-fuse`."""
    if passes is not None:
        return Pipeline.parse(passes) if isinstance(passes, str) else passes
    return None if fuse else NO_FUSE_PIPELINE


def preserving_spec(spec: str | Pipeline | None) -> Pipeline | None:
    """`spec` without the passes that change what a network computes (they already ran on a definition)."""
    if spec is None:
        return None
    return Pipeline.of_passes(p for p in build_pipeline(spec) if p.preserves_semantics)


def definition_spec(run: Mapping[str, Any]) -> Pipeline | None:
    """The `--passes` that rebuild a run's trained graph from its stored definition (run.json's fields)."""
    passes = run.get("passes")
    return preserving_spec(passes) if run.get("semantic_changes") else training_spec(passes, True)


def apply_assignment(source: Graph, before: str | Pipeline, assignment: Mapping[str, str], after: str | Pipeline,
                     target: str,
                     choices: Mapping[str, Any] | None = None) -> Graph:
    """The placed, optimised graph: passes up to the partition, its assignment (and `choices`, the
    partition's `PLAN_CHOICES`, e.g. what compress=auto chose), passes after it.

    The launcher, every worker and the report build the graph this way, so they
    agree on it without shipping it.
    """
    graph = source.copy()
    if before:
        run_pipeline(graph, before, target=target)
    for node in graph.nodes:
        if node.id in assignment:
            node.meta["pnode"] = assignment[node.id]
    if choices:
        graph.meta.setdefault("placement", {}).update({k: v for k, v in choices.items() if k in PLAN_CHOICES})
    if after:
        run_pipeline(graph, after, target=target)
    return graph


def refuse_files_named(spec: str | Pipeline | None, where: str) -> None:
    """A VGraphError when the pipeline `spec`, read from the run file `where`, sets an option that names a
    file (`partition{fleet=...}`): a reader of a run never opens a path the run's files name (the run may
    be someone else's, and what the pass would say about that file, e.g. a parse error quoting it, would
    end up in a page meant for sharing)."""
    if not spec:
        return
    named = options_naming_files(spec)
    if named:
        raise VGraphError(f"{where}'s passes name a file ({quote(named[0], 120)}); a reader of a run opens no "
                          f"path the run's files name")


def network_changes(graph: Graph) -> list[str]:
    """Specs of the passes that made `graph` compute another function than its definition and changed its
    weights too (see the module docstring)."""
    return [c["spec"] for c in graph.meta.get(SEMANTIC_CHANGES, ()) if not c.get("keeps_weights")]


def weight_keeping_changes(graph: Graph) -> list[str]:
    """Specs of the passes that changed what `graph` computes but none of its weights (compress-boundary)."""
    return [c["spec"] for c in graph.meta.get(SEMANTIC_CHANGES, ()) if c.get("keeps_weights")]


def plugin_distributions(source: Graph, graph: Graph) -> list[dict[str, str]]:
    """The installed plugin distributions (name, version) whose op types the run's network has, before or
    after its passes, or whose passes it ran: run.json records them so that a command lacking one says
    which package to install (`vgraph.plugins.missing_plugins`)."""
    installed = available_passes()
    ran = list(graph.meta.get(APPLIED) or []) + [c["pass"] for c in graph.meta.get(SEMANTIC_CHANGES) or []]
    return distributions_used({n.type for n in source.nodes} | {n.type for n in graph.nodes},
                              [installed[name].origin for name in ran if name in installed])
