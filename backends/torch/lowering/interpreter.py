"""A slow reference interpreter: runs the IR node by node in plain tensor math.

It is the test oracle for the compiled module, so it shares as little as
possible with it: every built-in op is written out here again in the most
direct form (explicit softmax attention per head, the fused attention split
back into its heads, full logits for the fused LM-head loss, layernorm from
mean and variance).  Only ops this file does not know (plugin ops) fall back
to their registered lowering, executed eagerly.

Conventions match the compiled module: feeds are `{"<node>:in<slot>": value}`,
parameters a state dict `{"<vnode_id>.<param>": tensor}` in the graph's own
layout (a tied weight under its publisher), activations batch-first, losses
float32 (float64 when the parameters are float64).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import Graph, VNode

from . import kernels as K
from .lower import feed_name
from .ops import LowerCtx, get_lowering

__all__ = ["interpret", "REFERENCE"]

Params = Mapping[str, torch.Tensor]


class _Node:
    """What a reference rule sees: config, inputs, parameters, mode."""

    def __init__(self, graph: Graph, node: VNode, inputs: list[Any], params: Params, training: bool,
                 tokenizer: Any) -> None:
        self.graph, self.node, self.inputs, self.params = graph, node, inputs, params
        self.cfg = node.cfg
        self.training = training
        self.tokenizer = tokenizer

    def p(self, name: str) -> torch.Tensor:
        return self.params[f"{self.node.id}.{name}"]

    def tied(self, name: str) -> torch.Tensor:
        alias, _ = self.node.op.tied(self.cfg)[name]
        return self.params[f"{self.graph.publishers()[alias].id}.weight"]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.matmul(x, w.t())
    return y if b is None else y + b


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE from first principles: pair (x[i], x[i + hd/2]) turns by p * theta^(-2i/hd)."""
    seq, hd = x.shape[-2], x.shape[-1]
    half = hd // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _head(x: torch.Tensor, wq, bq, wk, bk, wv, bv, *, causal: bool, rope_theta: float | None) -> torch.Tensor:
    k = _linear(x, wk, bk)
    return _attend(_linear(x, wq, bq), k if rope_theta is None else _rope(k, rope_theta), _linear(x, wv, bv),
                   causal=causal, rope_theta=rope_theta)


def _theta(cfg: Mapping[str, Any]) -> float | None:
    return float(cfg["rope_theta"]) if cfg["position_encoding"] == "rope" else None


def _embedder(n: _Node) -> list[Any]:
    x = n.p("weight")[n.inputs[0]]
    if n.cfg["position_encoding"] == "learned":
        x = x + n.p("position")
    return [x]


def _linear_node(n: _Node) -> list[Any]:
    if n.cfg.get("tie_weight_alias"):
        return [_linear(n.inputs[0], n.tied("weight"))]
    return [_linear(n.inputs[0], n.p("weight"), n.p("bias") if n.cfg["bias"] else None)]


def _layernorm(n: _Node) -> list[Any]:
    x = n.inputs[0]
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return [(x - mean) / torch.sqrt(var + n.cfg["eps"]) * n.p("weight") + n.p("bias")]


def _rmsnorm(n: _Node) -> list[Any]:
    x = n.inputs[0]
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = wide / torch.sqrt((wide * wide).mean(dim=-1, keepdim=True) + n.cfg["eps"])
    return [n.p("weight").to(x.dtype) * normed.to(x.dtype)]


def _bias(n: _Node, name: str) -> torch.Tensor | None:
    return n.p(name) if n.cfg["qkv_bias"] else None


