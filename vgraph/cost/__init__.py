"""Numbers about a network on machines: parameters and FLOPs (`analyze`), per-VNode and per-edge step costs
(`costmodel`), what recompute marks cost (`remat`), S stages x R replicas (`stepcost`), the largest batch
(`max_batch`), the fleet of PNodes and its links (`fleet`, `fleet_links`) and the host's memory.  Pure Python
over the IR: no pass, no backend."""
