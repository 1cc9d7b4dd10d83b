"""Hugging Face causal LMs in and out: `vgraph import hf` and `vgraph export hf`.

    from vgraph.backends.hf import import_hf, export_hf
    import_hf("models/gpt2", "runs/gpt2")          # a run directory at step 0 (docs/bring-a-hf-model.md)
    export_hf("runs/gpt2", "out/gpt2")             # config.json + model.safetensors for transformers

* `families.py`: which models (GPT-2, Llama, Qwen2) from their config.json, refusing every key that would
  change the computation; the network YAML of each; a network recognised as a family (torch-free).
* `source.py`: a model directory read without trusting it (symlinks, safetensors headers).
* `weights.py`: tensors between transformers' names and layouts and vgraph's unfused checkpoint layout.
* `importer.py`, `exporter.py`, `cli.py`: the commands.

Reading and writing needs only safetensors and torch; transformers (the `hf` extra) is imported only by
`export hf --check`, which loads the export back.  This backend uses the torch backend's package API only.
"""
from __future__ import annotations

from .exporter import check_export, export_hf
from .importer import import_hf

__all__ = ["import_hf", "export_hf", "check_export"]
