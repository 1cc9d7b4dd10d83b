"""Estimate a training step's memory from the IR, and refuse what cannot fit before allocating.

The estimate is computed from shapes alone (no tensor is created), so a
network too large for the machine is refused in milliseconds with the
numbers a user needs to act on (which term dominates, what batch would fit)
instead of dying minutes later in the allocator or being OOM-killed.

Terms, in bytes:

* parameters: float32 master weights (every parameter, once; tied weights
  count at their publisher);
* gradients: float32, one per trainable parameter;
* optimizer state: Adam keeps two float32 moments per parameter, plain SGD none;
* activations: what autograd keeps for backward at the given batch, at the
  compute dtype: every VNode's outputs that a reader keeps (a sum, a
  concatenation, a dropout or a cross-entropy keeps none of its inputs;
  broadcast copies are free, a fused LM-head loss keeps no logits), the
  one-byte masks of dropouts, plus the internals the kernels save
  (projected q/k/v and rotated q/k of attention, the float32 log-softmax of a
  cross-entropy);
* workspace: transient buffers, taken as twice the largest activation
  (its gradient and one temporary) plus the fused loss's float32 weight copy,
  weight-gradient accumulator and one logits chunk;
* rematerialisation (`remat: recompute`, vgraph/cost/remat.py): a recomputed
  VNode's outputs and the internals of every region member (the checkpointed
  function keeps only its inputs) are not kept; backward rebuilds them one
  region at a time, so the largest colocation group's rebuilt bytes are added
  once (counted with the activations).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping

import torch

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.host_memory import available_host_memory
from vgraph.cost.remat import remat_layout
from vgraph.ir.graph import Graph

from ..lowering import kernels as K

__all__ = ["MemoryEstimate", "MemoryRefused", "estimate_training_memory", "available_memory", "check_memory"]

_ITEM = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "string": 0}


class MemoryRefused(VGraphError):
    """The estimated memory of a training step exceeds what the device has."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryEstimate:
    batch: int
    parameters: int
    gradients: int
    optimizer: int
    activations_per_sample: int
    workspace_per_sample: int
    workspace_fixed: int

    @property
    def activations(self) -> int:
        return self.activations_per_sample * self.batch

    @property
    def workspace(self) -> int:
        return self.workspace_per_sample * self.batch + self.workspace_fixed

    @property
    def fixed(self) -> int:
        """Bytes that do not depend on the batch."""
        return self.parameters + self.gradients + self.optimizer + self.workspace_fixed

    @property
    def total(self) -> int:
        return self.fixed + (self.activations_per_sample + self.workspace_per_sample) * self.batch

    def largest_batch(self, available: int) -> int:
        """The largest batch this estimate says fits in `available` bytes (0 if none)."""
        per_sample = max(1, self.activations_per_sample + self.workspace_per_sample)
        return max(0, (available - self.fixed) // per_sample)

    def describe(self) -> str:
        return (f"{_gib(self.total)} = parameters {_gib(self.parameters)} + gradients {_gib(self.gradients)}"
                f" + optimizer state {_gib(self.optimizer)} + activations {_gib(self.activations)} at batch "
                f"{self.batch} + workspace {_gib(self.workspace)}")


_SAVES_NOTHING = frozenset(("add", "stack", "dropout"))  # backward needs none of their inputs (dropout: its mask)


def _saved_by_a_reader(graph: Graph, node_id: str) -> bool:
    """Does some reader keep this VNode's output for backward?  A sum, a concatenation, a dropout (which
    keeps its mask) and a cross-entropy (which keeps its log-softmax) do not; a broadcast or a rate-0
    dropout passes the tensor on, so its readers decide."""
    for e in graph.out_edges(node_id):
        reader = graph.node(e.dst)
        if reader.type == "broadcast" or (reader.type == "dropout" and reader.cfg["rate"] == 0):
            if _saved_by_a_reader(graph, reader.id):
                return True
        elif reader.type in _SAVES_NOTHING:
            continue
        elif reader.type == "cost" and reader.cfg["cost_function"] in ("ce", "ce_logits"):
            continue
        else:
            return True
    return False


def _activation_item(compute_dtype: torch.dtype) -> int:
    return torch.empty((), dtype=compute_dtype).element_size()


def _op_saved_bytes(graph: Graph, node, outs: list, item: int, compute_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per sample an op keeps for its backward beyond its outputs, the largest tensor it makes
    per sample): dropout's mask, attention's inputs and softmax statistics, a CE cost's float32 log-softmax."""
    cfg = node.cfg
    if node.type == "dropout" and cfg["rate"] > 0 and outs:
        return outs[0].numel, 0  # the boolean keep mask
    rope = cfg.get("position_encoding") == "rope"
    if node.type == "attention_head":
        seq, hd = cfg["seq_len"], cfg["head_dim"]
        if cfg["kv_input"]:  # its q (and the rotated q); the keys and values are the kv_head's output
            return item * seq * hd * (2 if rope else 1) + 4 * seq, 0
        return item * seq * hd * (5 if rope else 3) + 4 * seq, 0
    if node.type == "kv_head":  # k before the rotation; the output is counted as an output
        return item * cfg["seq_len"] * cfg["head_dim"] * (1 if rope else 0), 0
    if node.type == "attention":
        seq, hd, heads = cfg["seq_len"], cfg["head_dim"], cfg["num_heads"]
        kv = cfg.get("num_kv_heads") or heads
        rows = (heads + 2 * kv) + heads  # q, k, v and the heads' outputs
        rows += (heads + kv) if rope else 0  # rotated q and k
        rows += 2 * heads if kv != heads else 0  # k and v repeated for each query head of a group
        return item * seq * hd * rows + 4 * seq * heads, 0
    if node.type == "cost" and cfg["cost_function"] in ("ce", "ce_logits") and outs:
        logits = graph.producer(node.id, 0)
        if logits is not None and logits.outputs:
            size = 4 * logits.outputs[0].numel  # float32 log-softmax kept for backward
            return size * (1 if compute_dtype == torch.float32 else 2), size
    return 0, 0


def estimate_training_memory(graph: Graph, batch: int, *, compute_dtype: torch.dtype = torch.float32,
                             optimizers: Mapping[str, str] | None = None, train: bool = True,
                             want_logits: bool = False) -> MemoryEstimate:
    """Bytes a training step of `graph` at `batch` needs (see the module docstring).

    `optimizers` maps VNode id -> "adam" | "sgd" | "none" (default: the node's
    `optimizer` config, adam when unset).  With `train=False` only parameters
    and the largest live activations count (inference).
    """
    item = _activation_item(compute_dtype)
    layout = remat_layout(graph)
    rebuilt: dict[object, int] = {}  # per colocation group: bytes a remat region rebuilds (per sample)
    params = grads = opt_state = 0
    saved = 0  # per sample
    largest = 0  # per sample
    fixed_workspace = 0
    for node in graph.topo_order():
        cfg = node.cfg
        numel = sum(prod(s) for s in node.op.param_shapes(cfg).values())
        params += 4 * numel
        kind = (optimizers or {}).get(node.id) or cfg.get("optimizer") or "adam"
        if train and numel and kind != "none":
            grads += 4 * numel
            opt_state += 8 * numel if kind in ("adam", "adamw") else 0
        if node.type == "broadcast":
            continue
        kept_before = saved
        outs = list(node.outputs)
        if node.type == "tied_lm_head_ce":
            rows, vocab, dim = prod(outs[1].shape[:-1]), cfg["out_dim"], cfg["in_dim"]
            if not want_logits:
                outs = outs[:1]
            chunk = min(rows * batch, K.default_ce_chunk_size(vocab, dim=dim))
            fixed_workspace = max(fixed_workspace, 4 * (2 * vocab * dim + chunk * vocab))
            saved += 4 * rows
        read_later = _saved_by_a_reader(graph, node.id)
        for t in outs:
            size = t.numel * (item if t.kind == "float" else _ITEM[t.dtype])
            saved += size if read_later else 0
            largest = max(largest, size)
        extra, peak = _op_saved_bytes(graph, node, outs, item, compute_dtype)
        saved += extra
        largest = max(largest, peak)
        if node.id in layout.reexecuted:  # remat: rebuilt in backward instead of kept
            out_bytes = sum(t.numel * (item if t.kind == "float" else _ITEM[t.dtype]) for t in outs) * read_later
            moved = saved - kept_before - (0 if node.id in layout.recomputed else out_bytes)
            group = layout.groups[layout.region_of[node.id]]
            rebuilt[group] = rebuilt.get(group, 0) + moved
            saved -= moved
    saved += max(rebuilt.values(), default=0)
    if not train:  # inference keeps nothing for backward: the largest live tensors only
        return MemoryEstimate(batch, params, 0, 0, 2 * largest, 0, fixed_workspace)
    return MemoryEstimate(batch, params, grads, opt_state, saved, 2 * largest, fixed_workspace)


def available_memory(device: str | torch.device) -> tuple[int | None, str]:
    """(bytes the device can still give, where that number comes from); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device} (torch.cuda.mem_get_info)"
    if device.type == "cpu":
        return available_host_memory()
    return None, f"unknown for device type {device.type!r}"


def check_memory(graph: Graph, batch: int, device: str | torch.device, *,
                 compute_dtype: torch.dtype = torch.float32, optimizers: Mapping[str, str] | None = None,
                 limit: int | None = None) -> MemoryEstimate:
    """Raise `MemoryRefused` (with the estimate) if a training step cannot fit; else return the estimate.

    `limit` overrides the detected free memory (bytes), e.g. to leave room for
    other jobs; it is also how tests exercise the refusal.
    """
    estimate = estimate_training_memory(graph, batch, compute_dtype=compute_dtype, optimizers=optimizers)
    if limit is not None:
        available, source = int(limit), "the given memory limit"
    else:
        available, source = available_memory(device)
    if available is None or estimate.total <= available:
        return estimate
    fits = estimate.largest_batch(available)
    advice = (f"a batch of at most {fits} might fit; lower --batch" if fits >= 1 else
              "even batch 1 does not fit: use a smaller network or a device with more memory")
    raise MemoryRefused(f"network {graph.name!r} needs an estimated {estimate.describe()}, but {device} has "
                        f"only {_gib(available)} ({source}); {advice}. Nothing was allocated.")
