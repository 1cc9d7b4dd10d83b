"""Lower a vgraph IR graph to a PyTorch module whose code is a readable torch.fx GraphModule.

`compile_network(graph)` returns a `VGraphModule`:

* **Parameters**: one namespace per VNode, so `state_dict()` keys are exactly
  `"<vnode_id>.<param>"`.  A tied weight is one Parameter, owned (and saved)
  by its publisher; the tied linear / `tied_lm_head_ce` reads that object, so
  its gradient accumulates into the publisher's.
* **Forward**: `module(feeds, want=None)` takes the network inputs by name,
  `{"<node>:in<slot>": tensor}` (e.g. `"embedder:in0"` token ids `[B, S]`,
  `"loss:in1"` targets `[B, S]`), and returns `{endpoint name: tensor}` for the
  graph's outputs and costs.  `want` (names, or `"<node>:<slot>"` values)
  restricts the computation to what those need: `want=("ce_loss",)` on a graph
  with a fused `tied_lm_head_ce` never forms its logits, and `want=("logits",)`
  needs no targets.
* **Programs**: each distinct `(want, training)` is lowered once, op by op
  through the table in `ops.py`, into a torch.fx GraphModule (cached), so a
  step costs one dict lookup plus the generated code: no interpretation.
  Dropout is simply absent from eval programs.  `module.code()` shows the
  code; `module.program()` returns the GraphModule (for torch.compile/export).
* **Decoding** (`decode=True`, eval only): the program that runs new
  positions against a KV cache, taking `position_ids`, `attention_mask` and
  each attention VNode's `past_key:<id>` / `past_value:<id>`, returning
  `present_key:<id>` / `present_value:<id>` beside `want` (decode.py).
* **Initialisation** (deterministic): weights normal(0, 0.02), biases zero,
  layernorm weight one, each drawn from a generator seeded by
  sha256(f"{seed}:{unfused key}").  Parameters are initialised in the UNFUSED
  layout and concatenated (`vgraph.run.layout`), so a fused `attention` VNode
  starts exactly equal to the heads it replaced and fused and unfused graphs
  of one seed start from the same weights.
* **Precision**: parameters are float32 (master weights); mixed precision is
  `torch.autocast` around the call (see `train.py`), driven by
  `graph.meta["precision"]`.  A VNode whose annotated activation dtype is
  float32 inside a reduced-precision network runs with autocast off and its
  inputs upcast.  Losses are always float32.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from vgraph.base.diagnostics import Diagnostic, VGraphError
from vgraph.ir.graph import Graph, VNode
from vgraph.ir.verify import verify
from vgraph.run import layout

from . import decode as D
from .ops import LowerCtx, default_init, get_lowering
from .remat_regions import outline_remat_regions

__all__ = [
    "VGraphModule",
    "compile_network",
    "init_state",
    "feed_name",
    "param_sources",
    "to_graph_layout",
    "to_unfused_layout",
    "compute_dtype",
]

Want = str | Sequence[str] | None


def feed_name(node_id: str, slot: int) -> str:
    """The feed key of a network input: "<node>:in<slot>"."""
    return f"{node_id}:in{slot}"


# --------------------------------------------------------------------------
# Layouts (checkpoint compatibility between fused and unfused graphs)
# --------------------------------------------------------------------------


def param_sources(graph: Graph) -> dict[str, list[tuple[str, int]]]:
    """Every parameter key of `graph` -> its (unfused key, rows) pieces (see vgraph.run.layout)."""
    return layout.param_sources(graph)


def _split(tensor: torch.Tensor, rows: Sequence[int]) -> Sequence[torch.Tensor]:
    if sum(rows) != tensor.shape[0]:
        raise VGraphError(f"cannot split a tensor of {tensor.shape[0]} rows into pieces of {list(rows)}")
    return torch.split(tensor, list(rows), dim=0)


def to_graph_layout(unfused_state: Mapping[str, torch.Tensor], graph: Graph) -> dict[str, torch.Tensor]:
    """An unfused-layout state dict -> `graph`'s layout (fused parameters concatenated, exactly)."""
    return layout.to_graph_layout(unfused_state, graph, lambda parts: torch.cat(parts, dim=0))


