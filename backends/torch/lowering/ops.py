"""Per-op-type lowering rules: an IR op name -> the PyTorch computation of one VNode.

A rule is written once against a small `LowerCtx` and serves two executors:
`lower.py` hands it an emitter that records torch.fx nodes (the compiled,
readable GraphModule), and the reference interpreter can hand it an eager
emitter that simply calls the functions (how a plugin op runs there).

Rules are looked up by the canonical `OpDef.name`, so an op type a plugin
registers with `vgraph.register_op` gets its PyTorch meaning from
`register_lowering("my_op")` in the same plugin; nothing here is special-cased.

Conventions every rule follows:

* activations carry the batch dimension first: a per-sample `[S, D]` is `[B, S, D]`;
* a rule returns one value per output slot, `None` for a slot nobody reads
  (`ctx.needed`), so e.g. `tied_lm_head_ce` never forms logits unless asked;
* a rule reads its parameters with `ctx.param(name)` (owned) or
  `ctx.tied(name)` (the publisher's Parameter: one object, one gradient);
* losses come out in float32 whatever the compute dtype (the production
  policy); mixed precision itself is torch.autocast's job, around the call.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vgraph.base.diagnostics import Diagnostic, VGraphError
from vgraph.ir.graph import Graph, VNode
from vgraph.plugins import require_lowering

from . import decode as D
from . import kernels as K
from .wire_formats import CompressState
from .dropout import keyed_dropout, node_stream

__all__ = [
    "Value",
    "Emitter",
    "LowerCtx",
    "Lowering",
    "LOWERINGS",
    "register_lowering",
    "get_lowering",
    "default_init",
    "attention_head_sdpa",
    "query_head_sdpa",
    "kv_head_projection",
    "cost_loss",
    "TextCodec",
]

Value = Any  # an fx.Node while tracing, a tensor (or list of str) when run eagerly
InitFn = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


class Emitter(Protocol):
    """What a rule's computation is recorded into (fx) or executed by (eager)."""

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Value: ...
    def param(self, node_id: str, name: str) -> Value: ...
    def call_module(self, node_id: str, args: tuple) -> Value: ...


@dataclass
class LowerCtx:
    """Everything a lowering rule sees for one VNode."""

    node: VNode
    graph: Graph
    inputs: list[Value]  # one per input slot; None where the slot is not needed
    needed: frozenset[int]  # output slots somebody reads
    training: bool
    emitter: Emitter
    publishers: dict[str, VNode] = field(default_factory=dict)
    decode: D.DecodeCtx | None = None  # a decode program's positions, mask and caches (decode.py)

    @property
    def cfg(self) -> dict[str, Any]:
        return self.node.cfg

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Value:
        return self.emitter.call(fn, args, kwargs)

    def param(self, name: str) -> Value:
        """A parameter this VNode owns ("<id>.<name>")."""
        return self.emitter.param(self.node.id, name)

    def tied(self, name: str) -> Value:
        """A tied parameter: the publisher's own weight, read through its alias."""
        alias, _ = self.node.op.tied(self.cfg)[name]
        publisher = self.publishers.get(alias) or self.graph.publishers().get(alias)
        if publisher is None:
            raise VGraphError([Diagnostic(f"tie_weight_alias {alias!r} has no publisher", self.node.loc,
                                          self.node.id)])
        return self.emitter.param(publisher.id, "weight")

    def own_module(self, *args: Any) -> Value:
        """Call this VNode's own nn.Module (text codecs, plugin ops with state)."""
        return self.emitter.call_module(self.node.id, args)


