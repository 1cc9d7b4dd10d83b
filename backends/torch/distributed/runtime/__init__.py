"""The worker side of `vgraph launch`: one rank's stages, transport, gradient and tie sync."""
