"""The per-VNode optimizers of a network and the learning-rate schedule they follow.

* **Per-VNode optimizers**: every trainable VNode is optimised as its config
  says (`optimizer`: adam (default) | adamw | sgd | none; `learning_rate` overrides
  `--lr`; `weight_decay`, else --weight-decay, decays its matrices AdamW's way); a tied weight is its
  publisher's.  Adam and SGD are elementwise
  per parameter, so VNodes with equal settings share one torch optimizer
  (one param group per learning rate): the math is per VNode, the cost per
  step is that of a hand-written model's single optimizer.
* **Schedule** (`lr_factor`): linear warmup, then constant or cosine decay,
  as a factor on every VNode's own learning rate.

Shared by `vgraph train` and the workers of `vgraph launch`, so both step
alike.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..lowering.lower import VGraphModule

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["NodeOptimizers", "make_adam", "lr_factor"]


def lr_factor(step: int, config: TrainConfig) -> float:
    """Schedule multiplier for (1-based) `step`: linear warmup, then constant or cosine decay."""
    if config.warmup and step <= config.warmup:
        return step / config.warmup
    if config.schedule == "cosine":
        span = max(1, config.steps - config.warmup)
        progress = min(1.0, (step - config.warmup) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def make_adam(groups: list[dict[str, Any]], kind: str = "adam") -> torch.optim.Optimizer:
    """Adam (or AdamW: decoupled weight decay, each group its `weight_decay`), fused when this torch supports
    it for these tensors (one kernel per step)."""
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    try:
        return cls(groups, fused=True)
    except (RuntimeError, ValueError, TypeError):
        return cls(groups, foreach=True)


def _node_decay(cfg: Mapping[str, Any], kind: str, run_decay: float) -> float:
    """A node's decoupled weight decay: its own `weight_decay`, else the run's (--weight-decay) for Adam and
    AdamW nodes; an `adamw` node without either decays by AdamW's customary 0.01."""
    own = cfg.get("weight_decay")
    if own is not None:
        return float(own)
    if kind == "adamw" and not run_decay:
        return 0.01
    return float(run_decay) if kind in ("adam", "adamw") else 0.0


class NodeOptimizers:
    """The per-VNode optimizers of a network, batched by identical settings.

    `lr_of(node)` is the learning rate the node is trained with (its own
    `learning_rate`, else the run's `--lr`; a tied node reports its
    publisher's, which owns the weight), times the schedule's current factor.
    """

    KINDS = ("adam", "adamw", "sgd", "none")

    def __init__(self, module: VGraphModule, base_lr: float, weight_decay: float = 0.0) -> None:
        graph = module.network
        self.module = module
        self.base_lr: dict[str, float] = {}
        self.key_of: dict[torch.nn.Parameter, str] = {}
        buckets: dict[tuple[str, float, float], list[torch.nn.Parameter]] = {}
        for node in graph.topo_order():
            params = module.node_parameters(node.id)
            lr = float(node.cfg.get("learning_rate") or base_lr)
            self.base_lr[node.id] = lr
            kind = node.cfg.get("optimizer") or "adam"
            decay = _node_decay(node.cfg, kind, weight_decay)
            for pname, param in params.items():
                self.key_of[param] = f"{node.id}.{pname}"
                if kind == "none":
                    param.requires_grad_(False)
                else:
                    # Decay on matrices and embeddings only, as nanoGPT and most trainers: not on biases and
                    # norm scales, whose pull to zero is no regularisation.  Adam with no decay is Adam.
                    wd = decay if param.dim() >= 2 else 0.0
                    kind_of = ("adamw" if wd > 0 else "adam") if kind in ("adam", "adamw") else kind
                    buckets.setdefault((kind_of, lr, wd), []).append(param)
        publishers = graph.publishers()
        for node in graph.nodes:  # a tied node trains with its publisher's optimizer
            tied = node.op.tied(node.cfg)
            if tied and not module.node_parameters(node.id):
                alias = next(iter(tied.values()))[0]
                if alias in publishers:
                    self.base_lr[node.id] = self.base_lr[publishers[alias].id]
        self.optimizers: list[torch.optim.Optimizer] = []
        for kind in ("adam", "adamw", "sgd"):
            groups = [{"params": ps, "lr": lr, "base_lr": lr, **({"weight_decay": wd} if k == "adamw" else {})}
                      for (k, lr, wd), ps in buckets.items() if k == kind]
            if groups:
                self.optimizers.append(make_adam(groups, kind) if kind != "sgd" else torch.optim.SGD(groups))
        self.factor = 1.0
        self.trainable = [p for ps in buckets.values() for p in ps]

    def set_factor(self, factor: float) -> None:
        if factor != self.factor:
            self.factor = factor
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["base_lr"] * factor

    def lr_of(self, node_id: str) -> float:
        return self.base_lr[node_id] * self.factor

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_by_key(self) -> dict[str, dict[str, Any]]:
        """Optimizer state per parameter key ("<vnode>.<param>"), in the module's layout."""
        out: dict[str, dict[str, Any]] = {}
        for opt in self.optimizers:
            for param, state in opt.state.items():
                out[self.key_of[param]] = dict(state)
        return out

    def load_state_by_key(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        for opt in self.optimizers:
            current = opt.state_dict()
            index = 0
            new_state: dict[int, Any] = {}
            for group in opt.param_groups:
                for param in group["params"]:
                    key = self.key_of[param]
                    if key in states:
                        new_state[index] = dict(states[key])
                    index += 1
            opt.load_state_dict({"state": new_state, "param_groups": current["param_groups"]})
