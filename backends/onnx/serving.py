"""The serving layout: the KV-cache decoder as Hugging Face Optimum's ``ORTModelForCausalLM`` and
onnxruntime-genai read a decoder-only model with past, and the files those runtimes read beside it.

Why a layout of its own: vgraph's own export names every value after its VNode (``embedder:in0``,
``past_key:block0_head0``), which is what Netron and ``check-onnx`` want, but no serving stack reads it.
The serving model is that same lowering (``lower.build_model`` with ``padding=True``) with its interface
rewritten, so there is one implementation of the computation and two sets of names:

* inputs ``input_ids`` int64 ``[batch, sequence]``, ``attention_mask`` int64 ``[batch, past + sequence]``
  (1 for a real token, 0 for padding), ``position_ids`` int64 ``[batch, sequence]``, then per block ``i``
  ``past_key_values.{i}.key`` / ``.value`` float32 ``[batch, kv_heads, past, head_dim]``;
* outputs ``logits`` ``[batch, sequence, vocab]`` and ``present.{i}.key`` / ``.value``, the past extended
  by this call's positions.

The heads of a block are one cache tensor even where the network keeps each head (or each GQA ``kv_head``)
as its own VNode: the model splits ``past_key_values.{i}.key`` along the heads axis in front of the lowered
graph and concatenates the heads' presents behind it.  A block is the set of cached VNodes at the same
attention depth (how many cached VNodes precede it on the longest path from the input).

Left padding: ``position_ids`` pick the RoPE and learned-position rows per token, and ``attention_mask``
adds the causal mask's value to every padded key, so a batch of prompts of different lengths, left-padded,
gives each prompt the logits it gets alone.  A position past the context length has no row: the
``Decoder`` here refuses it before onnxruntime runs, and external runtimes are told the context through
``max_position_embeddings`` (config.json) and ``context_length`` (genai_config.json).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from vgraph import Graph, VGraphError
from vgraph.data.tokenizer import EOT_TOKEN, PAD_TOKEN

from .inference import _cache_metadata, lower_inference
from .lower import context_length
from .names import ATTENTION_MASK, BATCH_DIM, PAST_DIM, POSITION_IDS, SEQUENCE_DIM, TOTAL_DIM

__all__ = ["ServingShape", "lower_serving", "serving_files", "ServingDecoder", "MODEL_FILE", "INPUT_IDS",
           "LOGITS", "past_names", "present_names"]

MODEL_FILE = "model.onnx"
INPUT_IDS = "input_ids"
LOGITS = "logits"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


@dataclass(frozen=True)
class ServingShape:
    """What a runtime must know to size the caches: the numbers config.json and genai_config.json carry."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int


def _attention_depths(graph: Graph, cached: set[str]) -> dict[str, int]:
    """VNode -> how many cached VNodes precede it on its longest path from the inputs (its block)."""
    depth: dict[str, int] = {}
    for n in graph.topo_order():
        depth[n.id] = max((depth[e.src] + (e.src in cached) for e in graph.in_edges(n.id)), default=0)
    return depth


def _layers(graph: Graph, caches: Sequence[dict]) -> list[list[dict]]:
    """The decoder's caches grouped by block, each block's in the network's VNode order."""
    by_node = {c["node"]: c for c in caches}
    depth = _attention_depths(graph, set(by_node))
    position = {n.id: i for i, n in enumerate(graph.nodes)}
    layers: dict[int, list[dict]] = {}
    for node in sorted(by_node, key=position.__getitem__):
        layers.setdefault(depth[node], []).append(by_node[node])
    return [layers[d] for d in sorted(layers)]


def _heads_of(cache: dict) -> tuple[int, int]:
    """(K/V heads, head_dim) of one cache: a per-head VNode's ``[past, hd]`` is one head."""
    shape = cache["shape"]
    if len(shape) == 2 and shape[0] == PAST_DIM:
        return 1, int(shape[1])
    if len(shape) == 3 and shape[1] == PAST_DIM:
        return int(shape[0]), int(shape[2])
    raise VGraphError(f"VNode '{cache['node']}' caches {shape}: the serving layout holds [heads, past, head_dim] "
                      f"per block, so only attention caches of that form can be served")


