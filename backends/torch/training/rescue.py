"""Rescue shards: what each surviving worker holds when a peer is lost, and the checkpoint they add up to.

Why: a lost worker used to cost the steps since the last periodic checkpoint (every rank restarted from it),
although the survivors still hold, in memory, the parameters and optimizer state of the last step they
completed, and with data-parallel replicas another replica holds every VNode the lost one held.  So every
surviving rank writes its own VNodes' state at its last completed step (a *shard*); when the shards cover
every VNode at one step, they make a checkpoint at that step and the next attempt resumes from it: no step
is redone.  When they do not, the run resumes from its last checkpoint and says how many steps were redone.

A shard is a checkpoint directory in checkpoint.py's format (safetensors and tagged JSON, written into a
temporary and renamed into place, so a shard is complete or absent; `latest` is never touched), named
`a<attempt>-r<rank>` under `RUN/launch/rescue/`: the rank's parameters and optimizer state in the unfused
global layout (the keys a checkpoint has, replicas of tied weights left out), its loss scaler and
error-feedback residuals, and in `extra["rescue"]` the run's identity (`run_identity`), the attempt, the world
rank, its PNode and the step.  Machines other than machine 0 send theirs to machine 0 over the launchers'
sealed channel (launcher/shard_transfer.py); machine 0 assembles (`assemble`).

**One consistent step.**  Per step, a rank runs its forward and backward (the replicas' gradient all-reduce
included), then the control all-reduce every rank decides by, then its optimizer step.  A rank lost between
the control all-reduce and the optimizer step leaves survivors on both sides: those whose all-reduce
completed stepped to s + 1 (their state is right: the all-reduce had every rank's contribution), those still
waiting in it hold step s.  Mixing them would put VNodes of two different steps into one checkpoint, so a
rescue takes ONE step s for every VNode: the latest step at which the shards at exactly that step hold every
parameter key the network has; shards of other steps are not used, and two shards holding the same key at s
must agree exactly (replicas are identical at a step) or that step is not used.  A step no later than the
run's latest checkpoint gains nothing and is not used either.

Who reads this: launcher/failures.py (machine 0's decision after a failed attempt) and launcher/succession.py (the
survivor that takes machine 0's role reads the same shards), both through `rescue_saved`.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from vgraph.base.diagnostics import printable
from vgraph.run.files import CHECKPOINT_PREFIX

from . import checkpoint as ckpt  # torch-free until tensors are read or written (its imports say why)

__all__ = ["RESCUE_DIR", "SHARD_FILES", "SHARD_NAME", "Shard", "Rescue", "run_identity", "shard_name",
           "write_shard", "read_shards", "assemble", "rescue_saved", "save_rescued", "clear_rescue"]

RESCUE_DIR = "rescue"  # under RUN/launch/
SHARD_NAME = re.compile(r"a(\d{1,9})-r(\d{1,9})")  # a<attempt>-r<world rank>
SHARD_FILES = (ckpt.MODEL_FILE, ckpt.OPTIMIZER_TENSORS_FILE, ckpt.OPTIMIZER_JSON_FILE, ckpt.STATE_TENSORS_FILE,
               ckpt.STATE_JSON_FILE)  # what a shard directory holds, state.json last (its mark of completeness)
_IDENTITY_KEYS = ("network", "seed", "batch", "seq_len", "data_digest", "vocab_size", "steps", "lr", "tokenizer")


def run_identity(network_yaml: str, run_info: Mapping[str, Any]) -> str:
    """The run a shard belongs to: a digest of the network and the settings every attempt of the run shares
    (a shard of another network, data, seed or batch, left in the folder or sent by a machine of another
    run, is refused by it)."""
    settings = {k: run_info.get(k) for k in _IDENTITY_KEYS}
    text = json.dumps([network_yaml, settings], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def shard_name(attempt: int, rank: int) -> str:
    return f"a{attempt}-r{rank}"


def write_shard(folder: Path, *, run: str, attempt: int, rank: int, pnode: str, step: int,
                model: Mapping[str, torch.Tensor], optim: Mapping[str, Any], extra: Mapping[str, Any]) -> Path:
    """Write this rank's shard (atomically: checkpoint.save_checkpoint's temporary and rename) into `folder`."""
    info = {"run": run, "attempt": int(attempt), "rank": int(rank), "pnode": str(pnode), "step": int(step)}
    return ckpt.save_checkpoint(folder / shard_name(attempt, rank), step=int(step), model_state=dict(model),
                                optimizer_states=dict(optim), rng_state=ckpt.capture_rng_state(),
                                extra={**extra, "rescue": info}, update_latest=False)


@dataclass
class Shard:
    name: str
    rank: int
    pnode: str
    step: int
    state: ckpt.Checkpoint

    @property
    def keys(self) -> set[str]:
        return set(self.state.model_state)


def read_shards(folder: Path, *, run: str, attempt: int) -> tuple[list[Shard], list[str]]:
    """The complete shards of `attempt` in `folder`, and why each other one there was refused (damaged,
    truncated, another run's, another attempt's, a name that does not say what it holds)."""
    shards: list[Shard] = []
    refused: list[str] = []
    if not folder.is_dir():
        return shards, refused
    for path in sorted(folder.iterdir()):
        match = SHARD_NAME.fullmatch(path.name)
        if path.name.startswith("."):
            continue  # a shard being written or received: not complete
        if match is None or not path.is_dir() or path.is_symlink():
            refused.append(f"{printable(path.name, 80)}: not a rescue shard")
            continue
        if int(match.group(1)) != attempt:
            continue  # an earlier attempt's: cleared when that attempt's rescue was decided
        try:
            state = ckpt.load_checkpoint(path, map_location="cpu")
        except ckpt.CheckpointError as exc:
            refused.append(f"{path.name}: cannot be read ({printable(str(exc), 200)})")
            continue
        info = state.extra.get("rescue")
        why = _bad_info(info, run, attempt, int(match.group(2)), state.step)
        if why:
            refused.append(f"{path.name}: {why}")
            continue
        shards.append(Shard(path.name, info["rank"], info["pnode"], state.step, state))
    return shards, refused


def _bad_info(info: Any, run: str, attempt: int, rank: int, step: int) -> str:
    if not isinstance(info, dict):
        return "no rescue record (not a shard a worker wrote)"
    if info.get("run") != run:
        return "it belongs to another run (its network or settings differ)"
    if info.get("attempt") != attempt or info.get("rank") != rank:
        return f"its record says attempt {info.get('attempt')!r}, rank {info.get('rank')!r}, not its name's"
    if info.get("step") != step or not isinstance(info.get("pnode"), str):
        return "its record does not match its state"
    return ""


@dataclass
class Rescue:
    """What the shards of a failed attempt offer: `step` is the consistent step they cover (None: none);
    `reached` the latest step any shard (or the log) saw, from which the steps redone are counted."""

    step: int | None
    reached: int
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # grad_scaler, compression (from the shards at `step`)
    rng: dict[str, Any] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)  # the shards used
    why: str = ""  # why no step was taken
    refused: list[str] = field(default_factory=list)
    saved: Path | None = None  # its checkpoint in the run directory (`rescue_saved`)
    unsaved: str = ""  # why that checkpoint could not be written (a full disk), when it could not


def assemble(shards: list[Shard], *, keys: set[str], floor: int, ceiling: int, logged: int | None = None,
             reached: int = 0, refused: list[str] | None = None, per_rank_state: str = "") -> Rescue:
    """The latest step at which `shards` hold every key of `keys` (the network's parameter keys) and agree,
    later than `floor` (the latest checkpoint), no later than `ceiling` (the run's --steps) and, given
    `logged` (the run's last logged step), no later than it: a step without its row (rank 0 had not finished
    it) would be missing from the log after the resume.  See the module docstring.  A shard naming a key
    the network lacks, or a step past `ceiling`, is refused.  `per_rank_state`: why the run holds state only
    its own rank has (error-feedback buffers: a lost rank's are gone, and a rescue would not be the same
    training); then no step is taken."""
    refused = list(refused or [])
    usable: list[Shard] = []
    for shard in shards:
        foreign = sorted(shard.keys - keys)
        if foreign:
            refused.append(f"{shard.name}: holds {printable(foreign[0], 80)}, which the network does not have")
        elif shard.step > ceiling:
            refused.append(f"{shard.name}: says step {shard.step}, past the run's last step {ceiling}")
        else:
            usable.append(shard)
    reached = max([reached, *(s.step for s in usable)])
    if per_rank_state:
        return Rescue(None, reached, why=per_rank_state, refused=refused)
    reasons: list[str] = []  # why each later step was not taken, latest first
    for candidate in sorted({s.step for s in usable}, reverse=True):
        at = sorted((s for s in usable if s.step == candidate), key=lambda s: s.rank)
        missing = keys - set().union(*(s.keys for s in at))
        if logged is not None and candidate > logged:
            reasons.append(f"step {candidate} has no row in the log (rank 0 had not finished it)")
            continue
        if missing:
            reasons.append(f"at step {candidate} the survivors hold {len(keys) - len(missing)} of {len(keys)} "
                           f"parameters (none holds {printable(sorted(missing)[0], 80)}: no replica of it survived)")
            continue
        if candidate <= floor:
            reasons.append(f"the survivors' step {candidate} is no later than the last checkpoint's ({floor})")
            break
        disagree = _disagreement(at)
        if disagree:
            reasons.append(disagree)
            continue
        return _take(at, candidate, reached, keys, refused)
    return Rescue(None, reached, why="; ".join(reasons) or "no surviving worker left its state", refused=refused)


def _disagreement(at: list[Shard]) -> str:
    import torch

    seen: dict[str, tuple[str, torch.Tensor]] = {}
    for shard in at:
        for key, value in shard.state.model_state.items():
            if key in seen and not torch.equal(seen[key][1], value):
                return (f"at step {shard.step} shards {seen[key][0]} and {shard.name} hold different values of "
                        f"{printable(key, 80)} (replicas must be identical at a step)")
            seen.setdefault(key, (shard.name, value))
    return ""


def _take(at: list[Shard], step: int, reached: int, keys: set[str], refused: list[str]) -> Rescue:
    """The checkpoint content of the shards at `step`: each key from the lowest rank holding it."""
    from ..lowering.wire_formats import merge_residuals

    model: dict[str, torch.Tensor] = {}
    optim: dict[str, Any] = {}
    for shard in at:
        for key in keys:
            if key not in model and key in shard.state.model_state:
                model[key] = shard.state.model_state[key]
                if key in shard.state.optimizer_states:
                    optim[key] = shard.state.optimizer_states[key]
    first = at[0].state
    boundary = merge_residuals([(s.state.extra.get("compression") or {}).get("boundary") or {} for s in at])
    extra = {"grad_scaler": first.extra.get("grad_scaler"), "compression": {"boundary": boundary, "powersgd": {}}}
    return Rescue(step, reached, model, optim, extra, first.rng_state, [s.rank for s in at], refused=refused)


def rescue_saved(folder: Path, run_dir: Path, *, run: str, attempt: int, keys: set[str], floor: int, ceiling: int,
                 logged: int, extra: Mapping[str, Any], keep: int, per_rank_state: str = "",
                 say: Callable[[str], None] = lambda line: None) -> Rescue:
    """The shards of `attempt` in `folder` assembled (`assemble`; `logged`, the log's last step, is also the
    latest step reached) and, when they give a step, saved as a checkpoint in `run_dir` (`Rescue.saved`);
    every refused shard said.  One rescue for both who make one: machine 0 after a failed attempt
    (launcher/failures.py) and the machine that takes its role (launcher/succession.py).  A checkpoint that
    cannot be written (a full disk) leaves `saved` None and says why in `unsaved`: the run still has its
    last checkpoint."""
    shards, refused = read_shards(folder, run=run, attempt=attempt)
    found = assemble(shards, keys=keys, floor=floor, ceiling=ceiling, logged=logged, reached=logged,
                     refused=refused, per_rank_state=per_rank_state)
    for why in found.refused:
        say(f"launch: rescue shard refused: {why}")
    if found.step is not None:
        try:
            found.saved = save_rescued(run_dir, found, extra, keep)
        except OSError as exc:
            found.unsaved = str(exc.strerror or exc)
    return found


def save_rescued(run_dir: Path, rescue: Rescue, extra: Mapping[str, Any], keep: int) -> Path:
    """Rescue's checkpoint `step-<s>` in the run directory (as a worker set writes one: `latest` moved, old
    ones pruned); `extra` adds what every checkpoint carries (the run, the network, the tokenizer)."""
    from .run_checkpoints import prune_checkpoints  # the training loop's (torch, the lowering)

    assert rescue.step is not None
    path = ckpt.save_checkpoint(run_dir / f"{CHECKPOINT_PREFIX}{rescue.step:08d}", step=rescue.step,
                                model_state=rescue.model, optimizer_states=rescue.optim, rng_state=rescue.rng,
                                extra={**extra, **rescue.extra, "rescued_from": rescue.ranks})
    prune_checkpoints(run_dir, keep, path)
    return path


def clear_rescue(folder: Path) -> None:
    """Remove the shards once a rescue was decided (the next attempt writes its own)."""
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)
