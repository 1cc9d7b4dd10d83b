"""The launcher side of `vgraph launch`: placement, machines, supervision of workers."""
