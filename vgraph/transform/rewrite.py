"""Declarative subgraph rewriting.

A rule is a pattern plus a function, as in tinygrad's pattern matcher:

    Rule("fuse-lm-head-ce", P("cost", "cost", P("linear", "head", where=tied), where=ce_logits), fuse)

A pattern matches a node by type and predicate, and its producers input by
input (`Each(p)` matches every input of a variadic node).  Names bind nodes;
a name that appears twice must bind the same node, so "all heads read the
same broadcast" is just the broadcast's name repeated.  A failed match is not
an exception but data, `NoMatch(reason, node)`, as in onnxscript's rewriter,
so `--explain` can say why a candidate was left alone.  The rewrite function
may also refuse with `Reject(reason)` after looking at the whole match, and
says what the match becomes with one `replace(...)` call (vgraph.transform.replace),
which refuses by itself when a node it removes is read from outside.

Rules see the pass that runs them: predicates (`where=lambda node, ctx: ...`,
or just `node`) and rewrite functions receive a `RuleContext` whose `opts`
are that pass's options, so a pass built from rules is a class with
`options` and `rules` and nothing else.  A rule that raises is reported
with the pass, rule and node, never as a traceback.
"""
from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence, Union

from vgraph.base.diagnostics import Diagnostic, VGraphError
from vgraph.ir.graph import Graph, VNode
from vgraph.ops import REGISTRY
from vgraph.transform.pass_api import Pass, PassContext, PassError
# A rule author imports it all from here.
from vgraph.transform.replace import (NewNode, NewOutput, Reads, ReplaceError, Reject, Source, fresh_id,  # noqa: F401
                                      fused, inherited_config, reads, rebuilt, replace)

Predicate = Callable[..., Union[bool, str, None]]
"""`(node)` or `(node, ctx)`.  True/None: accept.  False or a string: refuse (the string is the reason)."""


class RuleContext:
    """What a rule's predicates and rewrite function see besides the graph.

    `opts` are the options of the pass running the rule (empty outside a
    pass), `pass_` that pass; everything else (`target`, `notes`, `explain`,
    `data`, ...) reads through to the pipeline's PassContext.
    """

    def __init__(self, ctx: PassContext | None = None, pass_: Pass | None = None) -> None:
        self.ctx = ctx if ctx is not None else PassContext()
        self.pass_ = pass_

    @property
    def opts(self) -> Mapping[str, Any]:
        return self.pass_.opts if self.pass_ is not None else {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "ctx":  # copy/pickle probing a half-built object
            raise AttributeError(name)
        return getattr(self.ctx, name)


class RuleError(PassError):
    """A rule's predicate or rewrite function failed (a bug in the rule, reported without a traceback)."""


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
    where_takes_ctx: bool = False


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
    return Pat(canon, name, ins, where, where is not None and _takes_ctx(where))


def _takes_ctx(fn: Callable) -> bool:
    """Whether a predicate takes `(node, ctx)` rather than `(node)`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with the node only
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


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


def match(graph: Graph, pat: Pat, node: VNode, ctx: RuleContext | None = None) -> Match | NoMatch:
    m = Match(node)
    failure = _match(graph, pat, node, m, None, ctx if ctx is not None else RuleContext())
    return m if failure is None else failure


def _match(graph: Graph, pat: Pat, node: VNode, m: Match, collect: str | None,
           ctx: RuleContext) -> NoMatch | None:
    if pat.types is not None and node.type not in pat.types:
        return NoMatch(f"is a {node.type}, not {' or '.join(pat.types)}", node.id)
    if pat.where is not None:
        verdict = pat.where(node, ctx) if pat.where_takes_ctx else pat.where(node)
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
    if all(n is not node for n in m.nodes):  # identity: VNode equality compares whole configs
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
        failure = _match(graph, sub, producer, m, inner, ctx)
        if failure is not None:
            return NoMatch(f"input {slot} {failure}", node.id)
    return None


RewriteFn = Callable[[Graph, Match, RuleContext], Union[Counter, dict, Reject, None]]


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

    def apply(self, graph: Graph, ctx: PassContext | RuleContext, pass_: Pass | None = None) -> Counter:
        """Apply the rules; `pass_` (whose options the rules read) is the pass running them."""
        rctx = ctx if isinstance(ctx, RuleContext) else RuleContext(ctx, pass_)
        counts: Counter = Counter()
        for node_id in [n.id for n in graph.topo_order()]:
            if node_id not in graph:
                continue  # consumed by an earlier rewrite
            node = graph.node(node_id)
            for rule in self.rules:
                if rule.pattern.types is not None and node.type not in rule.pattern.types:
                    continue
                result = _run_rule(graph, rule, node, rctx)
                if isinstance(result, NoMatch):
                    if rctx.explain:  # the reason names the node only when it is not the candidate itself
                        why = result.reason if result.node == node_id else str(result)
                        rctx.explanations.append(f"{rule.name}: '{node_id}' not rewritten: {why}")
                    continue
                if isinstance(result, Reject):
                    if rctx.explain:
                        rctx.explanations.append(f"{rule.name}: '{node_id}' not rewritten: {result.reason}")
                    continue
                counts.update(result or {})
                break
        return counts


def _run_rule(graph: Graph, rule: Rule, node: VNode, ctx: RuleContext) -> Counter | dict | Reject | NoMatch | None:
    """Match `rule` at `node` and rewrite; a rule that raises becomes a RuleError naming pass, rule, node."""
    where = f"{f'pass {ctx.pass_.name!r}, ' if ctx.pass_ is not None else ''}rule {rule.name!r}"
    try:
        found = match(graph, rule.pattern, node, ctx)
        return rule.rewrite(graph, found, ctx) if found else found
    except ReplaceError as exc:
        raise RuleError([Diagnostic(f"{where}: wrong replacement: {exc}", node.loc, node.id)]) from exc
    except VGraphError:
        raise  # already a user-facing message (a bad option value, ...)
    except Exception as exc:  # a plugin's bug must not look like ours, nor show a traceback
        raise RuleError([Diagnostic(f"{where} failed: {type(exc).__name__}: {exc}", node.loc, node.id)]
                        ) from exc


class RewritePass(Pass):
    """A pass that is a rule set: subclasses set `name`, a docstring, `options` and `rules`.

    `rules` is a RuleSet or a list of Rules; they read this pass's options
    through `ctx.opts`.
    """

    rules: ClassVar[RuleSet | Sequence[Rule]]
    fuses: ClassVar[bool] = True  # its replacements are built with `fused(...)`, which records `fused_from`

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        rules = self.rules if isinstance(self.rules, RuleSet) else RuleSet(self.rules)
        return rules.apply(graph, ctx, self)
