"""Mutation testing of the modules where a silent error costs most, with cosmic-ray.

A mutant is a small change to the code (``*`` -> ``+``, ``<`` -> ``<=``, a number nudged, a branch
negated); a test suite that still passes with it cannot tell the two programs apart.  Each target below
names a module, the part of it where a wrong number reaches a user (FLOP and parameter rules, the loss
kernel, the fusion rewrites, the cost model, checkpoint and resume), and the fast tests that should
notice.  Surviving mutants are listed with their diff; TESTING.md records the last run and what was
done about each survivor.

Why a copy: cosmic-ray mutates files in place, and the working tree is shared.  The script copies the
sources into their installed layout (tools/check_layers.installed_layout: `passes/` becomes
`vgraph/passes/`, ...) plus tests/, tools/, networks/ and pyproject.toml into a work directory, puts
it first on PYTHONPATH (ahead of the editable install), and mutates only there.

    bash tools/mutation.sh                    # every target (slow: hours on 2 cores)
    bash tools/mutation.sh catalog costmodel  # some targets
    bash tools/mutation.sh --list             # the targets, their scope and tests
    bash tools/mutation.sh --count stepcost   # how many mutants a target has (nothing is run)
    bash tools/mutation.sh --recheck catalog  # rerun only the last session's survivors (after new tests)
    bash tools/mutation.sh --sample 30 stepcost  # a seeded random 30 of the target's mutants

Sampling: where a target has hundreds of mutants whose tests start processes (the distributed runtime) a
whole session takes hours on 2 cores.  A uniform random sample of the in-scope mutants (seeded, so the
same sample is drawn again) estimates the mutation score without bias and still names concrete
survivors; the report says how many were drawn from how many.

Not part of CI.  Work directory: $VGRAPH_MUTATION_DIR (default /tmp/vgraph-mutation); per target a
session database and report.txt stay there.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.check_layers import installed_layout  # noqa: E402

# One mutation per kind of mistake is enough: `a * b` -> `a + b`, `a / b`, ... not all twelve operators
# (cosmic-ray's default would make ~11 mutants of every arithmetic operator, mostly equivalent in
# what they tell).  Targets outside these are skipped.
KEEP_BINARY_TARGETS = ("Add", "Sub", "Mul", "Div", "FloorDiv")
KEEP_COMPARISON_TARGETS = ("Eq", "NotEq", "Lt", "LtE", "Gt", "GtE")
SKIPPED_OPERATORS = re.compile(
    r"core/ReplaceBinaryOperator_\w+_(?!(%s)$)\w+$|core/ReplaceComparisonOperator_\w+_(?!(%s)$)\w+$"
    r"|core/VariableReplacer|core/VariableInserter"
    % ("|".join(KEEP_BINARY_TARGETS), "|".join(KEEP_COMPARISON_TARGETS)))


@dataclass(frozen=True)
class Target:
    source: str                      # path in the repository
    tests: tuple[str, ...]           # pytest arguments: the fast tests that guard it
    functions: tuple[str, ...] = ()  # mutate only inside these defs (and `keywords`); empty: everything
    keywords: tuple[str, ...] = ()   # ...and inside these keyword arguments (e.g. register_op(flops=...))
    timeout: float = 120.0
    why: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """Run `size` of a target's in-scope mutants, drawn uniformly with `seed` from the mutants in source
    order (the same sample again for the same code and seed)."""
    size: int
    seed: int = 0


TARGETS: dict[str, Target] = {
    "catalog": Target(
        "vgraph/ops/catalog.py",
        ("tests/test_flop_oracle.py", "tests/test_catalog_rules.py", "tests/test_networks.py",
         "tests/test_costmodel.py", "tests/test_ir.py", "tests/test_hf_ops.py"),
        functions=("_lead", "_elementwise", "_linear_params", "_tied_weight", "_embedder_params",
                   "_attention_flops", "_projections", "_head_flops", "attention_dim", "kv_heads", "_mha_params",
                   "fused_ids", "_mha_sources", "_mha_flops"),
        keywords=("flops", "params", "tied_params", "param_sources"),
        why="parameter and FLOP rules: analyze, the cost model and the partitioner read them"),
    "costmodel": Target(
        "vgraph/cost/costmodel.py", ("tests/test_costmodel.py", "tests/test_costmodel_oracle.py",
                                "tests/test_flop_oracle.py"),
        why="memory and traffic per PNode: what fits where"),
    "fuse-heads": Target(
        "passes/fuse_heads.py",
        ("tests/test_fuse_heads_rules.py", "tests/test_fuse_heads_placement_numerics.py", "tests/test_passes.py",
         "tests/test_flop_oracle.py", "tests/test_pass_semantics.py", "tests/test_hf_ops.py"),
        timeout=300.0, why="the rewrite every production run goes through; placement-aware"),
    "fuse-lm-head-ce": Target(
        "passes/fuse_lm_head_ce.py", ("tests/test_fuse_lm_head_ce_rules.py", "tests/test_passes.py",
                                      "tests/test_flop_oracle.py", "tests/test_torch_equivalence.py",
                                      "-k", "not six_layer"),
        timeout=300.0, why="the fused loss rewrite"),
    "layout": Target(
        "vgraph/run/layout.py", ("tests/test_passes.py", "tests/test_torch_equivalence.py", "-k", "not six_layer"),
        timeout=300.0, why="weights between fused and unfused layouts: checkpoints go through it"),
    "kernels-ce": Target(
        "backends/torch/lowering/kernels.py",
        ("tests/test_ce_reduced_precision.py", "tests/test_torch_kernels.py", "-k", "tied or ce or logits"),
        functions=("mm_fp32", "logits_chunk", "matmul_dtype", "forward", "backward", "tied_lm_head_ce",
                   "default_ce_chunk_size", "_accum_dtype"),
        timeout=300.0, why="the chunked tied LM-head cross-entropy: the production loss"),
    "kernels-attention": Target(
        "backends/torch/lowering/kernels.py", ("tests/test_torch_kernels.py", "tests/test_hf_ops.py"),
        functions=("rope_cos_sin", "_build_rope_tables", "_rotate_half", "_swap_halves", "apply_rope",
                   "attention_head", "multihead_attention", "rms_norm", "swiglu", "apply_mask"),
        timeout=300.0, why="RoPE, attention and SwiGLU kernels"),
    "checkpoint": Target(
        "backends/torch/training/checkpoint.py", ("tests/test_torch_checkpoint.py", "tests/test_checkpoint_fsync.py",
                                         "tests/test_checkpoint_malformed.py", "tests/test_fp16_resume.py"),
        timeout=300.0, why="atomic safetensors checkpoints, RNG state"),
    "run-checkpoints": Target(
        "backends/torch/training/run_checkpoints.py", ("tests/test_run_checkpoint_files.py", "tests/test_resume_settings.py",
                                              "tests/test_fp16_resume.py",
                                              "tests/test_torch_checkpoint.py",
                                              "tests/test_torch_equivalence.py", "-k", "not six_layer"),
        timeout=300.0, why="what a training run saves and restores on resume (scaler, optimizer, data RNG)"),
    "stepcost": Target(
        "vgraph/cost/stepcost.py", ("tests/test_stepcost.py", "tests/test_replica_shares.py", "tests/test_op_kinds.py",
                                    "tests/test_makespan.py", "tests/test_collectives.py"),
        functions=("bubble", "resident_samples", "resident_array", "ring_allreduce_bytes", "link",
                   "stage_rates", "compute_per_sample", "stage_overhead", "compute_seconds", "step_cost_of",
                   "_slowest_link", "pipeline_seconds", "balanced_shares", "shares_by_speed", "_fill_from_below",
                   "allreduce_seconds", "step_lower_bound"),
        timeout=600.0, why="the predicted step of S stages x R replicas and its bytes, which the planner optimises"),
    "makespan": Target(
        "vgraph/cost/makespan.py", ("tests/test_makespan.py", "tests/test_stepcost.py"),
        functions=("_compile", "makespan"),
        timeout=600.0, why="the simulated pipeline: the makespan of the workers' op orders"),
    "schedule": Target(
        "vgraph/cost/schedule.py", ("tests/test_makespan.py",),
        functions=("_schedule", "_one_f_one_b", "__init__", "next_op", "complete", "_wake_bwd"),
        timeout=600.0, why="the per-rank op orders the workers run and the cost model prices (1F1B, GPipe)"),
    "tasks": Target(
        "vgraph/cost/tasks.py", ("tests/test_makespan.py", "tests/test_stepcost.py"),
        functions=("scheduled", "tied_pairs", "depth", "_topological", "chain_tasks", "loads", "tasks",
                   "__post_init__"),
        timeout=600.0, why="a cut as one value: its stages' loads, its tasks as the workers run them (stage x "
                           "depth) and the tensors between"),
    "partition-replicas": Target(
        "passes/partition_replicas.py",
        ("tests/test_replica_shares.py", "tests/test_partition_replicas.py", "-k",
         "not large_heterogeneous and not placement_json and not stitch and not analyze"),
        functions=("price_layout", "_memory_caps", "_better", "_replica_counts", "_retarget", "_stage_major",
                   "_replica_major"),
        timeout=180.0, why="which R x S plan a fleet gets, with which batch shares and memory caps"),
    "replica-report": Target(
        "vgraph/placement/replica_report.py", ("tests/test_replica_shrink.py", "tests/test_partition_replicas.py"),
        functions=("replica_layout", "rebalanced_shares"),
        timeout=180.0, why="placement.json's replica fields and the shares after --on-failure shrink"),
    "remat-cost": Target(
        "vgraph/cost/remat.py", ("tests/test_remat.py", "tests/test_remat_everywhere.py", "tests/test_torch_remat.py",
                                 "-k", "not training_resume"),
        timeout=600.0, why="what recompute marks cost and which regions a backend checkpoints"),
    "remat-regions": Target(
        "backends/torch/lowering/remat_regions.py", ("tests/test_torch_remat.py", "-k", "not training_resume"),
        timeout=600.0, why="the torch lowering of remat regions: checkpointed submodules, dropout keys"),
    "grad-sync": Target(
        "backends/torch/distributed/runtime/grad_sync.py", ("tests/test_grad_sync.py",),
        functions=("allreduce_sum", "summed", "ring_bytes_sent", "bucket_layout", "__init__", "begin",
                   "last_backward", "ready", "finish", "_on_grad", "_mark", "_launch"),
        timeout=600.0, why="the replicas' gradient sum: buckets, readiness, the ring bytes"),
    "loss-scaler": Target(
        "backends/torch/distributed/runtime/loss_scaler.py", ("tests/test_loss_scaler.py",),
        timeout=600.0, why="a launch's loss-scale decisions and their checkpoint state"),
    "probe": Target(
        "backends/torch/probe/measure.py", ("tests/test_probe.py", "-k", "calibration or timing"),
        functions=("timed_in_turn", "timed", "_line", "calibrate"),
        timeout=300.0, why="the probed figures a fleet entry carries: time per call, the calibration's two scales"),
    "probe-collectives": Target(
        "backends/torch/probe/collectives.py", ("tests/test_probe_collectives.py", "-k", "by_hand or host_counts"),
        functions=("rank_counts", "measure", "_median"),
        timeout=300.0, why="the fleet's measured control, hop and ring rate by rank count"),
    "collectives": Target(
        "vgraph/cost/collectives.py", ("tests/test_collectives.py",),
        functions=("ring", "at", "_lookup", "collectives_of"),
        timeout=300.0, why="what the table adds to a plan's price: interpolated control and hop, the ring cap"),
    "grad-compress": Target(
        "backends/torch/distributed/runtime/powersgd.py", ("tests/test_grad_sync.py", "-k", "powersgd or hook"),
        timeout=600.0, why="PowerSGD on the replicas' buckets: the sum, its bytes, forgetting a non-finite step"),
    "worker-step": Target(
        "backends/torch/distributed/runtime/pipeline_step.py", ("tests/test_distributed_replicas.py", "-k", "clip"),
        functions=("_local_sumsq", "_local_bad_grads", "unscale", "clip", "step"),
        timeout=600.0, why="a launch worker's update: the clip norm over replicas, skipped steps, the optimizer"),
    "replica-groups": Target(
        "backends/torch/distributed/runtime/replica_groups.py",
        ("tests/test_distributed_replicas.py", "-k", "stage_groups or drifted"),
        timeout=600.0, why="the stage groups and the checks that replicas hold the same parameters and values"),
}


def spans(source: Path, target: Target) -> list[tuple[int, int]] | None:
    """Line spans to mutate (None: the whole module)."""
    if not target.functions and not target.keywords:
        return None
    tree = ast.parse(source.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in target.functions:
            out.append((node.lineno, node.end_lineno))
        elif isinstance(node, ast.keyword) and node.arg in target.keywords:
            out.append((node.value.lineno, node.value.end_lineno))
    return out


def annotation_spans(source: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every type annotation: never evaluated here (`from __future__ import
    annotations`), so a mutant inside one (`X | None` -> `X - None`) is equivalent by construction."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    nodes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            nodes.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            nodes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            nodes.append(node.annotation)
    return [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in nodes]


def prepare(work: Path) -> Path:
    """A fresh copy of the sources (installed layout under work/src) and of the test suite."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    installed_layout(ROOT, work / "src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in ("tests", "tools", "networks"):
        shutil.copytree(ROOT / name, work / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", work)
    return work


def layout_path(repo_path: str) -> str:
    """Where a repository source file sits in the installed layout (passes/x.py -> src/vgraph/passes/x.py)."""
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    best = max(((pkg, src) for pkg, src in mapping.items() if repo_path.startswith(src.rstrip("/") + "/")),
               key=lambda item: len(item[1]))
    pkg, src = best
    return str(Path("src", *pkg.split("."), repo_path[len(src.rstrip("/")) + 1:]))


def _env(work: Path, target: Target) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(work / "src"), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
                **target.extra_env)


