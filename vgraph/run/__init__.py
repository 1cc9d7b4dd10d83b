"""What a run directory holds and means, without torch: the graph a run compiled (`compiled_graph`),
checkpoint layouts across fusions (`layout`) and whether weights fit a network (`network_match`)."""