def _shape(graph: Graph, layers: list[list[dict]]) -> ServingShape:
    """The numbers of the caches, the same in every block (one config cannot say otherwise)."""
    per_layer = []
    for i, layer in enumerate(layers):
        heads = [_heads_of(c) for c in layer]
        dims = {hd for _, hd in heads}
        if len(dims) != 1:
            raise VGraphError(f"block {i} ({', '.join(c['node'] for c in layer)}) mixes head sizes {sorted(dims)}: "
                              "the serving layout's caches are [batch, kv_heads, past, head_dim] per block")
        per_layer.append((sum(k for k, _ in heads), dims.pop()))
    if len(set(per_layer)) != 1:
        raise VGraphError(f"network {graph.name!r}: the blocks' caches differ ({', '.join(f'{k} heads of {d}' for k, d in per_layer)}); "
                          "a serving config states one number of K/V heads and one head size for every block")
    kv_heads, head_dim = per_layer[0]
    queries = sum(1 for n in graph.nodes if n.type == "attention_head") + sum(
        int(n.cfg["num_heads"]) for n in graph.nodes if n.type == "attention")
    if queries % len(layers) or (queries // len(layers)) % kv_heads:
        raise VGraphError(f"network {graph.name!r}: {queries} query heads do not divide into {len(layers)} blocks "
                          f"of a multiple of {kv_heads} K/V heads")
    return ServingShape(len(layers), queries // len(layers), kv_heads, head_dim, 0, context_length(graph))


def lower_serving(graph: Graph, weights: Mapping[str, np.ndarray] | None) -> tuple[onnx.ModelProto, ServingShape]:
    """The serving model of a verified float32 ``graph`` (see the module doc) and its cache numbers."""
    if len(graph.outputs) != 1:
        raise VGraphError(f"network {graph.name!r} has {len(graph.outputs)} outputs "
                          f"({', '.join(ep.name for ep in graph.outputs) or 'none'}); a served decoder returns "
                          "one: its logits")
    model = lower_inference(graph, weights, kv_cache=True, padding=True)
    caches = _cache_metadata(model)
    if not caches:
        raise VGraphError(f"network {graph.name!r} has no attention VNode to cache: the serving layout is a "
                          "decoder with past keys and values")
    layers = _layers(graph, caches)
    shape = _shape(graph, layers)
    cached = {c[k] for c in caches for k in ("past_key", "past_value")}
    feeds = [vi for vi in model.graph.input if vi.name not in cached
             and vi.name not in (ATTENTION_MASK, POSITION_IDS)]
    if len(feeds) != 1 or feeds[0].type.tensor_type.elem_type != TensorProto.INT64:
        raise VGraphError(f"network {graph.name!r}: its logits read {len(feeds)} inputs "
                          f"({', '.join(vi.name for vi in feeds)}); a served decoder feeds token ids only")
    out = model.graph.output[0]
    shape = ServingShape(shape.layers, shape.heads, shape.kv_heads, shape.head_dim,
                         out.type.tensor_type.shape.dim[-1].dim_value, shape.context)
    _rewrite_interface(model, feeds[0].name, out.name, layers, shape)
    props = {p.key: p.value for p in model.metadata_props if p.key != "vgraph.kv_cache"}
    props.update({"vgraph.layout": "serving", "vgraph.endpoints": json.dumps({LOGITS: LOGITS})})
    del model.metadata_props[:]
    helper.set_model_props(model, props)
    return onnx.shape_inference.infer_shapes(model), shape  # value shapes for viewers such as Netron


def _rewrite_interface(model: onnx.ModelProto, tokens: str, logits: str, layers: list[list[dict]],
                       shape: ServingShape) -> None:
    """The lowered decoder's inputs and outputs renamed and its per-VNode caches grouped per block, by
    nodes in front of (Split, Squeeze) and behind (Unsqueeze, Concat) the lowered graph."""
    g = model.graph
    taken = {o for node in g.node for o in node.output} | {i.name for i in g.initializer}
    new_names = {INPUT_IDS, LOGITS, *(n for i in range(len(layers)) for n in (*past_names(i), *present_names(i)))}
    if taken & new_names:
        raise AssertionError(f"serving names already used inside the model: {sorted(taken & new_names)}")
    front = [helper.make_node("Identity", [INPUT_IDS], [tokens], name="serving/input_ids")]
    back = [helper.make_node("Identity", [logits], [LOGITS], name="serving/logits")]
    cache_inputs, cache_outputs = [], []
    for i, layer in enumerate(layers):
        heads = [_heads_of(c)[0] for c in layer]
        for kind, past, present in zip(("key", "value"), past_names(i), present_names(i)):
            olds = [c[f"past_{kind}"] for c in layer]
            news = [c[f"present_{kind}"] for c in layer]
            front += _split_heads(past, olds, heads, layer)
            back += _join_heads(news, present, heads, layer)
            dims = [BATCH_DIM, shape.kv_heads, PAST_DIM, shape.head_dim]
            cache_inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, dims))
            cache_outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, [*dims[:2], TOTAL_DIM,
                                                                                         dims[3]]))
    gone = {c[k] for layer in layers for c in layer for k in ("past_key", "past_value", "present_key",
                                                              "present_value")} | {tokens, logits}
    padding = {vi.name: vi for vi in g.input if vi.name in (ATTENTION_MASK, POSITION_IDS)}
    params = [vi for vi in g.input if vi.name not in gone and vi.name not in padding]
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [BATCH_DIM, SEQUENCE_DIM]),
              padding[ATTENTION_MASK], padding[POSITION_IDS], *cache_inputs, *params]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [BATCH_DIM, SEQUENCE_DIM, shape.vocab]),
               *cache_outputs]
    nodes = [*front, *g.node, *back]
    del g.node[:], g.input[:], g.output[:]
    g.node.extend(nodes)
    g.input.extend(inputs)
    g.output.extend(outputs)
    del g.value_info[:]  # shapes inferred for the old interface; lower_serving infers them again


