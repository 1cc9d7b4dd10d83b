"""Stable import path of the rewrite API for plugins (docs/plugins.md section 6); it lives in
`vgraph.transform.rewrite` (patterns and rules) and `vgraph.transform.replace` (what a match becomes)."""
from vgraph.transform.replace import (NewNode, Reject, ReplaceError, fresh_id, fused, inherited_config, reads,
                                      rebuilt, replace)
from vgraph.transform.rewrite import (Each, Match, NoMatch, P, RewritePass, Rule, RuleContext, RuleError, RuleSet,
                                      match)

__all__ = ["Each", "Match", "NoMatch", "NewNode", "P", "Reject", "ReplaceError", "RewritePass", "Rule", "RuleContext",
           "RuleError", "RuleSet", "fresh_id", "fused", "inherited_config", "match", "reads", "rebuilt", "replace"]
