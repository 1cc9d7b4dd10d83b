"""One worker of `vgraph launch`: hosts one PNode's part of the network and trains it in lockstep.

Started by the launcher (launch.py) as
`python -m vgraph.backends.torch.distributed.worker JOB.json` with the torchrun
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), so the
same command also runs under `torchrun` on several machines.

What a worker does, per training step (every rank the same, in lockstep):

1. draws the step's batch from the shared data generator (every rank draws,
   so every rank's generator state is the checkpointed one) and cuts it into
   micro-batches;
2. runs its ops of the pipeline schedule (plan.py, 1F1B or GPipe): the
   forward of a task for a micro-batch receives boundary activations and
   sends its own; its backward receives the gradients of what it sent and
   sends those of what it received; then the tied-weight gradients;
3. all-reduces [loss, squared gradient norm, non-finite flag, bytes sent] on
   the control group, so every rank takes the same decision (stop on a
   non-finite loss, skip under loss scaling, clip);
4. steps its optimizers (per VNode, as `vgraph train`), then owners send
   tied weights to their replicas;
5. on logging / validation / checkpoint steps, joins the collectives that
   gather metrics, validation loss and checkpoint state on rank 0.

Micro-batching is exact: a cost is a mean over its tokens, so micro-batch m's
loss is weighted by its share of the batch's counted tokens (targets equal to
`ignore_index` do not count), and dropout masks are keyed by the global
sample index (dropout.py).  Losses therefore equal the single-process
trainer's up to float rounding.

Checkpoints are `vgraph train` checkpoints (checkpoint.py), in the unfused
global layout: rank 0 gathers every rank's parameters and optimizer state and
writes one checkpoint, atomically, then moves `latest`.  A run resumes from
it on any partition, or on one process with `vgraph train --resume`.

Exit status: 0 done; 3 a user-facing error (message in launch/error-<rank>.txt
and on stderr; the launcher does not restart); anything else is a crash the
launcher answers with a restart from the last checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from vgraph import layout
from vgraph.diagnostics import Diagnostic, VGraphError
from vgraph.ir import Graph
from vgraph.partition_export import assignment_of
from vgraph.plugins import load_plugins
from vgraph.pipeline import run_pipeline
from vgraph.yamlio import loads

from .. import checkpoint as ckpt
from .. import data as D
from .comm import Transport
from .plan import (DistPlan, Message, Op, Task, make_plan, message_order, micro_batch_sizes, schedule_ops,
                        weight_ops)
from ..dropout import clear_dropout_key, set_dropout_key
from ..lower import VGraphModule, compile_network, compute_dtype
from ..metrics_log import MetricsLog
from ..node_optimizers import NodeOptimizers, lr_factor
from ..run_checkpoints import (CHECKPOINT_PREFIX, optimizer_state_to_graph, optimizer_state_to_unfused,
                               prune_checkpoints)
from ..train_config import TrainingError
from ..training_setup import use_deterministic_kernels

__all__ = ["main", "Worker", "EXIT_USER_ERROR", "LAUNCH_DIR", "apply_assignment"]

EXIT_USER_ERROR = 3
LAUNCH_DIR = "launch"  # inside the run directory: job files, token streams, worker markers
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_CE_COSTS = ("ce", "ce_logits")


def apply_assignment(source: Graph, before: str, assignment: dict[str, str], after: str, target: str) -> Graph:
    """The placed, optimised graph: passes up to the partition, its assignment, passes after it.

    The launcher and every worker build the graph this way, so they agree on
    it without shipping it (fusions after the partition respect the placement).
    """
    graph = source.copy()
    if before:
        run_pipeline(graph, before, target=target)
    for node in graph.nodes:
        if node.id in assignment:
            node.meta["pnode"] = assignment[node.id]
    if after:
        run_pipeline(graph, after, target=target)
    return graph


class _TokenStreams(D.TokenDataset):
    """A TokenDataset over token streams the launcher tokenised once (no corpus or tokenizer here)."""

    def __init__(self, train_tokens: torch.Tensor, val_tokens: torch.Tensor, seq_len: int) -> None:
        self.train_tokens = train_tokens
        self.val_tokens = val_tokens
        self.tokens = torch.cat([train_tokens, val_tokens])
        self.seq_len = seq_len


class _LossScaler:
    """Dynamic loss scaling with one decision for all ranks (GradScaler's rule and state_dict)."""

    def __init__(self, enabled: bool, init_scale: float) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = 2.0, 0.5, 2000
        self.tracker = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.tracker = 0

    def state_dict(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.tracker}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.enabled and state:
            self.scale = float(state["scale"])
            self.tracker = int(state.get("_growth_tracker", 0))


class Worker:
    """The state of one rank; `run()` trains to the configured step."""

    def __init__(self, job: dict[str, Any], rank: int, world: int, local_rank: int) -> None:
        self.job = job
        self.cfg = job["config"]
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.run_dir = Path(job["run_dir"])
        self.pnode = job["ranks"][rank]
        self.log_enabled = bool(self.cfg.get("progress", True))

    # -- set-up ------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.log_enabled:
            print(msg, flush=True)

    def setup(self) -> None:
        cfg, job = self.cfg, self.job
        if self.world != len(job["ranks"]):
            raise TrainingError(f"WORLD_SIZE is {self.world} but the placement has {len(job['ranks'])} PNodes")
        if job["device"] == "cuda":
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.set_num_threads(int(cfg["threads"]))
        if cfg.get("deterministic"):
            use_deterministic_kernels()
        dist.init_process_group(job["backend"], rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=float(cfg["comm_timeout"])))
        self.ctrl = dist.new_group(backend="gloo") if job["backend"] != "gloo" else None
        self.transport = Transport(self.device, stage_through_cpu=bool(job.get("stage_through_cpu")))
        self.traffic = 0  # bytes this rank sent for training since the last loss reduction

        source = loads(job["network_yaml"], file=job["network_file"])
        graph = apply_assignment(source, job["pipeline_before"], job["assignment"], job["pipeline_after"],
                                 job["target"])
        final = assignment_of(graph)
        if final != job["final_assignment"]:
            raise TrainingError("this worker's placed graph differs from the launcher's (different vgraph "
                                "versions or pass plugins on the machines?)")
        self.graph = graph
        self.plan: DistPlan = make_plan(graph, final, job["ranks"])
        self.tasks: list[Task] = self.plan.tasks_of(self.rank)
        self.dtype = compute_dtype(graph)
        precision = graph.meta.get("precision") or {}
        self.loss_scaling = bool(precision.get("loss_scaling")) and self.dtype == torch.float16
        self.amp = (lambda: torch.autocast(self.device.type, dtype=self.dtype)) if self.dtype != torch.float32 \
            else contextlib.nullcontext
        self.scaler = _LossScaler(self.loss_scaling, float(cfg["initial_loss_scale"]))

        self.modules: dict[str, VGraphModule] = {}
        self.optims: dict[str, NodeOptimizers] = {}
        for task in self.tasks:
            module = compile_network(task.graph, device=self.device, train=True, seed=int(cfg["seed"]))
            self.modules[task.id] = module
            self.optims[task.id] = NodeOptimizers(module, float(cfg["lr"]))
        self._link_replicas()
        self.trainable = [p for o in self.optims.values() for p in o.trainable]
        self._feeds = {task.id: self._feed_plan(task) for task in self.tasks}

        streams = self._load_tokens()
        self.seq_len = int(job["run_info"]["seq_len"])
        self.dataset = _TokenStreams(streams["train"], streams["val"], self.seq_len)
        self.data_gen = torch.Generator().manual_seed(int(cfg["seed"]))
        self.batch = int(cfg["batch"])
        self.sizes = micro_batch_sizes(self.batch, int(cfg["micro_batches"]))
        self._rounds: dict[tuple[tuple[int, ...], bool], tuple[list[Op], dict]] = {}

    def _link_replicas(self) -> None:
        """A replica on its owner's rank is the owner's Parameter; a remote one gets gradients to send."""
        self.replica_params: dict[int, torch.nn.Parameter] = {}
        self.owner_params: dict[int, torch.nn.Parameter] = {}
        for tie in self.plan.ties:
            if tie.owner_rank == self.rank:
                self.owner_params[tie.index] = self.modules[tie.owner_task].namespace(tie.owner_node).weight
            if tie.replica_rank != self.rank:
                continue
            namespace = self.modules[tie.replica_task].namespace(tie.replica_node)
            if not tie.remote:
                namespace._parameters["weight"] = self.owner_params[tie.index]
            else:
                namespace.weight.requires_grad_(True)  # optimizer "none": its gradient goes to the owner
                self.replica_params[tie.index] = namespace.weight

    def _feed_plan(self, task: Task) -> list[tuple[str, str]] | None:
        """How each feed of the task's program is filled: ("recv", id) | ("tokens", "") | ("targets", "")."""
        if not task.want:
            return None
        module = self.modules[task.id]
        out = []
        for name in module.program_for(task.want, training=True).feeds:
            node_id, _, slot_text = name.rpartition(":in")
            node, slot = task.graph.node(node_id), int(slot_text)
            if node.type == "receive":
                out.append(("recv", node_id))
            elif node.type == "embedder" and slot == 0:
                out.append(("tokens", ""))
            elif slot == 1 and (node.type == "tied_lm_head_ce" or
                                (node.type == "cost" and node.cfg["cost_function"] in _CE_COSTS)):
                out.append(("targets", ""))
            else:
                raise TrainingError([Diagnostic(
                    f"input {slot} of this {node.type} is a network input that `vgraph launch` cannot feed: it "
                    f"feeds token ids to embedders and next-token targets to cross-entropy costs",
                    node.loc, node.id)])
        return out

    def _load_tokens(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(self.job["tokens"])

    # -- rounds -------------------------------------------------------------------------------
    def _round(self, sizes: Sequence[int], train: bool) -> tuple[list[Op], dict]:
        """This rank's ops and the messages it expects, per peer, for a round of micro-batch `sizes`."""
        key = (tuple(sizes), train)
        if key not in self._rounds:
            ops_by_rank = schedule_ops(self.plan, len(sizes), train=train,
                                       pipeline=str(self.cfg.get("pipeline") or "1f1b"))
            self._rounds[key] = (ops_by_rank[self.rank], self._expected(ops_by_rank, sizes))
        return self._rounds[key]

    def _expected(self, ops_by_rank: dict[int, list[Op]], sizes: Sequence[int]) -> dict[int, list]:
        expected: dict[int, list] = {}
        for (src, dst), messages in message_order(self.plan, ops_by_rank).items():
            if dst != self.rank:
                continue
            rows = []
            for msg in messages:
                if msg.kind in ("a", "g"):
                    tr = self.plan.transfers[msg.index]
                    rows.append((msg, (sizes[msg.micro], *tr.shape), _DTYPES[tr.dtype]))
                else:
                    rows.append((msg, self.plan.ties[msg.index].shape, torch.float32))
            expected[src] = rows
        return expected

    def _cost_weights(self, task: Task, targets: list[torch.Tensor], sizes: Sequence[int]) -> dict[str, list[float]]:
        """Per cost, each micro-batch's share of the batch's loss (token counts for cross-entropy)."""
        total = sum(sizes)
        out = {}
        cost_node = {ep.name: ep.node for ep in task.graph.costs}
        for name in task.costs:
            node = task.graph.node(cost_node[name])
            ce = node.type == "tied_lm_head_ce" or (node.type == "cost" and node.cfg["cost_function"] in _CE_COSTS)
            if ce and task.graph.input_edge(node.id, 1) is None:
                ignore = int(node.cfg.get("ignore_index", -100))
                counts = [int((t != ignore).sum()) for t in targets]
                if sum(counts) > 0:
                    out[name] = [c / sum(counts) for c in counts]
                    continue
            out[name] = [b / total for b in sizes]
        return out

    def run_round(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, sizes: Sequence[int], *,
                  train: bool) -> dict[str, torch.Tensor]:
        """One round (forward+backward of a step, or a forward-only evaluation); returns this rank's costs,
        each the weighted sum over micro-batches (float32)."""
        ops, expected = self._round(sizes, train)
        sent_before = self.transport.bytes_sent
        tokens = list(torch.split(inputs.to(self.device), list(sizes)))
        targets_mb = list(torch.split(targets.to(self.device), list(sizes)))
        offsets = [sum(sizes[:m]) for m in range(len(sizes))]
        weights = {t.id: self._cost_weights(t, targets_mb, sizes) for t in self.tasks}
        costs: dict[str, torch.Tensor] = {}
        stash: dict[tuple[str, int], tuple[dict, dict]] = {}
        local: dict[tuple[str, int, int], torch.Tensor] = {}
        transport = self.transport
        transport.begin(expected)
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        with grad_mode:
            for op in ops:
                if op.kind == "fwd":
                    task = self.plan.tasks[op.task]
                    m = op.micro
                    outs, received = self._forward(task, m, step, offsets[m], tokens[m], targets_mb[m], local, train)
                    for name in task.costs:
                        value = outs[name].detach().float() * weights[task.id][name][m]
                        costs[name] = value if name not in costs else costs[name] + value
                    if train:
                        stash[(task.id, m)] = (outs, received)
                elif op.kind == "bwd":
                    task = self.plan.tasks[op.task]
                    self._backward(task, op.micro, weights[task.id], *stash.pop((task.id, op.micro)), local)
                elif op.kind == "tie_grad":
                    self._tie_grad(op.tie)
        transport.end()
        if train:
            self.traffic += transport.bytes_sent - sent_before
        return costs

    def _forward(self, task: Task, m: int, step: int, offset: int, tokens: torch.Tensor, targets: torch.Tensor,
                 local: dict, train: bool) -> tuple[dict, dict]:
        received: dict[str, torch.Tensor] = {}
        for i in task.receives:
            tr = self.plan.transfers[i]
            value = (self.transport.recv(tr.src_rank, Message("a", i, m)) if tr.remote
                     else local.pop(("a", i, m)))
            if train and tr.grad:
                value = value.detach().requires_grad_(True)
            received[tr.recv_id] = value
        outs: dict[str, torch.Tensor] = {}
        feeds = self._feeds[task.id]
        if feeds is not None:
            program = self.modules[task.id].program(task.want, training=train)
            args = [received[ref] if kind == "recv" else tokens if kind == "tokens" else targets
                    for kind, ref in feeds]
            set_dropout_key(int(self.cfg["seed"]), step, offset)
            with self.amp():
                outs = program(*args)
        for i in task.sends:
            tr = self.plan.transfers[i]
            wire = outs[task.send_outputs[tr.send_id]].detach().to(_DTYPES[tr.dtype])
            if tr.remote:
                self.transport.send(tr.dst_rank, Message("a", i, m), wire)
            else:
                local[("a", i, m)] = wire
        return outs, received

    def _backward(self, task: Task, m: int, weights: dict[str, list[float]], outs: dict, received: dict,
                  local: dict) -> None:
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for name in task.costs:
            value = outs[name]
            if value.requires_grad:
                roots.append(value * (weights[name][m] * self.scaler.scale))
                grads.append(None)
        by_value: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in task.sends:
            tr = self.plan.transfers[i]
            if not tr.grad:
                continue
            grad = self.transport.recv(tr.dst_rank, Message("g", i, m)) if tr.remote else local.pop(("g", i, m))
            value = outs[task.send_outputs[tr.send_id]]
            if value.requires_grad:
                grad = grad.to(value.dtype)
                seen = by_value.get(id(value))
                by_value[id(value)] = (value, grad if seen is None else seen[1] + grad)
        for value, grad in by_value.values():
            roots.append(value)
            grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)
        for i in task.receives:
            tr = self.plan.transfers[i]
            if not tr.grad:
                continue
            leaf = received[tr.recv_id]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if tr.remote:
                self.transport.send(tr.src_rank, Message("g", i, m), grad)
            else:
                local[("g", i, m)] = grad

    def _tie_grad(self, index: int) -> None:
        tie = self.plan.ties[index]
        if self.rank == tie.replica_rank:
            param = self.replica_params[index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            self.transport.send(tie.owner_rank, Message("tg", index), grad.float())
            param.grad = None
        else:
            grad = self.transport.recv(tie.replica_rank, Message("tg", index))
            param = self.owner_params[index]
            if param.requires_grad:
                param.grad = grad.to(param.dtype) if param.grad is None else param.grad.add_(grad)

    def sync_tied_weights(self) -> None:
        """Owners send tied weights to their replicas on other ranks (after every optimizer step)."""
        ops = weight_ops(self.plan, self.rank)
        ops_by_rank = {r: weight_ops(self.plan, r) for r in range(self.world)}
        if not any(ops_by_rank.values()):
            return
        self.transport.begin(self._expected(ops_by_rank, []))
        sent_before = self.transport.bytes_sent
        with torch.no_grad():
            for op in ops:
                tie = self.plan.ties[op.tie]
                if self.rank == tie.owner_rank:
                    self.transport.send(tie.replica_rank, Message("w", tie.index), self.owner_params[tie.index])
                else:
                    value = self.transport.recv(tie.owner_rank, Message("w", tie.index))
                    self.replica_params[tie.index].copy_(value)
        self.transport.end()
        self.traffic += self.transport.bytes_sent - sent_before

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=self.ctrl)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.ctrl)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        out = [None]
        dist.scatter_object_list(out, objs, src=0, group=self.ctrl)
        return out[0]

    # -- checkpoints --------------------------------------------------------------------------
    def _local_state(self) -> dict[str, Any]:
        """This rank's parameters and optimizer state, unfused layout, replicas left out (CPU copies)."""
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, Any]] = {}
        for task in self.tasks:
            module = self.modules[task.id]
            replicas = {f"{n.id}." for n in task.graph.nodes if n.type == "weight_replica"}
            for key, value in module.unfused_state_dict().items():
                if not any(key.startswith(r) for r in replicas):
                    model[key] = value.detach().cpu().clone()
            states = optimizer_state_to_unfused(self.optims[task.id].state_by_key(), module.network)
            for key, state in states.items():
                if not any(key.startswith(r) for r in replicas):
                    optim[key] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in state.items()}
        return {"model": model, "optim": optim}

    def save_checkpoint(self, step: int) -> Path | None:
        parts = self.gather(self._local_state())
        if self.rank != 0:
            return None
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, Any]] = {}
        for part in parts:
            model.update(part["model"])
            optim.update(part["optim"])
        job = self.job
        extra = {
            "layout": "unfused",
            "data_generator": self.data_gen.get_state(),
            "grad_scaler": self.scaler.state_dict(),
            "run": json.loads(json.dumps(job["run_info"], default=str)),
            "network_yaml": job["network_yaml"],
            "tokenizer_json": Path(job["tokenizer"]).read_text(encoding="utf-8"),
            "launch": {"ranks": job["ranks"], "assignment": job["final_assignment"],
                       "micro_batches": len(self.sizes), "attempt": job["attempt"]},
        }
        path = ckpt.save_checkpoint(self.run_dir / f"{CHECKPOINT_PREFIX}{step:08d}", step=step, model_state=model,
                                    optimizer_states=optim, rng_state=ckpt.capture_rng_state(), extra=extra)
        prune_checkpoints(self.run_dir, int(self.cfg["keep_checkpoints"]), path)
        return path

    def resume(self) -> int:
        """Load the latest checkpoint (rank 0 reads it and hands every rank its share); the start step."""
        payloads: list[Any] | None = None
        if self.rank == 0:
            payloads = self._resume_payloads()
        mine = self.scatter(payloads)
        if mine is None:
            return 0
        if "error" in mine:
            raise TrainingError(mine["error"])
        with torch.no_grad():
            for task in self.tasks:
                module = self.modules[task.id]
                own = module.state_dict(keep_vars=True)
                for key, pieces in layout.param_sources(module.network).items():
                    if module.network.node(key.split(".", 1)[0]).type == "weight_replica":
                        continue
                    parts = [mine["model"][k] for k, _ in pieces]
                    own[key].copy_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
                self.optims[task.id].load_state_by_key(optimizer_state_to_graph(mine["optim"], module.network))
        self.data_gen.set_state(mine["data_generator"])
        self.scaler.load_state_dict(mine["grad_scaler"])
        return int(mine["step"])

    def _resume_payloads(self) -> list[Any]:
        if not self.cfg.get("resume"):
            return [None] * self.world
        try:
            latest = ckpt.latest_checkpoint(self.run_dir)
            if latest is None:
                return [None] * self.world
            state = ckpt.load_checkpoint(latest, map_location="cpu")
        except ckpt.CheckpointError as exc:
            return [{"error": f"cannot resume: {exc}"}] * self.world
        before = state.extra.get("run", {})
        info = self.job["run_info"]
        for key in ("seed", "batch", "seq_len", "data", "vocab_size", "tokenizer"):
            if key in before and before[key] != info[key]:
                return [{"error": f"cannot resume {self.run_dir}: it was trained with {key}={before[key]!r}, "
                                  f"this run has {key}={info[key]!r}; resuming must not change it"}] * self.world
        out = []
        for r in range(self.world):
            keys = self.plan.param_keys(r)
            missing = sorted(keys - set(state.model_state))
            if missing:
                return [{"error": f"checkpoint {latest} has no {', '.join(missing[:4])}: it is not a checkpoint "
                                  f"of this network"}] * self.world
            out.append({"step": state.step, "model": {k: state.model_state[k] for k in keys},
                        "optim": {k: v for k, v in state.optimizer_states.items() if k in keys},
                        "data_generator": state.extra["data_generator"],
                        "grad_scaler": state.extra.get("grad_scaler")})
        self.say(f"resumed from {latest} at step {state.step}")
        return out

    # -- metrics ------------------------------------------------------------------------------
    def _metric_values(self, costs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The network's `metrics:` entries measured on this rank (see plan.MetricSource)."""
        values: dict[str, Any] = {}
        mine = {t.id for t in self.tasks}
        for src in self.plan.metrics:
            if src.task not in mine:
                continue
            task = self.plan.tasks[src.task]
            optim, module = self.optims[task.id], self.modules[task.id]
            if src.type in (None, "learning_rate"):
                values[src.name] = optim.lr_of(src.node) if src.node in optim.base_lr else None
            elif src.type == "loss":
                names = [ep.name for ep in task.graph.costs if ep.node == src.node and ep.slot == src.slot]
                if names and names[0] in costs:
                    values[src.name] = float(costs[names[0]])
            elif src.type == "grad_norm":
                grads = [p.grad for p in module.node_parameters(src.node).values() if p.grad is not None]
                if grads:
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                    values[src.name] = float(norm) / self.scaler.scale
        return values

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        start = self.resume()
        steps = int(cfg["steps"])
        self.sync_tied_weights()
        log: MetricsLog | None = None
        if self.rank == 0:
            metric_names = [m.name for m in self.plan.metrics if m.name not in ("step", "loss", "lr")]
            columns = ["step", "loss", "lr", "tokens_per_s", "elapsed_s", "val_loss", "loss_scale",
                       "boundary_bytes", *metric_names]
            log = MetricsLog(self.run_dir, columns)
            log.restart(start)
            self.say(f"{self.graph.name}: {len(self.graph)} VNodes on {self.world} worker(s), "
                     f"{len(self.sizes)} micro-batch(es) of {self.sizes}; steps {start + 1}..{steps}; "
                     f"predicted boundary traffic {self.job['predicted_cut_bytes']:,} bytes/step")
        for task in self.tasks:
            params = sum(p.numel() for p in self.modules[task.id].parameters())
            self.say(f"task {task.id}: {len(task.graph)} VNodes, {params:,} parameters, "
                     f"{len(task.receives)} inputs, {len(task.sends)} outputs")
        batches = self.dataset.batches("train", self.batch, self.seq_len, self.data_gen)
        log_every = int(cfg.get("log_every") or 1)
        val_every = int(cfg["val_every"])
        ckpt_every = int(cfg["checkpoint_every"])
        tokens_per_step = self.batch * self.seq_len
        pending: list[dict[str, Any]] = []
        consecutive_bad = 0
        start_time = last_flush = last_print = time.perf_counter()
        hold = self.job.get("hold")
        for step in range(start + 1, steps + 1):
            inputs, targets = next(batches)
            factor = lr_factor(step, _Schedule(cfg))
            for optim in self.optims.values():
                optim.set_factor(factor)
            costs = self.run_round(step, inputs, targets, self.sizes, train=True)
            loss_local = float(sum(costs.values())) if costs else 0.0
            validate = val_every > 0 and (step % val_every == 0 or step == steps)
            save_now = step == steps or (ckpt_every > 0 and step % ckpt_every == 0)
            flush = save_now or validate or step % log_every == 0
            extras = self._metric_values(costs) if flush else {}
            sumsq = 0.0
            if cfg.get("grad_clip"):
                sumsq = float(sum(float(p.grad.double().pow(2).sum()) for p in self.trainable if p.grad is not None))
            bad_grads = 0.0
            if self.loss_scaling:
                bad_grads = float(any(not bool(torch.isfinite(p.grad).all()) for p in self.trainable
                                      if p.grad is not None))
            # Traffic since the previous reduction: the weight sync that preceded this step, then its
            # activations, gradients and tied-weight gradients (what placement_report prices per step).
            loss, sumsq, bad_grads, step_bytes = self.all_reduce([loss_local, sumsq, bad_grads, self.traffic])
            self.traffic = 0
            if math.isfinite(loss):
                consecutive_bad = 0
            else:
                consecutive_bad += 1
                if not self.loss_scaling or consecutive_bad > int(cfg["max_skipped_steps"]):
                    raise TrainingError(self._diverged(step, loss, consecutive_bad))
            self._optimizer_step(bad_grads > 0, sumsq)
            self.sync_tied_weights()

            row = {"step": step, "loss": loss, "lr": float(cfg["lr"]) * factor, "boundary_bytes": int(step_bytes)}
            if self.loss_scaling:
                row["loss_scale"] = self.scaler.scale
            pending.append(row)
            if flush:
                gathered = self.gather(extras)
                val_loss = self.validate() if validate else None
                now = time.perf_counter()
                if self.rank == 0:
                    for r in pending:
                        r["tokens_per_s"] = tokens_per_step * len(pending) / max(now - last_flush, 1e-9)
                        r["elapsed_s"] = now - start_time
                    for part in gathered:
                        pending[-1].update({k: v for k, v in part.items()})
                    if val_loss is not None:
                        pending[-1]["val_loss"] = val_loss
                    log.append(pending)
                    if now - last_print >= 2.0 or step == steps or validate:
                        last_print = now
                        r = pending[-1]
                        self.say(f"step {step}/{steps} loss {r['loss']:.4f} tok/s {r['tokens_per_s']:,.0f} "
                                 f"lr {r['lr']:.2e}" + (f" val {val_loss:.4f}" if val_loss is not None else ""))
                    if validate:
                        log.plot(self.run_dir / "loss_curve.png", self.graph.name)
                pending = []
                last_flush = time.perf_counter()
            if save_now:
                path = self.save_checkpoint(step)
                if path is not None:
                    self.say(f"checkpoint {path}")
                last_flush = time.perf_counter()
            if hold and int(hold["rank"]) == self.rank and int(hold["step"]) == step:
                self._hold(step)
        if self.rank == 0 and log is not None:
            log.plot(self.run_dir / "loss_curve.png", self.graph.name)
        clear_dropout_key()
        dist.barrier(group=self.ctrl)

    def _optimizer_step(self, found_inf: bool, sumsq: float) -> None:
        scale = self.scaler.scale
        if found_inf:  # every rank skips together (the flag was all-reduced)
            self.scaler.update(True)
        else:
            with torch.no_grad():
                if self.scaler.enabled:
                    for p in self.trainable:
                        if p.grad is not None:
                            p.grad.mul_(1.0 / scale)
                clip = self.cfg.get("grad_clip")
                if clip:
                    total = math.sqrt(sumsq) / scale
                    coef = min(1.0, float(clip) / (total + 1e-6))
                    for p in self.trainable:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            for optim in self.optims.values():
                for opt in optim.optimizers:
                    opt.step()
            self.scaler.update(False)
        for optim in self.optims.values():
            optim.zero_grad()
        for param in self.replica_params.values():
            param.grad = None

    def validate(self) -> float:
        total, count = 0.0, 0
        for i, (inputs, targets) in enumerate(self.dataset.val_batches(self.batch, self.seq_len)):
            if i >= int(self.cfg["val_batches"]):
                break
            costs = self.run_round(0, inputs, targets, [inputs.shape[0]], train=False)
            total += float(sum(costs.values())) * inputs.shape[0] if costs else 0.0
            count += inputs.shape[0]
        (total,) = self.all_reduce([total])
        return total / max(count, 1)

    def _diverged(self, step: int, value: float, streak: int) -> str:
        why = (f"the loss scaler skipped {streak} steps in a row without recovering" if self.loss_scaling
               else "training stopped before applying that step's update")
        return (f"network {self.graph.name!r}: the loss at step {step} is {value} (not finite); {why}. Resume "
                f"from the last checkpoint (--resume) with a lower --lr, or clip gradients with --grad-clip 1.0.")

    def _hold(self, step: int) -> None:
        """Test hook: stop after `step` (others block on this rank) until killed or released."""
        launch_dir = self.run_dir / LAUNCH_DIR
        (launch_dir / f"held-{self.pnode}").write_text(f"{step}\n")
        deadline = time.monotonic() + 300
        while not (launch_dir / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


class _Schedule:
    """The fields `train.lr_factor` reads, from the job's config dict."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.warmup = int(cfg.get("warmup") or 0)
        self.schedule = cfg.get("schedule") or "constant"
        self.steps = int(cfg["steps"])
        self.min_lr_ratio = float(cfg.get("min_lr_ratio", 0.1))


def _peer_lost(exc: BaseException) -> bool:
    """A communication error caused by another worker going away (or timing out)."""
    backend_error = getattr(dist, "DistBackendError", None)
    text = str(exc)
    return (backend_error is not None and isinstance(exc, backend_error)) or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "Timed out", "timed out"))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.distributed.worker JOB.json` (torchrun environment)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m vgraph.backends.torch.distributed.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    worker = Worker(job, rank, world, local_rank)
    try:
        load_plugins(job.get("plugins", ()))  # what the launcher loaded: installed op types, --plugin files
        worker.setup()
        worker.run()
        return 0
    except VGraphError as exc:
        text = "\n".join(str(d) for d in exc.diagnostics)
        print(f"error: {text}", file=sys.stderr, flush=True)
        # Every rank that raised writes its message; a collective decision gives identical texts.
        (Path(job["run_dir"]) / LAUNCH_DIR / f"error-{rank}.txt").write_text(text + "\n", encoding="utf-8")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if _peer_lost(exc):  # the launcher knows which worker died first; no traceback needed here
            print(f"stopped: lost a peer ({str(exc).splitlines()[0][:200]})", file=sys.stderr, flush=True)
            return 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
