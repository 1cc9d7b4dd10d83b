"""Crash-safe training checkpoints for the PyTorch backend.

Layout of one checkpoint directory (e.g. ``run/step-00001000/``)::

    model.safetensors      parameters, keys as given ("<vnode_id>.<param>")
    optimizer.safetensors  every tensor found in the optimizer states
    optimizer.json         the optimizer states' structure and scalars
    state.safetensors      tensors from the RNG state and ``extra``
    state.json             format, version, step, RNG state and ``extra``

and next to it, in the run directory, a ``latest`` file holding the name of
the newest complete checkpoint.

Why this shape:

* **safetensors** for tensors: no pickle, so loading a checkpoint cannot
  execute code, and files are memory-mappable.  Everything else is JSON with
  explicit type tags (tuples, integer dict keys, non-finite floats, numpy
  arrays), so an ``Adam.state_dict()`` or ``random.getstate()`` comes back
  with exactly the types it went in with.
* **Atomicity**: files are written and fsynced into a fresh temporary
  directory beside the target, which is then renamed into place; the
  ``latest`` pointer is replaced atomically only afterwards.  A crash at any
  moment leaves either the previous checkpoint or the new one, never a torn
  one, and ``latest`` always names a complete checkpoint.
* **Tied weights**: safetensors refuses tensors that share storage.  Exact
  aliases (the same tensor under several keys, e.g. a tied embedding / LM
  head) are stored *once*, under the alphabetically first key; the other keys
  are recorded in the file metadata and on load point at the very same
  tensor object, so the tie survives a round trip.  Tensors that merely
  overlap (different views of one storage) are saved as independent copies.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

# torch (and safetensors.torch) are imported by the functions that handle tensors: the launcher of `vgraph launch`
# finds checkpoints and their steps through this module (latest_checkpoint, checkpoint_step) without importing
# torch, which its workers import (backends/torch/__init__.py says why).
from safetensors import SafetensorError, safe_open

from vgraph.base.diagnostics import VGraphError, printable, quote
from vgraph.base.jsonio import loads
from vgraph.base.numbers import NumberError, checked_number
from vgraph.base.safeio import atomic_write, atomic_write_with, read_json
from vgraph.run.files import LATEST, MAX_STEP, MODEL_FILE as MODEL, RUN_JSON, STATE_JSON

try:  # numpy is optional; only needed to (de)serialise numpy RNG state.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the supported torch wheels
    np = None  # type: ignore[assignment]

__all__ = [
    "CheckpointError",
    "checked_tokenizer",
    "network_vocab",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "newest_loadable",
    "checkpoint_step",
    "resolve_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "LATEST_POINTER",
]

FORMAT = "vgraph-checkpoint"
VERSION = 1
LATEST_POINTER = LATEST  # the run directory's names are vgraph/run/files.py's
MODEL_FILE = MODEL
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_JSON_FILE = "optimizer.json"
STATE_TENSORS_FILE = "state.safetensors"
STATE_JSON_FILE = STATE_JSON
_ALIASES_METADATA_KEY = "vgraph_aliases"
_MAX_POINTER_BYTES = 4096


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or in an unknown format."""


