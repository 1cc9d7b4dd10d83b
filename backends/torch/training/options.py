"""The training options of `vgraph train` and `vgraph launch`, declared once, and what both commands share.

    add_train_options(parser, "launch")      # the network and every training option launch takes
    config = LaunchConfig(**train_settings(args, "launch"), fleet=...)

Why one table: the two commands train the same way and once declared each
option twice, with defaults in three places (argparse, `TrainConfig`, the job
file), which drifted.  Here a row names the option, its `TrainConfig` field,
its checked type (vgraph.base.options) and its help; its default IS the
field's default (`TrainConfig` stays the one place a default lives), and the
same row's type checks the value a library caller or a job file brings
(`config_problems`), so a value the command line refuses is refused there too.
What only one command has: `commands` says which (launch's own options, the
fleet, replicas, pipeline, machines, stay in launch.py).

Also here, because both commands print and rebuild them the same way: the
command that continues a stopped run (`resume_command`) and the summary line of
a finished one (`print_result`).
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from vgraph.base import options
from vgraph.base.diagnostics import quote
from vgraph.cli.common import command_line

from .config import TrainConfig, TrainingError

__all__ = ["TrainOption", "TRAIN_OPTIONS", "SCHEDULES", "add_train_options", "train_settings", "config_problems",
           "check_train_config", "train_section", "resume_command", "print_result"]

SCHEDULES = ("constant", "cosine")
TRAIN, LAUNCH = "train", "launch"
_BOTH = (TRAIN, LAUNCH)


@dataclass(frozen=True)
class TrainOption:
    """One training option: `flag` sets `TrainConfig.<field>`; a `negated` flag turns a field that is on by
    default off (--no-fuse: fuse=False).  `{default}` in a help text is the field's default, as shown."""

    flag: str
    field: str
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    negated: bool = False
    commands: tuple[str, ...] = _BOTH
    launch_help: str | None = None  # where the option means something else per worker (None: the same help)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def flag_only(self) -> bool:
        return self.type is None and self.choices is None and isinstance(self.default, bool)

    @property
    def default(self) -> Any:
        """The field's default in `TrainConfig`: the one place it is written."""
        return _DEFAULTS[self.field]

    def help_for(self, command: str) -> str:
        text = self.launch_help if command == LAUNCH and self.launch_help is not None else self.help
        return text.replace("{default}", _shown(self.default))


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}

# In the order `--help` lists them.
TRAIN_OPTIONS: tuple[TrainOption, ...] = (
    TrainOption("--data", "data", "a directory `vgraph data prepare` wrote (shards read a window at a time), or text/"
                "JSONL/Parquet files, a directory or a glob (prepared into the cache); default: the embedded corpus",
                options.path, "PATH"),
    TrainOption("--steps", "steps", "optimizer steps in all (default {default})", options.non_negative_int),
    TrainOption("--batch", "batch", "sequences per step (default {default})", options.positive_int),
    TrainOption("--lr", "lr", "learning rate of nodes without their own learning_rate (default {default})",
                options.positive_float),
    TrainOption("--warmup", "warmup", "linear warmup steps (default {default})", options.non_negative_int),
    TrainOption("--schedule", "schedule", "after warmup: constant (default), or cosine decay to 0.1*lr at the last "
                "step", choices=SCHEDULES),
    TrainOption("--seed", "seed", "seed of initialisation, data order and dropout (default {default})", options.seed),
    TrainOption("--out", "out", "run directory (default runs/<network name>)", options.path, "DIR"),
    TrainOption("--resume", "resume", "continue the run in --out from its latest checkpoint (starts fresh if it has "
                "none yet)"),
    TrainOption("--accept-network-change", "accept_network_change",
                "with --resume: continue even though the network differs from the one the checkpoint was trained on "
                "(the change is recorded in run.json; network.yml follows)", commands=(TRAIN,)),
    TrainOption("--device", "device", "cpu, cuda, cuda:N (default: cuda if available)",
                launch_help="cpu or cuda (default: cuda if available)"),
    TrainOption("--passes", "passes", "pass pipeline to run first (default: the production pipeline; '' for none)",
                metavar="SPEC", launch_help="pass pipeline (the partition pass is inserted before the fusions "
                                            "unless the pipeline names it)"),
    TrainOption("--no-fuse", "fuse", "run the pipeline without fusion passes", negated=True),
    TrainOption("--val-every", "val_every", "validation loss every N steps and at the end; 0: never "
                "(default {default})", options.non_negative_int, "N"),
    TrainOption("--val-batches", "val_batches", "validation batches per evaluation (default {default})",
                options.positive_int, "N"),
    TrainOption("--checkpoint-every", "checkpoint_every", "checkpoint every N steps, and always at the end; 0: only "
                "at the end (default {default})", options.non_negative_int, "N"),
    TrainOption("--keep-checkpoints", "keep_checkpoints", "newest checkpoints kept (default {default})",
                options.positive_int, "N"),
    TrainOption("--deterministic", "deterministic",
                "deterministic kernels: a resumed run ends bitwise equal to an uninterrupted one"),
    TrainOption("--threads", "threads", "CPU threads for torch", options.positive_int,
                launch_help="CPU threads per worker (default: cores / workers)"),
    TrainOption("--log-every", "log_every", "write the metrics rows (the losses read back and checked) every N steps "
                "(default: about once a second; every step has its row either way)", options.positive_int, "N",
                launch_help="gather the metrics rows on rank 0 every N steps (default: about once a second; every "
                            "step has its row either way)"),
    TrainOption("--grad-clip", "grad_clip", "clip the global gradient norm", options.positive_float, "NORM"),
    TrainOption("--weight-decay", "weight_decay", "decoupled weight decay (AdamW) of the matrices and embeddings of "
                "Adam nodes; a node's own weight_decay wins (default {default}: Adam)", options.non_negative_float,
                "WD"),
    # launch: the global batch K x --batch, pipelined in at least K micro-batches (launch.py)
    TrainOption("--grad-accum", "grad_accum", "gradient accumulation: K micro-batches of --batch per optimizer step, "
                "the step of a batch K x --batch (default {default})", options.positive_int, "K"),
    TrainOption("--corpus-bytes", "corpus_bytes", "size cap of the embedded corpus (default {default})",
                options.positive_int, "N"),
    TrainOption("--memory-limit", "memory_limit", "refuse networks estimated above SIZE (e.g. 8G) instead of the "
                "device's free memory", options.byte_size, "SIZE", commands=(TRAIN,)),
    TrainOption("--compile", "compile", "torch.compile the training step's graph", commands=(TRAIN,)),
    TrainOption("--quiet", "progress", "no progress bar or status lines", negated=True,
                launch_help="no status lines (errors still show)"),
    TrainOption("--no-tensorboard", "tensorboard", "write no TensorBoard event files into the run directory "
                "(default: written; watch with tensorboard --logdir runs)", negated=True),
)


