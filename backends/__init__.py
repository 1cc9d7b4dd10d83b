"""vgraph's execution backends, installed as `vgraph.backends`.

* `torch/`  - PyTorch: lowering to torch.fx, training, checkpoints, sampling,
  and the distributed runtime (`torch/distributed/`);
* `onnx/`   - ONNX export and the independent onnxruntime check.

Backends import the core (`vgraph.*`) and never each other's internals, and
the core never imports them: they add their commands through the
`vgraph.commands` entry points, so `vgraph validate` never pays for torch.
"""
