"""The core's commands: each a parser builder registered with `@command` and a handler that imports the
module doing the work only when it runs (so `vgraph validate` never loads the report or the cost model)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vgraph.base import options
from vgraph.base.diagnostics import VGraphError, printable
from vgraph.cli.common import EXIT_INVALID, add_plugin_option, command, load_network

if TYPE_CHECKING:
    from vgraph.transform.pipeline import Pipeline


@command("validate")
def _validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check network YAML files; exit 2 listing every problem")
    p.add_argument("files", nargs="+", metavar="FILE", type=options.network_file)
    add_plugin_option(p)
    p.set_defaults(func=_validate)


def _validate(args: argparse.Namespace) -> int:
    from vgraph.yamlio import load

    failed = False
    for path in args.files:
        warnings: list = []
        try:
            g = load(path, warnings=warnings)
        except VGraphError as exc:
            failed = True
            for d in exc.diagnostics:
                print(d, file=sys.stderr)
            print(f"{printable(path)}: invalid ({len(exc.errors)} error{'s' * (len(exc.errors) != 1)})",
                  file=sys.stderr)
            continue
        for w in warnings:
            print(w, file=sys.stderr)
        print(f"{printable(path)}: ok ({len(g)} VNodes, {len(g.edges)} edges)")
    return EXIT_INVALID if failed else 0


@command("analyze")
def _analyze_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="shapes, parameters, FLOPs and memory per node and group")
    p.add_argument("file", metavar="FILE", type=options.network_file)
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    p.add_argument("--fleet", metavar="FLEET.yml", type=options.fleet_file,
                   help="show the training-step cost model (bytes by kind, FLOPs per step) and the fleet")
    p.add_argument("--batch", type=options.batch, default=None,
                   help="samples per step for the cost model (default 8; implies the cost model)")
    p.add_argument("--micro-batches", type=_positive_int, default=1, help="micro-batches per step")
    p.add_argument("--replicas", type=options.replicas, default="auto", metavar="N|auto",
                   help="with --fleet: data-parallel replicas of the plan shown (default auto)")
    p.add_argument("--max-batch", action="store_true",
                   help="with --fleet: the largest batch each PNode of the plan (one pipeline, placed at --batch) "
                        "fits, with and without remat (JSON keys max_batch, max_batch_remat)")
    add_plugin_option(p)
    p.set_defaults(func=_analyze)


_positive_int = options.positive_int  # every numeric option is checked as it is parsed (vgraph/base/options.py)


def _fleet_plan(graph, fleet, batch: int, micro_batches: int, replicas: str) -> dict | str:
    """The partition pass's plan of `graph` on `fleet` as a placement report, or why there is none."""
    from vgraph.base.diagnostics import VGraphError
    from vgraph.placement.export import placement_report
    from vgraph.transform.pipeline import available_passes, run_pipeline

    if "partition" not in available_passes():
        return "the 'partition' pass is not installed"
    placed = graph.copy()
    try:
        run_pipeline(placed, _pipeline_with_partition(None, batch, micro_batches, replicas), data={"fleet": fleet})
    except VGraphError as exc:
        return "; ".join(str(d) for d in exc.diagnostics)
    report = placement_report(placed, fleet)
    report["plan"] = {k: v for k, v in placed.meta["placement"].items() if k not in ("pnodes",)}
    return report