def to_unfused_layout(state: Mapping[str, torch.Tensor], graph: Graph) -> dict[str, torch.Tensor]:
    """A state dict in `graph`'s layout -> the unfused layout (fused parameters split by rows)."""
    return layout.to_unfused_layout(state, graph, _split)


# --------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------


def _seed_for(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_state(graph: Graph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial float32 parameters of `graph` (its own layout), on the CPU.

    Each unfused piece is drawn from its own generator seeded by the seed and
    the piece's unfused key, so the result is independent of node order and
    of fusion.  A piece whose key is the graph's own uses its op's init rule;
    a piece of a VNode a fusion removed uses `default_init` by parameter name
    (biases zero, others normal(0, 0.02)), which is what the catalog's
    attention heads use.
    """
    state: dict[str, torch.Tensor] = {}
    for key, pieces in param_sources(graph).items():
        node_id, pname = key.split(".", 1)
        node = graph.node(node_id)
        shape = tuple(node.op.param_shapes(node.cfg)[pname])
        own_init = get_lowering(node).init or default_init
        parts = []
        for src_key, rows in pieces:
            generator = torch.Generator().manual_seed(_seed_for(seed, src_key))
            if src_key == key and len(pieces) == 1:
                parts.append(own_init(pname, shape, generator))
            else:
                parts.append(default_init(src_key.split(".", 1)[1], (rows, *shape[1:]), generator))
        state[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return state


# --------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def compute_dtype(graph: Graph) -> torch.dtype:
    """The network's compute dtype from the `precision` pass (float32 without annotations)."""
    info = graph.meta.get("precision") or {}
    return _DTYPES.get(info.get("compute_dtype", "float32"), torch.float32)


@functools.lru_cache(maxsize=None)
def float32_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with autocast off and floating tensor arguments upcast to float32."""

    def run(*args: Any, **kwargs: Any) -> Any:
        def up(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float64:
                return v.float()
            if isinstance(v, (list, tuple)):
                return type(v)(up(x) for x in v)
            return v

        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device_type=device, enabled=False):
            return fn(*up(args), **{k: up(v) for k, v in kwargs.items()})

    run.__name__ = f"{getattr(fn, '__name__', 'op')}_float32"
    run.__qualname__ = run.__name__
    run.__module__ = __name__
    return run


# --------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------


class ParamNamespace(nn.Module):
    """The parameters of one VNode (its `state_dict` prefix is the VNode id)."""


@dataclass
class Program:
    """One lowered computation: the GraphModule and the feed keys it takes, in order."""

    module: fx.GraphModule
    feeds: tuple[str, ...]
    outputs: tuple[str, ...]


_RESERVED = frozenset(dir(fx.GraphModule(nn.Module(), fx.Graph())))


class VGraphModule(nn.Module):
    """A compiled network; see the module docstring for feeds, outputs and parameters."""

    def __init__(self, graph: Graph, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.network = graph
        self.options = dict(options or {})
        self.compute_dtype = compute_dtype(graph)
        self._programs: dict[tuple[Any, bool, bool], Program] = {}
        self._attr: dict[str, str] = {}  # vnode id -> attribute name inside the GraphModules
        self.param_owner: dict[str, str] = {}  # "<id>.<param>" -> owning vnode id
        publishers = graph.publishers()
        self._publishers = publishers
        for node in graph.topo_order():
            lowering = get_lowering(node)
            shapes = node.op.param_shapes(node.cfg)
            if lowering.make_module is not None:
                module = lowering.make_module(node, self.options)
            elif shapes:
                module = ParamNamespace()
            else:
                continue
            for pname, shape in shapes.items():
                if pname not in module._parameters:
                    module.register_parameter(pname, nn.Parameter(torch.zeros(shape)))
                self.param_owner[f"{node.id}.{pname}"] = node.id
            self._add_namespace(node, module)

    def _add_namespace(self, node: VNode, module: nn.Module) -> None:
        if not node.id or "." in node.id:
            raise VGraphError([Diagnostic(
                f"VNode id {node.id!r} cannot name a parameter namespace: state_dict keys are "
                f"'<vnode_id>.<param>', so ids must be non-empty and contain no '.'", node.loc, node.id)])
        # Registered directly (not add_module) so that ids such as "eval" or "train",
        # which shadow nn.Module methods, still give "<id>.<param>" keys.
        self._modules[node.id] = module
        safe = node.id
        if safe in _RESERVED or safe in self._attr.values():
            safe = f"v_{node.id}"
            while safe in _RESERVED or safe in self._attr.values():
                safe += "_"
        self._attr[node.id] = safe

    # -- access ---------------------------------------------------------------
    def namespace(self, node_id: str) -> nn.Module:
        """The nn.Module holding VNode `node_id`'s parameters."""
        return self._modules[node_id]

    def node_parameters(self, node_id: str) -> dict[str, nn.Parameter]:
        module = self._modules.get(node_id)
        return dict(module.named_parameters()) if module is not None else {}

    @property
    def output_names(self) -> list[str]:
        return [ep.name for ep in self.network.outputs]

    @property
    def cost_names(self) -> list[str]:
        return [ep.name for ep in self.network.costs]

    def unfused_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters in the unfused layout (what checkpoints store)."""
        return to_unfused_layout({k: v.detach() for k, v in self.state_dict().items()}, self.network)

    def load_unfused_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load unfused-layout parameters (e.g. from an unfused run's checkpoint).

        Weights of another shape or a missing parameter are a VGraphError naming them (torch's
        `load_state_dict` raised RuntimeError "size mismatch", a traceback, e.g. on
        `train --resume --accept-network-change` with a wider vocabulary)."""
        own = self.state_dict()
        unused = set(state) - set(to_unfused_layout(own, self.network))
        if unused:
            raise VGraphError(f"checkpoint has parameters network {self.network.name!r} does not: "
                              f"{', '.join(sorted(unused)[:5])}{' ...' if len(unused) > 5 else ''}")
        wanted = to_unfused_layout({k: v.detach() for k, v in own.items()}, self.network)
        wrong = [f"{k} {list(state[k].shape)} (the network's is {list(v.shape)})" for k, v in sorted(wanted.items())
                 if k in state and tuple(state[k].shape) != tuple(v.shape)]
        missing = sorted(k for k in wanted if k not in state)
        if wrong or missing:
            what = (f"weights of other shapes: {'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}" if wrong
                    else f"no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
            raise VGraphError(f"the checkpoint does not fit network {self.network.name!r}: it holds {what}; "
                              f"a changed network can continue only where its parameters keep their shapes")
        self.load_state_dict(to_graph_layout(state, self.network), strict=True)

    # -- running -------------------------------------------------------------------
    def forward(self, feeds: Mapping[str, Any], want: Want = None, decode: bool = False) -> dict[str, Any]:
        if want.__class__ is list:
            want = tuple(want)
        program = self._programs.get((want, self.training, decode))
        if program is None:
            program = self.program_for(want, self.training, decode)
        try:
            args = [feeds[name] for name in program.feeds]
        except KeyError:
            missing = [name for name in program.feeds if name not in feeds]
            raise VGraphError(f"network {self.network.name!r}: missing feed(s) {', '.join(missing)} "
                              f"(this computation needs {', '.join(program.feeds)})") from None
        return program.module(*args)

    def program_for(self, want: Want = None, training: bool | None = None, decode: bool = False) -> Program:
        if training is None:
            training = self.training
        if isinstance(want, list):
            want = tuple(want)
        key = (want, training, decode)
        if key not in self._programs:
            if decode and training:
                raise VGraphError("a decode program (KV cache) is an inference program: call it in eval mode")
            self._programs[key] = _lower(self, want, training, decode)
        return self._programs[key]

    def program(self, want: Want = None, training: bool | None = None, decode: bool = False) -> fx.GraphModule:
        """The torch.fx GraphModule computing `want` (positional feeds, dict result)."""
        return self.program_for(want, training, decode).module

    def code(self, want: Want = None, training: bool | None = None, decode: bool = False) -> str:
        """The generated Python source of the program for `want`."""
        return self.program(want, training, decode).code

    def feeds_needed(self, want: Want = None, decode: bool = False) -> tuple[str, ...]:
        return self.program_for(want, decode=decode).feeds

    def decode_caches(self, want: Want = None) -> tuple[str, ...]:
        """The VNodes whose keys and values the decode program for `want` caches, in feed order."""
        return tuple(name.split(":", 1)[1] for name in self.program_for(want, False, True).feeds
                     if name.startswith("past_key:"))

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # Programs hold the Parameter objects; drop them whenever tensors may be replaced.
        self._programs.clear()
        return super()._apply(fn, recurse)


def _targets(graph: Graph, want: Want) -> list[tuple[str, str, int]]:
    """(result name, node, slot) of what a program returns."""
    endpoints = {ep.name: ep for ep in [*graph.outputs, *graph.costs]}
    if want is None:
        return [(ep.name, ep.node, ep.slot) for ep in endpoints.values()]
    names = [want] if isinstance(want, str) else list(want)
    out = []
    for name in names:
        if name in endpoints:
            out.append((name, endpoints[name].node, endpoints[name].slot))
            continue
        node_id, sep, slot = name.rpartition(":")
        if sep and node_id in graph and slot.isdigit() and int(slot) < graph.node(node_id).num_outputs:
            out.append((name, node_id, int(slot)))
            continue
        raise VGraphError(f"network {graph.name!r} has no output or cost named {name!r} (known: "
                          f"{', '.join(endpoints) or 'none'}; a value can also be named '<node>:<slot>')")
    return out


def _needed(graph: Graph, targets: Iterable[tuple[str, str, int]]
            ) -> tuple[dict[str, frozenset[int]], dict[str, frozenset[int]]]:
    """Per needed node: the output slots read and the input slots those depend on."""
    out_slots: dict[str, set[int]] = {}
    for _, node_id, slot in targets:
        out_slots.setdefault(node_id, set()).add(slot)
    in_slots: dict[str, frozenset[int]] = {}
    for node in reversed(graph.topo_order()):
        if node.id not in out_slots:
            continue
        slots = frozenset(out_slots[node.id])
        count = graph.num_inputs(node.id)
        rule = get_lowering(node).inputs_needed
        ins = frozenset(range(count)) if rule is None else rule(slots, count)
        in_slots[node.id] = ins
        for slot in ins:
            edge = graph.input_edge(node.id, slot)
            if edge is not None:
                out_slots.setdefault(edge.src, set()).add(edge.src_slot)
    return {k: frozenset(v) for k, v in out_slots.items()}, in_slots


class _FxEmitter:
    """Records a lowering rule's calls as torch.fx nodes named after the VNode."""

    def __init__(self, graph: fx.Graph, attr: Mapping[str, str]) -> None:
        self.graph = graph
        self.attr = attr
        self.node_id = ""
        self.float32 = False
        self.created: set[fx.Node] = set()
        self._params: dict[tuple[str, str], fx.Node] = {}

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> fx.Node:
        target = float32_region(fn) if self.float32 else fn
        short = getattr(fn, "__name__", "op").strip("_") or "op"
        node = self.graph.create_node("call_function", target, tuple(args), dict(kwargs),
                                      name=f"{self.node_id}_{short}")
        self.created.add(node)
        return node

    def param(self, node_id: str, name: str) -> fx.Node:
        key = (node_id, name)
        if key not in self._params:
            self._params[key] = self.graph.get_attr(f"{self.attr[node_id]}.{name}")
        return self._params[key]

    def call_module(self, node_id: str, args: tuple) -> fx.Node:
        node = self.graph.create_node("call_module", self.attr[node_id], tuple(args), {},
                                      name=f"{node_id}_call")
        self.created.add(node)
        return node


def _node_float32(graph: Graph, node: VNode, compute: torch.dtype) -> bool:
    info = node.meta.get("precision") or {}
    return compute != torch.float32 and info.get("activation") == "float32"


def _decode_inputs(graph: Graph, order: list[VNode], fxg: fx.Graph, emitter: "_FxEmitter",
                   feeds: list[str]) -> D.DecodeCtx:
    """A decode program's extra placeholders (positions, mask, past caches) after the network's inputs; a
    network with a VNode that cannot run on new positions alone is refused, every such VNode named."""
    problems = D.undecodable(graph, order, get_lowering)
    if problems:
        raise VGraphError(problems)
    positions = fxg.placeholder(D.POSITION_IDS)
    mask = fxg.placeholder(D.ATTENTION_MASK)
    feeds += [D.POSITION_IDS, D.ATTENTION_MASK]
    past = {}
    for node in order:
        if get_lowering(node).caches_for(node):
            names = D.past_names(node.id)
            past[node.id] = tuple(fxg.placeholder(n.replace(":", "_")) for n in names)
            feeds += names
    emitter.node_id = "decode"
    return D.DecodeCtx(positions, emitter.call(D.decode_mask, (mask, positions), {}), past)


def _lower(module: VGraphModule, want: Want, training: bool, decode: bool = False) -> Program:
    """Long because it is the driver's one pass: placeholders, each needed VNode's rule, the output, and the
    parameters and submodules the GraphModule holds, in order."""
    graph = module.network
    targets = _targets(graph, want)
    out_slots, in_slots = _needed(graph, targets)
    fxg = fx.Graph()
    emitter = _FxEmitter(fxg, module._attr)
    values: dict[tuple[str, int], Any] = {}
    feeds: list[str] = []
    order = [n for n in graph.topo_order() if n.id in out_slots]
    created: dict[str, set[fx.Node]] = {}  # VNode id -> its fx nodes (remat regions are cut by VNode)
    # Placeholders first, in the graph's network-input order.
    placeholders: dict[tuple[str, int], fx.Node] = {}
    for node in order:
        for slot in sorted(in_slots[node.id]):
            if graph.input_edge(node.id, slot) is None:
                name = feed_name(node.id, slot)
                placeholders[(node.id, slot)] = fxg.placeholder(name.replace(":", "_"))
                feeds.append(name)
    decoding = _decode_inputs(graph, order, fxg, emitter, feeds) if decode else None
    for node in order:
        lowering = get_lowering(node)
        inputs: list[Any] = []
        for slot in range(graph.num_inputs(node.id)):
            if slot not in in_slots[node.id]:
                inputs.append(None)
                continue
            edge = graph.input_edge(node.id, slot)
            inputs.append(placeholders[(node.id, slot)] if edge is None else values[(edge.src, edge.src_slot)])
        emitter.node_id = node.id
        emitter.float32 = _node_float32(graph, node, module.compute_dtype)
        emitter.created = set()
        ctx = LowerCtx(node, graph, inputs, out_slots[node.id], training, emitter, module._publishers, decoding)
        outs = list(lowering.emit(ctx))
        if len(outs) != node.num_outputs:
            raise VGraphError([Diagnostic(f"torch lowering of {node.type!r} returned {len(outs)} values "
                                          f"for {node.num_outputs} outputs", node.loc, node.id)])
        for slot, value in enumerate(outs):
            if slot in out_slots[node.id] and value is None:
                raise VGraphError([Diagnostic(f"torch lowering of {node.type!r} did not compute output "
                                              f"{slot}", node.loc, node.id)])
            values[(node.id, slot)] = value
        _name_outputs(node, outs, out_slots[node.id], emitter.created)
        created[node.id] = emitter.created
    results = {name: values[(node_id, slot)] for name, node_id, slot in targets}
    if decoding is not None:
        silent = [Diagnostic(f"its torch lowering declares a key/value cache but did not extend it "
                             f"(ctx.decode.present)", graph.node(n).loc, n) for n in decoding.past if n not in decoding.present]
        if silent:
            raise VGraphError(silent)
        for node_id, kv in decoding.present.items():
            results.update(zip(D.present_names(node_id), kv))
    fxg.output(results)
    root: dict[str, Any] = {}
    owners = {attr: node_id for node_id, attr in module._attr.items()}
    for fx_node in fxg.nodes:
        if fx_node.op == "get_attr":
            owner_attr, _, pname = fx_node.target.rpartition(".")
            owner = owners[owner_attr]
            root[fx_node.target] = module.namespace(owner)._parameters[pname]
        elif fx_node.op == "call_module":
            owner = owners[fx_node.target]
            root[fx_node.target] = module.namespace(owner)
    if training:  # `remat: recompute` regions become checkpointed submodules (remat_regions.py)
        outline_remat_regions(graph, fxg, root, created)
    class_name = "".join(part.capitalize() for part in _words(graph.name)) or "Network"
    gm = fx.GraphModule(root, fxg, class_name=class_name)
    return Program(gm, tuple(feeds), tuple(results))


def _words(text: str) -> list[str]:
    return [w for w in "".join(c if c.isalnum() else " " for c in text).split() if w]


def _name_outputs(node: VNode, outs: Sequence[Any], needed: frozenset[int], created: set[fx.Node]) -> None:
    """Name a VNode's result after it in the generated code (`block0_head1 = ...`)."""
    rename = getattr(fx.Node, "_rename", None)
    if rename is None:
        return
    single = sum(1 for v in outs if v is not None) == 1
    for slot, value in enumerate(outs):
        if isinstance(value, fx.Node) and value in created and slot in needed:
            rename(value, node.id if single else f"{node.id}_{slot}")


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def compile_network(graph: Graph, *, device: str | torch.device = "cpu", train: bool = True, seed: int = 0,
                    tokenizer: Any = None, unfused_state: Mapping[str, torch.Tensor] | None = None
                    ) -> VGraphModule:
    """Lower `graph` to a `VGraphModule` on `device`.

    Parameters are initialised deterministically from `seed` (see
    `init_state`) unless `unfused_state` gives them (unfused layout, e.g. a
    checkpoint of the unfused network loading into a fused one).
    `tokenizer` serves tokenizer/detokenizer VNodes without a `vocab_path`.
    The graph is copied: later edits to it do not affect the module.
    """
    graph = graph.copy()
    if any(not n.outputs for n in graph.nodes):
        verify(graph)
    module = VGraphModule(graph, options={"tokenizer": tokenizer})
    with torch.no_grad():
        state = to_graph_layout(unfused_state, graph) if unfused_state is not None else init_state(graph, seed)
        own = module.state_dict(keep_vars=True)
        missing = set(own) - set(state)
        if missing:
            raise VGraphError(f"no initial value for {', '.join(sorted(missing))}")
        for key, tensor in own.items():
            if tuple(state[key].shape) != tuple(tensor.shape):
                raise VGraphError(f"parameter {key!r} has shape {list(state[key].shape)}, network "
                                  f"{graph.name!r} needs {list(tensor.shape)}")
            tensor.copy_(state[key])
    module.to(device)
    module.train(train)
    return module