def _attention_head(n: _Node) -> list[Any]:
    cfg = n.cfg
    if not cfg["kv_input"]:
        return [_head(n.inputs[0], n.p("wq"), _bias(n, "bq"), n.p("wk"), _bias(n, "bk"), n.p("wv"), _bias(n, "bv"),
                      causal=cfg["causal"], rope_theta=_theta(cfg))]
    hd = cfg["head_dim"]
    kv = n.inputs[1]  # a kv_head's keys (rotated already) and values: the rotation must not be applied twice
    return [_attend(_linear(n.inputs[0], n.p("wq"), _bias(n, "bq")), kv[..., :hd], kv[..., hd:],
                    causal=cfg["causal"], rope_theta=_theta(cfg))]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            rope_theta: float | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v with q rotated here and k given as it is."""
    if rope_theta is not None:
        q = _rope(q, rope_theta)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        future = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=q.device), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _kv_head(n: _Node) -> list[Any]:
    x, theta = n.inputs[0], _theta(n.cfg)
    k = _linear(x, n.p("wk"), _bias(n, "bk"))
    return [torch.cat([k if theta is None else _rope(k, theta), _linear(x, n.p("wv"), _bias(n, "bv"))], dim=-1)]


def _attention(n: _Node) -> list[Any]:
    """The fused layer as the heads it stands for: query head h's q is row block h, its k and v the blocks
    H + g and H + KV + g of its K/V head g = h // (H / KV) (g = h without grouped-query attention)."""
    cfg = n.cfg
    heads, hd = cfg["num_heads"], cfg["head_dim"]
    kv_heads = cfg.get("num_kv_heads") or heads
    w, b = n.p("qkv_weight"), (n.p("qkv_bias") if cfg["qkv_bias"] else None)

    def block(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return None if t is None else t[i * hd:(i + 1) * hd]

    def group(h: int) -> int:
        return h // (heads // kv_heads)

    outs = [_head(n.inputs[0], block(w, h), block(b, h), block(w, heads + group(h)), block(b, heads + group(h)),
                  block(w, heads + kv_heads + group(h)), block(b, heads + kv_heads + group(h)),
                  causal=cfg["causal"], rope_theta=_theta(cfg)) for h in range(heads)]
    out = torch.cat(outs, dim=-1)
    if cfg["output_projection"]:
        out = _linear(out, n.p("out_weight"), n.p("out_bias"))
    return [out]


def _ce_from_logits(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = log_probs.gather(1, safe[:, None]).squeeze(1)
    return -(picked * valid).sum() / valid.sum()


def _loss_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _tied_lm_head_ce(n: _Node) -> list[Any]:
    x, targets = n.inputs
    logits = _linear(x.to(_loss_dtype(x)), n.tied("weight").to(_loss_dtype(x)))
    loss = _ce_from_logits(logits, targets, n.cfg["ignore_index"]) if targets is not None else None
    return [loss, logits]


def _cost(n: _Node) -> list[Any]:
    pred, target = n.inputs
    pred = pred.to(_loss_dtype(pred))
    fn = n.cfg["cost_function"]
    if fn == "mse":
        return [((pred - target.to(pred.dtype)) ** 2).mean()]
    if fn == "ce_logits":
        return [_ce_from_logits(pred, target, n.cfg["ignore_index"])]
    log_p = torch.log(pred.clamp_min(torch.finfo(pred.dtype).tiny))
    return [_nll(log_p, target, n.cfg["ignore_index"])]


def _nll(log_p: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    log_p = log_p.reshape(-1, log_p.shape[-1])
    targets = targets.reshape(-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    return -(log_p.gather(1, safe[:, None]).squeeze(1) * valid).sum() / valid.sum()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new, as written in its paper's appendix."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _swiglu(n: _Node) -> list[Any]:
    x = n.inputs[0]
    half = x.shape[-1] // 2
    value, gate = x[..., :half], x[..., half:]
    return [value * gate * torch.sigmoid(gate)]


def _dropout(n: _Node) -> list[Any]:
    x = n.inputs[0]
    return [F.dropout(x, p=n.cfg["rate"], training=True) if n.training and n.cfg["rate"] > 0 else x]


def _stack(n: _Node) -> list[Any]:
    axis = n.cfg["axis"]
    return [torch.cat(list(n.inputs), dim=axis + 1 if axis >= 0 else axis)]


def _reshape(n: _Node) -> list[Any]:
    x = n.inputs[0]
    return [x.reshape(x.shape[0], *n.cfg["target_shape"])]


def _mask(n: _Node) -> list[Any]:
    x, cfg = n.inputs[0], n.cfg
    seq_q, seq_k = x.shape[-2:]
    if cfg["causal"]:
        rows = torch.arange(seq_q, device=x.device)[:, None]
        cols = torch.arange(seq_k, device=x.device)[None, :]
        x = torch.where(cols > rows, torch.full_like(x, cfg["mask_val"]), x)
    if n.training and cfg["random_prob"] > 0:  # the random part has one definition: the kernel's
        x = K.apply_mask(x, causal=False, mask_val=cfg["mask_val"], random_prob=cfg["random_prob"],
                         seed=cfg["seed"], training=True)
    return [x]


def _codec(n: _Node):
    from tokenizers import Tokenizer

    path = n.cfg.get("vocab_path")
    tokenizer = Tokenizer.from_file(str(path)) if path else n.tokenizer
    if tokenizer is None:
        raise VGraphError(f"node {n.node.id!r}: a {n.node.type} needs vocab_path or tokenizer=")
    return tokenizer


def _tokenizer(n: _Node) -> list[Any]:
    tok = _codec(n)
    texts = [n.inputs[0]] if isinstance(n.inputs[0], str) else list(n.inputs[0])
    pad = tok.token_to_id("<|pad|>") or 0
    length = n.cfg["pad_length"]
    rows = []
    for text in texts:
        ids = tok.encode(text).ids[:length]
        rows.append(ids + [pad] * (length - len(ids)))
    return [torch.tensor(rows, dtype=torch.int64)]


def _detokenizer(n: _Node) -> list[Any]:
    tok = _codec(n)
    return [[tok.decode(row, skip_special_tokens=True) for row in n.inputs[0].tolist()]]


REFERENCE: dict[str, Callable[[_Node], list[Any]]] = {
    "embedder": _embedder,
    "linear": _linear_node,
    "layernorm": _layernorm,
    "rmsnorm": _rmsnorm,
    "attention_head": _attention_head,
    "kv_head": _kv_head,
    "attention": _attention,
    "tied_lm_head_ce": _tied_lm_head_ce,
    "cost": _cost,
    "relu": lambda n: [torch.clamp_min(n.inputs[0], 0)],
    "gelu": lambda n: [_gelu_tanh(n.inputs[0]) if n.cfg["approximate"] == "tanh" else
                       0.5 * n.inputs[0] * (1 + torch.erf(n.inputs[0] / math.sqrt(2.0)))],
    "silu": lambda n: [n.inputs[0] * torch.sigmoid(n.inputs[0])],
    "swiglu": _swiglu,
    "dropout": _dropout,
    "broadcast": lambda n: [n.inputs[0]] * n.node.num_outputs,
    "stack": _stack,
    "add": lambda n: [n.inputs[0] + n.inputs[1]],
    "reshape": _reshape,
    "mask": _mask,
    "tokenizer": _tokenizer,
    "detokenizer": _detokenizer,
}


class _EagerEmitter:
    """Runs a lowering rule's calls immediately (plugin ops in the interpreter)."""

    def __init__(self, params: Params, modules: Mapping[str, Any]) -> None:
        self.params, self.modules = params, modules

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def param(self, node_id: str, name: str) -> torch.Tensor:
        return self.params[f"{node_id}.{name}"]

    def call_module(self, node_id: str, args: tuple) -> Any:
        if node_id not in self.modules:
            raise VGraphError(f"node {node_id!r}: its lowering calls a module; pass modules= to interpret")
        return self.modules[node_id](*args)


def _wanted(graph: Graph, want: str | Sequence[str] | None) -> list[tuple[str, str, int]]:
    endpoints = {ep.name: ep for ep in [*graph.outputs, *graph.costs]}
    names = list(endpoints) if want is None else ([want] if isinstance(want, str) else list(want))
    out = []
    for name in names:
        if name in endpoints:
            out.append((name, endpoints[name].node, endpoints[name].slot))
        else:
            node_id, _, slot = name.rpartition(":")
            if node_id not in graph or not slot.isdigit():
                raise VGraphError(f"network {graph.name!r} has no output or cost named {name!r}")
            out.append((name, node_id, int(slot)))
    return out


def interpret(graph: Graph, params: Params, feeds: Mapping[str, Any], *,
              want: str | Sequence[str] | None = None, training: bool = False, tokenizer: Any = None,
              modules: Mapping[str, Any] | None = None, values: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Run `graph` on `feeds` with `params`; returns {name: value} like the compiled module.

    Every node needed by `want` (default: all outputs and costs) runs, in
    topological order, with all of its inputs.  If `values` is given it is
    filled with every computed value as "<node>:<slot>" (for debugging and
    for comparing intermediate results).
    """
    targets = _wanted(graph, want)
    needed = {node_id for _, node_id, _ in targets}
    for node in reversed(graph.topo_order()):
        if node.id in needed:
            needed.update(e.src for e in graph.in_edges(node.id))
    results: dict[tuple[str, int], Any] = {}
    for node in graph.topo_order():
        if node.id not in needed:
            continue
        inputs = []
        for slot in range(graph.num_inputs(node.id)):
            edge = graph.input_edge(node.id, slot)
            if edge is not None:
                inputs.append(results[(edge.src, edge.src_slot)])
            elif feed_name(node.id, slot) in feeds:
                inputs.append(feeds[feed_name(node.id, slot)])
            elif node.type == "tied_lm_head_ce" and slot == 1:
                inputs.append(None)  # logits only
            else:
                raise VGraphError(f"network {graph.name!r}: missing feed {feed_name(node.id, slot)}")
        rule = REFERENCE.get(node.type)
        if rule is not None:
            outs = rule(_Node(graph, node, inputs, params, training, tokenizer))
        else:
            lowering = get_lowering(node)
            emitter = _EagerEmitter(params, modules or {})
            ctx = LowerCtx(node, graph, inputs, frozenset(range(node.num_outputs)), training, emitter)
            outs = list(lowering.emit(ctx))
        for slot, value in enumerate(outs):
            results[(node.id, slot)] = value
            if values is not None:
                values[f"{node.id}:{slot}"] = value
    return {name: results[(node_id, slot)] for name, node_id, slot in targets}