@dataclass(frozen=True)
class Lowering:
    """How one op type becomes PyTorch.

    `emit` records the computation.  `init` gives a parameter's initial value
    (None: `default_init`).  `inputs_needed(needed_outputs, num_inputs)` says
    which input slots the requested outputs depend on (None: all), so that a
    graph run for its logits alone needs no targets.  `make_module(node,
    options)` builds the VNode's own nn.Module when it needs more than its
    parameters (None: a plain parameter namespace).

    For a decode program (a KV cache, decode.py): `positionwise` says the
    output at a position reads that position alone, so the rule runs
    unchanged on new positions (a bool, or a predicate of the VNode);
    `caches(node)` gives the per-sample shape of the VNode's empty key cache
    (values alike; 0 on the growing axis), or None for a config that caches
    nothing, and the rule then reads `ctx.decode` and extends the cache.  A
    rule that declares neither (the default, the safe one for a plugin)
    keeps its network from decoding incrementally.
    """

    op: str
    emit: Callable[[LowerCtx], Sequence[Value | None]]
    init: InitFn | None = None
    inputs_needed: Callable[[frozenset[int], int], frozenset[int]] | None = None
    make_module: Callable[[VNode, dict[str, Any]], nn.Module] | None = None
    origin: str = "vgraph"
    positionwise: bool | Callable[[VNode], bool] = False
    caches: Callable[[VNode], tuple[int, ...] | None] | None = None

    def is_positionwise(self, node: VNode) -> bool:
        return bool(self.positionwise(node) if callable(self.positionwise) else self.positionwise)

    def caches_for(self, node: VNode) -> tuple[int, ...] | None:
        """The empty key cache's per-sample shape (decode programs), None when `node` caches nothing."""
        return self.caches(node) if self.caches is not None else None


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(op: str, *, init: InitFn | None = None,
                      inputs_needed: Callable[[frozenset[int], int], frozenset[int]] | None = None,
                      make_module: Callable[[VNode, dict[str, Any]], nn.Module] | None = None,
                      replace: bool = False, origin: str = "vgraph",
                      positionwise: bool | Callable[[VNode], bool] = False,
                      caches: Callable[[VNode], tuple[int, ...] | None] | None = None):
    """Decorator: `emit` becomes the torch lowering of op type `op` (its canonical name); `positionwise` and
    `caches` declare how it runs in a decode program (`Lowering`)."""
    from vgraph.ops import REGISTRY

    name = REGISTRY.canonical(op) or op

    def deco(emit: Callable[[LowerCtx], Sequence[Value | None]]):
        if name in LOWERINGS and not replace:
            raise ValueError(f"op type {name!r} already has a torch lowering (from {LOWERINGS[name].origin})")
        LOWERINGS[name] = Lowering(name, emit, init, inputs_needed, make_module, origin, positionwise, caches)
        return emit

    return deco


def get_lowering(node: VNode) -> Lowering:
    """The node's rule; a plugin's lowering is loaded (its entry point run) when first needed."""
    return require_lowering("torch", node, LOWERINGS)


# --------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------

INIT_STD = 0.02


def _is_bias(name: str) -> bool:
    return name == "bias" or name.endswith("_bias") or name in ("bq", "bk", "bv")


def default_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Biases zero, every other parameter normal(0, 0.02) (GPT-2's scheme)."""
    if _is_bias(name):
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)


def _layernorm_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.ones(shape) if name == "weight" else torch.zeros(shape)  # rmsnorm: its weight alone


# --------------------------------------------------------------------------
# Helpers the emitted code calls
# --------------------------------------------------------------------------


def attention_head_sdpa(x: torch.Tensor, wq: torch.Tensor, bq: torch.Tensor | None, wk: torch.Tensor,
                        bk: torch.Tensor | None, wv: torch.Tensor, bv: torch.Tensor | None, *, causal: bool,
                        rope_theta: float | None) -> torch.Tensor:
    """One attention head `[B, S, D] -> [B, S, hd]` on scaled_dot_product_attention.

    Same math as `kernels.attention_head` (the explicit reference): RoPE in
    the rotate-half convention on q and k, scale 1/sqrt(hd), causal mask.
    Biases are None for a head without them (qkv_bias false).
    """
    q = F.linear(x, wq, bq)
    k = F.linear(x, wk, bk)
    v = F.linear(x, wv, bv)
    if rope_theta is not None:
        cos, sin = K.rope_cos_sin(x.shape[1], q.shape[-1], rope_theta, q.device, q.dtype)
        q = K.apply_rope(q, cos, sin)
        k = K.apply_rope(k, cos, sin)
    # A head axis of 1 lets SDPA pick its fused (flash / memory-efficient) kernels.
    out = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=causal)
    return out.squeeze(1)