@dataclass
class Checkpoint:
    """A loaded checkpoint; fields mirror the arguments of :func:`save_checkpoint`."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_states: dict[str, Any]
    rng_state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optimizer_states: Mapping[str, Any],
    rng_state: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    update_latest: bool = True,
) -> Path:
    """Atomically write a checkpoint to ``directory`` and point ``latest`` at it.

    ``model_state`` maps names to tensors (tied tensors allowed, see the
    module docstring).  ``optimizer_states`` maps a name (e.g. a VNode id) to
    an optimizer ``state_dict()``; ``rng_state`` is typically
    :func:`capture_rng_state`; ``extra`` holds any further JSON-like data
    (tensors and numpy arrays allowed).  Supported leaf types: tensors, numpy
    arrays, ``None``, ``bool``, ``int``, ``float``, ``str``, numpy scalars
    (restored as Python scalars); containers: dict (str or int keys), list,
    tuple.

    If ``directory`` already exists it is replaced (e.g. a step re-run after
    resuming); the old copy is only removed once the new one is in place.
    ``latest`` lives in ``directory``'s parent, the run directory.  Returns the
    checkpoint path.
    """
    target = Path(directory).absolute()
    if target.name in ("", LATEST_POINTER) or target.name.startswith("."):
        raise ValueError(f"invalid checkpoint directory name: {target.name!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")

    import torch

    # Encode everything first: an unsupported value must fail before any
    # file is touched.
    model_tensors = {}
    for key, value in model_state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(f"model_state must map str to Tensor; got {key!r}: {type(value).__name__}")
        model_tensors[key] = value
    optimizer_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = {
        "format": FORMAT,
        "version": VERSION,
        "states": _encode(dict(optimizer_states), ("optimizer",), optimizer_tensors),
    }
    state_tensors: dict[str, torch.Tensor] = {}
    state_json = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "rng": _encode(dict(rng_state), ("rng",), state_tensors),
        "extra": _encode(dict(extra or {}), ("extra",), state_tensors),
    }

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _write_tensors(tmp / MODEL_FILE, model_tensors)
        _write_tensors(tmp / OPTIMIZER_TENSORS_FILE, optimizer_tensors)
        _write_json(tmp / OPTIMIZER_JSON_FILE, optimizer_json)
        _write_tensors(tmp / STATE_TENSORS_FILE, state_tensors)
        # state.json last: its presence marks a complete checkpoint.
        _write_json(tmp / STATE_JSON_FILE, state_json)
        _fsync_dir(tmp)
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if update_latest:
        _write_pointer(parent / LATEST_POINTER, target.name)
    return target


def load_checkpoint(
    directory: str | os.PathLike[str], *, map_location: str | torch.device = "cpu"
) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Model and optimizer tensors are placed on ``map_location``; RNG and
    ``extra`` tensors always load on the CPU (``torch.set_rng_state`` needs a
    CPU byte tensor).  Tied model tensors come back as one shared object.
    """
    path = Path(directory)
    state_file = path / STATE_JSON_FILE
    for part in (path, state_file, path / OPTIMIZER_JSON_FILE, path / MODEL_FILE, path / OPTIMIZER_TENSORS_FILE,
                 path / STATE_TENSORS_FILE):
        if part.is_symlink():  # a run's files are read from the run itself (vgraph/run/files.py's rule)
            raise CheckpointError(f"{part} is a symbolic link; a checkpoint's files are read only from the "
                                  f"checkpoint itself")
    if not state_file.is_file():
        hint = ""
        if (path / LATEST_POINTER).is_file():
            hint = "; this looks like a run directory, use latest_checkpoint() to find its checkpoint"
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_JSON_FILE}){hint}")
    state = _read_json(state_file)
    optimizer = _read_json(path / OPTIMIZER_JSON_FILE)
    device = str(map_location)
    model_state = _read_tensors(path / MODEL_FILE, device)
    optimizer_tensors = _read_tensors(path / OPTIMIZER_TENSORS_FILE, device)
    state_tensors = _read_tensors(path / STATE_TENSORS_FILE, "cpu")
    try:
        return Checkpoint(
            path=path,
            step=_step(state.get("step")),
            model_state=model_state,
            optimizer_states=_decode(optimizer["states"], optimizer_tensors),
            rng_state=_decode(state["rng"], state_tensors),
            extra=_decode(state["extra"], state_tensors),
        )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as exc:
        raise CheckpointError(f"malformed checkpoint {path}: {quote(str(exc), 200)}") from None


