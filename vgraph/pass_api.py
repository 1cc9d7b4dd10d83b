"""Stable import path of the pass API for plugins (docs/plugins.md section 6); it lives in
`vgraph.transform.pass_api`."""
from vgraph.transform.pass_api import Option, Pass, PassContext, PassError, register_pass

__all__ = ["Option", "Pass", "PassContext", "PassError", "register_pass"]
