"""Rewriting the IR: what a pass is (`pass_api`), the pass manager that verifies after every pass
(`pipeline`), patterns and rules (`rewrite`) and what a match becomes (`replace`).  Plugins import the
stable names through `vgraph.pass_api` and `vgraph.rewrite`."""
