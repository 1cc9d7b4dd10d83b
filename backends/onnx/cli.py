"""``vgraph export-onnx`` and ``vgraph check-onnx`` (registered through ``vgraph.commands``).

    vgraph export-onnx FILE|RUN [--checkpoint CKPT | --random-weights] [--passes SPEC] [--with-loss | --kv-cache]
                       -o OUT.onnx
    vgraph export-onnx FILE|RUN [--checkpoint CKPT | --random-weights] --serving -o DIR
    vgraph check-onnx FILE|RUN [--checkpoint CKPT] [--batch B] [--passes SPEC]
    vgraph check-onnx [FILE] --ops [TYPE ...]

``export-onnx`` writes the inference model (``inference.py``): logits, batch
and sequence dynamic; ``--with-loss`` adds the costs and their targets,
``--kv-cache`` makes it a decoder with past keys and values, named after its
VNodes.  ``--serving`` writes a directory in the layout Hugging Face Optimum's
``ORTModelForCausalLM`` and onnxruntime-genai read (``serving.py``: model.onnx
with ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.*``,
``logits``, ``present.{i}.*``; config.json, genai_config.json,
generation_config.json and the run's tokenizer); docs/serving.md.  The weights are
a checkpoint's: a run directory (or a checkpoint directory) in place of FILE
is the network it trained and its latest weights, resolved as ``generate``
resolves them.  A model with the torch backend's seeded initialisation
(``--seed``) is asked for with ``--random-weights``, so an export of untrained
weights is never mistaken for a trained one.  ``check-onnx`` compares the torch backend and onnxruntime
(``check.py``: realistic weights at several input scales, or the
checkpoint's; the inference export and its KV cache, ``inference_check.py``);
with ``--ops`` each op type alone (``op_check.py``).  It exits 0 when every
output agrees, 1 when one does not, 2 for a user error (bad file, mismatched
checkpoint).
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


def _common(p: argparse.ArgumentParser, *, file_optional: bool = False) -> None:
    from vgraph.base import options
    from vgraph.cli.main import add_plugin_option

    p.add_argument("file", metavar="FILE", type=options.network_file, nargs="?" if file_optional else None,
                   help="network YAML or a shipped network's name, or a run directory (its network and latest "
                        "checkpoint)" + (
                       " (with --ops: optional, adds the configs its VNodes have)" if file_optional else ""))
    p.add_argument("--checkpoint", metavar="CKPT", type=options.path,
                   help="vgraph checkpoint directory, run directory or model .safetensors file")
    p.add_argument("--passes", metavar="SPEC",
                   help="run these passes first, e.g. fuse-heads,fuse-lm-head-ce (default: none)")
    p.add_argument("--seed", type=options.seed, default=0, help="seed of the weights without --checkpoint and of "
                                                                "the random inputs (default 0)")
    add_plugin_option(p)


def register_export(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export-onnx", help="write a trained network's inference model as ONNX (float32 "
                                                  "logits; batch and sequence dynamic)",
                              description="Write the inference model of a trained network (a run directory, or "
                                          "FILE with --checkpoint) as ONNX: float32 logits, batch and sequence "
                                          "dynamic; --kv-cache for a decoder with past keys and values.")
    _common(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx|DIR", type=options.path,
                   help="the model file; with --serving, the directory of the model and its configs")
    p.add_argument("--random-weights", action="store_true",
                   help="export the torch backend's seeded initialisation (--seed) instead of trained weights")
    p.add_argument("--no-weights", action="store_true",
                   help="make the parameters named graph inputs instead of storing them")
    p.add_argument("--with-loss", action="store_true",
                   help="also return the costs (the model then takes their targets)")
    p.add_argument("--kv-cache", action="store_true",
                   help="a decoder: takes and returns every attention VNode's past keys and values")
    p.add_argument("--serving", action="store_true",
                   help="write -o DIR for Hugging Face Optimum (ORTModelForCausalLM) and onnxruntime-genai: a "
                        "decoder with input_ids, attention_mask, position_ids and past_key_values per block, "
                        "config.json, genai_config.json, generation_config.json and the tokenizer "
                        "(docs/serving.md)")
    p.set_defaults(func=_export)


def register_check(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-onnx",
                              help="run the torch backend and onnxruntime on the same random inputs; "
                                   "compare every output")
    _common(p, file_optional=True)
    from vgraph.base import options

    p.add_argument("--batch", type=options.positive_int, default=None,
                   help="batch size of the random inputs (default 1; 2 with --ops)")
    p.add_argument("--rtol", type=options.non_negative_float, default=None,
                   help="relative tolerance (default: float32's, 2^-15; see docs)")
    p.add_argument("--atol", type=options.non_negative_float, default=None,
                   help="absolute tolerance (default: float32's, 2^-20)")
    p.add_argument("--ops", nargs="*", metavar="TYPE", type=options.op_type,
                   help="check op types alone (default: every type both backends lower, or that FILE uses) on "
                        "their examples and FILE's configs, at input scales 0.01 to 100")
    p.set_defaults(func=_check)


def _graph(args: argparse.Namespace):
    """FILE's network, or a run's: a directory in place of FILE is a run (or checkpoint) directory, whose
    network is the one it trained and whose latest weights become ``args.saved``."""
    import vgraph

    from .check import read_checkpoint

    args.saved = None
    if os.path.isdir(args.file):
        if args.checkpoint:
            raise VGraphError(f"{args.file} is a run directory, which names its own checkpoint: leave out "
                              f"--checkpoint (or name the network YAML instead of the run)")
        args.saved = read_checkpoint(args.file)
        graph = args.saved.network()
    else:
        graph = vgraph.load(args.file)  # plugins are loaded: `vgraph.cli.main.run_parser` does it for every command
        if args.checkpoint:
            args.saved = read_checkpoint(args.checkpoint)
    if args.passes:
        from vgraph.transform.pipeline import run_pipeline

        run_pipeline(graph, args.passes)
    return graph


def _weights(args: argparse.Namespace, graph):
    from .check import initial_weights, weights_from_checkpoint

    if args.saved is not None:
        return weights_from_checkpoint(args.saved, graph, given=args.file)
    return initial_weights(graph, args.seed)


def _refuse_unweighted(args: argparse.Namespace) -> None:
    """An export without trained weights must be asked for: its 'wrote ... parameters' reads like a real one."""
    trained = args.checkpoint or os.path.isdir(args.file)
    if args.random_weights and (trained or args.no_weights):
        raise VGraphError(f"--random-weights excludes {'--no-weights' if args.no_weights else 'trained weights'}"
                          f" ({'--no-weights' if args.no_weights else args.checkpoint or args.file}): give one")
    if not (trained or args.no_weights or args.random_weights):
        raise VGraphError(f"export-onnx {args.file}: no trained weights given: pass --checkpoint CKPT (or a run "
                          f"directory in place of the network) to export trained weights, or --random-weights "
                          f"to export the seeded initialisation (--seed)")


def _export(args: argparse.Namespace) -> int:
    import onnx

    from .check import fp32_graph
    from .inference import lower_inference
    from .lower import context_length, expected_param_shapes
    from .names import SEQUENCE_DIM

    if args.with_loss and args.kv_cache:
        raise VGraphError("--with-loss and --kv-cache exclude each other: a decoder returns logits only")
    if args.serving:
        return _export_serving(args)
    out = check_output(args.output, inputs=(args.file, args.checkpoint, *args.plugin))
    graph = fp32_graph(_graph(args))  # FILE read first: a missing or broken one is the first thing to say
    _refuse_unweighted(args)
    weights = None if args.no_weights else _weights(args, graph)
    model = lower_inference(graph, weights, with_loss=args.with_loss, kv_cache=args.kv_cache)
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
          f"{' (as graph inputs)' if weights is None else ''}"
          f"{f' (random: seeded initialisation, seed {args.seed}, not trained)' if args.random_weights else ''}"
          f"{data}; opset {model.opset_import[0].version}, "
          f"float32; {SEQUENCE_DIM} 1 to {context_length(graph)}")
    inputs = [v for v in model.graph.input if v.name not in keys]
    print("inputs:  " + ", ".join(_describe(v) for v in inputs if not v.name.startswith("past_"))
          + (f" + past keys and values of {sum(v.name.startswith('past_key:') for v in inputs)} attention VNodes"
             if args.kv_cache else ""))
    print("outputs: " + ", ".join(_describe(v) for v in model.graph.output if not v.name.startswith("present_"))
          + (" + their present keys and values" if args.kv_cache else ""))
    return 0


def _export_serving(args: argparse.Namespace) -> int:
    """``--serving``: the decoder in the serving layout and the files its runtimes read, into ``-o DIR``."""
    import onnx

    from vgraph.base.diagnostics import printable
    from vgraph.base.safeio import OutputDir

    from .check import fp32_graph
    from .serving import MODEL_FILE, lower_serving, serving_files

    clash = next((o for o, on in (("--with-loss", args.with_loss), ("--no-weights", args.no_weights)) if on), None)
    if clash:
        raise VGraphError(f"--serving and {clash} exclude each other: a served decoder returns logits only and "
                          "carries its weights")
    target = OutputDir(args.output, command="export-onnx --serving", inputs=(args.file, args.checkpoint, *args.plugin))
    graph = fp32_graph(_graph(args))
    _refuse_unweighted(args)
    model, shape = lower_serving(graph, _weights(args, graph))
    tokenizer = args.saved.tokenizer_json if args.saved is not None else None
    files = serving_files(shape, network=graph.name, tokenizer_json=tokenizer)
    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    target.plan([MODEL_FILE, *([MODEL_FILE + ".data"] if external else []), *files])
    if external:
        target.check(MODEL_FILE + ".data")
        _save_external(model, target.check(MODEL_FILE))
        target.wrote(MODEL_FILE + ".data")
        target.wrote(MODEL_FILE)
    else:
        onnx.checker.check_model(model, full_check=True)
        target.write(MODEL_FILE, model.SerializeToString())
    for name in sorted(files, key=lambda n: n == "config.json"):  # config.json last: its presence marks a model
        target.write(name, files[name])
    target.remove_stale()
    print(f"wrote {printable(str(target.path))}: {MODEL_FILE} ({shape.layers} blocks, {shape.heads} heads, {shape.kv_heads} K/V "
          f"heads of {shape.head_dim}, vocabulary {shape.vocab:,}, context {shape.context}"
          f"{f'; random: seeded initialisation, seed {args.seed}, not trained' if args.random_weights else ''}), "
          f"{', '.join(sorted(files))}")
    if tokenizer is None:
        print("note: no tokenizer beside it (the weights carry none): feed token ids", file=sys.stderr)
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
    from .inference_check import check_network_and_export

    if args.ops is not None:
        return _check_ops(args)
    if args.file is None:
        raise VGraphError("check-onnx needs a network FILE (or --ops to check op types alone)")
    graph = _graph(args)
    weights = weights_from_checkpoint_of(args, graph)
    report = check_network_and_export(graph, weights=weights, batch=args.batch or 1, seed=args.seed,
                                      rtol=args.rtol, atol=args.atol)
    print(report.format())
    return 0 if report.ok else 1


def weights_from_checkpoint_of(args: argparse.Namespace, graph):
    from .check import weights_from_checkpoint

    return weights_from_checkpoint(args.saved, graph, given=args.file) if args.saved is not None else None


def _check_ops(args: argparse.Namespace) -> int:
    from .op_check import check_ops, op_cases

    if args.checkpoint or args.passes:
        raise VGraphError(f"--ops checks op types on seeded weights: {'--checkpoint' if args.checkpoint else '--passes'}"
                          " does not apply (check a network with it instead)")
    network = None
    if args.file is not None:
        import vgraph

        network = vgraph.load(args.file)
    cases, notes = op_cases(args.ops, network)
    if not cases:
        raise VGraphError("--ops: nothing to check" + (f" ({'; '.join(notes)})" if notes else ""))
    report = check_ops(cases, batch=args.batch or 2, seed=args.seed, rtol=args.rtol, atol=args.atol)
    report.notes += notes
    print(report.format())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m vgraph.backends.onnx.cli {export-onnx,check-onnx} ...`` without the entry points."""
    from vgraph.cli.main import run_commands

    return run_commands([register_export, register_check], argv, prog="python -m vgraph.backends.onnx.cli")


if __name__ == "__main__":
    sys.exit(main())
