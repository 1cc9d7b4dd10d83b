"""`vgraph export hf RUN -o DIR`: a run's weights as a Hugging Face model directory transformers loads.

The run's network (the one its checkpoint carries) must be exactly what one supported family expresses
(families.recognise: sizes read off the network, the family's network built from them, compared VNode by
VNode): anything else, the production networks' SwiGLU LM head for one, is refused naming the first VNode
that does not fit.  DIR gets config.json, model.safetensors (float32) and the run's tokenizer.json when it
has one, written through `OutputDir` (no file vgraph did not write there is replaced).

`--check` loads DIR back with transformers (the `hf` extra) and compares its logits with the run's on random
token ids, so an export that transformers reads differently is an error, not a silent mismatch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from vgraph.backends.torch import CheckpointError, latest_checkpoint, load_checkpoint
from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.safeio import OutputDir
from vgraph.run.files import LATEST
from vgraph.yamlio import loads

from .families import hf_config, recognise
from .source import CONFIG, TOKENIZER
from .weights import to_hf

__all__ = ["export_hf", "check_export", "MODEL_FILE"]

MODEL_FILE = "model.safetensors"
CHECK_TOLERANCE = 1e-4  # max abs logits difference in float32 (the importer's tests see ~1e-6)


def export_hf(run: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the Hugging Face model of `run` (a run directory or a checkpoint) into `out`; returns `out`."""
    path = Path(run)
    try:
        checkpoint = latest_checkpoint(path) if (path / LATEST).is_file() else path
        if checkpoint is None:
            raise VGraphError(f"{printable(str(path))}: the run has no checkpoint yet")
        state = load_checkpoint(checkpoint, map_location="cpu")
    except CheckpointError as exc:
        raise VGraphError(f"{printable(str(path))}: {exc}") from None
    yaml_text = state.extra.get("network_yaml")
    if not yaml_text:
        raise VGraphError(f"{printable(str(checkpoint))}: the checkpoint does not carry its network")
    graph = loads(yaml_text, file=f"{checkpoint}/network.yml")
    spec, fused = recognise(graph)
    tensors = to_hf(spec, dict(state.model_state), fused=fused)
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise VGraphError(f"{printable(str(checkpoint))}: weight {name} is not finite; refusing to export it")
    target = OutputDir(out, command="export hf", inputs=[run])
    tokenizer = state.extra.get("tokenizer_json")
    names = [CONFIG, MODEL_FILE] + ([TOKENIZER] if tokenizer else [])
    target.plan(names)
    target.write(MODEL_FILE, safetensors_bytes(tensors, metadata={"format": "pt"}))
    if tokenizer:
        target.write(TOKENIZER, tokenizer)
    target.write(CONFIG, json.dumps(hf_config(spec), indent=2) + "\n")  # last: its presence marks a model
    target.remove_stale()
    return target.path


def check_export(run: str | os.PathLike, out: str | os.PathLike, *, seed: int = 0) -> float:
    """The max abs difference of transformers' logits on the export `out` from the run's own, on random ids;
    a VGraphError above CHECK_TOLERANCE."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise VGraphError("export hf --check loads the export with transformers: pip install 'vgraph[hf]'") from None
    from vgraph.backends.torch import load_model

    model = load_model(run, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    ids = torch.randint(0, model.vocab_size, (2, model.seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = float((hf(ids).logits.float() - model(ids).float()).abs().max())
    if not diff <= CHECK_TOLERANCE:
        raise VGraphError(f"{printable(str(out))}: transformers computes logits {diff:.3g} away from the run's "
                          f"(tolerance {CHECK_TOLERANCE}); the export does not reproduce the model")
    return diff
