"""Stable import path of the rewrite API for plugins (docs/plugins.md section 6); it lives in
`vgraph.transform.rewrite` (patterns and rules) and `vgraph.transform.replace` (what a match becomes).

Names that left the API stay here as deprecated aliases for one release
(`_DEPRECATED`): reading one warns with a DeprecationWarning that says what
replaces it, so a plugin written against the previous release keeps loading
and its author is told what to change (docs/plugins.md section 6 promises it;
tests/test_stable_api.py holds us to it).
"""
import warnings
from typing import Any, Iterable

from vgraph.ir.graph import Graph, VNode
from vgraph.transform.replace import (NewNode, Reject, ReplaceError, fresh_id, fused, inherited_config, reads,
                                      rebuilt, replace)
from vgraph.transform.rewrite import (Each, Match, NoMatch, P, RewritePass, Rule, RuleContext, RuleError, RuleSet,
                                      match)

__all__ = ["Each", "Match", "NoMatch", "NewNode", "P", "Reject", "ReplaceError", "RewritePass", "Rule", "RuleContext",
           "RuleError", "RuleSet", "fresh_id", "fused", "inherited_config", "match", "reads", "rebuilt", "replace"]


def _only_feeds(graph: Graph, node: VNode, consumers: Iterable[VNode]) -> str | None:
    """Why `node`'s outputs reach something other than `consumers` (None if they don't): 0.1.0's check,
    kept exactly for plugins that call it.  Its successor is `replace`, which refuses by itself (with a
    `Reject`) when a value it removes is still read from outside the match."""
    allowed = {c.id for c in consumers}
    for e in graph.out_edges(node.id):
        if e.dst not in allowed:
            return f"'{node.id}' also feeds '{e.dst}'"
    for ep in graph.iter_endpoints():
        if ep.node == node.id:
            return f"'{node.id}' is read by {ep.name!r}"
    return None


# name -> (the object, the release that deprecated it, what to use instead)
_DEPRECATED: dict[str, tuple[Any, str, str]] = {
    "only_feeds": (_only_feeds, "0.2.0", "replace(...), which returns a Reject by itself when a removed value "
                                         "is still read outside the match"),
}


def __getattr__(name: str) -> Any:
    """Deprecated names (PEP 562): the old object, with a DeprecationWarning naming its successor."""
    if name in _DEPRECATED:
        value, since, instead = _DEPRECATED[name]
        warnings.warn(f"vgraph.rewrite.{name} is deprecated since vgraph {since} and will be removed in the next "
                      f"release; use {instead}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module 'vgraph.rewrite' has no attribute {name!r}")
