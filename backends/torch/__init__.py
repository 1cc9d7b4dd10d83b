"""The PyTorch backend: compile network YAML to torch, train it, sample from it.

    from vgraph.backends.torch import compile_network
    module = compile_network(vgraph.load("net.yml"), device="cuda")
    out = module({"embedder:in0": ids, "loss:in1": targets}, want=("ce_loss",))

* `compile_network` / `VGraphModule` (lower.py): IR -> readable torch.fx code,
  state_dict keys "<vnode_id>.<param>", tied weights shared.
* `register_lowering` (ops.py): give a plugin op type its PyTorch meaning.
* `interpret` (interpreter.py): the slow node-by-node reference.
* `train` / `TrainConfig` (train.py) and the `train` / `generate` commands (cli.py).
* `distributed/`: `vgraph launch`, one torch.distributed worker per PNode.
* `keyed_dropout` (dropout.py): counter-based masks keyed by (seed, step, VNode, sample, element).
* `graph_breaks.py`: torch.compile graph breaks of a training step (one graph per step).
* `to_graph_layout` / `to_unfused_layout`: move weights between fused and unfused graphs.
* `estimate_training_memory` / `check_memory` (memory.py): refuse what cannot fit.
* `load_checkpoint` / `latest_checkpoint` / `resolve_checkpoint` / `CheckpointError` (checkpoint.py): read a
  run's weights (`resolve_checkpoint`: a checkpoint or a run directory, its latest) (the ONNX backend's
  `check-onnx` does; other backends use this API, never the modules behind it);
  `save_checkpoint` / `capture_rng_state`: write one (`vgraph import hf` writes a run's step 0).
* `load_model` / `CausalLM` (model_api.py): a run or checkpoint as `forward(input_ids [B, T]) -> logits
  [B, T, vocab]`, in eval mode; `vgraph eval` scores token ids with it.
"""
from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module it lives in, imported on first use (PEP 562): `vgraph launch` (its launcher
# process: membership, joins, supervision) and `vgraph launch --help` import this package without torch, which
# costs 3-4 CPU-s (issue 36: at 0.35 of a core, a joiner asked to join ~7 s later for it); its workers import
# torch once, in the forkserver (distributed/launcher/supervisor.py).
_HOME = {
    **dict.fromkeys(("CheckpointError", "capture_rng_state", "checked_tokenizer", "latest_checkpoint",
                     "load_checkpoint", "network_vocab", "resolve_checkpoint", "save_checkpoint"),
                    ".training.checkpoint"),
    "interpret": ".lowering.interpreter",
    **dict.fromkeys(("VGraphModule", "compile_network", "compute_dtype", "feed_name", "init_state",
                     "to_graph_layout", "to_unfused_layout"), ".lowering.lower"),
    **dict.fromkeys(("CausalLM", "load_model"), ".model_api"),
    **dict.fromkeys(("MemoryEstimate", "MemoryRefused", "check_memory", "estimate_training_memory"),
                    ".training.memory"),
    **dict.fromkeys(("LOWERINGS", "LowerCtx", "register_lowering"), ".lowering.ops"),
    **dict.fromkeys(("TrainConfig", "TrainingError", "TrainResult", "load_trained", "prepare_graph", "train"),
                    ".training.train"),
}

__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:  # a submodule (`from vgraph.backends.torch import cli`) is then imported by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
