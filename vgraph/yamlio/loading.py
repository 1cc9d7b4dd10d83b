"""`load` and `loads`: pick the reader, build, validate, raise every problem at once."""
from __future__ import annotations

from pathlib import Path

from vgraph.base.diagnostics import Diagnostic, DiagnosticSink
from vgraph.base.gcpause import paused_gc
from vgraph.base.safeio import read_input
from vgraph.ir.graph import Graph
from vgraph.yamlio.build import Builder
from vgraph.yamlio.fast_reader import read_fast
from vgraph.yamlio.yaml_reader import read_yaml


def loads(text: str, file: str = "<string>", *, validate: bool = True,
          warnings: list[Diagnostic] | None = None) -> Graph:
    """Parse network YAML text; raise VGraphError listing every problem.

    With `validate` (the default) the graph is also verified and its types
    inferred.  Warnings (e.g. unknown top-level keys) go into `warnings`.
    """
    return read_network(text, file, validate=validate, warnings=warnings)


def read_network(text: str, file: str, *, validate: bool = True, warnings: list[Diagnostic] | None = None,
           fast: bool | None = None) -> Graph:
    """`loads`, choosing the reader: None tries the fast one first, False never, True only it.

    `fast=True` raises LookupError when the text is not in the canonical
    layout (tests use it to compare the readers).
    """
    from vgraph.ir.verify import check

    with paused_gc():
        sink = DiagnosticSink()
        build = Builder(file, sink)
        if fast is False or not read_fast(text, build):
            if fast:
                raise LookupError("not in the canonical layout")
            sink = DiagnosticSink()
            build = Builder(file, sink)
            read_yaml(text, build)
        graph = build.graph if build.readable else None
        build._ends.clear()  # the builder's index is not needed any more: free it before checking
        if graph is not None and validate:
            check(graph, sink, skip=build.broken)
    sink.raise_if_errors()
    if warnings is not None:
        warnings.extend(d for d in sink.items if d.severity == "warning")
    assert graph is not None  # no graph means a reported error
    return graph


def load(path: str | Path, *, validate: bool = True,
         warnings: list[Diagnostic] | None = None) -> Graph:
    path = Path(path)
    text = read_input(path, what="network file")  # a regular file, size-capped, UTF-8: never /dev/zero
    return loads(text, str(path), validate=validate, warnings=warnings)
