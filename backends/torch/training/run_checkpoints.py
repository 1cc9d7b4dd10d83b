"""A training run's checkpoints: saving one (and pruning old ones), resuming from one, cleaning a killed write.

A checkpoint (checkpoint.py) holds the weights in the UNFUSED layout, the
optimizer state per parameter (moments split like the weights), the step,
the RNG and data-generator state, the loss scaler, and the network YAML and
tokenizer again, so one checkpoint directory is self-contained (`vgraph
generate` needs nothing else) and a run resumes from it with any fusion, or
under `vgraph launch` on any partition.  Resuming restores every one of
these, so a run killed at any moment ends bitwise equal to an uninterrupted
run (CPU, `--deterministic`).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from vgraph.ir.graph import Graph
from vgraph.run import files

from . import checkpoint as ckpt
from ..lowering.wire_formats import boundary_state, compress_modules, load_boundary_state
from ..lowering.lower import VGraphModule, param_sources
from .optimizers import NodeOptimizers
from .run_network import check_finite, check_resumed_network
from .config import TrainingError

__all__ = ["CHECKPOINT_PREFIX", "run_checkpoints", "prune_checkpoints", "clean_stale",
           "optimizer_state_to_unfused", "optimizer_state_to_graph", "TrainingState", "save_run_checkpoint",
           "resume_run"]

CHECKPOINT_PREFIX = files.CHECKPOINT_PREFIX

def run_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint directories, oldest first."""
    return sorted(p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())

def prune_checkpoints(run_dir: Path, keep: int, newest: Path) -> None:
    """Delete all but the newest `keep` (at least 1) checkpoints, never `newest` (the one just written)."""
    for old in run_checkpoints(run_dir)[:-max(1, keep)]:
        if old.name != newest.name:
            shutil.rmtree(old, ignore_errors=True)


def clean_stale(run_dir: Path) -> None:
    """Remove temporaries a killed checkpoint write left behind (never a complete checkpoint)."""
    for p in run_dir.glob(f".{CHECKPOINT_PREFIX}*"):
        if ".tmp-" in p.name or ".old-" in p.name:
            shutil.rmtree(p, ignore_errors=True)

def optimizer_state_to_unfused(states: Mapping[str, Mapping[str, Any]], graph: Graph) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state -> unfused keys: moments split like the weights, scalars copied."""
    sources = param_sources(graph)
    out: dict[str, dict[str, Any]] = {}
    for key, state in states.items():
        pieces = sources[key]
        rows = [r for _, r in pieces]
        for unfused_key, _ in pieces:
            out[unfused_key] = {}
        for name, value in state.items():
            if len(pieces) > 1 and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape[0] == sum(rows):
                for (unfused_key, _), part in zip(pieces, torch.split(value, rows, dim=0)):
                    out[unfused_key][name] = part
            else:
                for unfused_key, _ in pieces:
                    out[unfused_key][name] = value
    return out

def optimizer_state_to_graph(states: Mapping[str, Mapping[str, Any]], graph: Graph) -> dict[str, dict[str, Any]]:
    """Unfused per-parameter optimizer state -> `graph`'s keys (moments concatenated)."""
    out: dict[str, dict[str, Any]] = {}
    for key, pieces in param_sources(graph).items():
        parts = [states.get(unfused_key) for unfused_key, _ in pieces]
        if any(p is None for p in parts):
            continue  # never stepped: the optimizer initialises its state on the first step
        merged: dict[str, Any] = {}
        for name, first in parts[0].items():
            if len(parts) > 1 and isinstance(first, torch.Tensor) and first.dim() > 0:
                merged[name] = torch.cat([p[name] for p in parts], dim=0)
            else:
                merged[name] = first
        out[key] = merged
    return out

@dataclass
class TrainingState:
    """What a checkpoint saves and a resume restores, besides the global RNGs."""

    module: VGraphModule
    optimizers: NodeOptimizers
    scaler: torch.amp.GradScaler