def kv_head_projection(x: torch.Tensor, wk: torch.Tensor, bk: torch.Tensor | None, wv: torch.Tensor,
                       bv: torch.Tensor | None, *, rope_theta: float | None) -> torch.Tensor:
    """A `kv_head`: `[B, S, D] -> [B, S, 2*hd]`, its keys (RoPE applied, as the query heads expect them)
    then its values, one tensor so that it is one edge to each query head of the group."""
    k = F.linear(x, wk, bk)
    if rope_theta is not None:
        cos, sin = K.rope_cos_sin(x.shape[1], k.shape[-1], rope_theta, k.device, k.dtype)
        k = K.apply_rope(k, cos, sin)
    return torch.cat([k, F.linear(x, wv, bv)], dim=-1)


def query_head_sdpa(x: torch.Tensor, kv: torch.Tensor, wq: torch.Tensor, bq: torch.Tensor | None, *,
                    causal: bool, rope_theta: float | None) -> torch.Tensor:
    """An `attention_head` with kv_input: its own query from `x [B, S, D]`, the keys and values of its
    group's kv_head from `kv [B, S, 2*hd]` (keys already rotated); the math of `attention_head_sdpa`."""
    q = F.linear(x, wq, bq)
    if rope_theta is not None:
        cos, sin = K.rope_cos_sin(x.shape[1], q.shape[-1], rope_theta, q.device, q.dtype)
        q = K.apply_rope(q, cos, sin)
    k, v = kv.unsqueeze(1).chunk(2, dim=-1)
    out = F.scaled_dot_product_attention(q.unsqueeze(1), k, v, is_causal=causal)
    return out.squeeze(1)


def cost_loss(pred: torch.Tensor, target: torch.Tensor, *, function: str, ignore_index: int) -> torch.Tensor:
    """A `cost` node's loss, always computed and returned in float32 (float64 stays float64)."""
    dtype = torch.promote_types(pred.dtype, torch.float32)
    with torch.autocast(device_type=pred.device.type, enabled=False):
        pred = pred.to(dtype)
        if function == "mse":
            return F.mse_loss(pred, target.to(dtype))
        classes = pred.shape[-1]
        flat_pred, flat_target = pred.reshape(-1, classes), target.reshape(-1)
        if function == "ce_logits":
            return F.cross_entropy(flat_pred, flat_target, ignore_index=ignore_index)
        if function == "ce":  # from probabilities; clamped so that p=0 gives a large finite loss
            log_probs = torch.log(flat_pred.clamp_min(torch.finfo(dtype).tiny))
            return F.nll_loss(log_probs, flat_target, ignore_index=ignore_index)
    raise ValueError(f"unknown cost_function {function!r}")


class TextCodec(nn.Module):
    """A tokenizer / detokenizer VNode: HF `tokenizers` BPE, text <-> int64 ids.

    The tokenizer comes from the node's `vocab_path` (a tokenizers JSON file)
    or from the `tokenizer=` given to compile_network.  Ids are truncated or
    right-padded to `pad_length` with the `<|pad|>` id (0 if the vocabulary
    has none).  `use_word_boundary_tokens` is accepted and has no effect: the
    byte-level BPE already encodes word boundaries in its tokens.
    """

    def __init__(self, node: VNode, tokenizer: Any) -> None:
        super().__init__()
        self.node_id = node.id
        self.tokenizer = tokenizer
        self.encode_text = node.type == "tokenizer"
        self.pad_length = int(node.cfg.get("pad_length") or 0)
        pad = tokenizer.token_to_id("<|pad|>")
        self.pad_id = 0 if pad is None else int(pad)
        # Follows .to(device) so ids land where the model is; not saved.
        self.register_buffer("_device_probe", torch.empty(0), persistent=False)

    def forward(self, x: Any) -> Any:
        if self.encode_text:
            texts = [x] if isinstance(x, str) else list(x)
            rows = [e.ids[: self.pad_length] for e in self.tokenizer.encode_batch(texts)]
            rows = [r + [self.pad_id] * (self.pad_length - len(r)) for r in rows]
            return torch.tensor(rows, dtype=torch.int64, device=self._device_probe.device)
        ids = x.tolist() if isinstance(x, torch.Tensor) else x
        return self.tokenizer.decode_batch(ids, skip_special_tokens=True)


def _make_text_codec(node: VNode, options: dict[str, Any]) -> nn.Module:
    path = node.cfg.get("vocab_path")
    if path:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a plain Exception for bad files
            raise VGraphError([Diagnostic(f"cannot load vocab_path {path!r}: {exc}", node.loc, node.id)]) from None
    elif options.get("tokenizer") is not None:
        tokenizer = options["tokenizer"]
    else:
        raise VGraphError([Diagnostic(
            f"a {node.type} needs a vocabulary: set its vocab_path to a tokenizers JSON file or pass "
            f"tokenizer= to compile_network", node.loc, node.id)])
    return TextCodec(node, tokenizer)


