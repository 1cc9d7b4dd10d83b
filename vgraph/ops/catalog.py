"""The built-in node type catalog (docs/network-yaml.md lists it, generated from here).

Each op is one `OpDef`: schema, arity, inference, parameters, FLOPs per
sample (forward; a training step costs about three times that).  Parameter
counts follow the production networks: attention heads have Q/K/V biases (unless
`qkv_bias: false`, as Llama), a tied linear (the LM head) has no bias of its own.
"""
from __future__ import annotations

from math import prod
from typing import Sequence

from vgraph.ops.registry import Config, InferCtx, OpDef, OpExample, register_op, same_as_input
from vgraph.ops.schema import F, Schema
from vgraph.types import ShapeError, TensorType

T = TensorType
E = OpExample
ROPE = ("rope", "none")
# The examples' sizes (`check-onnx --ops`): small, and distinct so a transposed weight cannot fit.
_S, _D, _HD, _V = 8, 16, 8, 24


def _lead(t: TensorType) -> int:
    """Number of rows a per-row op processes: all dims but the last."""
    return prod(t.shape[:-1]) if t.shape else 1


def _elementwise(per_elem: int):
    return lambda cfg, ins, outs: per_elem * outs[0].numel


def _check_rank(t: TensorType, rank: int, what: str, slot: int = 0) -> None:
    if len(t.shape) != rank:
        raise ShapeError(f"input {slot} has shape {list(t.shape)} but {what} needs rank {rank}")


# -- trainable layers ---------------------------------------------------------

def _linear_infer(ctx: InferCtx) -> list[TensorType]:
    ctx.require_last_dim(0, ctx.cfg["in_dim"], "in_dim")
    x = ctx.single()
    return [T(x.shape[:-1] + (ctx.cfg["out_dim"],), ctx.dtype)]


def _linear_params(cfg: Config) -> dict[str, tuple[int, ...]]:
    if cfg.get("tie_weight_alias"):
        return {}
    p = {"weight": (cfg["out_dim"], cfg["in_dim"])}
    if cfg["bias"]:
        p["bias"] = (cfg["out_dim"],)
    return p