def _test_command(python: str, target: Target) -> str:
    return shlex.join([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                       "--no-header", "-o", "addopts=", *target.tests])


def init_session(name: str, target: Target, base: Path, python: str, sample: Sample | None = None
                 ) -> tuple[Path, Path, dict[str, str], int]:
    """A fresh work directory and cosmic-ray session for `name`, mutants outside its scope (or its
    sample) skipped: (work directory, session, environment, mutants to run)."""
    work = prepare(base / name)
    module = layout_path(target.source)
    env = _env(work, target)
    test_command = _test_command(python, target)
    config = work / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        f"timeout = {target.timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test_command)}\n"
        "\n[cosmic-ray.distributor]\nname = \"local\"\n", encoding="utf-8")
    session = work / "session.sqlite"
    cosmic = str(Path(python).with_name("cosmic-ray"))
    subprocess.run([cosmic, "init", str(config), str(session), "--force"], cwd=work, env=env, check=True)
    return work, session, env, skip_outside_scope(session, work / module, target, sample)


def run_target(name: str, target: Target, base: Path, python: str, sample: Sample | None = None) -> dict:
    work, session, env, selected = init_session(name, target, base, python, sample)
    test_command = _test_command(python, target)
    cosmic = str(Path(python).with_name("cosmic-ray"))
    start = time.monotonic()
    baseline = subprocess.run(shlex.split(test_command), cwd=work, env=env, capture_output=True, text=True)
    if baseline.returncode != 0:
        raise SystemExit(f"{name}: the tests fail without any mutation; fix that first:\n{baseline.stdout[-3000:]}")
    _cap_timeout(work / "cosmic-ray.toml", target, time.monotonic() - start)
    start = time.monotonic()
    subprocess.run([cosmic, "exec", str(work / "cosmic-ray.toml"), str(session)], cwd=work, env=env, check=True)
    report = summarize(name, target, session, selected, time.monotonic() - start, sample)
    (work / "report.txt").write_text(report["text"], encoding="utf-8")
    print(report["text"], flush=True)
    return report


