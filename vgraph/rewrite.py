"""Declarative subgraph rewriting.

A rule is a pattern plus a function, as in tinygrad's pattern matcher:

    Rule("fuse-lm-head-ce", P("cost", "cost", P("linear", "head", where=tied), where=ce_logits), fuse)

A pattern matches a node by type and predicate, and its producers input by
input (`Each(p)` matches every input of a variadic node).  Names bind nodes;
a name that appears twice must bind the same node, so "all heads read the
same broadcast" is just the broadcast's name repeated.  A failed match is not
an exception but data, `NoMatch(reason, node)`, as in onnxscript's rewriter,
so `--explain` can say why a candidate was left alone.  The rewrite function
may also refuse with `Reject(reason)` after looking at the whole match.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Container, Iterable, Sequence, Union

from .ir import Graph, VNode
from .ops import REGISTRY
from .pass_api import Pass, PassContext

Predicate = Callable[[VNode], Union[bool, str, None]]
"""True/None: accept.  False or a string: refuse (the string is the reason)."""


@dataclass(frozen=True)
class Each:
    """Every input of a variadic node matches `pattern`; its name binds a list."""

    pattern: "Pat"
    min: int = 1


@dataclass(frozen=True)
class Pat:
    types: tuple[str, ...] | None
    name: str | None = None
    inputs: tuple["Pat | None", ...] | Each | None = None
    where: Predicate | None = None


def P(types: str | Sequence[str] | None, name: str | None = None, *inputs: "Pat | Each | None",
      where: Predicate | None = None) -> Pat:
    """Pattern shorthand: P(type, name, *input_patterns, where=predicate)."""
    if isinstance(types, str):
        types = (types,)
    canon = tuple(REGISTRY.canonical(t) or t for t in types) if types is not None else None
    ins: tuple | Each | None
    if len(inputs) == 1 and isinstance(inputs[0], Each):
        ins = inputs[0]
    else:
        ins = tuple(inputs) if inputs else None
    return Pat(canon, name, ins, where)


@dataclass
class Match:
    root: VNode
    bindings: dict[str, VNode | list[VNode]] = field(default_factory=dict)
    nodes: list[VNode] = field(default_factory=list)

    def __getitem__(self, name: str):
        return self.bindings[name]


@dataclass(frozen=True)
class NoMatch:
    reason: str
    node: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"'{self.node}': {self.reason}"


@dataclass(frozen=True)
class Reject:
    """Returned by a rewrite function that declines a match, with the reason."""

    reason: str


def match(graph: Graph, pat: Pat, node: VNode) -> Match | NoMatch:
    m = Match(node)
    failure = _match(graph, pat, node, m, None)
    return m if failure is None else failure


def _match(graph: Graph, pat: Pat, node: VNode, m: Match, collect: str | None) -> NoMatch | None:
    if pat.types is not None and node.type not in pat.types:
        return NoMatch(f"is a {node.type}, not {' or '.join(pat.types)}", node.id)
    if pat.where is not None:
        verdict = pat.where(node)
        if verdict is False or isinstance(verdict, str):
            return NoMatch(verdict if isinstance(verdict, str) else "predicate failed", node.id)
    if pat.name is not None:
        if pat.name == collect:
            m.bindings.setdefault(pat.name, []).append(node)  # type: ignore[union-attr]
        else:
            bound = m.bindings.get(pat.name)
            if bound is not None and bound is not node:
                return NoMatch(f"{pat.name!r} would be both '{bound.id}' and '{node.id}'",  # type: ignore
                               node.id)
            m.bindings[pat.name] = node
    if node not in m.nodes:
        m.nodes.append(node)
    if isinstance(pat.inputs, Each):
        count = graph.num_inputs(node.id)
        if count < pat.inputs.min:
            return NoMatch(f"has {count} inputs, fewer than {pat.inputs.min}", node.id)
        subs: Iterable[tuple[int, Pat | None]] = ((s, pat.inputs.pattern) for s in range(count))
        inner = pat.inputs.pattern.name
    else:
        subs = enumerate(pat.inputs or ())
        inner = collect
    for slot, sub in subs:
        if sub is None:
            continue
        producer = graph.producer(node.id, slot)
        if producer is None:
            return NoMatch(f"input {slot} is not connected", node.id)
        failure = _match(graph, sub, producer, m, inner)
        if failure is not None:
            return NoMatch(f"input {slot} {failure}", node.id)
    return None


RewriteFn = Callable[[Graph, Match, PassContext], Union[Counter, dict, Reject, None]]


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    rewrite: RewriteFn


class RuleSet:
    """Rules applied to every node once, in topological order; sets compose with `+`."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = list(rules)

    def __add__(self, other: "RuleSet") -> "RuleSet":
        return RuleSet(self.rules + other.rules)

    def apply(self, graph: Graph, ctx: PassContext) -> Counter:
        counts: Counter = Counter()
        for node_id in [n.id for n in graph.topo_order()]:
            if node_id not in graph:
                continue  # consumed by an earlier rewrite
            node = graph.node(node_id)
            for rule in self.rules:
                if rule.pattern.types is not None and node.type not in rule.pattern.types:
                    continue
                found = match(graph, rule.pattern, node)
                if not found:
                    if ctx.explain:
                        ctx.explanations.append(f"{rule.name}: '{node_id}' not rewritten: {found}")
                    continue
                result = rule.rewrite(graph, found, ctx)
                if isinstance(result, Reject):
                    if ctx.explain:
                        ctx.explanations.append(f"{rule.name}: '{node_id}' not rewritten: {result.reason}")
                    continue
                counts.update(result or {})
                break
        return counts


class RewritePass(Pass):
    """A pass that is a rule set: subclasses set `name`, a docstring and `rules`."""

    rules: ClassVar[RuleSet]

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        return self.rules.apply(graph, ctx)


def only_feeds(graph: Graph, node: VNode, consumers: Iterable[VNode]) -> str | None:
    """Why `node`'s outputs reach something other than `consumers` (None if they don't)."""
    allowed = {c.id for c in consumers}
    for e in graph.out_edges(node.id):
        if e.dst not in allowed:
            return f"'{node.id}' also feeds '{e.dst}'"
    for ep in graph.iter_endpoints():
        if ep.node == node.id:
            return f"'{node.id}' is read by {ep.name!r}"
    return None


def fresh_id(taken: Container[str], base: str) -> str:
    """`base`, or `base_2`, `base_3`, ... whichever is not in `taken` (a Graph or a set of names)."""
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


PLACEMENT_KEYS = ("colocate_group", "colocate_policy")
PRECISION_KEYS = ("precision", "param_precision", "activation_precision")
TRAINING_KEYS = ("optimizer", "learning_rate")


def inherited_config(node: VNode, keys: Sequence[str] = PLACEMENT_KEYS + PRECISION_KEYS + TRAINING_KEYS
                     ) -> dict:
    """The keys a fused node takes over from a node it replaces (placement, precision, training)."""
    return {k: node.config[k] for k in keys if k in node.config}
