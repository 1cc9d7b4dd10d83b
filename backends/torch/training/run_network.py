"""The network a run stores, and the checks that keep a checkpoint describing the function it was trained as.

A run's *definition* is what its network.yml and every checkpoint carry: the
YAML as given when every pass of the pipeline kept what it computes, else the
graph the run actually trained (after the pass that changed it, e.g. an
architecture swap), written as YAML.  Weights are stored in the unfused
layout of that definition (`fused_from` maps fused parameters back), so the
definition alone, with the run's semantics-preserving passes, rebuilds the
trained model (`definition_graph`).

On resume, the network given now is compared with the checkpoint's
(vgraph.run.network_match): a different network is refused, naming the first
node or key that differs, unless the user says it is intended
(`--accept-network-change`), in which case the change is recorded in
run.json and network.yml follows.  A checkpoint holding non-finite weights is
never loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import Graph
from vgraph.plugins import naming_missing_plugins
# shared with `vgraph report`
from vgraph.run.compiled_graph import definition_spec as passes_for_definition, preserving_spec
from vgraph.run.network_match import NetworkMismatch, difference, require_match
from vgraph.yamlio import dumps, loads

from .config import TrainingError

__all__ = ["trained_network_yaml", "definition_graph", "preserving_spec", "check_resumed_network",
           "check_finite", "NetworkMismatch", "require_match"]


def trained_network_yaml(graph: Graph) -> str:
    """The YAML of a graph a run trained (after passes): its definition when a pass changed the function."""
    return dumps(graph)


def definition_graph(yaml_text: str, where: str, run: Mapping[str, Any] | None = None) -> Graph:
    """A stored network, loaded; if it fails (an op type nobody registered), say which plugin distributions
    and files the run had (`vgraph.plugins.missing_plugins`)."""
    return naming_missing_plugins(run, lambda: loads(yaml_text, file=where))


def check_resumed_network(saved_yaml: str | None, saved_run: Mapping[str, Any], yaml_text: str, *,
                          checkpoint: Path, network: str, accept_change: bool,
                          say: Callable[[str], None]) -> dict[str, Any] | None:
    """Compare the network given now with the checkpoint's; the change record when accepted, else None.

    Refuses (NetworkMismatch) a different network unless `accept_change`.
    """
    if not saved_yaml or saved_yaml == yaml_text:
        return None
    trained = definition_graph(saved_yaml, f"{checkpoint}/network.yml", saved_run)
    given = definition_graph(yaml_text, str(network))
    why = difference(trained, given)
    if why is None:
        return None
    if not accept_change:
        changes = saved_run.get("semantic_changes") or ()
        hint = (f" (it was trained after {', '.join(map(repr, changes))} changed the network)" if changes else "")
        raise NetworkMismatch(f"cannot resume {checkpoint.parent}: checkpoint {checkpoint.name} was trained on "
                              f"another network than {network}{hint}: {why}; pass --accept-network-change to "
                              f"continue it on this network anyway (the change is recorded in run.json)")
    say(f"note: resuming on a changed network ({why}); recorded in run.json, network.yml updated")
    return {"at_step": None, "difference": why, "from": saved_run.get("network_fingerprint"), "network": str(network)}


def check_finite(model_state: Mapping[str, torch.Tensor], checkpoint: Path) -> None:
    """Refuse a checkpoint whose weights are not all finite (resuming from it can only diverge again)."""
    bad = [key for key, value in model_state.items()
           if value.is_floating_point() and not bool(torch.isfinite(value).all())]
    if bad:
        raise TrainingError(f"checkpoint {checkpoint} holds non-finite weights ({', '.join(bad[:3])}"
                            f"{' ...' if len(bad) > 3 else ''}): it cannot be resumed or used; resume from an "
                            f"earlier checkpoint (remove this one) or restart")


def finite_checkpoint(path: Path | None, load: Callable[[Path], Mapping[str, torch.Tensor]]) -> bool:
    """Whether checkpoint `path` exists and holds only finite weights (what a message may recommend)."""
    if path is None:
        return False
    try:
        check_finite(load(path), path)
    except Exception:  # noqa: BLE001 - unreadable or non-finite: not something to recommend
        return False
    return True
