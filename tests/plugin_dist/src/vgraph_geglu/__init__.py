"""vgraph-geglu: a GEGLU feed-forward VNode type and a pass that swaps SwiGLU feed-forwards for it; a fused
GELU feed-forward VNode type and the semantics-preserving pass that fuses into it.

Nothing here imports torch or onnx: vgraph imports `torch_lowering` and
`onnx_lowering` through their entry points only when that backend runs.
"""
