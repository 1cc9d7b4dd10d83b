"""The production networks (`*.yml`) and example fleets (`fleets/*.yml`), installed as `vgraph.networks`
package data so that an installed vgraph can run them by name (`vgraph networks` lists them; the resolver
is `vgraph.base.shipped`).  Nothing here is code; the files are generated (networks/README.md)."""
