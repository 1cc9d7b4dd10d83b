"""Where a KV cache may stand: the one graph rule both backends' decoders check (torch decode mode, ONNX export).

With a cache, a `kv_head`'s output spans past and new positions while every other value spans the new ones
only.  So a query head must get its keys and values from a kv_head (through broadcasts), and a kv_head's
output may reach nothing but such query heads: each backend words its own refusal, the rule is here.
"""
from __future__ import annotations

from .graph import Graph, VNode


def kv_source(graph: Graph, head: VNode) -> VNode | None:
    """What a query head's keys and values (input 1) come from, looking through broadcasts; None: a
    network input."""
    source = graph.producer(head.id, 1)
    while source is not None and source.type == "broadcast":
        source = graph.producer(source.id, 0)
    return source


def foreign_kv_reader(graph: Graph, node: VNode) -> VNode | None:
    """A reader of kv_head `node` (through broadcasts) that is not an attention_head taking it as kv_input:
    it would get the wrong number of positions under a cache.  None when there is none."""
    todo = [e.dst for e in graph.out_edges(node.id)]
    while todo:
        reader = graph.node(todo.pop())
        if reader.type == "broadcast":
            todo.extend(e.dst for e in graph.out_edges(reader.id))
        elif not (reader.type == "attention_head" and reader.cfg["kv_input"]):
            return reader
    return None