def _cap_timeout(config: Path, target: Target, baseline_s: float) -> None:
    """A mutant that makes its tests hang (a bucket never ready, a rank waiting forever) costs the whole
    timeout; 4x the unmutated tests' time (at least a minute, at most the target's) is plenty for a mutant
    that merely slows them, and keeps a run of the distributed targets from losing 10 minutes a hang."""
    timeout = min(target.timeout, max(60.0, 4 * baseline_s))
    text = config.read_text(encoding="utf-8")
    config.write_text(re.sub(r"(?m)^timeout = .*$", f"timeout = {timeout:.0f}", text, count=1), encoding="utf-8")


def skip_outside_scope(session: Path, module: Path, target: Target, sample: Sample | None = None) -> int:
    """Mark mutants outside the target's scope, of an operator left out, or not drawn into `sample`, as
    skipped; returns how many remain."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    scope = spans(module, target)
    annotations = annotation_spans(module)
    with use_db(str(session), WorkDB.Mode.open) as db:
        keep, skip = [], []
        for item in db.pending_work_items:
            m = item.mutations[0]
            line = m.start_pos[0]
            inside = scope is None or any(a <= line <= b for a, b in scope)
            annotation = any(a <= tuple(m.start_pos) < b for a, b in annotations)
            if inside and not annotation and not SKIPPED_OPERATORS.match(m.operator_name):
                keep.append(item)
            else:
                skip.append((item, "outside the target's scope"))
        if sample is not None:
            chosen = {id(i) for i in draw(keep, sample, key=_source_order)}
            skip += [(i, f"not in the sample (seed {sample.seed})") for i in keep if id(i) not in chosen]
            keep = [i for i in keep if id(i) in chosen]
        for item, why in skip:
            db.set_result(item.job_id, WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED))
    return len(keep)


def recheck(name: str, target: Target, base: Path, python: str) -> int:
    """Run the survivors of the last session of `name` again, against the current sources and tests.

    After new tests are written for survivors this answers "are they killed now?" in minutes, where a
    whole session takes an hour; the session database is left as it was.  Returns how many still survive.
    """
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    session = base / name / "session.sqlite"
    if not session.is_file():
        raise SystemExit(f"{name}: no session in {session.parent}; run the target first")
    with use_db(str(session), WorkDB.Mode.open) as db:
        survivors = [item.mutations[0] for item, result in db.completed_work_items
                     if result.test_outcome == TestOutcome.SURVIVED]
    work = prepare(base / f"{name}-recheck")
    env = _env(work, target)
    cosmic = str(Path(python).with_name("cosmic-ray"))
    annotations = annotation_spans(work / layout_path(target.source))
    still = 0
    for m in survivors:
        if any(a <= tuple(m.start_pos) < b for a, b in annotations):
            print(f"  {target.source}:{m.start_pos[0]} {m.operator_name} #{m.occurrence}: in an annotation "
                  f"(equivalent; no longer generated)", flush=True)
            continue
        proc = subprocess.run([cosmic, "mutate-and-test", str(m.module_path), m.operator_name, str(m.occurrence),
                               _test_command(python, target)], cwd=work, env=env, capture_output=True, text=True,
                              timeout=target.timeout * 2)
        outcome = json.loads(proc.stdout or "{}").get("test_outcome", f"error: {proc.stderr[-300:]}")
        still += outcome == "survived"
        print(f"  {target.source}:{m.start_pos[0]} {m.operator_name} #{m.occurrence}: {outcome}", flush=True)
    print(f"{name}: {len(survivors)} survivors of the last session rechecked, {still} still survive", flush=True)
    return still


def summarize(name: str, target: Target, session: Path, selected: int, seconds: float,
              sample: Sample | None = None) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    killed = survived = incompetent = 0
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.test_outcome == TestOutcome.SURVIVED:
                survived += 1
                m = item.mutations[0]
                diff = "\n".join(l for l in (result.diff or "").splitlines()
                                 if l.startswith(("+", "-")) and not l.startswith(("+++", "---")))
                survivors.append(f"  {target.source}:{m.start_pos[0]} {m.operator_name} "
                                 f"(in {m.definition_name or 'module level'})\n    " + diff.replace("\n", "\n    "))
            elif result.test_outcome == TestOutcome.INCOMPETENT:
                incompetent += 1
            else:
                killed += 1
    lines = [f"{name}: {target.source} ({target.why}); tests: {' '.join(target.tests)}",
             f"  {selected} mutants{_drawn(sample)}: {killed} killed, {survived} survived, {incompetent} incompetent "
             f"(did not run: import error or timeout); {seconds / 60:.1f} min"]
    lines += survivors
    return {"name": name, "killed": killed, "survived": survived, "text": "\n".join(lines) + "\n"}


def draw(items: list, sample: Sample, key) -> list:
    """`sample.size` of `items` drawn uniformly with `sample.seed`, in `key` order (all of them when
    there are fewer): the same draw for the same items whatever order they come in."""
    ordered = sorted(items, key=key)
    if sample.size >= len(ordered):
        return ordered
    return sorted(random.Random(sample.seed).sample(ordered, sample.size), key=key)


def _source_order(item) -> tuple:
    """cosmic-ray's job ids are random per session; the sample is drawn from an order that is not."""
    m = item.mutations[0]
    return (tuple(m.start_pos), m.operator_name, m.occurrence)