def add_train_options(parser: argparse.ArgumentParser, command: str, *, network: bool = True) -> None:
    """The network argument (unless the command declares its own: `launch --join` takes none) and every
    training option `command` ("train" or "launch") takes, with the defaults of `TrainConfig`."""
    if network:
        parser.add_argument("network", metavar="FILE", type=options.network_file,
                            help="network YAML, or a shipped network's name (vgraph networks)")
    for option in TRAIN_OPTIONS:
        if command not in option.commands:
            continue
        if option.flag_only:
            parser.add_argument(option.flag, action="store_true", help=option.help_for(command))
            continue
        parser.add_argument(option.flag, type=option.type, default=option.default, metavar=option.metavar,
                            choices=option.choices, help=option.help_for(command))


def train_settings(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The `TrainConfig` fields `command`'s parsed options set, by field name."""
    settings: dict[str, Any] = {"network": args.network}
    for option in TRAIN_OPTIONS:
        if command in option.commands:
            value = getattr(args, option.dest)
            settings[option.field] = not value if option.negated else value
    settings["continue_command"] = resume_command(args)
    return settings


def config_problems(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(field, why) for each option field of `cfg` that its command-line option would refuse: a library
    caller's config and a job file's train section are held to the CLI's own checks.  File names are
    checked where they are opened."""
    problems = []
    for option in TRAIN_OPTIONS:
        value = getattr(cfg, option.field)
        if option.choices is not None and value not in option.choices:
            problems.append((option.field, f"{quote(str(value), 40)} is not one of {', '.join(option.choices)}"))
        if value is None or option.type in (None, options.path):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append((option.field, f"expected a number, got {quote(repr(value), 40)}"))
            continue
        try:
            parsed = option.type(str(value))
        except argparse.ArgumentTypeError as exc:
            problems.append((option.field, str(exc)))
            continue
        if parsed != value:  # 2.5 steps: an integer's parser reads the text otherwise
            problems.append((option.field, f"expected {type(parsed).__name__}, got {value!r}"))
    return problems


def check_train_config(cfg: TrainConfig) -> None:
    """A library caller's `TrainConfig` refused as the command line would refuse its options."""
    problems = config_problems(cfg)
    if problems:
        flag = {option.field: option.flag for option in TRAIN_OPTIONS}
        raise TrainingError("; ".join(f"{flag[name]}: {why}" for name, why in problems))


def train_section(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg` as the job file's `train` object (job.py): JSON values; paths as text; the launcher's own resume
    hint, a function, left out."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "continue_command"}


def resume_command(args: argparse.Namespace):
    """The exact command that continues a stopped `train`/`launch` run: this one, with the run directory as
    --out and --resume (a changed network, once accepted, is the checkpoint's: --accept-network-change is
    not repeated)."""
    if getattr(args, "command_parser", None) is None:
        return None
    return lambda run_dir: command_line(args, override={"out": str(run_dir), "resume": True},
                                        drop={"accept_network_change", "emit_job"})


def print_result(result, *extra: str | None) -> None:
    """The one summary line of a finished run (`vgraph train`, `vgraph launch`)."""
    parts = [f"step {result.step}"]
    if result.loss is not None:
        parts.append(f"loss {result.loss:.4f}")
    if result.val_loss is not None:
        parts.append(f"val loss {result.val_loss:.4f}")
    parts += [e for e in extra if e]
    print(f"{result.run_dir}: {', '.join(parts)}; checkpoint {result.checkpoint}")
    print(f"report: vgraph report {shlex.quote(str(result.run_dir))} -o "
          f"{shlex.quote(str(Path(result.run_dir) / 'report.html'))}")