def checkpoint_step(directory: str | os.PathLike[str]) -> int:
    """The step of a complete checkpoint, from its state.json alone (its tensors are not read)."""
    try:
        return _step(_read_json(Path(directory) / STATE_JSON_FILE).get("step"))
    except ValueError as exc:
        raise CheckpointError(f"malformed checkpoint {directory}: {quote(str(exc), 200)}") from None


def _step(value: Any) -> int:
    """The step a checkpoint was taken after: an integer from 0 to MAX_STEP (10**30 or -1 are damage, and
    a resume would start from them), read through the one checked reader of numbers."""
    try:
        return int(checked_number(value, "step", integer=True, low=0, high=MAX_STEP))
    except NumberError as exc:
        raise ValueError(str(exc)) from None


def checked_tokenizer(tokenizer_json: str | None, vocab: int | None, where: str):
    """A checkpoint's tokenizer (tokenizers.Tokenizer), read and checked against its network's vocabulary
    `vocab` (its embedder's rows; None: no embedder, nothing to check); None for a checkpoint without one
    (`vgraph import hf` of a model directory without tokenizer.json: such a model reads token ids).

    Why: a checkpoint carries its tokenizer next to its network, and nothing tied the two: a tokenizer
    whose ids pass the vocabulary (a tokenizer.json replaced, a checkpoint edited or assembled by hand)
    surfaced as an IndexError in torch's embedding or a Gather error in onnxruntime, mid-generation.
    Every reader of a checkpoint (generate, export-onnx, check-onnx, resume) checks it on load; a
    VGraphError names both sizes."""
    from tokenizers import Tokenizer

    from vgraph.base.diagnostics import VGraphError

    if not tokenizer_json:
        return None
    from vgraph.data.tokenizer import vocabulary_span

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
        size = vocabulary_span(tokenizer)  # the one rule for a tokenizer's ids, the shards' dtype's too
    except Exception as exc:  # noqa: BLE001 - the Rust library's errors have no common Python class
        raise VGraphError(f"{where}: its tokenizer cannot be read ({quote(str(exc), 200)})") from None
    if vocab is not None and size > vocab:
        raise VGraphError(f"{where}: its tokenizer has {size:,} token ids (0..{size - 1}) but its network's "
                          f"vocabulary is {vocab:,}: ids from {vocab} on would index past the embedding (a "
                          f"tokenizer.json replaced or a checkpoint edited?); use the tokenizer the network was "
                          f"trained with")
    return tokenizer


