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

from .training.checkpoint import (CheckpointError, capture_rng_state, checked_tokenizer, latest_checkpoint, load_checkpoint,
                         network_vocab, resolve_checkpoint, save_checkpoint)
from .lowering.interpreter import interpret
from .lowering.lower import (VGraphModule, compile_network, compute_dtype, feed_name, init_state, to_graph_layout,
                    to_unfused_layout)
from .model_api import CausalLM, load_model
from .training.memory import MemoryEstimate, MemoryRefused, check_memory, estimate_training_memory
from .lowering.ops import LOWERINGS, LowerCtx, register_lowering
from .training.train import TrainConfig, TrainingError, TrainResult, load_trained, prepare_graph, train

__all__ = [
    "VGraphModule", "compile_network", "compute_dtype", "feed_name", "init_state", "to_graph_layout",
    "to_unfused_layout", "interpret", "register_lowering", "LowerCtx", "LOWERINGS", "MemoryEstimate",
    "MemoryRefused", "check_memory", "estimate_training_memory", "TrainConfig", "TrainResult",
    "TrainingError", "train", "load_trained", "prepare_graph", "CheckpointError", "latest_checkpoint",
    "load_checkpoint", "checked_tokenizer", "network_vocab", "save_checkpoint", "capture_rng_state", "CausalLM",
    "load_model", "resolve_checkpoint",
]