def _analyze(args: argparse.Namespace) -> int:
    from vgraph.cost.analyze import analyze, format_table

    graph = load_network(args.file)
    if getattr(args, "max_batch", False):
        return _analyze_max_batch(graph, args)
    if args.fleet is None and args.batch is None:
        a = analyze(graph)
        print(json.dumps(a.to_json(), indent=2) if args.json else format_table(a))
        return 0
    from vgraph.cost.costmodel import DEFAULT_BATCH, cost_model, format_costs
    from vgraph.cost.fleet import load_fleet

    fleet = load_fleet(args.fleet) if args.fleet else None
    cm = cost_model(graph, batch=args.batch or DEFAULT_BATCH, micro_batches=args.micro_batches)
    plan = _fleet_plan(graph, fleet, cm.batch, cm.micro_batches, args.replicas) if fleet is not None else None
    if args.json:
        doc = cm.to_json()
        if fleet is not None:
            doc["fleet"] = {"name": fleet.name, "pnodes": [
                {"id": p.id, "memory": p.memory, "flops": p.flops, "bandwidth": p.bandwidth,
                 "accelerator": p.accelerator, "region": p.region} for p in fleet]}
            doc["plan"] = plan if isinstance(plan, dict) else {"error": plan}
        print(json.dumps(doc, indent=2))
    else:
        print(format_costs(cm, graph, fleet))
        if isinstance(plan, dict):
            from vgraph.placement.replica_report import format_plan

            print()
            print(format_plan(plan))
        elif plan is not None:
            print(f"\nno plan on fleet {fleet.name!r}: {plan}")
    return 0


def _analyze_max_batch(graph, args: argparse.Namespace) -> int:
    """`analyze --max-batch`: place the network (one pipeline) and size each PNode's batch (vgraph/cost/max_batch.py)."""
    from vgraph.base.diagnostics import VGraphError
    from vgraph.cost.costmodel import DEFAULT_BATCH, cost_model
    from vgraph.cost.fleet import load_fleet
    from vgraph.cost.max_batch import format_max_batch, max_batch_report
    from vgraph.transform.pipeline import run_pipeline

    if args.fleet is None:
        raise VGraphError("--max-batch needs --fleet FLEET.yml (the PNodes whose memory decides the batch)")
    fleet = load_fleet(args.fleet)
    batch = args.batch or DEFAULT_BATCH
    placed = graph.copy()
    run_pipeline(placed, _pipeline_with_partition(None, batch, args.micro_batches, "1"), data={"fleet": fleet})
    cm = cost_model(placed, batch=batch, micro_batches=args.micro_batches)
    stages = len(placed.meta["placement"].get("stages") or [None])
    report = max_batch_report(placed, cm, fleet, {n.id: n.meta["pnode"] for n in placed.nodes},
                              args.micro_batches, stages)
    report["plan_batch"] = batch
    print(json.dumps(report, indent=2) if args.json else format_max_batch(report))
    return 0


def _pipeline_with_partition(spec: str | None, batch: int, micro_batches: int, replicas: str = "auto") -> Pipeline:
    """The user's pipeline, with `partition` added (at the batch asked for) unless it is there."""
    from vgraph.transform.pipeline import Pipeline

    pipeline = Pipeline.parse(spec or "")
    if "partition" in pipeline:
        return pipeline
    return pipeline.insert("partition", batch=batch, micro_batches=micro_batches, replicas=replicas)


@command("partition")
def _partition_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("partition", help="place a network on a fleet; write one network per PNode")
    p.add_argument("file", metavar="FILE", type=options.network_file)
    p.add_argument("--fleet", required=True, metavar="FLEET.yml", type=options.fleet_file,
                   help="the PNodes (networks/fleets/*.yml)")
    p.add_argument("--batch", type=options.batch, default=8, help="samples per training step (default 8)")
    p.add_argument("--micro-batches", type=_positive_int, default=1, help="micro-batches per step (per replica)")
    p.add_argument("--replicas", type=options.replicas, default="auto", metavar="N|auto",
                   help="data-parallel replicas of the pipeline (default auto: the plan of least predicted step "
                        "time; 1: one pipeline, as before)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", type=options.path,
                   help="writes DIR/<pnode>.yml per PNode and DIR/placement.json")
    p.add_argument("--passes", metavar="SPEC", default=None,
                   help="passes to run with the partition, e.g. 'precision{target=cuda-sm75},fuse-heads' "
                        "(partition is added; fusions run after it, so they respect the placement)")
    p.add_argument("--onnx", action="store_true", help="also DIR/<pnode>.onnx (needs the ONNX backend)")
    add_plugin_option(p)
    p.set_defaults(func=_partition)


