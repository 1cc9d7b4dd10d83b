"""A Hugging Face model directory read without trusting it: config.json, *.safetensors, tokenizer.json.

Nothing is downloaded and nothing is executed: the config is JSON, the weights are safetensors (no pickle).
Every file is read from the directory itself: a symbolic link is followed only when it resolves inside the
directory, or, for a snapshot of the hub's cache (`.../snapshots/REV/`), inside that cache's `blobs/`; a
link to anywhere else is refused.  Each safetensors header is checked before the file is opened by the
library: its length inside the file, every tensor's dtype known, its shape non-negative, its byte range
inside the data section and exactly as long as its shape and dtype say, no two ranges overlapping.  A
tensor name held by two files is refused.  The tensors come back as loaded by `safetensors`, unchanged.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from vgraph.base.diagnostics import VGraphError, printable, quote
from vgraph.base.safeio import read_input

__all__ = ["ModelDir", "read_model_dir", "CONFIG", "TOKENIZER"]

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
MAX_CONFIG_BYTES = 4 * 2**20
MAX_TOKENIZER_BYTES = 256 * 2**20
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass
class ModelDir:
    path: Path
    config: dict[str, Any]
    headers: dict[str, tuple[Path, str, tuple[int, ...]]]  # tensor name -> (file, dtype, shape)
    tokenizer_json: str | None

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` as stored (each file's header was checked when the directory was read)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.headers[name][0], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as fh:
                    for name in wanted:
                        out[name] = fh.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError, TypeError) as exc:
                raise VGraphError(f"{printable(str(file))}: cannot read its tensors: {quote(str(exc), 200)}") from None
        return out

def read_model_dir(src: str | os.PathLike) -> ModelDir:
    """The config, the safetensors headers and the tokenizer of the model directory `src`."""
    root = Path(src)
    shown = printable(str(root))
    if not root.is_dir():
        raise VGraphError(f"{shown}: not a directory; give a model directory (config.json, *.safetensors)")
    real = Path(os.path.realpath(root))
    config_path = _inside(root, real, CONFIG, required=True)
    try:
        config = json.loads(read_input(config_path, what="config.json", limit=MAX_CONFIG_BYTES))
    except (ValueError, RecursionError) as exc:
        raise VGraphError(f"{printable(str(config_path))}: not JSON: {quote(str(exc), 120)}") from None
    if not isinstance(config, dict):
        raise VGraphError(f"{printable(str(config_path))}: not a JSON object")
    files = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        bins = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise VGraphError(f"{shown}: no *.safetensors file"
                          + (f" ({', '.join(bins[:3])} are pickles, which vgraph does not load: convert them "
                             f"to safetensors)" if bins else ""))
    headers: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for name in files:
        path = _inside(root, real, name, required=True)
        for tensor, (dtype, shape) in read_header(path).items():
            if tensor in headers:
                raise VGraphError(f"{printable(str(path))}: tensor {quote(tensor)} is also in "
                                  f"{printable(headers[tensor][0].name)}")
            headers[tensor] = (path, dtype, shape)
    tok_path = _inside(root, real, TOKENIZER, required=False)
    tokenizer = read_input(tok_path, what="tokenizer", limit=MAX_TOKENIZER_BYTES) if tok_path else None
    return ModelDir(root, config, headers, tokenizer)


def _inside(root: Path, real: Path, name: str, *, required: bool) -> Path | None:
    """`root/name` when it is a file of the model directory (a link resolving inside it, or into the hub
    cache's blobs for a snapshot), None when absent and not `required`."""
    path = root / name
    if not path.exists() and not path.is_symlink():
        if required:
            raise VGraphError(f"{printable(str(path))}: missing; a model directory holds {CONFIG} and "
                              f"*.safetensors")
        return None
    target = Path(os.path.realpath(path))
    allowed = [real]
    if real.parent.name == "snapshots":  # the hub cache: snapshots/REV/NAME -> ../../blobs/HASH
        allowed.append(real.parent.parent / "blobs")
    if not any(a == target.parent or a in target.parents for a in allowed):
        raise VGraphError(f"{printable(str(path))}: a symbolic link to {printable(str(target))}, outside the "
                          f"model directory; copy the model (cp -rL) instead of linking to elsewhere")
    if not target.is_file():
        raise VGraphError(f"{printable(str(path))}: not a regular file")
    return path


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every tensor in the safetensors file `path`, its header checked (module docstring)."""
    shown = printable(str(path))
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(8)
            if len(raw) < 8:
                raise VGraphError(f"{shown}: {size} bytes, too short for a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise VGraphError(f"{shown}: the header claims {length} bytes but the file has {size - 8} after "
                                  f"its length field; not a safetensors file, or a truncated one")
            text = fh.read(length)
    except OSError as exc:
        raise VGraphError(f"{shown}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise VGraphError(f"{shown}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise VGraphError(f"{shown}: the safetensors header is not a JSON object")
    data = size - 8 - length
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(shown, name, entry)
        if not 0 <= begin <= end <= data:
            raise VGraphError(f"{shown}: tensor {quote(name)} has bytes {begin}..{end}, outside the file's "
                              f"{data} bytes of data")
        if end - begin != prod(shape) * _ITEMSIZE[dtype]:
            raise VGraphError(f"{shown}: tensor {quote(name)} is {dtype} {list(shape)} "
                              f"({prod(shape) * _ITEMSIZE[dtype]} bytes) but its range holds {end - begin}")
        ranges.append((begin, end, name))
        out[name] = (dtype, shape)
    ranges.sort()
    for (_, end, a), (begin, _, b) in zip(ranges, ranges[1:]):
        if begin < end:
            raise VGraphError(f"{shown}: tensors {quote(a)} and {quote(b)} overlap in the file")
    return out


def _entry(shown: str, name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in value)

    if not isinstance(entry, dict) or entry.get("dtype") not in _ITEMSIZE or not ints(entry.get("shape")) \
            or not ints(entry.get("data_offsets")) or len(entry["data_offsets"]) != 2:
        raise VGraphError(f"{shown}: tensor {quote(name)} has a malformed header entry {quote(entry, 120)}")
    begin, end = entry["data_offsets"]
    return entry["dtype"], tuple(entry["shape"]), begin, end