# --------------------------------------------------------------------------
# The built-in catalog
# --------------------------------------------------------------------------


def _batch_dim(axis: int) -> int:
    """A per-sample axis (batch excluded) as a tensor dim (batch first)."""
    return axis + 1 if axis >= 0 else axis


@register_lowering("embedder", positionwise=True)
def _embedder(ctx: LowerCtx):
    x = ctx.call(F.embedding, ctx.inputs[0], ctx.param("weight"))
    if ctx.cfg["position_encoding"] == "learned" and ctx.decode is not None:
        x = ctx.call(D.embed_positions, x, ctx.param("position"), ctx.decode.positions)
    elif ctx.cfg["position_encoding"] == "learned":
        x = ctx.call(K.add_positions, x, ctx.param("position"))
    return [x]


def _optional(ctx: LowerCtx, name: str) -> Value | None:
    """A parameter the node's config may leave out (a bias with bias / qkv_bias false): None then."""
    return ctx.param(name) if name in ctx.node.op.param_shapes(ctx.cfg) else None


@register_lowering("linear", positionwise=True)
def _linear(ctx: LowerCtx):
    if ctx.cfg.get("tie_weight_alias"):
        return [ctx.call(F.linear, ctx.inputs[0], ctx.tied("weight"))]
    if not ctx.cfg["bias"]:
        return [ctx.call(F.linear, ctx.inputs[0], ctx.param("weight"))]
    return [ctx.call(F.linear, ctx.inputs[0], ctx.param("weight"), ctx.param("bias"))]


@register_lowering("layernorm", init=_layernorm_init, positionwise=True)
def _layernorm(ctx: LowerCtx):
    cfg = ctx.cfg
    return [ctx.call(F.layer_norm, ctx.inputs[0], (cfg["dim"],), ctx.param("weight"), ctx.param("bias"),
                     cfg["eps"])]


@register_lowering("rmsnorm", init=_layernorm_init, positionwise=True)
def _rmsnorm(ctx: LowerCtx):
    return [ctx.call(K.rms_norm, ctx.inputs[0], ctx.param("weight"), eps=ctx.cfg["eps"])]


def _rope_theta(cfg: dict[str, Any]) -> float | None:
    return float(cfg["rope_theta"]) if cfg["position_encoding"] == "rope" else None


def _head_cache(node: VNode) -> tuple[int, ...] | None:
    """A causal head caches `[past, head_dim]`; a query head of a GQA group caches nothing (its kv_head does)."""
    return (0, int(node.cfg["head_dim"])) if node.cfg["causal"] and not node.cfg["kv_input"] else None


def _attention_cache(node: VNode) -> tuple[int, ...] | None:
    """A causal fused attention caches its K/V heads, `[kv_heads, past, head_dim]`."""
    cfg = node.cfg
    return (int(cfg.get("num_kv_heads") or cfg["num_heads"]), 0, int(cfg["head_dim"])) if cfg["causal"] else None


@register_lowering("attention_head", positionwise=lambda n: n.cfg["kv_input"] and n.cfg["causal"],
                   caches=_head_cache)
def _attention_head(ctx: LowerCtx):
    cfg = ctx.cfg
    if ctx.decode is not None:
        return [_attention_head_step(ctx)]
    if cfg["kv_input"]:
        return [ctx.call(query_head_sdpa, ctx.inputs[0], ctx.inputs[1], ctx.param("wq"), _optional(ctx, "bq"),
                         causal=cfg["causal"], rope_theta=_rope_theta(cfg))]
    p = ctx.param
    b = functools.partial(_optional, ctx)
    return [ctx.call(attention_head_sdpa, ctx.inputs[0], p("wq"), b("bq"), p("wk"), b("bk"), p("wv"), b("bv"),
                     causal=cfg["causal"], rope_theta=_rope_theta(cfg))]


