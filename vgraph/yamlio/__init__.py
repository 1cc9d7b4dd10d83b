"""Network YAML <-> IR.

Reading has two stages.  A *reader* turns the text into plain records (a
node's id, type text, config strings, each with the line it came from) and
reports everything malformed about the document's structure.  One *builder*
then turns records into the IR and reports what is wrong with their meaning
(unknown types, bad config values, duplicate ids, dangling edges).  Semantic
validation (`vgraph.ir.verify`) runs last, and all diagnostics are raised
together.

There are two readers with the same output: the general one (PyYAML's
composer, any YAML) and a fast one that recognises exactly the canonical
layout `dumps` writes and gives up on anything else, in which case the
general one runs.  Both must agree on everything the fast one accepts: the
same graph, the same lines, the same diagnostics (tests/test_properties.py
checks it on valid and mutated texts).

The package, by job:

- `records`: the keys of the format and the records a reader hands the builder;
- `build`: the builder (records -> IR, the checks of meaning);
- `yaml_reader`: the general reader (PyYAML's composer, safe tags only);
- `fast_reader`: the scanner for the canonical layout;
- `loading`: `load`/`loads`, which pick the reader and run validation;
- `writer`: `dumps`/`save`, the canonical layout.

The format itself is described in docs/network-yaml.md.
"""
from __future__ import annotations

from vgraph.base.diagnostics import sorted_diagnostics
from vgraph.yamlio.loading import load, loads
from vgraph.yamlio.records import NETWORK_KEYS
from vgraph.yamlio.writer import dumps, save

__all__ = ["load", "loads", "dumps", "save", "sorted_diagnostics", "NETWORK_KEYS"]