def _partition(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vgraph.cost.fleet import load_fleet
    from vgraph.placement.export import export_partition, format_report
    from vgraph.transform.pipeline import run_pipeline

    fleet = load_fleet(args.fleet)
    graph = load_network(args.file)
    spec = _pipeline_with_partition(args.passes, args.batch, args.micro_batches, args.replicas)
    pm = run_pipeline(graph, spec, data={"fleet": fleet})
    report = export_partition(graph, fleet, args.output, batch=args.batch, micro_batches=args.micro_batches,
                              formats=("onnx",) if args.onnx else (), inputs=(args.file, args.fleet, *args.plugin))
    print(f"pipeline: {spec}")
    print(format_report(report))
    if report["replicas"] > 1:
        from vgraph.placement.replica_report import format_plan

        print(format_plan(dict(report, plan=graph.meta.get("placement") or {})))
    print(f"wrote {len(report['files'])} files to {args.output}/: "
          f"{', '.join(Path(f).name for f in report['files'])}")
    for note in pm.ctx.notes:
        print(f"note: {note}")
    return 0


@command("render")
def _render_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="draw a network as SVG (Graphviz): groups, PNodes, fused and cut edges")
    p.add_argument("file", metavar="FILE", type=options.network_file)
    p.add_argument("-o", "--output", required=True, metavar="OUT.svg", type=options.path)
    p.add_argument("--passes", metavar="SPEC", default=None, help="run a pipeline first, e.g. 'fuse-heads'")
    p.add_argument("--fleet", metavar="FLEET.yml", type=options.fleet_file,
                   help="partition onto this fleet first (adds 'partition')")
    p.add_argument("--batch", type=options.batch, default=8, help="batch for the partition and cut bytes")
    p.add_argument("--group-by", choices=("colocate", "pnode"), default=None,
                   help="clusters: colocation groups or PNodes (default: pnode when placed)")
    p.add_argument("--collapse", action="store_true",
                   help="draw runs of identical colocation groups (transformer blocks) once")
    p.add_argument("--target", default=None, type=options.compile_target,
                   help="compile target for target-aware passes (cpu, cuda-smXY)")
    add_plugin_option(p)
    p.set_defaults(func=_render)


def _render(args: argparse.Namespace) -> int:
    from vgraph.base.safeio import atomic_write, check_output
    from vgraph.report.render import render_svg
    from vgraph.transform.pipeline import run_pipeline

    out = check_output(args.output, inputs=(args.file, args.fleet, *args.plugin))
    graph = load_network(args.file)
    data = {}
    spec = args.passes
    if args.fleet:
        from vgraph.cost.fleet import load_fleet

        data["fleet"] = load_fleet(args.fleet)
        spec = _pipeline_with_partition(spec, args.batch, 1)
    if spec:
        run_pipeline(graph, spec, target=args.target, data=data)
    placed = any("pnode" in n.meta for n in graph.nodes)
    group_by = args.group_by or ("pnode" if placed else "colocate")
    svg = render_svg(graph, group_by=group_by, collapse=args.collapse)
    atomic_write(out, svg)
    print(f"wrote {out} ({len(graph)} VNodes, clusters by {group_by}{', collapsed' if args.collapse else ''})")
    return 0