def _tied_weight(cfg: Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A tied output projection reads the [out_dim, in_dim] (= [vocab, dim]) embedding."""
    alias = cfg.get("tie_weight_alias")
    return {"weight": (alias, (cfg["out_dim"], cfg["in_dim"]))} if alias else {}


register_op(OpDef(
    "linear", "layer", "y = x W^T + b; with tie_weight_alias, W is the aliased matrix and there is no bias",
    aliases=("dense",),
    schema=Schema((F("in_dim", "int", required=True, min=1, doc="size of the input's last dimension"),
                   F("out_dim", "int", required=True, min=1, doc="size of the output's last dimension"),
                   F("bias", "bool", True, doc="false: y = x W^T, no bias parameter (a tied linear never has one)"))),
    infer=_linear_infer, params=_linear_params, tied_params=_tied_weight,
    flops=lambda cfg, ins, outs: 2 * _lead(ins[0]) * cfg["in_dim"] * cfg["out_dim"],
    examples=(E({"in_dim": _D, "out_dim": 12}, ((_S, _D),)),
              E({"in_dim": _D, "out_dim": 12, "bias": False}, ((_S, _D),), "nobias"),
              E({"in_dim": _D, "out_dim": _V, "tie_weight_alias": "tok"}, ((_S, _D),), "tied")),
))


def _embedder_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.single()
    if x.shape != (ctx.cfg["seq_len"],):
        raise ShapeError(f"token ids have shape {list(x.shape)} but seq_len={ctx.cfg['seq_len']} "
                         f"needs [{ctx.cfg['seq_len']}]")
    return [T((ctx.cfg["seq_len"], ctx.cfg["dim"]), ctx.dtype)]


def _embedder_params(cfg: Config) -> dict[str, tuple[int, ...]]:
    p = {"weight": (cfg["vocab_size"], cfg["dim"])}
    if cfg["position_encoding"] == "learned":
        p["position"] = (cfg["seq_len"], cfg["dim"])
    return p


register_op(OpDef(
    "embedder", "layer", "token ids [seq] -> vectors [seq, dim], optionally adding a position encoding",
    schema=Schema((
        F("vocab_size", "int", required=True, min=1, doc="rows of the embedding matrix (token ids 0 to vocab_size-1)"),
        F("dim", "int", required=True, min=1, doc="width of each token's vector"),
        F("seq_len", "int", required=True, min=1, doc="tokens per sample"),
        F("position_encoding", default="none", choices=("learned", "rope", "none"),
          doc="learned: adds a trained [seq_len, dim] table; rope and none add nothing here (heads apply RoPE)"),
        F("rope_theta", "float", 10000.0, min=1e-6, doc="RoPE base frequency, for the heads that read it"),
    )),
    input_kind="int",
    network_input=lambda cfg, slot, ins: T((cfg["seq_len"],), "int64"),
    infer=_embedder_infer, params=_embedder_params,
    flops=lambda cfg, ins, outs: outs[0].numel if cfg["position_encoding"] == "learned" else 0,
    advice=lambda cfg: ["position_encoding 'rope' does nothing on an embedder: RoPE is applied by the "
                        "attention heads that say position_encoding: rope (write 'none' here)"]
    if cfg["position_encoding"] == "rope" else [],
    examples=tuple(E({"vocab_size": _V, "dim": _D, "seq_len": _S, "position_encoding": pe}, label=pe)
                   for pe in ("none", "learned")),
))


def _layernorm_infer(ctx: InferCtx) -> list[TensorType]:
    ctx.require_last_dim(0, ctx.cfg["dim"], "dim")
    return same_as_input(ctx)


register_op(OpDef(
    "layernorm", "layer", "layer normalisation over the last dimension with learned scale and shift",
    schema=Schema((F("dim", "int", required=True, min=1, doc="size of the normalised last dimension"),
                   F("eps", "float", 1e-5, min=0.0, doc="added to the variance before the square root"))),
    infer=_layernorm_infer,
    params=lambda cfg: {"weight": (cfg["dim"],), "bias": (cfg["dim"],)},
    flops=_elementwise(8),
    examples=(E({"dim": _D}, ((_S, _D),)),),
))

register_op(OpDef(
    "rmsnorm", "layer", "RMS normalisation over the last dimension with a learned scale, computed in float32: "
    "y = x / sqrt(mean(x^2) + eps) * weight (Llama, Qwen2)",
    schema=Schema((F("dim", "int", required=True, min=1, doc="size of the normalised last dimension"),
                   F("eps", "float", 1e-6, min=0.0, doc="added to the mean square before the square root"))),
    infer=_layernorm_infer,
    params=lambda cfg: {"weight": (cfg["dim"],)},
    flops=_elementwise(4),
    examples=(E({"dim": _D}, ((_S, _D),)), E({"dim": _D, "eps": 0.5}, ((_S, _D),), "eps")),
))

_ATTN_COMMON = (
    F("seq_len", "int", required=True, min=1, doc="tokens per sample"),
    F("causal", "bool", True, doc="a position attends only to itself and earlier positions"),
    F("position_encoding", default="none", choices=ROPE, doc="rope: rotary encoding of Q and K (even head_dim)"),
    F("rope_theta", "float", 10000.0, min=1e-6, doc="RoPE base frequency"),
)


def _check_rope(cfg: Config) -> None:
    if cfg["position_encoding"] == "rope" and cfg["head_dim"] % 2:
        raise ShapeError(f"position_encoding=rope needs an even head_dim, got {cfg['head_dim']}")


def _attention_flops(seq: int, dim: int, heads: int, hd: int) -> int:
    # Q/K/V projections + scores + weighted sum (full square; causal skips about half).
    return 3 * 2 * seq * dim * heads * hd + 2 * 2 * seq * seq * heads * hd


_QKV_BIAS_DOC = "false: the Q, K and V projections have no bias (Llama); true: each has one (GPT-2, Qwen2)"


def _check_seq_input(x: TensorType, cfg: Config, slot: int, width: int, what: str) -> None:
    _check_rank(x, 2, "a head's input ([seq, width])", slot)
    if x.shape != (cfg["seq_len"], width):
        raise ShapeError(f"input {slot} has shape {list(x.shape)} but seq_len={cfg['seq_len']} and {what} "
                         f"need [{cfg['seq_len']}, {width}]")


def _head_infer(ctx: InferCtx) -> list[TensorType]:
    cfg = ctx.cfg
    _check_rope(cfg)
    _check_seq_input(ctx.single(), cfg, 0, cfg["input_dim"], f"input_dim={cfg['input_dim']}")
    if cfg["kv_input"]:
        if len(ctx.inputs) < 2:
            raise ShapeError("kv_input is true but input 1 (the keys and values of a kv_head) is not connected")
        _check_seq_input(ctx.inputs[1], cfg, 1, 2 * cfg["head_dim"],
                         f"head_dim={cfg['head_dim']} (a kv_head's keys and values, 2 x head_dim wide)")
        _check_kv_rotation(cfg, ctx.source(1))
    elif len(ctx.inputs) > 1:
        raise ShapeError("input 1 is connected but kv_input is false (set kv_input: true to read the keys "
                         "and values of a kv_head there)")
    return [T((cfg["seq_len"], cfg["head_dim"]), ctx.dtype)]


def _check_kv_rotation(cfg: Config, source: tuple[str, str, Config] | None) -> None:
    """A kv_head rotates the keys, the query head its query: with different RoPE the scores would silently
    compare positions in two different encodings."""
    if source is None or source[1] != "kv_head":
        return
    kv_id, _, kv = source
    keys = ("position_encoding", "rope_theta") if cfg["position_encoding"] == "rope" else ("position_encoding",)
    differ = [f"{k}={kv[k]!r} there, {cfg[k]!r} here" for k in keys if kv[k] != cfg[k]]
    if differ:
        raise ShapeError(f"its kv_head '{kv_id}' rotates the keys differently ({'; '.join(differ)}): a query "
                         "head and its kv_head need the same position_encoding and rope_theta")


def _projections(cfg: Config, names: str) -> dict[str, tuple[int, ...]]:
    """w<x> [head_dim, input_dim] and, with qkv_bias, b<x> [head_dim] for each projection x in `names`."""
    hd, d = cfg["head_dim"], cfg["input_dim"]
    p: dict[str, tuple[int, ...]] = {}
    for x in names:
        p[f"w{x}"] = (hd, d)
        if cfg["qkv_bias"]:
            p[f"b{x}"] = (hd,)
    return p


def _head_flops(cfg: Config, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
    if not cfg["kv_input"]:
        return _attention_flops(cfg["seq_len"], cfg["input_dim"], 1, cfg["head_dim"])
    seq, hd = cfg["seq_len"], cfg["head_dim"]
    return 2 * seq * cfg["input_dim"] * hd + 2 * 2 * seq * seq * hd  # Q projection, scores, weighted sum


_HEAD_SHAPE = (F("head_dim", "int", required=True, min=1, doc="width of Q, K, V and the output"),
               F("input_dim", "int", required=True, min=1, doc="width of the input"))

register_op(OpDef(
    "attention_head", "layer", "one attention head [seq, input_dim] -> [seq, head_dim] with its own Q, K, V; "
    "with kv_input, only its own Q, reading K and V from a kv_head shared by a group of heads (GQA)",
    aliases=("singleheadattention",),
    schema=Schema((*_HEAD_SHAPE, *_ATTN_COMMON, F("qkv_bias", "bool", True, doc=_QKV_BIAS_DOC),
                   F("kv_input", "bool", False,
                     doc="true: input 1 is a kv_head's [seq, 2 x head_dim] keys and values, and the head owns "
                         "only wq (and bq)"))),
    num_inputs=(1, 2),
    infer=_head_infer, params=lambda cfg: _projections(cfg, "q" if cfg["kv_input"] else "qkv"),
    flops=_head_flops,
    examples=(E({"head_dim": _HD, "input_dim": _D, "seq_len": _S, "position_encoding": "rope"}, ((_S, _D),), "rope"),
              E({"head_dim": _HD, "input_dim": _D, "seq_len": _S, "causal": False}, ((_S, _D),), "plain"),
              E({"head_dim": _HD, "input_dim": _D, "seq_len": _S, "qkv_bias": False, "position_encoding": "rope"},
                ((_S, _D),), "nobias"),
              E({"head_dim": _HD, "input_dim": _D, "seq_len": _S, "kv_input": True, "qkv_bias": False,
                 "position_encoding": "rope"}, ((_S, _D), (_S, 2 * _HD)), "kv"),
              E({"head_dim": _HD, "input_dim": _D, "seq_len": _S, "kv_input": True, "causal": False},
                ((_S, _D), (_S, 2 * _HD)), "kv-bias")),
))


def _kv_head_infer(ctx: InferCtx) -> list[TensorType]:
    cfg = ctx.cfg
    _check_rope(cfg)
    _check_seq_input(ctx.single(), cfg, 0, cfg["input_dim"], f"input_dim={cfg['input_dim']}")
    return [T((cfg["seq_len"], 2 * cfg["head_dim"]), ctx.dtype)]


register_op(OpDef(
    "kv_head", "layer", "the keys and values of one K/V head, shared by the query heads of its group (GQA, MQA): "
    "[seq, input_dim] -> [seq, 2 x head_dim] = concat(K with RoPE applied, V), read by attention_heads with "
    "kv_input",
    schema=Schema((F("head_dim", "int", required=True, min=1, doc="width of K and of V (the output is 2 x head_dim)"),
                   _HEAD_SHAPE[1], *(f for f in _ATTN_COMMON if f.name != "causal"),  # its query heads mask
                   F("qkv_bias", "bool", True, doc="false: the K and V projections have no bias"))),
    infer=_kv_head_infer, params=lambda cfg: _projections(cfg, "kv"),
    flops=lambda cfg, ins, outs: 2 * 2 * cfg["seq_len"] * cfg["input_dim"] * cfg["head_dim"],
    examples=(E({"head_dim": _HD, "input_dim": _D, "seq_len": _S, "position_encoding": "rope"}, ((_S, _D),), "rope"),
              E({"head_dim": 6, "input_dim": _D, "seq_len": _S, "qkv_bias": False}, ((_S, _D),), "plain")),
))


def attention_dim(cfg: Config) -> int:
    return cfg["dim"] if cfg.get("dim") else cfg["num_heads"] * cfg["head_dim"]


def kv_heads(cfg: Config) -> int:
    """K/V heads of an `attention` node: num_kv_heads, or one per query head when unset."""
    return cfg.get("num_kv_heads") or cfg["num_heads"]


def _mha_infer(ctx: InferCtx) -> list[TensorType]:
    cfg = ctx.cfg
    _check_rope(cfg)
    heads, kv = cfg["num_heads"], kv_heads(cfg)
    if heads % kv:
        raise ShapeError(f"num_heads={heads} is not a multiple of num_kv_heads={kv}: every K/V head serves "
                         "the same number of query heads")
    dim = attention_dim(cfg)
    x = ctx.single()
    if x.shape != (cfg["seq_len"], dim):
        raise ShapeError(f"input has shape {list(x.shape)} but seq_len={cfg['seq_len']}, dim={dim} "
                         f"need [{cfg['seq_len']}, {dim}]")
    if cfg.get("fused_from"):
        count = len(fused_ids(cfg))
        if count != heads + kv and not (count == heads and kv == heads):
            either = f"{heads} heads or " if kv == heads else ""
            raise ShapeError(f"fused_from names {count} nodes but num_heads={heads}, num_kv_heads={kv} need "
                             f"{either}{heads} query heads followed by {kv} kv_heads")
    width = dim if cfg["output_projection"] else heads * cfg["head_dim"]
    return [T((cfg["seq_len"], width), ctx.dtype)]


def _mha_params(cfg: Config) -> dict[str, tuple[int, ...]]:
    inner, dim = cfg["num_heads"] * cfg["head_dim"], attention_dim(cfg)
    rows = (cfg["num_heads"] + 2 * kv_heads(cfg)) * cfg["head_dim"]
    p = {"qkv_weight": (rows, dim)}
    if cfg["qkv_bias"]:
        p["qkv_bias"] = (rows,)
    if cfg["output_projection"]:
        p.update(out_weight=(dim, inner), out_bias=(dim,))
    return p


def fused_ids(cfg: Config) -> list[str]:
    return [x.strip() for x in (cfg.get("fused_from") or "").split(",") if x.strip()]


def _mha_sources(cfg: Config) -> dict[str, list[tuple[str, int]]]:
    """qkv rows are all query heads' Q, then every K/V head's K, then their V, in `fused_from` order.

    `fused_from` names num_heads attention_heads (each with its own K and V),
    or num_heads query heads (kv_input) followed by num_kv_heads kv_heads.
    """
    ids, heads, hd = fused_ids(cfg), cfg["num_heads"], cfg["head_dim"]
    if len(ids) == heads:
        rows = [(h, x) for x in "qkv" for h in ids]
    else:
        q, kv = ids[:heads], ids[heads:]
        rows = [(h, "q") for h in q] + [(g, "k") for g in kv] + [(g, "v") for g in kv]
    out = {"qkv_weight": [(f"{node}.w{x}", hd) for node, x in rows]}
    if cfg["qkv_bias"]:
        out["qkv_bias"] = [(f"{node}.b{x}", hd) for node, x in rows]
    return out


def _mha_flops(cfg: Config, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
    heads, hd, seq, dim = cfg["num_heads"], cfg["head_dim"], cfg["seq_len"], attention_dim(cfg)
    proj = 2 * seq * heads * hd * dim if cfg["output_projection"] else 0
    qkv = 2 * seq * dim * (heads + 2 * kv_heads(cfg)) * hd
    return qkv + 2 * 2 * seq * seq * heads * hd + proj


register_op(OpDef(
    "attention", "layer", "all heads in one VNode: combined Q/K/V (and optional output) weights; fewer K/V "
    "heads than query heads with num_kv_heads (GQA, MQA)",
    aliases=("multiheadattention",),
    schema=Schema((F("num_heads", "int", required=True, min=1, doc="number of (query) heads"),
                   F("head_dim", "int", required=True, min=1, doc="width of each head"),
                   F("dim", "int", min=1, doc="width of the input (unset: num_heads x head_dim)"), *_ATTN_COMMON,
                   F("output_projection", "bool", False,
                     doc="true: also owns the [dim, num_heads x head_dim] output projection"),
                   F("num_kv_heads", "int", min=1,
                     doc="K/V heads, each shared by num_heads / num_kv_heads consecutive query heads (GQA; 1: "
                         "MQA); unset: num_heads"),
                   F("qkv_bias", "bool", True, doc=_QKV_BIAS_DOC))),
    infer=_mha_infer, params=_mha_params, flops=_mha_flops, param_sources=_mha_sources,
    examples=(E({"num_heads": 2, "head_dim": _HD, "dim": _D, "seq_len": _S, "position_encoding": "rope"},
                ((_S, _D),), "rope"),
              E({"num_heads": 3, "head_dim": 6, "dim": 12, "seq_len": _S, "output_projection": True,
                 "position_encoding": "rope"}, ((_S, 12),), "projection"),
              E({"num_heads": 2, "head_dim": _HD, "dim": _D, "seq_len": _S, "causal": False}, ((_S, _D),), "plain"),
              E({"num_heads": 4, "num_kv_heads": 2, "head_dim": 4, "dim": _D, "seq_len": _S, "qkv_bias": False,
                 "position_encoding": "rope"}, ((_S, _D),), "gqa"),
              E({"num_heads": 3, "num_kv_heads": 1, "head_dim": 6, "dim": 12, "seq_len": _S,
                 "output_projection": True}, ((_S, 12),), "mqa")),
))


def _token_targets(cfg: Config, slot: int, ins: Sequence[TensorType | None]) -> TensorType | None:
    """Targets of a cross-entropy are token ids shaped like the logits' rows."""
    if slot != 1 or ins[0] is None:
        return None
    pred = ins[0]
    if cfg.get("cost_function", "ce") == "mse":
        return T(pred.shape, pred.dtype)
    return T(pred.shape[:-1], "int64")


def _check_targets(ctx: InferCtx, rows: tuple[int, ...]) -> None:
    tgt = ctx.inputs[1]
    if tgt.shape != rows:
        raise ShapeError(f"targets (input 1) have shape {list(tgt.shape)} but the predictions need "
                         f"{list(rows)}")


def _loss_dtype(ctx: InferCtx) -> str:
    from vgraph.ops.schema import DTYPE_OF_PRECISION

    prec = ctx.cfg.get("cost_precision")
    return DTYPE_OF_PRECISION[prec] if prec else ctx.dtype


def _fused_ce_infer(ctx: InferCtx) -> list[TensorType]:
    ctx.require_last_dim(0, ctx.cfg["in_dim"], "in_dim")
    x = ctx.inputs[0]
    _check_targets(ctx, x.shape[:-1])
    return [T((), _loss_dtype(ctx)), T(x.shape[:-1] + (ctx.cfg["out_dim"],), ctx.dtype)]


register_op(OpDef(
    "tied_lm_head_ce", "layer",
    "tied LM head fused with cross-entropy: the loss without materialising [batch, seq, vocab] logits; "
    "output 1 gives the logits, computed only when read",
    aliases=("fusedlmheadce",),
    schema=Schema((F("in_dim", "int", required=True, min=1, doc="width of the hidden states (input 0)"),
                   F("out_dim", "int", required=True, min=1, doc="vocabulary size (the logits' width)"),
                   F("tie_weight_alias", required=True, doc="the published [out_dim, in_dim] embedding"),
                   F("cost_precision", "precision", doc="precision of the loss (unset: the node's own)"),
                   F("ignore_index", "int", -100, doc="targets equal to this count for nothing"))),
    num_inputs=2, num_outputs=2,
    input_kind=lambda cfg, slot: "float" if slot == 0 else "int",
    network_input=_token_targets,
    infer=_fused_ce_infer, params=lambda cfg: {}, tied_params=_tied_weight,
    flops=lambda cfg, ins, outs: 2 * _lead(ins[0]) * cfg["in_dim"] * cfg["out_dim"]
    + 5 * _lead(ins[0]) * cfg["out_dim"],
    is_cost=True,
    examples=(E({"in_dim": _D, "out_dim": _V, "tie_weight_alias": "tok"}, ((_S, _D),)),),
))

# -- activations --------------------------------------------------------------

for _name, _doc, _cost in (("relu", "max(x, 0)", 1), ("silu", "x * sigmoid(x)", 4)):
    register_op(OpDef(_name, "activation", _doc, flops=_elementwise(_cost), examples=(E({}, ((_S, _D),)),)))
register_op(OpDef(
    "gelu", "activation", "Gaussian error linear unit: x * Phi(x) (erf form), or its tanh approximation",
    schema=Schema((F("approximate", default="none", choices=("none", "tanh"),
                     doc="none: the exact erf form; tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), "
                         "GPT-2's gelu_new (torch's approximate='tanh')"),)),
    flops=_elementwise(8), examples=(E({}, ((_S, _D),)), E({"approximate": "tanh"}, ((_S, _D),), "tanh")),
))


def _swiglu_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.single()
    if not x.shape or x.shape[-1] % 2:
        raise ShapeError(f"input has shape {list(x.shape)} but swiglu needs an even last dimension")
    return [T(x.shape[:-1] + (x.shape[-1] // 2,), ctx.dtype)]


register_op(OpDef("swiglu", "activation", "[.., 2n] -> [.., n]: value * silu(gate), the value the first half of "
                  "the last dimension and the gate the second (Llama's up_proj rows, then gate_proj's)",
                  infer=_swiglu_infer, flops=_elementwise(5), examples=(E({}, ((_S, _D),)),)))
register_op(OpDef("dropout", "activation", "random dropout while training, identity otherwise",
                  schema=Schema((F("rate", "float", 0.1, min=0.0, max=0.999999,
                                   doc="probability of zeroing an element (the rest are scaled by 1/(1-rate))"),)),
                  flops=_elementwise(1), examples=(E({"rate": 0.5}, ((_S, _D),)),)))

# -- structural ---------------------------------------------------------------

register_op(OpDef(
    "broadcast", "structural", "copies its one input to N output slots",
    schema=Schema((F("num_outputs", "int", 2, min=1, doc="how many output slots carry the copy"),)),
    num_outputs=lambda cfg: cfg["num_outputs"], input_kind="any",
    infer=lambda ctx: [ctx.single()] * ctx.cfg["num_outputs"],
    examples=(E({"num_outputs": 3}, ((_S, _D),)),),
))


def _stack_infer(ctx: InferCtx) -> list[TensorType]:
    first = ctx.inputs[0]
    rank = len(first.shape)
    axis = ctx.cfg["axis"]
    if not -rank <= axis < rank:
        raise ShapeError(f"axis={axis} is out of range for inputs of rank {rank}")
    ax = axis % rank
    total = 0
    for i, t in enumerate(ctx.inputs):
        others = t.shape[:ax] + t.shape[ax + 1:] if len(t.shape) == rank else None
        if others != first.shape[:ax] + first.shape[ax + 1:]:
            raise ShapeError(f"input {i} has shape {list(t.shape)} but input 0 has {list(first.shape)}; "
                             f"they may differ only along axis {axis}")
        total += t.shape[ax]
    return [first.with_shape(first.shape[:ax] + (total,) + first.shape[ax + 1:])]


register_op(OpDef(
    "stack", "structural", "joins its inputs along a per-sample axis (N x [seq, hd] -> [seq, N*hd])",
    schema=Schema((F("axis", "int", -1, doc="per-sample axis to join along; negative counts from the end"),)),
    num_inputs=(1, None), infer=_stack_infer,
    examples=(E({"axis": -1}, ((_S, 4), (_S, 6), (_S, 2)), "features"), E({"axis": 0}, ((3, _D), (_S, _D)), "rows")),
))


def _add_infer(ctx: InferCtx) -> list[TensorType]:
    a, b = ctx.inputs
    if a.shape != b.shape:
        raise ShapeError(f"input 0 has shape {list(a.shape)} but input 1 has {list(b.shape)}")
    return [T(a.shape, ctx.dtype)]


register_op(OpDef("add", "structural", "adds its two inputs (residual connection)",
                  num_inputs=2, infer=_add_infer, flops=_elementwise(1), examples=(E({}, ((_S, _D), (_S, _D))),)))


def _reshape_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.single()
    target = list(ctx.cfg["target_shape"])
    known = prod(d for d in target if d != -1)
    if -1 in target:
        if x.numel % known:
            raise ShapeError(f"cannot reshape {list(x.shape)} into {target}")
        target[target.index(-1)] = x.numel // known
    if prod(target) != x.numel:
        raise ShapeError(f"cannot reshape {list(x.shape)} ({x.numel} elements) into {target} "
                         f"({prod(target)} elements)")
    return [x.with_shape(tuple(target))]


register_op(OpDef("reshape", "structural", "reshapes to an explicit per-sample shape",
                  schema=Schema((F("target_shape", "shape", required=True,
                                   doc="the per-sample result shape; one -1 is inferred"),)),
                  input_kind="any", infer=_reshape_infer,
                  examples=(E({"target_shape": [2, -1, 4]}, ((_S, _D),)),)))


def _mask_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.single()
    if ctx.cfg["causal"] and (len(x.shape) < 2 or x.shape[-1] != x.shape[-2]):
        raise ShapeError(f"input has shape {list(x.shape)} but a causal mask needs [.., seq, seq]")
    return same_as_input(ctx)


register_op(OpDef(
    "mask", "structural", "causal and/or random masking of [.., seq, seq] scores",
    schema=Schema((F("causal", "bool", True, doc="mask every score above the diagonal"),
                   F("mask_val", "float", -1e9, doc="the value masked scores get"),
                   F("random_prob", "float", 0.0, min=0.0, max=1.0,
                     doc="probability of masking each score at random as well"),
                   F("seed", "int", 0, doc="seed of the random mask"))),
    infer=_mask_infer, flops=_elementwise(1),
    examples=(E({"causal": True, "mask_val": -1e4}, ((3, _S, _S),), "causal"),
              E({"causal": False, "random_prob": 0.5}, ((_S, _S),), "off")),
))

# -- text I/O -----------------------------------------------------------------

register_op(OpDef(
    "tokenizer", "text", "text -> token ids [pad_length] with a trained BPE vocabulary",
    schema=Schema((F("vocab_size", "int", 50000, min=1, doc="size of the BPE vocabulary"),
                   F("pad_length", "int", required=True, min=1, doc="token ids per text (padded or cut)"),
                   F("vocab_path", doc="file of a trained vocabulary"),
                   F("use_word_boundary_tokens", "bool", False, doc="mark word starts with their own tokens"))),
    input_kind="str", network_input=lambda cfg, slot, ins: T((), "string"),
    infer=lambda ctx: [T((ctx.cfg["pad_length"],), "int64")],
))


def _detok_infer(ctx: InferCtx) -> list[TensorType]:
    _check_rank(ctx.single(), 1, "a detokenizer ([seq] token ids)")
    return [T((), "string")]


register_op(OpDef(
    "detokenizer", "text", "token ids -> text",
    schema=Schema((F("vocab_size", "int", 50000, min=1, doc="size of the BPE vocabulary"),
                   F("vocab_path", doc="file of a trained vocabulary"))),
    input_kind="int", infer=_detok_infer,
))

# -- training -----------------------------------------------------------------


def _cost_infer(ctx: InferCtx) -> list[TensorType]:
    cfg, pred = ctx.cfg, ctx.inputs[0]
    if cfg["cost_function"] == "mse":
        if ctx.inputs[1].shape != pred.shape:
            raise ShapeError(f"targets (input 1) have shape {list(ctx.inputs[1].shape)} but the "
                             f"predictions have {list(pred.shape)}")
    else:
        if not pred.shape:
            raise ShapeError("cross-entropy predictions need a class dimension")
        if cfg.get("vocab_size") and pred.shape[-1] != cfg["vocab_size"]:
            raise ShapeError(f"predictions have shape {list(pred.shape)} but vocab_size="
                             f"{cfg['vocab_size']} needs a last dimension of {cfg['vocab_size']}")
        _check_targets(ctx, pred.shape[:-1])
    return [T((), _loss_dtype(ctx))]


register_op(OpDef(
    "cost", "training", "a loss node: mse, ce (from probabilities) or ce_logits (from raw logits); input 0 is "
    "the predictions, input 1 the targets (token ids for ce and ce_logits, the predictions' shape for mse)",
    schema=Schema((F("cost_function", required=True, choices=("mse", "ce", "ce_logits"),
                     doc="mse; ce from probabilities; ce_logits from raw logits"),
                   F("vocab_size", "int", min=1, doc="if set, the predictions' last dimension must equal it"),
                   F("in_dim", "int", min=1, doc="width of the predictions, informational"),
                   F("cost_precision", "precision", doc="precision of the loss (float32 keeps it exact)"),
                   F("ignore_index", "int", -100, doc="cross-entropy targets equal to this count for nothing"))),
    num_inputs=2,
    input_kind=lambda cfg, slot: "float" if slot == 0 or cfg["cost_function"] == "mse" else "int",
    network_input=_token_targets, infer=_cost_infer,
    flops=lambda cfg, ins, outs: 5 * ins[0].numel, is_cost=True,
    examples=(E({"cost_function": "mse"}, ((_S, _D), (_S, _D)), "mse"),
              E({"cost_function": "ce_logits", "vocab_size": _V}, ((_S, _V),), "ce_logits")),
))