def network_vocab(graph: Any) -> int | None:
    """The vocabulary of a network's first embedder (what token ids must stay below); None without one."""
    embedders = graph.nodes_of_type("embedder")
    return int(embedders[0].cfg["vocab_size"]) if embedders else None


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``run_dir/latest`` points to, or ``None`` if there is none yet.

    A pointer to a missing or incomplete directory raises
    :class:`CheckpointError`: saving only moves the pointer after the
    checkpoint is complete, so that state means files were removed by hand.
    """
    pointer = Path(run_dir) / LATEST_POINTER
    if not pointer.is_file() and not pointer.is_symlink():
        return None
    try:
        fd = os.open(pointer, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            raw = f.read(_MAX_POINTER_BYTES + 1)  # a pointer is one short name: never read a huge file
        name = raw.decode("utf-8").strip()
    except OSError as exc:
        why = "it is a symbolic link (a run's files are read from the run itself)" if pointer.is_symlink() else (
            exc.strerror or exc)
        raise CheckpointError(f"cannot read {pointer}: {why}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} is not UTF-8 text: not a pointer vgraph wrote") from None
    if (not name or len(raw) > _MAX_POINTER_BYTES or Path(name).name != name or name in (".", "..")
            or not name.isprintable()):
        raise CheckpointError(f"{pointer} holds an invalid checkpoint name {quote(name)}")
    target = Path(run_dir) / name
    if target.is_symlink():
        raise CheckpointError(f"{pointer} names {target}, a symbolic link; a run's checkpoints are read from the "
                              f"run itself")
    if not (target / STATE_JSON_FILE).is_file():
        raise CheckpointError(f"{pointer} points to {target}, which is not a complete checkpoint")
    return target


def newest_loadable(candidates: Iterable[Path], refused: Callable[[Path, Exception], None] = lambda path, exc: None
                    ) -> tuple[Path, int] | None:
    """(folder, step) of the candidate checkpoint with the highest step that loads whole (tensors included),
    None when none does; each that does not load is `refused` with why.  Used by a run that may resume
    from several states (a launch's successor: its mirrored checkpoint and a rescue)."""
    best: tuple[Path, int] | None = None
    for path in candidates:
        try:
            step = load_checkpoint(path, map_location="cpu").step
        except (CheckpointError, OSError, VGraphError) as exc:
            refused(path, exc)
            continue
        if best is None or step > best[1]:
            best = (path, step)
    return best


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint a user named: a checkpoint directory itself, or a run directory's latest.

    The one resolver of every command that reads a trained run (`generate`, `export-onnx`, `check-onnx`),
    so each takes a run directory wherever it takes a checkpoint, and says the same when there is none."""
    target = Path(path)
    if not target.exists():
        raise CheckpointError(f"{target}: no such checkpoint or run directory")
    if not target.is_dir() or (target / STATE_JSON_FILE).is_file():
        return target
    latest = latest_checkpoint(target)
    if latest is not None:
        return latest
    if (target / RUN_JSON).is_file():
        raise CheckpointError(f"{target}: this run has no checkpoint yet (train it, or --resume it, first)")
    raise CheckpointError(f"{target}: neither a checkpoint (no {STATE_JSON_FILE}) nor a run directory "
                          f"(no {LATEST_POINTER})")


def capture_rng_state() -> dict[str, Any]:
    """Snapshot every RNG a training step may draw from (python, numpy, torch, CUDA)."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore a :func:`capture_rng_state` snapshot (missing entries are left alone)."""
    import torch

    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        if np is None:
            raise CheckpointError("checkpoint holds numpy RNG state but numpy is not installed")
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        cuda_states = state["cuda"]
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
        else:
            warnings.warn(
                f"checkpoint has CUDA RNG state for {len(cuda_states)} device(s) but "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are visible; "
                "CUDA RNG not restored",
                stacklevel=2,
            )


# --------------------------------------------------------------------------
# Tagged JSON encoding
# --------------------------------------------------------------------------


def _encode(obj: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    """Turn ``obj`` into JSON data, moving tensors into ``tensors``.

    Every JSON object produced is a tag (``__dict__``, ``__tuple__``,
    ``__tensor__``, ...), so decoding is unambiguous whatever the user keys.
    """
    import torch

    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": _add_tensor(tensors, path, obj)}
    if np is not None and isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"cannot checkpoint numpy object array at {'/'.join(path)}")
        raw = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8).copy())
        key = _add_tensor(tensors, path, raw)
        return {"__ndarray__": key, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if np is not None and isinstance(obj, np.generic):
        return _encode(obj.item(), path, tensors)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return {"__list__": [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, Mapping):
        items = []
        for key, value in obj.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"cannot checkpoint dict key {key!r} at {'/'.join(path)}: only str and int keys")
            items.append([key, _encode(value, (*path, str(key)), tensors)])
        return {"__dict__": items}
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {'/'.join(path)}")


def _add_tensor(tensors: dict[str, torch.Tensor], path: tuple[str, ...], tensor: torch.Tensor) -> str:
    key = "/".join(path)
    unique, n = key, 1
    while unique in tensors:  # e.g. keys 0 and "0" in one dict
        unique, n = f"{key}#{n}", n + 1
    tensors[unique] = tensor
    return unique


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if not isinstance(obj, (dict, list)):
        return obj
    if isinstance(obj, list):
        raise ValueError("untagged JSON list in checkpoint")
    if "__dict__" in obj:
        return {key: _decode(value, tensors) for key, value in obj["__dict__"]}
    if "__list__" in obj:
        return [_decode(v, tensors) for v in obj["__list__"]]
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__ndarray__" in obj:
        if np is None:
            raise CheckpointError("checkpoint holds numpy arrays but numpy is not installed")
        raw = tensors[obj["__ndarray__"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    raise ValueError(f"unknown tag in checkpoint JSON: {sorted(obj)}")


# --------------------------------------------------------------------------
# Tensor files
# --------------------------------------------------------------------------


def _view_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identical for two tensors exactly when they are the same view of the same memory."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _dedupe(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split into uniquely-stored tensors and ``alias -> canonical key`` pairs.

    Exact aliases are collapsed onto the alphabetically first key.  Tensors
    still sharing storage afterwards (overlapping views) are cloned, because
    safetensors refuses to write shared storage.
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    canonical_of: dict[tuple[Any, ...], str] = {}
    for key in sorted(tensors):
        tensor = tensors[key].detach()
        identity = _view_identity(tensor)
        if identity is not None and identity in canonical_of:
            aliases[key] = canonical_of[identity]
            continue
        if identity is not None:
            canonical_of[identity] = key
        unique[key] = tensor

    by_storage: dict[tuple[Any, int], list[str]] = {}
    for key, tensor in unique.items():
        if tensor.numel():
            by_storage.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(key)
    shared = {key for keys in by_storage.values() if len(keys) > 1 for key in keys}
    prepared = {}
    for key, tensor in unique.items():
        tensor = tensor.clone() if key in shared else tensor
        prepared[key] = tensor.cpu().contiguous()
    return prepared, aliases


def _write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    unique, aliases = _dedupe(tensors)
    metadata = {"format": "pt", _ALIASES_METADATA_KEY: json.dumps(aliases, sort_keys=True)}
    # Through the core's writer: save_file alone leaves the file 0600 whatever the umask (safeio.py).
    try:
        atomic_write_with(path, lambda tmp: save_file(unique, os.fspath(tmp), metadata=metadata))
    except SafetensorError as exc:  # a full disk: safetensors' own error, which no caller expects (a traceback)
        raise OSError(errno.EIO, f"cannot write the checkpoint ({printable(str(exc), 300)})",
                      os.fspath(path)) from None


def _read_tensors(path: Path, device: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with safe_open(os.fspath(path), framework="pt", device=device) as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        for alias, canonical in loads(metadata.get(_ALIASES_METADATA_KEY, "{}"), printable(str(path))).items():
            tensors[alias] = tensors[canonical]
    except (VGraphError, AttributeError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path}: bad tensor metadata ({quote(str(exc), 200)})") from None
    return dict(sorted(tensors.items()))


# --------------------------------------------------------------------------
# Durable file system helpers
# --------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        # Compact: RNG states alone are hundreds of integers.
        json.dump(data, f, separators=(",", ":"), allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        data = read_json(path, what="checkpoint file")  # bounded: depth, size, numbers, surrogates
    except VGraphError as exc:
        raise CheckpointError(f"cannot read {exc.diagnostics[0]}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {data.get('version')}; this code reads {VERSION}")
    return data


def _fsync_dir(path: Path) -> None:
    """Persist a directory's entries (renames); not possible on Windows."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` directory to ``target``.

    A rename cannot replace a non-empty directory, so an existing target is
    first renamed aside and deleted only once the new one is in place.
    """
    parent = target.parent
    if target.exists():
        old = parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(target, old)
        os.rename(tmp, target)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
        _fsync_dir(parent)


def _write_pointer(pointer: Path, name: str) -> None:
    atomic_write(pointer, name + "\n")  # the core's atomic writer: temporary, fsync, rename
    _fsync_dir(pointer.parent)  # ... and the rename itself survives a crash
