"""The op registry: what each VNode type means to the IR.

An `OpDef` declares a type's config schema, slot arity, shape/dtype inference,
parameter shapes and a FLOP estimate.  The core knows no backend: a backend
keeps its own table keyed by `OpDef.name`.  Third parties register more types
with `register_op` (directly, or through the `vgraph.ops` entry point group).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from vgraph.ops.schema import Schema, suggest
from vgraph.types import ShapeError, TensorType

Config = Mapping[str, Any]


@dataclass(frozen=True)
class InferCtx:
    """What an inference rule sees: resolved config, input types, dtype."""

    cfg: Config
    inputs: Sequence[TensorType]
    dtype: str  # the node's declared activation dtype
    # slot -> (id, canonical type, resolved config) of the VNode feeding it, or None (a network input); for
    # the few rules whose meaning depends on their producer's config (a query head and its kv_head must rotate
    # with the same RoPE).  Looked up only when asked; None where the caller has no graph.
    producer: Callable[[int], tuple[str, str, Config] | None] | None = None

    def single(self) -> TensorType:
        return self.inputs[0]

    def source(self, slot: int) -> tuple[str, str, Config] | None:
        """The VNode feeding input `slot` as (id, type, config), or None when unknown."""
        return self.producer(slot) if self.producer is not None else None

    def require_last_dim(self, slot: int, expected: int, key: str) -> None:
        t = self.inputs[slot]
        if not t.shape or t.shape[-1] != expected:
            raise ShapeError(f"input {slot} has shape {list(t.shape)} but {key}={expected} "
                             f"needs a last dimension of {expected}")


def same_as_input(ctx: InferCtx) -> list[TensorType]:
    """Elementwise ops: the input's shape, in the node's dtype when floating."""
    x = ctx.single()
    return [TensorType(x.shape, ctx.dtype if x.kind == "float" else x.dtype)]


@dataclass(frozen=True)
class OpExample:
    """A config and input shapes a single VNode of the type can be run with, for `check-onnx --ops`.

    `config` holds Python values (parsed through the op's schema like YAML
    strings); `inputs` the per-sample shape of each float input slot, in order
    (integer inputs such as token ids or targets may be left off when the op's
    `network_input` knows their type).  A weight-tied config gets a publisher of
    its alias.  Like PyTorch's OpInfo samples: a few small cases that reach
    every branch of the lowerings (each option value, with and without bias).
    """

    config: Mapping[str, Any]
    inputs: tuple[tuple[int, ...], ...] = ()
    label: str = ""


@dataclass(frozen=True)
class OpDef:
    """Everything the core needs to know about one VNode type."""

    name: str
    category: str  # layer | activation | structural | text | training
    doc: str = ""
    aliases: tuple[str, ...] = ()
    schema: Schema = field(default_factory=Schema)
    num_inputs: int | tuple[int, int | None] = 1
    num_outputs: Callable[[Config], int] | int = 1
    input_kind: Callable[[Config, int], str] | str = "float"  # float | int | str | any
    infer: Callable[[InferCtx], list[TensorType]] = same_as_input
    params: Callable[[Config], dict[str, tuple[int, ...]]] | None = None
    tied_params: Callable[[Config], dict[str, tuple[str, tuple[int, ...]]]] | None = None
    flops: Callable[[Config, Sequence[TensorType], Sequence[TensorType]], int] | None = None
    network_input: Callable[[Config, int, Sequence[TensorType | None]], TensorType | None] | None = None
    # For fused types: param -> [(unfused "<vnode>.<param>" key, rows along dim 0), ...].
    param_sources: Callable[[Config], dict[str, list[tuple[str, int]]]] | None = None
    is_cost: bool = False
    origin: str = "vgraph"
    # Warnings about a valid but likely mistaken config (a setting that has no effect): validation
    # reports them, so a user learns a value is ignored instead of meeting silence.
    advice: Callable[[Config], list[str]] | None = None
    # Small configs the backends' lowerings are checked on (`vgraph check-onnx --ops`).
    examples: tuple[OpExample, ...] = ()

    # -- arity --------------------------------------------------------------
    def input_range(self) -> tuple[int, int | None]:
        n = self.num_inputs
        return (n, n) if isinstance(n, int) else n

    def outputs_for(self, cfg: Config) -> int:
        n = self.num_outputs
        return n if isinstance(n, int) else n(cfg)

    def kind_of_input(self, cfg: Config, slot: int) -> str:
        k = self.input_kind
        return k if isinstance(k, str) else k(cfg, slot)

    # -- parameters -----------------------------------------------------------
    def param_shapes(self, cfg: Config) -> dict[str, tuple[int, ...]]:
        """Parameters this node owns (tied ones belong to their publisher)."""
        return self.params(cfg) if self.params else {}

    def tied(self, cfg: Config) -> dict[str, tuple[str, tuple[int, ...]]]:
        """param name -> (alias it reads from another node, shape it needs)."""
        return self.tied_params(cfg) if self.tied_params else {}

    def flop_count(self, cfg: Config, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
        return int(self.flops(cfg, ins, outs)) if self.flops else 0

    @property
    def trainable(self) -> bool:
        return self.params is not None


class OpRegistry:
    """Name/alias -> OpDef, case-insensitive on aliases as the orchestrator is."""

    def __init__(self) -> None:
        self._ops: dict[str, OpDef] = {}
        self._alias: dict[str, str] = {}

    def register(self, op: OpDef, *, replace: bool = False) -> OpDef:
        names = (op.name, *op.aliases)
        for n in names:
            owner = self._alias.get(n.lower())
            if owner is not None and not (replace and owner == op.name):
                raise ValueError(f"op type {n!r} is already registered (by {self._ops[owner].origin})")
        self._ops[op.name] = op
        for n in names:
            self._alias[n.lower()] = op.name
        return op

    def canonical(self, name: str) -> str | None:
        return self._alias.get(str(name).lower())

    def get(self, name: str) -> OpDef:
        canon = self.canonical(name)
        if canon is None:
            raise KeyError(f"unknown node type {name!r}{suggest(str(name), self._alias)}")
        return self._ops[canon]

    def __contains__(self, name: str) -> bool:
        return self.canonical(name) is not None

    def __iter__(self):
        return iter(sorted(self._ops.values(), key=lambda o: o.name))

    def aliases(self) -> dict[str, str]:
        return dict(self._alias)

    def set_origin(self, name: str, origin: str) -> None:
        """Record who defined op type `name` (the plugin loader knows; the plugin may not)."""
        op = self._ops[self._alias[name.lower()]]
        if op.origin != origin:
            self._ops[op.name] = replace(op, origin=origin)


REGISTRY = OpRegistry()


def register_op(op: OpDef, *, replace: bool = False) -> OpDef:
    """Public hook for plugins: make a new VNode type known to the IR."""
    return REGISTRY.register(op, replace=replace)


def get_op(name: str) -> OpDef:
    return REGISTRY.get(name)