def save_run_checkpoint(run_dir: Path, step: int, state: TrainingState, run_info: dict, yaml_text: str,
                        tokenizer_json: str, keep: int) -> Path:
    """Checkpoint `step` (atomically, then `latest` moves to it); keep the newest `keep` checkpoints."""
    module, graph = state.module, state.module.network
    model_state = module.unfused_state_dict()
    opt_state = optimizer_state_to_unfused(state.optimizers.state_by_key(), graph)
    extra = {
        "layout": "unfused",
        "grad_scaler": state.scaler.state_dict() if state.scaler.is_enabled() else None,
        "run": json.loads(json.dumps(run_info, default=str)),
        "network_yaml": yaml_text,
        "tokenizer_json": tokenizer_json,
        "compression": {"boundary": boundary_state(compress_modules(module))},  # error feedback: compression.py
    }
    path = ckpt.save_checkpoint(run_dir / f"{CHECKPOINT_PREFIX}{step:08d}", step=step,
                                model_state=model_state, optimizer_states=opt_state,
                                rng_state=ckpt.capture_rng_state(), extra=extra)
    prune_checkpoints(run_dir, keep, path)
    return path


def changed_identity(run_dir: Path, before: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """Why resuming `run_dir` (its checkpoint's run info `before`) as the run `now` describes would make another
    run, or None.  The data is compared by content (`data_content`: the tokens and tokenizer,
    PreparedCorpus.content_digest) when both record it, so a corpus prepared again under another tokenizers
    version still resumes; a checkpoint written before the field existed is compared by its manifest's digest."""
    data = "data_content" if "data_content" in before and "data_content" in now else "data_digest"
    for key in ("seed", "batch", "seq_len", "data", data, "vocab_size", "tokenizer"):
        if key in before and before[key] != now[key]:
            return (f"cannot resume {run_dir}: it was trained with {key}={before[key]!r}, this run has "
                    f"{key}={now[key]!r}; resuming must not change it")
    return None


def resume_run(latest: Path, state: TrainingState, run_info: dict, say: Callable[[str], None], *,
               yaml_text: str | None = None, network: str = "the given network",
               accept_network_change: bool = False) -> int:
    """Restore `state` and the global RNGs from checkpoint `latest`; the step it was taken after.

    Refused when the run's data-defining settings (`run_info`) differ from the
    checkpoint's, when the network (`yaml_text`, the run's definition now)
    is not the one the checkpoint was trained on (unless
    `accept_network_change`: then the change is added to
    run_info["network_changes"]), or when its weights are not finite; a
    changed learning rate or schedule is only noted.
    """
    try:
        saved = ckpt.load_checkpoint(latest, map_location="cpu")
    except ckpt.CheckpointError as exc:
        raise TrainingError(f"cannot resume: {exc}") from None
    before = saved.extra.get("run", {})
    check_finite(saved.model_state, latest)
    if yaml_text is not None:
        change = check_resumed_network(saved.extra.get("network_yaml"), before, yaml_text, checkpoint=latest,
                                       network=network, accept_change=accept_network_change, say=say)
        run_info["network_changes"] = list(before.get("network_changes") or [])
        if change is not None:
            run_info["network_changes"].append({**change, "at_step": saved.step})
    refused = changed_identity(latest.parent, before, run_info)
    if refused is not None:
        raise TrainingError(refused)
    if saved.extra.get("tokenizer_json"):  # the checkpoint's own tokenizer must fit its network too
        ckpt.checked_tokenizer(saved.extra["tokenizer_json"], int(run_info["vocab_size"]), str(latest))
    for key in ("lr", "warmup", "schedule"):
        if key in before and before[key] != run_info[key]:
            say(f"note: resuming with {key}={run_info[key]!r} (the run had {before[key]!r})")
    module = state.module
    device = next(module.parameters()).device
    module.load_unfused_state_dict({k: v.to(device) for k, v in saved.model_state.items()})
    state.optimizers.load_state_by_key(optimizer_state_to_graph(saved.optimizer_states, module.network))
    if saved.extra.get("grad_scaler") and state.scaler.is_enabled():
        state.scaler.load_state_dict(saved.extra["grad_scaler"])
    load_boundary_state(compress_modules(module), (saved.extra.get("compression") or {}).get("boundary"), device)
    ckpt.restore_rng_state(saved.rng_state)
    say(f"resumed from {latest} at step {saved.step}")
    return saved.step