def _drawn(sample: Sample | None) -> str:
    return "" if sample is None else f" (a random sample of at most {sample.size}, seed {sample.seed})"


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"any of: {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument("--count", action="store_true",
                        help="only say how many mutants each target would run (a session is prepared, none run)")
    parser.add_argument("--recheck", action="store_true",
                        help="only rerun the survivors of each target's last session against the current tests")
    parser.add_argument("--sample", type=_positive, metavar="N",
                        help="run a seeded random N of each target's mutants (all when it has fewer)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    args = parser.parse_args(argv)
    sample = Sample(args.sample, args.seed) if args.sample else None
    if args.list:
        for name, t in TARGETS.items():
            scope = ", ".join(t.functions + tuple(f"{k}=" for k in t.keywords)) or "whole module"
            print(f"{name}: {t.source} [{scope}]\n    tests: {' '.join(t.tests)}\n    why: {t.why}")
        return 0
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    base = Path(os.environ.get("VGRAPH_MUTATION_DIR", "/tmp/vgraph-mutation"))
    if args.count:
        for name in args.targets or TARGETS:
            n = init_session(name, TARGETS[name], base / "count", sys.executable, sample)[3]
            print(f"{name}: {n} mutants{_drawn(sample)}", flush=True)
        return 0
    if args.recheck:
        return 1 if sum(recheck(name, TARGETS[name], base, sys.executable) for name in (args.targets or TARGETS)) else 0
    reports = [run_target(name, TARGETS[name], base, sys.executable, sample) for name in (args.targets or TARGETS)]
    total = sum(r["survived"] for r in reports)
    print(f"date {time.strftime('%Y-%m-%d')}: {sum(r['killed'] for r in reports)} killed, {total} survived")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
