"""Which Hugging Face causal LMs vgraph expresses, read from their config.json, and the network YAML of each.

A model directory's `config.json` is read into a `Spec` (sizes, norm, activation, position encoding,
biases, tie), refusing every architecture and every key that would make the network compute something
else than transformers does: an unknown `model_type`, rope scaling, an active sliding window, an
activation vgraph has no op for, a key this module does not know with a value that is not null.  What a
key does is listed once (`_GENERIC`, `_FAMILY_KEYS`); a key in neither is refused, never ignored, so a
config written by a newer transformers that adds a computation-changing key is refused until it is read.

`network(spec)` builds the network as the production networks are laid out: one colocation group per
transformer block, the embedder, final norm, LM head and loss in `token_embedding`, every attention head
its own VNode (`fused=False`) or one `attention` VNode per block.  Grouped-query attention (fewer K/V heads
than Q heads) puts each K/V head in a `kv_head` VNode read by the Q heads that share it (`attention_head` with
`kv_input: true`, docs/network-yaml.md), so head fusion and the partitioner see every head.

This module imports nothing heavy (no torch, no transformers): `vgraph import hf` refuses a model before
anything is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from vgraph.base.diagnostics import Diagnostic, VGraphError, quote
from vgraph.base.numbers import NumberError, checked_number
from vgraph.ir.builder import NetBuilder
from vgraph.ir.graph import Graph

__all__ = ["Spec", "FAMILIES", "SUPPORTED", "read_spec", "network", "recognise", "hf_config", "TOKENS_GROUP"]

FAMILIES = ("gpt2", "llama", "qwen2")
SUPPORTED = ("GPT-2 (model_type gpt2: learned positions, LayerNorm, GELU, tied head), "
             "Llama (llama: RoPE, RMSNorm, SwiGLU, grouped-query attention, tied or untied head), "
             "Qwen2 (qwen2: Llama with Q/K/V biases)")
TOKENS_GROUP = "token_embedding"
MAX_SIZE = 2**31 - 1  # a dimension larger than this is no model this machine could hold

# Keys every transformers config may carry that do not change what the model computes from token ids
# (generation defaults, labels, bookkeeping, the attention kernel's name).
_GENERIC = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
    "_attn_implementation_internal", "architectures", "transformers_version", "model_type", "torch_dtype", "dtype",
    "use_bfloat16", "return_dict", "output_hidden_states", "output_attentions", "torchscript", "tf_legacy_loss",
    "pruned_heads", "is_decoder", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix",
    "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "use_cache", "initializer_range", "gradient_checkpointing",
    "chunk_size_feed_forward", "tie_encoder_decoder", "cross_attention_hidden_size", "output_router_logits",
    "tie_word_embeddings", "is_encoder_decoder", "add_cross_attention",
})
# Per family: the keys read below (each checked), and those that only train (dropout) or describe.
_FAMILY_KEYS = {
    "gpt2": frozenset({"vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
                       "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
                       "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                       "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                       "summary_first_dropout"}),
    "llama": frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                        "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                        "attention_bias", "attention_dropout", "mlp_bias", "pretraining_tp"}),
    "qwen2": frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                        "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                        "attention_dropout", "use_sliding_window", "sliding_window", "max_window_layers",
                        "layer_types", "use_mrope"}),
}
# GPT-2's activation_function values vgraph has an op for: (op, its `approximate`).
_GPT2_ACTIVATIONS = {"gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
                     "gelu": ("gelu", "none"), "relu": ("relu", None), "silu": ("silu", None),
                     "swish": ("silu", None)}


@dataclass(frozen=True)
class Spec:
    """What vgraph needs of a model: its family and sizes, and every choice that changes the computation."""

    family: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    seq_len: int  # the network's sequence length (the model's maximum, or --seq-len)
    max_positions: int  # the model's own maximum (GPT-2: rows of its position table)
    eps: float
    activation: str  # gpt2: the HF activation_function; llama/qwen2: "silu" (SwiGLU)
    rope_theta: float | None  # None: learned positions (GPT-2)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied: bool
    dropout: float = 0.0  # residual dropout while training (GPT-2's resid_pdrop)
    embd_dropout: float = 0.0

    @property
    def norm(self) -> str:
        return "layernorm" if self.family == "gpt2" else "rmsnorm"


def _refuse(where: str, problem: str) -> VGraphError:
    return VGraphError(f"{where}: {problem}; vgraph imports {SUPPORTED}")


def read_spec(config: Mapping[str, Any], where: str, *, seq_len: int | None = None) -> Spec:
    """The `Spec` of a parsed config.json (`where` names it in messages), or a VGraphError naming the key."""
    if not isinstance(config, Mapping):
        raise _refuse(where, "not a JSON object")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        archs = config.get("architectures")
        raise _refuse(where, f"model_type {quote(model_type)}"
                      f"{' (architectures ' + quote(archs) + ')' if archs else ''} is not supported")
    known = _GENERIC | _FAMILY_KEYS[model_type]
    unknown = sorted(k for k, v in config.items() if k not in known and v is not None)
    if unknown:
        raise _refuse(where, f"key {quote(unknown[0])} (= {quote(config[unknown[0]], 60)}) is not one vgraph "
                      f"knows for {model_type}; it may change the computation, so the model is refused"
                      f"{' (also: ' + ', '.join(unknown[1:6]) + ')' if len(unknown) > 1 else ''}")
    reader = _Reader(config, where)
    for key, wanted in (("is_encoder_decoder", False), ("add_cross_attention", False)):
        if config.get(key) not in (None, wanted):
            raise _refuse(where, f"{key}={quote(config[key])} is not supported (decoder-only models only)")
    spec = _gpt2(reader) if model_type == "gpt2" else _llama(reader, model_type)
    if seq_len is not None:
        if seq_len > spec.max_positions:
            raise VGraphError(f"--seq-len {seq_len} is longer than the model's {spec.max_positions} positions")
        spec = replace(spec, seq_len=seq_len)
    return spec


class _Reader:
    """Typed values of one config, each refusal naming its key."""

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        self.config, self.where = config, where

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def int(self, key: str, default: int | None = None, *, low: int = 1) -> int:
        value = default if self.config.get(key) is None else self.config[key]  # null: transformers' default
        if value is None:
            raise _refuse(self.where, f"key {quote(key)} is missing")
        try:
            return int(checked_number(value, key, integer=True, low=low, high=MAX_SIZE))
        except NumberError as exc:
            raise VGraphError(f"{self.where}: {exc}") from None

    def float(self, key: str, default: float | None = None, *, low: float = 0.0, high: float | None = None) -> float:
        value = default if self.config.get(key) is None else self.config[key]
        if value is None:
            raise _refuse(self.where, f"key {quote(key)} is missing")
        try:
            return float(checked_number(value, key, low=low, high=high))
        except NumberError as exc:
            raise VGraphError(f"{self.where}: {exc}") from None

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise VGraphError(f"{self.where}: {key} must be true or false, got {quote(value)}")
        return value

    def require(self, key: str, allowed: tuple[Any, ...], why: str) -> None:
        value = self.config.get(key)
        if value is not None and value not in allowed:
            raise _refuse(self.where, f"{key}={quote(value)} is not supported ({why})")


def _gpt2(r: _Reader) -> Spec:
    dim, heads = r.int("n_embd"), r.int("n_head")
    if dim % heads:
        raise VGraphError(f"{r.where}: n_embd={dim} is not a multiple of n_head={heads}")
    act = r.config.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise _refuse(r.where, f"activation_function {quote(act)} is not supported (supported: "
                      f"{', '.join(_GPT2_ACTIVATIONS)})")
    r.require("scale_attn_weights", (True,), "vgraph's attention always scales by 1/sqrt(head_dim)")
    r.require("scale_attn_by_inverse_layer_idx", (False,), "vgraph's attention does not scale by layer")
    positions = r.int("n_positions")
    if r.has("n_ctx") and r.int("n_ctx") != positions:
        raise VGraphError(f"{r.where}: n_ctx={r.int('n_ctx')} differs from n_positions={positions}")
    if r.config.get("tie_word_embeddings") is False:
        raise _refuse(r.where, "tie_word_embeddings=false is not supported for gpt2 (its head is the embedding)")
    return Spec("gpt2", vocab=r.int("vocab_size"), dim=dim, layers=r.int("n_layer"), heads=heads, kv_heads=heads,
                head_dim=dim // heads, ffn=r.int("n_inner") if r.has("n_inner") else 4 * dim,
                seq_len=positions, max_positions=positions, eps=r.float("layer_norm_epsilon", 1e-5),
                activation=act, rope_theta=None, qkv_bias=True, o_bias=True, mlp_bias=True, tied=True,
                dropout=r.float("resid_pdrop", 0.1, high=0.999999),
                embd_dropout=r.float("embd_pdrop", 0.1, high=0.999999))


def _rope_theta(r: _Reader) -> float:
    """RoPE's base from `rope_theta` (transformers 4) or `rope_parameters` (5); any scaling is refused."""
    params = r.config.get("rope_parameters")
    scaling = r.config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise VGraphError(f"{r.where}: {key} must be an object, got {quote(value)}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise _refuse(r.where, f"{key} with rope_type {quote(kind)} is not supported (only unscaled RoPE, "
                          f"rope_type 'default')")
        extra = sorted(set(value) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise _refuse(r.where, f"{key} key {quote(extra[0])} is not supported (only rope_theta)")
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        theta = _Reader(params, f"{r.where}: rope_parameters").float("rope_theta", low=1e-6)
        if r.has("rope_theta") and r.float("rope_theta", low=1e-6) != theta:
            raise VGraphError(f"{r.where}: rope_theta={r.config['rope_theta']} differs from "
                              f"rope_parameters.rope_theta={theta}")
        return theta
    return r.float("rope_theta", 10000.0, low=1e-6)


def _llama(r: _Reader, family: str) -> Spec:
    dim, heads = r.int("hidden_size"), r.int("num_attention_heads")
    kv_heads = r.int("num_key_value_heads", heads) if r.has("num_key_value_heads") else heads
    if heads % kv_heads:
        raise VGraphError(f"{r.where}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    if r.has("head_dim"):
        head_dim = r.int("head_dim")
    elif dim % heads:
        raise VGraphError(f"{r.where}: hidden_size={dim} is not a multiple of num_attention_heads={heads}")
    else:
        head_dim = dim // heads
    if head_dim % 2:
        raise VGraphError(f"{r.where}: head_dim={head_dim} is odd; RoPE rotates pairs")
    r.require("hidden_act", ("silu", "swish"), "the MLP is SwiGLU, silu(gate) * up")
    r.require("pretraining_tp", (1,), "tensor-parallel slicing of the projections")
    theta = _rope_theta(r)
    if family == "qwen2":
        r.require("use_mrope", (False,), "multimodal RoPE")
        types = r.config.get("layer_types")
        if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
            raise _refuse(r.where, "layer_types other than full_attention (a sliding window) are not supported")
        if r.flag("use_sliding_window", False):
            raise _refuse(r.where, "use_sliding_window=true is not supported (vgraph's attention sees the whole "
                          "causal context)")
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = r.flag("attention_bias", False)
        mlp_bias = r.flag("mlp_bias", False)
    positions = r.int("max_position_embeddings")
    return Spec(family, vocab=r.int("vocab_size"), dim=dim, layers=r.int("num_hidden_layers"), heads=heads,
                kv_heads=kv_heads, head_dim=head_dim, ffn=r.int("intermediate_size"), seq_len=positions,
                max_positions=positions, eps=r.float("rms_norm_eps", 1e-6), activation="silu", rope_theta=theta,
                qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                tied=r.flag("tie_word_embeddings", False))


# -- the network -------------------------------------------------------------------------------------------


def network(spec: Spec, name: str, *, fused: bool = False) -> Graph:
    """The network of `spec`, laid out as the production networks are (see the module docstring).

    Long because it is the one place the whole layout reads top to bottom: embedder, the blocks (norm,
    heads, projection, residual, norm, MLP, residual), final norm, LM head, loss."""
    b = NetBuilder(name)
    tok = dict(colocate_group=TOKENS_GROUP, colocate_policy="required")
    adam = dict(optimizer="adam")
    b.node("embedder", "embedder", vocab_size=spec.vocab, dim=spec.dim, seq_len=spec.seq_len,
           position_encoding="learned" if spec.rope_theta is None else "none",
           shared_weight_alias=TOKENS_GROUP if spec.tied else None, **tok, **adam)
    last = "embedder"
    if spec.embd_dropout > 0:
        last = b.chain(last, b.node("embedder_dropout", "dropout", rate=spec.embd_dropout, **tok))
    for i in range(spec.layers):
        last = _block(b, spec, i, last, fused)
    b.edge(last, _norm(b, spec, "final_norm", tok))
    b.node("lm_head", "linear", in_dim=spec.dim, out_dim=spec.vocab,
           tie_weight_alias=TOKENS_GROUP if spec.tied else None, bias=None if spec.tied else False, **tok, **adam)
    b.node("loss", "cost", cost_function="ce_logits", vocab_size=spec.vocab, cost_precision="float32", **tok)
    b.chain("final_norm", "lm_head", "loss")
    b.output("logits", "lm_head")
    b.cost("ce_loss", "loss")
    b.metric("learning_rate", "lm_head")
    return b.build()


def _norm(b: NetBuilder, spec: Spec, node_id: str, group: dict[str, str]) -> str:
    if spec.norm == "layernorm":
        return b.node(node_id, "layernorm", dim=spec.dim, eps=spec.eps, optimizer="adam", **group)
    return b.node(node_id, "rmsnorm", dim=spec.dim, eps=spec.eps, optimizer="adam", **group)


def _block(b: NetBuilder, spec: Spec, i: int, last: str, fused: bool) -> str:
    """Transformer block `i` after `last`; its last node (the second residual add)."""
    p = f"block{i}_"
    grp = dict(colocate_group=f"transformer_block_{i}", colocate_policy="required")
    b.node(p + "in", "broadcast", num_outputs=2, **grp)
    b.edge(last, p + "in")
    b.edge(p + "in", _norm(b, spec, p + "ln1", grp))
    attn_out = _attention(b, spec, p, grp, fused)
    inner = spec.heads * spec.head_dim
    b.node(p + "attn_proj", "linear", in_dim=inner, out_dim=spec.dim, bias=None if spec.o_bias else False,
           optimizer="adam", **grp)
    b.edge(attn_out, p + "attn_proj")
    after = _dropped(b, spec, p + "attn_dropout", p + "attn_proj", grp)
    b.node(p + "attn_residual", "add", **grp)
    b.edge(after, p + "attn_residual")
    b.edge(p + "in", p + "attn_residual", 1, 1)
    b.node(p + "mid", "broadcast", num_outputs=2, **grp)
    b.edge(p + "attn_residual", p + "mid")
    b.edge(p + "mid", _norm(b, spec, p + "ln2", grp))
    bias = None if spec.mlp_bias else False
    if spec.family == "gpt2":
        b.node(p + "ffn_up", "linear", in_dim=spec.dim, out_dim=spec.ffn, optimizer="adam", **grp)
        op, approximate = _GPT2_ACTIVATIONS[spec.activation]
        b.node(p + "ffn_act", op, approximate=approximate, **grp)
    else:  # SwiGLU: one up-projection [up; gate], value * silu(gate) (kernels.swiglu's halves)
        b.node(p + "ffn_up", "linear", in_dim=spec.dim, out_dim=2 * spec.ffn, bias=bias, optimizer="adam", **grp)
        b.node(p + "ffn_act", "swiglu", **grp)
    b.node(p + "ffn_down", "linear", in_dim=spec.ffn, out_dim=spec.dim, bias=bias, optimizer="adam", **grp)
    b.chain(p + "ln2", p + "ffn_up", p + "ffn_act", p + "ffn_down")
    after = _dropped(b, spec, p + "ffn_dropout", p + "ffn_down", grp)
    b.node(p + "ffn_residual", "add", **grp)
    b.edge(after, p + "ffn_residual")
    b.edge(p + "mid", p + "ffn_residual", 1, 1)
    return p + "ffn_residual"


def _dropped(b: NetBuilder, spec: Spec, node_id: str, src: str, grp: dict[str, str]) -> str:
    """`src`, or a dropout after it when the model trains with residual dropout."""
    if spec.dropout <= 0:
        return src
    b.node(node_id, "dropout", rate=spec.dropout, **grp)
    b.edge(src, node_id)
    return node_id


def _attention(b: NetBuilder, spec: Spec, p: str, grp: dict[str, str], fused: bool) -> str:
    """The attention of one block after `p`ln1: its last node, [seq, heads x head_dim]."""
    rope = dict(position_encoding="rope", rope_theta=spec.rope_theta) if spec.rope_theta is not None \
        else dict(position_encoding="none")
    common = dict(seq_len=spec.seq_len, causal=True, **rope, **grp)
    bias = None if spec.qkv_bias else False
    if fused:
        b.node(p + "attn", "attention", num_heads=spec.heads, head_dim=spec.head_dim, dim=spec.dim,
               num_kv_heads=spec.kv_heads if spec.kv_heads != spec.heads else None, qkv_bias=bias,
               optimizer="adam", **common)
        b.edge(p + "ln1", p + "attn")
        return p + "attn"
    head = dict(head_dim=spec.head_dim, input_dim=spec.dim, qkv_bias=bias, optimizer="adam", **common)
    grouped = spec.kv_heads != spec.heads
    readers = spec.heads + (spec.kv_heads if grouped else 0)
    b.node(p + "heads", "broadcast", num_outputs=readers, **grp)
    b.edge(p + "ln1", p + "heads")
    b.node(p + "stack", "stack", axis=-1, **grp)
    share = spec.heads // spec.kv_heads
    for h in range(spec.heads):
        node = b.node(f"{p}head{h}", "attention_head", kv_input=True if grouped else None, **head)
        b.edge(p + "heads", node, h)
        b.edge(node, p + "stack", 0, h)
    for g in range(spec.kv_heads if grouped else 0):  # one kv_head read by its group's query heads
        kv = b.node(f"{p}kv{g}", "kv_head", **{k: v for k, v in head.items() if k != "causal"})
        b.edge(p + "heads", kv, spec.heads + g)
        for h in range(g * share, (g + 1) * share):
            b.edge(kv, f"{p}head{h}", 0, 1)
    return p + "stack"



# -- back: a network recognised as a family, and its config.json ------------------------------------------

_IGNORED = frozenset({"optimizer", "learning_rate", "colocate_group", "colocate_policy", "precision",
                      "param_precision", "activation_precision", "remat", "input_shape", "output_shape"})
_ACTIVATION_NAMES = {("gelu", "tanh"): "gelu_new", ("gelu", "none"): "gelu", ("relu", None): "relu",
                     ("silu", None): "silu"}


def recognise(graph: Graph) -> tuple[Spec, bool]:
    """(the family's spec, fused attention) of a network that one supported family expresses exactly, else
    a VGraphError naming the first VNode that fits none (in the network's order), and what it should be."""
    misfits = []
    for spec, fused in _candidates(graph):
        misfit = _first_misfit(graph, network(spec, graph.name, fused=fused), spec.family)
        if misfit is None:
            return spec, fused
        misfits.append(misfit)
    if not misfits:
        raise VGraphError(f"network {graph.name!r} has no embedder and blocks named as `vgraph import hf` writes "
                          f"them (embedder, block0_in, ...); it fits none of {SUPPORTED}")
    index, message, node = max(misfits, key=lambda m: m[0])
    loc = graph.node(node).loc if node in graph.node_ids() else None
    raise VGraphError([Diagnostic(f"{message}; no Hugging Face family expresses this network (supported: "
                                  f"{SUPPORTED})", loc, node)])


def _cfg(graph: Graph, node_id: str) -> dict[str, Any]:
    return graph.node(node_id).cfg if node_id in graph.node_ids() else {}


def _candidates(graph: Graph) -> list[tuple[Spec, bool]]:
    """A spec per family read off the network's sizes (defaults where a VNode is missing: the comparison
    then names it)."""
    emb = _cfg(graph, "embedder")
    if not emb or graph.node("embedder").type != "embedder":
        return []
    layers = 0
    while f"block{layers}_in" in graph.node_ids():
        layers += 1
    fused = "block0_attn" in graph.node_ids()
    heads_ = [n for n in graph.node_ids() if n.startswith("block0_head") and n[11:].isdigit()]
    kvs = [n for n in graph.node_ids() if n.startswith("block0_kv") and n[9:].isdigit()]
    attn = _cfg(graph, "block0_attn") if fused else _cfg(graph, "block0_head0")
    heads = int(attn.get("num_heads") or len(heads_) or 1)
    kv_heads = int(attn.get("num_kv_heads") or heads) if fused else (len(kvs) or heads)
    head_dim = int(attn.get("head_dim") or 1)
    norm = _cfg(graph, "final_norm")
    act = graph.node("block0_ffn_act") if "block0_ffn_act" in graph.node_ids() else None
    dropout = _cfg(graph, "block0_attn_dropout").get("rate", 0.0)
    lm_head = _cfg(graph, "lm_head")
    base = dict(vocab=int(emb["vocab_size"]), dim=int(emb["dim"]), layers=layers, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, ffn=int(_cfg(graph, "block0_ffn_down").get("in_dim") or 1),
                seq_len=int(emb["seq_len"]), max_positions=int(emb["seq_len"]), eps=float(norm.get("eps") or 1e-5),
                qkv_bias=attn.get("qkv_bias", True) is not False, o_bias=_cfg(graph, "block0_attn_proj").get("bias")
                is not False, mlp_bias=_cfg(graph, "block0_ffn_up").get("bias") is not False,
                tied=bool(lm_head.get("tie_weight_alias")), dropout=float(dropout),
                embd_dropout=float(_cfg(graph, "embedder_dropout").get("rate", 0.0)))
    key = (act.type, act.cfg.get("approximate")) if act is not None else ("gelu", "tanh")
    gpt2 = Spec("gpt2", **{**base, "kv_heads": heads, "qkv_bias": True, "o_bias": True, "mlp_bias": True,
                           "tied": True}, activation=_ACTIVATION_NAMES.get(key, "gelu_new"), rope_theta=None)
    theta = float(attn.get("rope_theta") or 10000.0)
    llama = Spec("llama", **{**base, "qkv_bias": base["qkv_bias"] and base["o_bias"],
                             "o_bias": base["qkv_bias"] and base["o_bias"], "dropout": 0.0, "embd_dropout": 0.0},
                 activation="silu", rope_theta=theta)
    qwen2 = replace(llama, family="qwen2", qkv_bias=True, o_bias=False, mlp_bias=False)
    return [(gpt2, fused), (llama, fused), (qwen2, fused)]


def _first_misfit(graph: Graph, expected: Graph, family: str) -> tuple[int, str, str] | None:
    """(how far the network fits, the problem, the VNode) of the first difference from `expected`."""
    order = [n.id for n in graph.nodes]
    for index, node_id in enumerate(order):
        if node_id not in expected.node_ids():
            return index, f"VNode {node_id!r} ({graph.node(node_id).type}) has no place in a {family} model", node_id
        want, have = expected.node(node_id), graph.node(node_id)
        if have.type != want.type:
            return index, f"VNode {node_id!r} is a {have.type}; a {family} model has a {want.type} here", node_id
        a = {k: v for k, v in have.cfg.items() if k not in _IGNORED}
        b = {k: v for k, v in want.cfg.items() if k not in _IGNORED}
        if a != b:
            key = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[0]
            return index, (f"VNode {node_id!r} ({have.type}) has {key}={a.get(key)!r}; a {family} model has "
                           f"{key}={b.get(key)!r}"), node_id
        ins = {(e.src, e.src_slot, e.dst_slot) for e in graph.in_edges(node_id)}
        if ins != {(e.src, e.src_slot, e.dst_slot) for e in expected.in_edges(node_id)}:
            return index, f"VNode {node_id!r} ({have.type}) reads other inputs than a {family} model's", node_id
    missing = [n for n in expected.node_ids() if n not in graph.node_ids()]
    if missing:
        return len(order), f"the network lacks VNode {missing[0]!r} of a {family} model", order[-1]
    logits = {(ep.node, ep.slot) for ep in graph.outputs if ep.name == "logits"}
    if logits != {("lm_head", 0)}:
        return len(order), "the output 'logits' is not lm_head's", "lm_head"
    return None


def hf_config(spec: Spec) -> dict[str, Any]:
    """The config.json transformers builds `spec`'s model from (float32 weights)."""
    # No special token ids: vgraph does not keep the source's, and transformers' family defaults (GPT-2's
    # 50256) would name ids outside a smaller vocabulary.
    common = {"vocab_size": spec.vocab, "tie_word_embeddings": spec.tied, "torch_dtype": "float32",
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if spec.family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common, "n_positions": spec.seq_len,
                "n_embd": spec.dim, "n_layer": spec.layers, "n_head": spec.heads, "n_inner": spec.ffn,
                "activation_function": spec.activation, "layer_norm_epsilon": spec.eps, "resid_pdrop": spec.dropout,
                "embd_pdrop": spec.embd_dropout, "attn_pdrop": 0.0, "scale_attn_weights": True}
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.family]
    out = {"architectures": [arch], "model_type": spec.family, **common, "hidden_size": spec.dim,
           "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
           "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
           "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.eps, "rope_theta": spec.rope_theta,
           "attention_dropout": 0.0}
    if spec.family == "llama":
        out.update(attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)
    else:
        out.update(use_sliding_window=False)
    return out