@command("optimize")
def _optimize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="run a pass pipeline and write the rewritten network")
    p.add_argument("file", metavar="FILE", type=options.network_file)
    p.add_argument("-o", "--output", required=True, metavar="OUT.yml", type=options.path)
    p.add_argument("--passes", metavar="SPEC", default=None,
                   help="pipeline, e.g. 'fuse-heads,precision{target=cuda-sm80}' "
                        "(default: the production pipeline)")
    p.add_argument("--target", default=None, type=options.compile_target,
                   help="compile target for target-aware passes (cpu, cuda-smXY)")
    p.add_argument("--dump-dir", metavar="DIR", type=options.path,
                   help="write the graph after each pass as NN_pass.yml")
    p.add_argument("--explain", action="store_true", help="say why rewrites did not match")
    p.add_argument("--no-verify", action="store_true", help="skip IR verification between passes")
    add_plugin_option(p)
    p.set_defaults(func=_optimize)


def _optimize(args: argparse.Namespace) -> int:
    from vgraph.base.safeio import check_output
    from vgraph.report.render import render_svg
    from vgraph.transform.pipeline import DEFAULT_PIPELINE, DumpInstrument, run_pipeline
    from vgraph.yamlio import save

    check_output(args.output, inputs=(args.file, *args.plugin))
    inputs = (args.file, *args.plugin)
    if args.dump_dir and Path(os.path.realpath(args.dump_dir)) in Path(os.path.realpath(args.output)).parents:
        raise VGraphError(f"{printable(args.output)}: -o lies inside --dump-dir {printable(args.dump_dir)}, whose "
                          f"files the dumps write; write the output elsewhere")
    graph = load_network(args.file)
    dumps = [DumpInstrument(args.dump_dir, draw=render_svg, inputs=inputs)] if args.dump_dir else []
    pm = run_pipeline(graph, args.passes, target=args.target, explain=args.explain, instruments=dumps,
                      verify=not args.no_verify)
    save(graph, args.output)
    print(f"pipeline: {args.passes or DEFAULT_PIPELINE}")
    print(pm.report())
    for note in pm.ctx.notes:
        print(f"note: {note}")
    if args.explain:
        print("explain:" if pm.ctx.explanations else "explain: every candidate was rewritten")
        for line in pm.ctx.explanations:
            print(f"  {line}")
    print(f"wrote {args.output} ({len(graph)} VNodes)")
    return 0


@command("ops")
def _ops_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ops", help="list every op type: category, config schema, origin, backends",
                              description="Every VNode type known here (built-in, installed plugins and "
                                          "--plugin files): its category, aliases, config keys (type, "
                                          "default, allowed values), who defined it and which backends "
                                          "lower it.")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    add_plugin_option(p)
    p.set_defaults(func=_ops)


def _ops(args: argparse.Namespace) -> int:
    from vgraph.cli.op_listing import run_ops

    return run_ops(args)


