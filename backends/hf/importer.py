"""`vgraph import hf SRC -o RUN`: a Hugging Face model directory as a vgraph run at step 0.

Everything is checked before anything is written: the config (families.py: the architecture and every key
that changes the computation), the safetensors headers (source.py), the set of tensors (none missing, none
unknown), every shape against the config, every value finite.  Then the run is assembled in a temporary
directory beside RUN and renamed into place, so an import that fails or is killed leaves no RUN at all.

The run holds what `vgraph train` writes at its start, so every command takes it: network.yml,
tokenizer.json (when the model has one), run.json, and a checkpoint `step-00000000` in vgraph's layout
(weights unfused, float32; no optimizer state: Adam starts fresh), which carries the network and the
tokenizer again.  Training continues from it with `vgraph train RUN/network.yml --out RUN --resume`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from vgraph.backends.torch import capture_rng_state, save_checkpoint
from vgraph.base.diagnostics import VGraphError, printable, quote
from vgraph.base.safeio import atomic_write, check_output_dir
from vgraph.run import files
from vgraph.yamlio import dumps

from .families import Spec, network, read_spec
from .source import CONFIG, ModelDir, read_model_dir
from .weights import hf_prefix, hf_shapes, ignorable, to_vgraph

__all__ = ["import_hf", "checked_weights"]

_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def import_hf(src: str | os.PathLike, out: str | os.PathLike, *, fused: bool = False,
              seq_len: int | None = None) -> Path:
    """Import the model directory `src` into the new run directory `out`; returns `out`."""
    target = check_output_dir(out, inputs=[src], what="run directory")
    if target.exists() and any(target.iterdir()):
        raise VGraphError(f"{printable(str(target))}: not empty; `vgraph import hf` writes a new run directory")
    model = read_model_dir(src)
    spec = read_spec(model.config, printable(str(Path(src) / CONFIG)), seq_len=seq_len)
    weights = checked_weights(model, spec)
    name = _network_name(Path(src))
    graph = network(spec, name, fused=fused)
    state = to_vgraph(spec, weights, fused=fused)
    yaml_text = dumps(graph)
    run_info = {"network": name, "vocab_size": spec.vocab, "seq_len": spec.seq_len, "passes": None, "fuse": True,
                "imported_from": {"format": "hf", "path": str(Path(src).resolve()), "family": spec.family,
                                  "attention": "fused" if fused else "per-head"}}
    _write_run(target, state, yaml_text, model.tokenizer_json, run_info)
    return target


def checked_weights(model: ModelDir, spec: Spec) -> dict[str, torch.Tensor]:
    """The model's weights by their names without the base model's prefix, refused unless they are exactly
    the tensors `spec` needs, of its shapes, floating point and finite."""
    where = printable(str(model.path))
    prefix = hf_prefix(spec)
    names: dict[str, str] = {}
    for stored in model.headers:
        short = stored[len(prefix):] if stored.startswith(prefix) else stored
        if short in names:
            raise VGraphError(f"{where}: tensor {quote(short)} is stored twice ({quote(names[short])} and "
                              f"{quote(stored)})")
        names[short] = stored
    expected = hf_shapes(spec)
    tied_copy = spec.tied and "lm_head.weight" in names  # some writers store the tied head too: must equal
    missing = [k for k in expected if k not in names]
    extra = [k for k in names if k not in expected and not ignorable(spec, k, model.headers[names[k]][2])
             and not (tied_copy and k == "lm_head.weight")]
    if missing or extra:
        what = "; ".join(p for p in (
            f"missing {len(missing)} tensor(s) a {spec.family} model of this config has: {', '.join(missing[:4])}"
            if missing else "",
            f"{len(extra)} tensor(s) this config has no place for: {', '.join(extra[:4])}" if extra else "") if p)
        raise VGraphError(f"{where}: {what} (config.json and the weights do not describe the same model)")
    for short, shape in expected.items():
        _, dtype, stored_shape = model.headers[names[short]]
        if stored_shape != shape:
            raise VGraphError(f"{where}: tensor {quote(names[short])} has shape {list(stored_shape)}, but config.json "
                              f"says {list(shape)}")
        if dtype not in _FLOAT_DTYPES:
            raise VGraphError(f"{where}: tensor {quote(names[short])} is {dtype}; weights are floating point "
                              f"({', '.join(_FLOAT_DTYPES)}; quantized models are not supported)")
    wanted = list(expected) + (["lm_head.weight"] if tied_copy else [])
    loaded = model.tensors([names[k] for k in wanted])
    weights = {k: loaded[names[k]] for k in wanted}
    for short, tensor in weights.items():
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise VGraphError(f"{where}: tensor {quote(names[short])} holds {bad} NaN or infinite value(s)")
    if tied_copy:
        embedding = weights["wte.weight" if spec.family == "gpt2" else "embed_tokens.weight"]
        head = weights.pop("lm_head.weight")
        if head.shape != embedding.shape or not torch.equal(head, embedding):
            raise VGraphError(f"{where}: tie_word_embeddings is true but lm_head.weight differs from the token "
                              f"embedding")
    return weights


def _network_name(src: Path) -> str:
    """The network's name: the model directory's, in the characters a run directory's default name keeps."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(os.path.realpath(src)).name).strip("-.")
    return name or "hf-model"


def _write_run(target: Path, state: dict[str, torch.Tensor], yaml_text: str, tokenizer_json: str | None,
               run_info: dict) -> None:
    """The run assembled beside `target`, then renamed into place (module docstring)."""
    parent = target.absolute().parent
    tmp = parent / f".{target.name}.tmp-import-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise VGraphError(f"{printable(str(target))}: cannot create the run directory: {exc.strerror or exc}") from None
    try:
        lock = files.RunLock.acquire(tmp, "vgraph import hf")  # its file marks the directory as a run
        extra = {"layout": "unfused", "grad_scaler": None, "run": run_info, "network_yaml": yaml_text,
                 "tokenizer_json": tokenizer_json, "compression": {"boundary": {}}}
        save_checkpoint(tmp / files.checkpoint_name(0), step=0, model_state=state, optimizer_states={},
                        rng_state=capture_rng_state(), extra=extra)
        atomic_write(tmp / files.NETWORK_YML, yaml_text)
        atomic_write(tmp / files.RUN_JSON, json.dumps(run_info, indent=2) + "\n")
        if tokenizer_json is not None:
            atomic_write(tmp / files.TOKENIZER_JSON, tokenizer_json)
        lock.release()
        if target.exists():
            target.rmdir()  # empty (checked first): replaced by the complete run
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
