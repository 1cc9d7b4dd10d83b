"""The probe: a PNode's own figures measured (`vgraph probe`), collectives included."""
