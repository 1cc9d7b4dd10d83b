"""``vgraph export-onnx`` and ``vgraph check-onnx`` (registered through ``vgraph.commands``).

    vgraph export-onnx FILE [--checkpoint CKPT] [--passes SPEC] -o OUT.onnx
    vgraph check-onnx FILE [--checkpoint CKPT] [--batch B] [--passes SPEC]

Without ``--checkpoint`` the weights are the torch backend's seeded
initialisation (``--seed``), so an export and a training run of the same seed
start from the same model.  ``check-onnx`` exits 0 when every output agrees,
1 when one does not, 2 for a user error (bad file, mismatched checkpoint).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vgraph.base import options
from vgraph.base.diagnostics import VGraphError
from vgraph.base.safeio import atomic_write, check_output

#: Above this a model is written with its tensors in a side file: protobuf
#: cannot serialise a message of 2 GiB or more.
EXTERNAL_DATA_BYTES = 1_800_000_000


def _common(p: argparse.ArgumentParser) -> None:
    from vgraph.base import options
    from vgraph.cli.main import add_plugin_option

    p.add_argument("file", metavar="FILE", type=options.network_file, help="network YAML or a shipped network's name")
    p.add_argument("--checkpoint", metavar="CKPT", type=options.path,
                   help="vgraph checkpoint directory, run directory or model .safetensors file")
    p.add_argument("--passes", metavar="SPEC",
                   help="run these passes first, e.g. fuse-heads,fuse-lm-head-ce (default: none)")
    p.add_argument("--seed", type=options.seed, default=0, help="initialisation seed without --checkpoint (default 0)")
    add_plugin_option(p)


def register_export(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export-onnx", help="write the network as an ONNX model (float32, dynamic batch)",
                              description=__doc__.split("\n\n")[0])
    _common(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", type=options.path)
    p.add_argument("--no-weights", action="store_true",
                   help="make the parameters named graph inputs instead of storing them")
    p.set_defaults(func=_export)


def register_check(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-onnx",
                              help="run the torch backend and onnxruntime on the same random inputs; "
                                   "compare every output")
    _common(p)
    from vgraph.base import options
    p.add_argument("--batch", type=options.positive_int, default=1, help="batch size of the random inputs (default 1)")
    p.add_argument("--rtol", type=options.non_negative_float, default=None, help="relative tolerance (default 1e-4)")
    p.add_argument("--atol", type=options.non_negative_float, default=None, help="absolute tolerance (default 1e-5)")
    p.set_defaults(func=_check)


def _graph(args: argparse.Namespace):
    import vgraph

    graph = vgraph.load(args.file)  # plugins are loaded: `vgraph.cli.main.run_parser` does it for every command
    if args.passes:
        from vgraph.transform.pipeline import run_pipeline

        run_pipeline(graph, args.passes)
    return graph


def _weights(args: argparse.Namespace, graph):
    from .check import initial_weights, weights_from_checkpoint

    if args.checkpoint:
        return weights_from_checkpoint(args.checkpoint, graph, given=args.file)
    return initial_weights(graph, args.seed)


def _export(args: argparse.Namespace) -> int:
    import onnx

    from .check import fp32_graph
    from .lower import expected_param_shapes, lower_network

    out = check_output(args.output, inputs=(args.file, args.checkpoint, *args.plugin))
    graph = fp32_graph(_graph(args))
    weights = None if args.no_weights else _weights(args, graph)
    model = lower_network(graph, weights)
    model = onnx.shape_inference.infer_shapes(model)  # value shapes for viewers such as Netron
    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    if external:
        _save_external(model, out)
    else:
        onnx.checker.check_model(model, full_check=True)
        atomic_write(out, model.SerializeToString())
    keys = set(expected_param_shapes(graph))
    params = sum(_numel(t.dims) for t in model.graph.initializer if t.name in keys)
    data = f", tensors in {out.name}.data" if external else ""
    print(f"wrote {out}: {len(model.graph.node)} ONNX nodes from {len(graph)} VNodes, {params:,} parameters"
          f"{' (as graph inputs)' if weights is None else ''}{data}; opset {model.opset_import[0].version}, "
          "float32")
    print("inputs:  " + ", ".join(_describe(v) for v in model.graph.input if v.name not in keys))
    print("outputs: " + ", ".join(_describe(v) for v in model.graph.output))
    return 0


def _save_external(model, out: Path) -> None:
    """Model and tensor file written and checked in a temporary directory next to `out`, then each
    renamed into place: a failure (a full disk) leaves neither a truncated model nor a temporary."""
    import tempfile

    import onnx

    check_output(out.with_name(out.name + ".data"), what="tensor file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            staged = Path(tmp) / out.name
            onnx.save_model(model, os.fspath(staged), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=out.name + ".data")
            onnx.checker.check_model(os.fspath(staged), full_check=True)
            os.replace(staged.with_name(out.name + ".data"), out.with_name(out.name + ".data"))
            os.replace(staged, out)
    except OSError as exc:
        raise VGraphError(f"{out}: cannot write: {exc.strerror or exc}") from None


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _describe(vi) -> str:
    dims = [d.dim_param or str(d.dim_value) for d in vi.type.tensor_type.shape.dim]
    return f"{vi.name}[{', '.join(dims)}]"


def _check(args: argparse.Namespace) -> int:
    from .check import ATOL, RTOL, check_network

    graph = _graph(args)
    weights = _weights(args, graph) if args.checkpoint else None
    report = check_network(graph, weights=weights, batch=args.batch, seed=args.seed,
                           rtol=RTOL if args.rtol is None else args.rtol,
                           atol=ATOL if args.atol is None else args.atol)
    print(report.format())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m vgraph.backends.onnx.cli {export-onnx,check-onnx} ...`` without the entry points."""
    from vgraph.cli.main import run_commands

    return run_commands([register_export, register_check], argv, prog="python -m vgraph.backends.onnx.cli")


if __name__ == "__main__":
    sys.exit(main())