@command("networks")
def _networks_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("networks", help="list the networks and fleets that ship with vgraph (every command "
                                        "that reads a network or a fleet takes their names)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_networks)


def _networks(args: argparse.Namespace) -> int:
    from vgraph.cli.network_listing import print_listing

    print_listing(args.json)
    return 0


@command("passes")
def _passes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("passes", help="list every pass: doc, origin, options (type, default, allowed values), "
                                      "ordering (requires/after/before), whether it keeps what the network computes")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    add_plugin_option(p)
    p.set_defaults(func=_passes)


def _passes(args: argparse.Namespace) -> int:
    from vgraph.cli.pass_listing import print_listing

    print_listing(args.json)
    return 0


@command("report")
def _report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page about a training run (curves, network, "
                                      "PNodes, memory, settings)",
                       description="Write a self-contained HTML page (inline SVG, no scripts, nothing fetched) "
                                   "about a run directory of vgraph train or vgraph launch, finished or still "
                                   "going: loss and validation curves, throughput, the network as compiled "
                                   "(passes, placement), per-PNode figures, memory estimate vs measured, settings.")
    p.add_argument("run", metavar="RUN", type=options.path,
                   help="the run directory (--out of vgraph train / vgraph launch)")
    p.add_argument("-o", "--output", required=True, metavar="REPORT.html")
    add_plugin_option(p)
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from vgraph.report.page import write_report

    out, rec, why = write_report(args.run, args.output)
    steps = f"{len(rec.rows)} logged step(s)"
    print(f"wrote {printable(str(out))} ({rec.command} run, {steps}{'; ' + printable(why) if why else ''})")
    return 0


@command("new")
def _new_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("new", help="write a network YAML from a few numbers, in the production networks' shape",
                       description="Write a decoder-only transformer as network YAML, shaped like the shipped "
                                   "networks (one VNode per attention head, RoPE, colocation groups per block, tied "
                                   "embedding and SwiGLU LM head, dropout, per-VNode Adam), from its sizes.")
    p.add_argument("-o", "--output", required=True, metavar="OUT.yml", type=options.path)
    p.add_argument("--name", help="the network's name (default: the output file's stem)")
    p.add_argument("--layers", type=options.positive_int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--dim", type=options.positive_int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=options.positive_int, default=8, help="attention heads, each dim/heads wide "
                                                                         "(default 8)")
    p.add_argument("--kv-heads", type=options.positive_int,
                   help="K/V heads for grouped-query attention, each shared by heads/kv-heads query heads (a "
                        "kv_head VNode per group; default: every head its own K and V)")
    p.add_argument("--vocab", type=options.positive_int, default=10000, help="vocabulary size (default 10000)")
    p.add_argument("--context", type=options.positive_int, default=128, help="sequence length (default 128)")
    p.add_argument("--ffn", type=options.positive_int, help="FFN width (default 4 x dim)")
    p.add_argument("--ffn-kind", choices=("gelu", "swiglu"), default="gelu",
                   help="gelu: dim -> ffn -> dim (default, as the shipped networks); swiglu: dim -> ffn -> ffn/2 "
                        "gated -> dim")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                   help="the network's precision policy (default fp16, as the shipped networks)")
    p.add_argument("--dropout", type=options.non_negative_float, default=0.1, help="dropout rate (default 0.1)")
    p.set_defaults(func=_new)


#: Beyond these a network is not one to write by accident (a typo's extra digits): the YAML alone would be
#: gigabytes, or the weights of one matrix would not fit any machine.
_NEW_LIMITS = {"layers": 4096, "dim": 65536, "heads": 4096, "kv_heads": 4096, "vocab": 2**31 - 1, "context": 2**24, "ffn": 2**20}


def _new(args: argparse.Namespace) -> int:
    from vgraph.base.safeio import atomic_write, check_output
    from vgraph.cost.analyze import analyze
    from vgraph.ir.transformer import TransformerSpec, check_spec, transformer
    from vgraph.yamlio import dumps

    over = [f"--{k} {getattr(args, k)} is over {v:,}" for k, v in _NEW_LIMITS.items()
            if getattr(args, k) is not None and getattr(args, k) > v]
    if over:
        raise VGraphError("; ".join(over))
    out = check_output(args.output)
    name = args.name if args.name is not None else Path(args.output).stem
    if not name or not name.isprintable() or len(name) > 200:
        raise VGraphError(f"--name {printable(name)!r}: give a printable name of 1 to 200 characters")
    spec = TransformerSpec(name, layers=args.layers, vocab=args.vocab, seq_len=args.context, dim=args.dim,
                           heads=args.heads, ffn=args.ffn or 4 * args.dim, head_up=8 * args.dim,
                           dropout=args.dropout, precision=None if args.precision == "fp32" else args.precision,
                           ffn_kind=args.ffn_kind, kv_heads=args.kv_heads)
    check_spec(spec)
    graph = transformer(spec)
    atomic_write(out, dumps(graph))
    params = analyze(graph).params
    print(f"wrote {printable(str(out))}: network {name!r}, {len(graph)} VNodes, {params:,} parameters "
          f"({args.layers} x {args.heads} heads of {args.dim // args.heads}, context {args.context}, vocab "
          f"{args.vocab}, {args.ffn_kind} FFN {spec.ffn}, {args.precision})")
    return 0