def _attention_head_step(ctx: LowerCtx) -> Value:
    """An attention_head in a decode program: a query head reads its kv_head's keys and values (the past
    included); a head with its own keys extends its cache."""
    cfg, dec = ctx.cfg, ctx.decode
    rope = {"rope_theta": _rope_theta(cfg), "context": int(cfg["seq_len"])}
    if cfg["kv_input"]:
        return ctx.call(D.query_head_step, ctx.inputs[0], ctx.inputs[1], ctx.param("wq"), _optional(ctx, "bq"),
                        dec.positions, dec.mask, **rope)
    p, b = ctx.param, functools.partial(_optional, ctx)
    step = ctx.call(D.head_step, ctx.inputs[0], p("wq"), b("bq"), p("wk"), b("bk"), p("wv"), b("bv"),
                    *dec.past[ctx.node.id], dec.positions, dec.mask, **rope)
    return _record_present(ctx, step)


def _record_present(ctx: LowerCtx, step: Value) -> Value:
    """Result 0 of a caching step; results 1 and 2 (keys and values so far) become the VNode's present."""
    parts = [ctx.call(operator.getitem, step, i) for i in range(3)]
    ctx.decode.present[ctx.node.id] = (parts[1], parts[2])
    return parts[0]


@register_lowering("kv_head", caches=lambda n: (0, int(n.cfg["head_dim"])))
def _kv_head(ctx: LowerCtx):
    p, b = ctx.param, functools.partial(_optional, ctx)
    if ctx.decode is not None:
        step = ctx.call(D.kv_head_step, ctx.inputs[0], p("wk"), b("bk"), p("wv"), b("bv"),
                        *ctx.decode.past[ctx.node.id], ctx.decode.positions, rope_theta=_rope_theta(ctx.cfg),
                        context=int(ctx.cfg["seq_len"]))
        return [_record_present(ctx, step)]
    return [ctx.call(kv_head_projection, ctx.inputs[0], p("wk"), b("bk"), p("wv"), b("bv"),
                     rope_theta=_rope_theta(ctx.cfg))]


@register_lowering("attention", caches=_attention_cache)
def _attention(ctx: LowerCtx):
    cfg = ctx.cfg
    out_w = ctx.param("out_weight") if cfg["output_projection"] else None
    out_b = ctx.param("out_bias") if cfg["output_projection"] else None
    kv = {"num_kv_heads": cfg["num_kv_heads"]} if cfg.get("num_kv_heads") not in (None, cfg["num_heads"]) else {}
    if ctx.decode is not None:
        step = ctx.call(D.attention_step, ctx.inputs[0], ctx.param("qkv_weight"), _optional(ctx, "qkv_bias"),
                        out_w, out_b, *ctx.decode.past[ctx.node.id], ctx.decode.positions, ctx.decode.mask,
                        num_heads=cfg["num_heads"], head_dim=cfg["head_dim"], num_kv_heads=kv.get("num_kv_heads"),
                        rope_theta=_rope_theta(cfg), context=int(ctx.cfg["seq_len"]))
        return [_record_present(ctx, step)]
    return [ctx.call(K.multihead_attention, ctx.inputs[0], ctx.param("qkv_weight"), _optional(ctx, "qkv_bias"),
                     out_w, out_b, num_heads=cfg["num_heads"], head_dim=cfg["head_dim"],
                     causal=cfg["causal"], rope_theta=_rope_theta(cfg), **kv)]


def _lm_head_inputs(needed: frozenset[int], num_inputs: int) -> frozenset[int]:
    return frozenset({0, 1}) if 0 in needed else frozenset({0})  # logits alone need no targets


@register_lowering("tied_lm_head_ce", inputs_needed=_lm_head_inputs, positionwise=True)
def _tied_lm_head_ce(ctx: LowerCtx):
    weight = ctx.tied("weight")
    loss = logits = None
    if 1 in ctx.needed:
        logits = ctx.call(K.logits_chunk, ctx.inputs[0], weight)
    if 0 in ctx.needed and logits is not None:
        # Both read (e.g. an inference run returning every output): the logits
        # exist anyway, so the loss comes from them instead of a second matmul.
        loss = ctx.call(cost_loss, logits, ctx.inputs[1], function="ce_logits",
                        ignore_index=ctx.cfg["ignore_index"])
    elif 0 in ctx.needed:  # chunked: the [B, S, V] logits never exist
        loss = ctx.call(K.tied_lm_head_ce, ctx.inputs[0], weight, ctx.inputs[1],
                        ignore_index=ctx.cfg["ignore_index"])
    return [loss, logits]