def _axis_const(name: str) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name,
                            value=helper.make_tensor(name, TensorProto.INT64, [1], [1]))


def _fused(layer: list[dict]) -> bool:
    """A block cached by one fused ``attention`` VNode: its cache is the block's already."""
    return len(layer) == 1 and len(layer[0]["shape"]) == 3


def _split_heads(grouped: str, per_node: list[str], heads: list[int], layer: list[dict]) -> list[onnx.NodeProto]:
    """``grouped`` [B, kv, past, hd] cut into each cached VNode's past along the heads axis."""
    if _fused(layer):
        return [helper.make_node("Identity", [grouped], per_node, name=f"serving/{per_node[0]}")]
    axis, sizes = f"serving/{grouped}/axis", f"serving/{grouped}/sizes"
    parts = [f"serving/{grouped}/part{j}" for j in range(len(per_node))]
    nodes = [_axis_const(axis),
             helper.make_node("Constant", [], [sizes], name=sizes,
                              value=helper.make_tensor(sizes, TensorProto.INT64, [len(heads)], heads)),
             helper.make_node("Split", [grouped, sizes], parts, name=f"serving/{grouped}/split", axis=1)]
    for part, name, cache in zip(parts, per_node, layer):
        per_head = len(cache["shape"]) == 2
        nodes.append(helper.make_node("Squeeze" if per_head else "Identity", [part, axis] if per_head else [part],
                                      [name], name=f"serving/{name}"))
    return nodes


