"""vgraph's built-in passes, installed as `vgraph.passes`.

Each module holds one pass (or one pass's helpers) and imports only the core
(`vgraph.*`), never a backend.  The passes are registered through the
`vgraph.passes` entry points in pyproject.toml, exactly as a third-party
plugin registers its own, so nothing here is imported until a pipeline names
it (see `vgraph.plugins`).
"""
