"""The worker side of `vgraph launch`: one rank's stage and its schedule rounds, transport, gradient and tie sync."""
