"""Pictures and pages: a network as SVG through Graphviz (`render`), and `vgraph report`'s one self-contained
HTML page about a run (`page`, with its charts and embedded SVG)."""
