"""Lowering: network YAML to torch (fx code, ops, kernels, keyed dropout, wire formats, remat, graph breaks)."""