def _join_heads(per_node: list[str], grouped: str, heads: list[int], layer: list[dict]) -> list[onnx.NodeProto]:
    """Each cached VNode's present, joined along the heads axis into ``grouped`` [B, kv, total, hd]."""
    if _fused(layer):
        return [helper.make_node("Identity", per_node, [grouped], name=f"serving/{grouped}")]
    axis = f"serving/{grouped}/axis"
    nodes, parts = [_axis_const(axis)], []
    for name, cache in zip(per_node, layer):
        if len(cache["shape"]) == 2:
            parts.append(f"serving/{grouped}/{name}")
            nodes.append(helper.make_node("Unsqueeze", [name, axis], [parts[-1]], name=parts[-1]))
        else:
            parts.append(name)
    nodes.append(helper.make_node("Concat", parts, [grouped], name=f"serving/{grouped}/concat", axis=1))
    return nodes


# ---------------------------------------------------------------------------
# The files beside the model
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecialTokens:
    """End-of-text (also the start a prompt-less generation begins from) and padding, from the tokenizer."""

    eos: int | None
    pad: int


def special_tokens(tokenizer_json: str | None) -> SpecialTokens:
    """vgraph's tokenizers end texts with EOT_TOKEN and pad with PAD_TOKEN; without a tokenizer, pad with 0."""
    if tokenizer_json is None:
        return SpecialTokens(None, 0)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    pad = tok.token_to_id(PAD_TOKEN)
    return SpecialTokens(tok.token_to_id(EOT_TOKEN), pad if pad is not None else 0)


def serving_files(shape: ServingShape, *, network: str, tokenizer_json: str | None) -> dict[str, str]:
    """config.json (what transformers' AutoConfig and Optimum read to size the caches), genai_config.json
    (onnxruntime-genai's schema), generation_config.json, and the tokenizer, by file name.

    ``model_type`` is ``llama``: a type both Optimum and onnxruntime-genai know, for which Optimum reads
    ``num_key_value_heads`` and takes the head size as ``hidden_size / num_attention_heads``, so
    ``hidden_size`` is the attention width (heads x head_dim).  Neither runtime computes anything from the
    type: the computation is all in model.onnx.
    """
    ids = special_tokens(tokenizer_json)
    tokens = {"bos_token_id": ids.eos, "eos_token_id": ids.eos, "pad_token_id": ids.pad}
    width = shape.heads * shape.head_dim
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab,
              "hidden_size": width, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
              "max_position_embeddings": shape.context, "use_cache": True, "torch_dtype": "float32",
              **tokens, "vgraph_network": network}
    decoder = {"filename": MODEL_FILE, "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
               "head_size": shape.head_dim, "hidden_size": width, "num_attention_heads": shape.heads,
               "num_hidden_layers": shape.layers, "num_key_value_heads": shape.kv_heads,
               "inputs": {"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK, "position_ids": POSITION_IDS,
                          "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
               "outputs": {"logits": LOGITS, "present_key_names": "present.%d.key",
                           "present_value_names": "present.%d.value"}}
    known = {k: v for k, v in tokens.items() if v is not None}  # genai refuses a null id
    genai = {"model": {**known, "context_length": shape.context, "decoder": decoder, "type": "llama",
                       "vocab_size": shape.vocab},
             "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": shape.context,
                        "min_length": 0, "past_present_share_buffer": False, "temperature": 1.0, "top_k": 1,
                        "top_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
                        "no_repeat_ngram_size": 0, "diversity_penalty": 0.0, "early_stopping": True}}
    generation = {**known, "do_sample": False,
                  "max_length": shape.context}
    files = {"config.json": config, "genai_config.json": genai, "generation_config.json": generation}
    out = {name: json.dumps(doc, indent=2) + "\n" for name, doc in files.items()}
    if tokenizer_json is not None:
        out["tokenizer.json"] = tokenizer_json
        out["tokenizer_config.json"] = json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT_TOKEN, "bos_token": EOT_TOKEN,
             "pad_token": PAD_TOKEN, "padding_side": "left", "model_max_length": shape.context,
             "model_input_names": [INPUT_IDS, ATTENTION_MASK]}, indent=2) + "\n"  # no token_type_ids
    return out