@register_lowering("cost")
def _cost(ctx: LowerCtx):
    return [ctx.call(cost_loss, ctx.inputs[0], ctx.inputs[1], function=ctx.cfg["cost_function"],
                     ignore_index=ctx.cfg["ignore_index"])]


for _name, _fn in (("relu", F.relu), ("silu", F.silu), ("swiglu", K.swiglu)):
    register_lowering(_name, positionwise=True)(lambda ctx, _fn=_fn: [ctx.call(_fn, ctx.inputs[0])])


@register_lowering("gelu", positionwise=True)
def _gelu(ctx: LowerCtx):
    if ctx.cfg["approximate"] == "tanh":
        return [ctx.call(F.gelu, ctx.inputs[0], approximate="tanh")]
    return [ctx.call(F.gelu, ctx.inputs[0])]


@register_lowering("dropout", positionwise=True)
def _dropout(ctx: LowerCtx):
    rate = ctx.cfg["rate"]
    if not ctx.training or rate == 0.0:
        return [ctx.inputs[0]]  # identity: nothing is emitted
    # Keyed by (seed, step, VNode, sample) when a trainer sets a key (dropout.py), so a
    # micro-batched, partitioned step draws the same masks as the single-process one.
    # The id's stream number is computed here, once, so the traced step hashes nothing.
    return [ctx.call(keyed_dropout, ctx.inputs[0], p=rate, node=ctx.node.id,
                     stream=node_stream(ctx.node.id))]


@register_lowering("broadcast", positionwise=True)
def _broadcast(ctx: LowerCtx):
    return [ctx.inputs[0]] * ctx.node.num_outputs  # copies are the same tensor: no work


def _off_sequence_axis(node: VNode) -> bool:
    """A stack joins per-head outputs along features (positionwise), or along the sequence (not)."""
    rank = len(node.outputs[0].shape) if node.outputs else 0
    return rank > 0 and node.cfg["axis"] % rank != 0


@register_lowering("stack", positionwise=_off_sequence_axis)
def _stack(ctx: LowerCtx):
    inputs = list(ctx.inputs)
    if len(inputs) == 1:
        return inputs
    return [ctx.call(torch.cat, inputs, dim=_batch_dim(ctx.cfg["axis"]))]


@register_lowering("add", positionwise=True)
def _add(ctx: LowerCtx):
    return [ctx.call(operator.add, ctx.inputs[0], ctx.inputs[1])]


@register_lowering("reshape")
def _reshape(ctx: LowerCtx):
    return [ctx.call(K.reshape, ctx.inputs[0], tuple(ctx.cfg["target_shape"]))]


@register_lowering("mask")
def _mask(ctx: LowerCtx):
    cfg = ctx.cfg
    return [ctx.call(K.apply_mask, ctx.inputs[0], causal=cfg["causal"], mask_val=float(cfg["mask_val"]),
                     random_prob=float(cfg["random_prob"]), seed=int(cfg["seed"]), training=ctx.training)]


@register_lowering("tokenizer", make_module=_make_text_codec)
def _tokenizer(ctx: LowerCtx):
    return [ctx.own_module(ctx.inputs[0])]


@register_lowering("detokenizer", make_module=_make_text_codec)
def _detokenizer(ctx: LowerCtx):
    return [ctx.own_module(ctx.inputs[0])]


# Boundary VNodes of a partitioned network's parts (vgraph/ops/boundary.py): a `send` is its
# input (the part returns it as an output), a `receive` is the tensor fed as "<id>:in0", and a
# `weight_replica` only owns the copy of a tied weight its part reads (`vgraph launch` keeps it
# equal to the publisher's).
# A `compress` VNode: the wire round trip of its codecs, forward and back (compression.py); its module holds
# the codecs and the error-feedback residuals.  Under `vgraph launch` the transport does the same work on the
# real wire instead (vgraph/run/step_plan.py lifts it out of the sender's program).
register_lowering("compress", make_module=lambda node, options: CompressState(node.cfg))(
    lambda ctx: [ctx.own_module(ctx.inputs[0])])
register_lowering("send")(lambda ctx: [ctx.inputs[0]])
register_lowering("receive")(lambda ctx: [ctx.inputs[0]])
register_lowering("weight_replica")(lambda ctx: [])