# ---------------------------------------------------------------------------
# vgraph's own reader of the layout
# ---------------------------------------------------------------------------


class ServingDecoder:
    """Greedy decoding of batches of prompts through a serving model, as an external runtime does it.

    Prompts of different lengths are left-padded; ``attention_mask`` marks the padding and
    ``position_ids`` count each prompt's own tokens from 0, so every prompt gets the tokens it gets alone.
    A prompt whose positions would pass the context length is refused before anything runs.
    """

    def __init__(self, model: onnx.ModelProto | str | os.PathLike[str], *, pad: int = 0,
                 threads: int | None = None) -> None:
        from .check import session

        path = None if isinstance(model, onnx.ModelProto) else os.fspath(model)
        if path is not None and os.path.isdir(path):
            path = os.path.join(path, MODEL_FILE)
        proto = model if path is None else onnx.load(path, load_external_data=False)
        props = {p.key: p.value for p in proto.metadata_props}
        if props.get("vgraph.layout") != "serving":
            raise VGraphError(f"{path or 'the model'}: not a serving export (vgraph export-onnx --serving)")
        self.context = int(props["vgraph.context_length"])
        self.layers = sum(vi.name.endswith(".key") and vi.name.startswith("past_key_values.")
                          for vi in proto.graph.input)
        (past,) = [vi for vi in proto.graph.input if vi.name == past_names(0)[0]]
        dims = past.type.tensor_type.shape.dim
        self.kv_heads, self.head_dim, self.pad = dims[1].dim_value, dims[3].dim_value, int(pad)
        self.session = session(model if path is None else path, threads=threads)

    def check_fits(self, lengths: Sequence[int], new_tokens: int) -> None:
        """A VGraphError when a prompt of ``lengths`` and ``new_tokens`` more would need a position past the
        context (the last new token is never fed back, so a prompt of L tokens uses L + new_tokens - 1)."""
        for i, length in enumerate(lengths):
            if length < 1:
                raise VGraphError(f"prompt {i} is empty: a decoder starts from at least one token")
            if length + max(new_tokens - 1, 0) > self.context:
                raise VGraphError(f"prompt {i}: {length} tokens and {new_tokens} new ones need "
                                  f"{length + new_tokens - 1} positions, past the model's context of "
                                  f"{self.context} (max_position_embeddings in config.json)")

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos: int | None = None
               ) -> list[list[int]]:
        """Each prompt's greedy continuation (new tokens only, ending at ``eos`` when it comes)."""
        self.check_fits([len(p) for p in prompts], max_new_tokens)
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), self.pad, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        past = {name: np.zeros((len(prompts), self.kv_heads, 0, self.head_dim), np.float32)
                for i in range(self.layers) for name in past_names(i)}
        out: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), dtype=bool)
        for _ in range(max_new_tokens):
            logits, past = self.step(ids, mask, positions, past)
            token = logits[:, -1].argmax(-1)
            for i in np.flatnonzero(~done):
                out[i].append(int(token[i]))
                done[i] = eos is not None and token[i] == eos
            if done.all():
                break
            ids, positions = token[:, None].astype(np.int64), positions[:, -1:] + 1
            mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        return out

    def step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Mapping[str, np.ndarray]
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One call: logits of ``ids`` and the presents as the next call's pasts."""
        if positions.size and int(positions.max()) >= self.context:
            raise VGraphError(f"position {int(positions.max())} is past the model's context of {self.context} "
                              "tokens (positions 0 to context - 1)")
        names = [LOGITS, *(n for i in range(self.layers) for n in present_names(i))]
        results = self.session.run(names, {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions, **past})
        nxt = {name: results[1 + k] for k, name in enumerate(n for i in range(self.layers) for n in past_names(i))}
        return results[0], nxt
