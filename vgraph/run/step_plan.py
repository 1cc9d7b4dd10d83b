"""The static plan of a partitioned training step: who computes what, and which tensors cross.

Input: a placed graph (every VNode assigned to a PNode, see the `partition`
pass) and the order of the PNodes (rank r hosts `ranks[r]`).  Output: a
`DistPlan` every worker derives identically, so no plan ever travels.

**Tasks.**  A PNode's VNodes cannot always run as one block: production
networks keep the embedder and the LM head in one `required` group, so the
PNode holding it computes the start of the network, waits for the blocks on
the other PNodes, then computes the end.  Each VNode therefore gets a *depth*:
the number of stage changes on the longest path reaching it (one rule for the
whole project: `vgraph.ir.depth`; a *stage* is the VNodes one PNode holds in
the pipeline, its rank here).  A *task* is one (PNode, depth); edges between
tasks only go from lower to higher depths, so the task graph is acyclic even
when the PNode graph has a cycle.  The tasks are cut out with
`vgraph.placement.export.split_network` (tasks stand in for PNodes), so every
crossing is an explicit `send` / `receive` pair and a tied weight used away
from its publisher's task is a `weight_replica`.

**Transfers.**  One per cut edge (the partition's `cut_edges`): the tensor on
the wire is the producer's activation at the effective dtype the cost model
prices (`vgraph.cost.costmodel`), and, for floats, its gradient comes back the
same way.  Between two tasks of one rank the tensor is handed over in memory.

**Compression.**  A `compress` VNode (the compress-boundary pass) sits on the
producer's side of a cut edge, so in the producer's task it feeds a `send`.
There it is lifted out of the program (`_lift_compression`): the send reads
its input, and the transfer carries its `Compression`, so the transport sends
the wire format itself (stage_runner.py: the producer encodes the activation,
the consumer decodes it, and the other way round for the gradient, with the
error feedback at the gradient's sender).  The bytes on the wire are
`vgraph.ops.boundary.wire_bytes`, as the cost model prices the edge.

**Ties.**  A `weight_replica` whose publisher is on another rank is synced
every step: the replica's gradient goes to the owner (added to the owner's
before its optimizer steps) and the updated weight comes back, 2 x the
weight, exactly what `TieCost.sync_bytes_per_step` predicts.  Both travel on
collectives of the two ranks (tie_sync.py), not in the point-to-point
messages below: the schedule only says where the `tie_grad` op falls.  A
replica on the publisher's own rank simply shares the publisher's Parameter.

**Schedule** (`schedule_ops` / `message_order`).  The per-rank op orders
are the core's (`vgraph.cost.schedule`: 1F1B by default, GPipe the
alternative), computed from this plan's tasks (`scheduled_tasks`), so the
step cost model prices exactly the orders the workers run
(`vgraph.cost.makespan`); every worker repeats the same deterministic
computation.  Every op only needs ops that come before it in one global
order, and sends never block (isend), so the schedule cannot deadlock on any
placement.  `message_order` lists, per ordered pair of ranks, the messages
in the sender's order; receivers read a peer's messages in that order
(buffering any they do not need yet), which is what NCCL requires (no tags)
and keeps gloo's matching trivially right.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.schedule import PIPELINES, Op, ScheduledTask, TiedPair, schedule, weight_round
from vgraph.ir.depth import graph_depths
from vgraph.ir.graph import Graph
from vgraph.ops.boundary import wire_bytes
from vgraph.placement.export import split_network
from vgraph.run import layout

__all__ = ["Task", "Transfer", "Compression", "Tie", "MetricSource", "DistPlan", "make_plan", "Op", "rank_ops",
           "schedule_ops", "PIPELINES", "weight_ops", "sends_of", "message_order", "Message", "micro_batch_sizes",
           "scheduled_tasks", "tied_pairs"]

_REDUCED = ("float16", "bfloat16")


@dataclass
class Task:
    """The VNodes of one PNode at one depth, as a network of their own."""

    id: str  # "<pnode>#<depth>"
    pnode: str
    rank: int
    depth: int
    graph: Graph
    sends: list[int] = field(default_factory=list)  # indices of outgoing transfers
    receives: list[int] = field(default_factory=list)  # indices of incoming transfers
    costs: list[str] = field(default_factory=list)  # cost endpoint names computed here
    send_outputs: dict[str, str] = field(default_factory=dict)  # send VNode -> its output name

    @property
    def want(self) -> tuple[str, ...]:
        """What this task's program computes: every send, then every cost."""
        return (*self.send_outputs.values(), *self.costs)


@dataclass(frozen=True)
class Compression:
    """What a lifted `compress` VNode did: the wire formats of the transfer, each way."""

    node: str  # the compress VNode (its error-feedback rows are checkpointed under this id)
    activations: str
    gradients: str
    scale: str
    error_feedback: bool

    def codec(self, kind: str) -> str:
        """The wire format of message kind 'a' (activation) or 'g' (gradient)."""
        return self.activations if kind == "a" else self.gradients


@dataclass(frozen=True)
class Transfer:
    """One cut edge: `src`:`src_slot` (task `src_task`) feeds `dst`:`dst_slot` (task `dst_task`)."""

    index: int
    src_task: str
    dst_task: str
    src_rank: int
    dst_rank: int
    send_id: str  # the send VNode in the producer's task graph
    recv_id: str  # the receive VNode in the consumer's task graph
    src: str
    src_slot: int
    dst: str
    dst_slot: int
    shape: tuple[int, ...]  # per sample
    dtype: str  # of the tensor (on the wire unless compressed)
    grad: bool  # a gradient flows back
    compression: Compression | None = None  # the wire formats, when a compress VNode fed the send

    @property
    def remote(self) -> bool:
        return self.src_rank != self.dst_rank

    def bytes_per_sample(self) -> int:
        """Bytes one sample of this transfer puts on the wire, both ways."""
        c = self.compression
        fwd = wire_bytes(self.shape, self.dtype, c.activations if c else "none", c.scale if c else "token")
        back = wire_bytes(self.shape, self.dtype, c.gradients if c else "none", c.scale if c else "token")
        return fwd + (back if self.grad else 0)


@dataclass(frozen=True)
class Tie:
    """A tied weight read through a `weight_replica` in `replica_task`, owned by `owner_node`."""

    index: int
    alias: str
    owner_task: str
    owner_node: str
    owner_rank: int
    replica_task: str
    replica_node: str
    replica_rank: int
    shape: tuple[int, ...]

    @property
    def remote(self) -> bool:
        return self.owner_rank != self.replica_rank


@dataclass(frozen=True)
class MetricSource:
    """Where a `metrics:` entry of the network is measured: the task and VNode that hold its value."""

    name: str
    type: str | None
    task: str
    node: str  # the VNode whose lr / gradient / cost it reports (a tied VNode's publisher)
    slot: int


@dataclass
class DistPlan:
    graph: Graph
    ranks: list[str]  # rank -> PNode id
    tasks: dict[str, Task]  # in (depth, rank) order
    transfers: list[Transfer]
    ties: list[Tie]
    metrics: list[MetricSource]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def tasks_of(self, rank: int) -> list[Task]:
        """The rank's tasks in forward order (by depth)."""
        return sorted((t for t in self.tasks.values() if t.rank == rank), key=lambda t: t.depth)

    def param_keys(self, rank: int) -> set[str]:
        """Unfused checkpoint keys the rank's tasks own (replicas excluded: their owners save them)."""
        keys: set[str] = set()
        for task in self.tasks_of(rank):
            for key, pieces in layout.param_sources(task.graph).items():
                if task.graph.node(key.split(".", 1)[0]).type != "weight_replica":
                    keys.update(k for k, _ in pieces)
        return keys

    def cut_bytes_per_step(self, batch: int) -> int:
        """Bytes the plan moves between ranks in one training step of `batch` samples."""
        total = 0
        for tr in self.transfers:
            if tr.remote:
                total += tr.bytes_per_sample() * batch
        for tie in self.ties:
            if tie.remote:
                numel = 1
                for d in tie.shape:
                    numel *= d
                total += 2 * numel * 4  # float32 master weight out, its gradient back
        return total

    def describe(self) -> str:
        lines = [f"{len(self.tasks)} tasks on {self.world_size} ranks; "
                 f"{sum(t.remote for t in self.transfers)} remote transfers, "
                 f"{sum(t.remote for t in self.ties)} tied weights synced"]
        for task in self.tasks.values():
            lines.append(f"  rank {task.rank} ({task.pnode}) depth {task.depth}: {len(task.graph)} VNodes, "
                         f"in {len(task.receives)}, out {len(task.sends)}, costs {task.costs or '-'}")
        return "\n".join(lines)


def _wire_dtype(graph: Graph, node_id: str, declared: str) -> str:
    """The dtype a boundary tensor travels in: the cost model's effective dtype (fp32 without annotations)."""
    if declared not in _REDUCED:
        return declared
    info = graph.node(node_id).meta.get("precision") or {}
    return info.get("activation") or "float32"


def make_plan(graph: Graph, assignment: dict[str, str], ranks: Sequence[str] | None = None) -> DistPlan:
    """The plan for `graph` placed by `assignment` (VNode -> PNode), rank r hosting `ranks[r]`.

    `ranks` defaults to the PNodes in order of first use along the network.
    """
    missing = [n.id for n in graph.nodes if n.id not in assignment]
    if missing:
        raise VGraphError(f"the placement does not assign {', '.join(missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''} to a PNode")
    if ranks is None:
        ranks = list(dict.fromkeys(assignment[n.id] for n in graph.topo_order()))
    rank_of = {pnode: r for r, pnode in enumerate(ranks)}
    unknown = sorted({p for p in assignment.values() if p not in rank_of})
    if unknown:
        raise VGraphError(f"PNode(s) {', '.join(unknown)} hold VNodes but have no worker rank")
    depth_of = graph_depths(graph, assignment)
    task_of = {nid: f"{assignment[nid]}#{depth_of[nid]}" for nid in depth_of}
    parts = split_network(graph, task_of)
    precision = graph.meta.get("precision")
    lifted: dict[str, Compression] = {}
    for part in parts.values():
        lifted.update(_lift_compression(part))
    tasks: dict[str, Task] = {}
    order = sorted(parts, key=lambda tid: (int(tid.rsplit("#", 1)[1]), rank_of[tid.rsplit("#", 1)[0]]))
    for tid in order:
        part = parts[tid]
        if precision is not None:
            part.meta["precision"] = copy.deepcopy(precision)
        pnode, depth = tid.rsplit("#", 1)
        task = Task(tid, pnode, rank_of[pnode], int(depth), part)
        task.costs = [ep.name for ep in part.costs]
        for ep in part.outputs:
            if part.node(ep.node).type == "send":
                task.send_outputs[ep.node] = ep.name
        tasks[tid] = task

    transfers = _transfers(graph, tasks, lifted)
    for tr in transfers:
        tasks[tr.src_task].sends.append(tr.index)
        tasks[tr.dst_task].receives.append(tr.index)
    ties = _ties(graph, tasks)
    metrics = _metrics(graph, task_of)
    return DistPlan(graph, list(ranks), tasks, transfers, ties, metrics)


def _lift_compression(part: Graph) -> dict[str, Compression]:
    """send id -> the `compress` VNode that fed it, taken out of the task's program (the send now reads its
    input): the transport encodes and decodes on the wire instead."""
    out: dict[str, Compression] = {}
    for node in list(part.nodes_of_type("compress")):
        users = part.out_edges(node.id)
        feed = part.input_edge(node.id, 0)
        if feed is None or len(users) != 1 or part.node(users[0].dst).type != "send":
            continue  # not at a cut (same rank): it stays in the program, which computes it alike
        send, cfg = users[0].dst, node.cfg
        part.remove_edge(users[0])
        part.remove_node(node.id)
        part.add_edge(feed.src, feed.src_slot, send, 0, feed.loc)
        out[send] = Compression(node.id, cfg["activations"], cfg["gradients"], cfg["scale"],
                                bool(cfg.get("error_feedback")) and cfg["gradients"] != "none")
    return out


def _transfers(graph: Graph, tasks: dict[str, Task], lifted: dict[str, Compression]) -> list[Transfer]:
    sends: dict[tuple[str, str, int], str] = {}  # (task, consumer VNode, its slot) -> send id
    for task in tasks.values():
        for n in task.graph.nodes:
            if n.type == "send":
                sends[(task.id, n.cfg["peer_node"], int(n.cfg["peer_slot"]))] = n.id
    found = []
    for task in tasks.values():
        for n in task.graph.nodes:
            if n.type != "receive":
                continue
            (edge,) = task.graph.out_edges(n.id)
            src_task = tasks[n.cfg["peer_pnode"]]
            send_id = sends[(src_task.id, edge.dst, edge.dst_slot)]
            src, src_slot = n.cfg["peer_node"], int(n.cfg["peer_slot"])
            t = graph.node(src).outputs[src_slot]
            found.append((src_task, task, send_id, n.id, src, src_slot, edge.dst, edge.dst_slot, t))
    found.sort(key=lambda f: (f[0].depth, f[0].rank, f[1].depth, f[1].rank, f[6], f[7]))
    out = []
    for i, (st, dt, send_id, recv_id, src, src_slot, dst, dst_slot, t) in enumerate(found):
        dtype = _wire_dtype(graph, src, t.dtype)
        out.append(Transfer(i, st.id, dt.id, st.rank, dt.rank, send_id, recv_id, src, src_slot, dst, dst_slot,
                            tuple(t.shape), dtype, t.kind == "float", lifted.get(send_id)))
    return out


def _ties(graph: Graph, tasks: dict[str, Task]) -> list[Tie]:
    publishers = graph.publishers()
    found = []
    for task in tasks.values():
        for n in task.graph.nodes:
            if n.type != "weight_replica":
                continue
            alias = n.config.get("shared_weight_alias")
            owner = publishers.get(alias)
            if owner is None:
                raise VGraphError(f"weight replica {n.id!r} in task {task.id} has no publisher of {alias!r}")
            owner_task = tasks[n.cfg["peer_pnode"]]
            found.append((alias, owner_task, owner.id, task, n.id, tuple(n.cfg["shape"])))
    found.sort(key=lambda f: (f[0], f[3].depth, f[3].rank))
    return [Tie(i, alias, ot.id, owner, ot.rank, rt.id, rid, rt.rank, shape)
            for i, (alias, ot, owner, rt, rid, shape) in enumerate(found)]


def _metrics(graph: Graph, task_of: dict[str, str]) -> list[MetricSource]:
    publishers = graph.publishers()
    out = []
    for ep in graph.metrics:
        node = graph.node(ep.node)
        source = node.id
        if ep.type != "loss" and not node.op.param_shapes(node.cfg) and node.op.tied(node.cfg):
            alias = next(iter(node.op.tied(node.cfg).values()))[0]
            if alias in publishers:
                source = publishers[alias].id  # a tied VNode trains (and is measured) through its publisher
        out.append(MetricSource(ep.name, ep.type, task_of[source], source, ep.slot))
    return out


# -- the schedule ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Message:
    """One tensor between two ranks: activation 'a' / gradient 'g' of a transfer in micro-batch `micro`
    (tied weights and their gradients travel on collectives, tie_sync.py)."""

    kind: str
    index: int
    micro: int = 0


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """Sizes of the micro-batches of a batch (as torch.tensor_split cuts it: larger ones first)."""
    if not 1 <= micro_batches <= batch:
        raise VGraphError(f"--micro-batches must be between 1 and the batch size {batch}, got {micro_batches}")
    base, extra = divmod(batch, micro_batches)
    return [base + (1 if m < extra else 0) for m in range(micro_batches)]


def scheduled_tasks(plan: DistPlan) -> tuple[ScheduledTask, ...]:
    """The plan's tasks as the core schedule sees them (vgraph/cost/schedule.py), in forward order per rank:
    a forward reads the tasks its transfers come from; a backward waits for the gradients of the tasks its
    outputs go to (local transfers included: they are handed over in memory, but in order all the same)."""
    out = []
    for task in sorted(plan.tasks.values(), key=lambda t: (t.rank, t.depth)):
        reads = tuple(dict.fromkeys(plan.transfers[i].src_task for i in task.receives))
        grads = tuple(dict.fromkeys(plan.transfers[i].dst_task for i in task.sends if plan.transfers[i].grad))
        out.append(ScheduledTask(task.id, task.rank, reads, grads))
    return tuple(out)


def tied_pairs(plan: DistPlan) -> tuple[TiedPair, ...]:
    """The plan's remote tied weights, as the core schedule syncs them."""
    return tuple(TiedPair(t.index, (t.owner_rank, t.replica_rank)) for t in plan.ties if t.remote)


def schedule_ops(plan: DistPlan, micro_batches: int, *, train: bool, pipeline: str = "1f1b"
                 ) -> dict[int, list[Op]]:
    """Every rank's ops of one round (a training step, or a forward-only evaluation), in execution order:
    the core's schedule (`vgraph.cost.schedule.schedule`, the one the step cost model prices) of this plan."""
    if pipeline not in PIPELINES:
        raise VGraphError(f"pipeline schedule must be one of {', '.join(PIPELINES)}, not {pipeline!r}")
    return schedule(scheduled_tasks(plan), plan.world_size, micro_batches, train=train, pipeline=pipeline,
                    ties=tied_pairs(plan))


def rank_ops(plan: DistPlan, rank: int, micro_batches: int, *, train: bool, pipeline: str = "1f1b") -> list[Op]:
    """One rank's ops of a round (see `schedule_ops`)."""
    return schedule_ops(plan, micro_batches, train=train, pipeline=pipeline)[rank]


def weight_ops(plan: DistPlan, rank: int) -> list[Op]:
    """The rank's part of a tie-weight round (owner -> replicas), run after every optimizer step."""
    return weight_round(tied_pairs(plan), rank)


def sends_of(plan: DistPlan, rank: int, op: Op) -> Iterable[tuple[int, Message]]:
    """(destination rank, message) of everything `op` on `rank` sends to another rank point to point, in
    order (a tie op's tensors go on the tie's collectives instead)."""
    if op.kind == "fwd":
        for i in plan.tasks[op.task].sends:
            tr = plan.transfers[i]
            if tr.remote:
                yield tr.dst_rank, Message("a", i, op.micro)
    elif op.kind == "bwd":
        for i in plan.tasks[op.task].receives:
            tr = plan.transfers[i]
            if tr.remote and tr.grad:
                yield tr.src_rank, Message("g", i, op.micro)


def message_order(plan: DistPlan, ops_by_rank: dict[int, list[Op]]) -> dict[tuple[int, int], list[Message]]:
    """(src rank, dst rank) -> the messages src sends dst in one round, in sending order."""
    out: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for rank, ops in ops_by_rank.items():
        for op in ops:
            for dst, msg in sends_of(plan, rank, op):
                out[(rank, dst)].append(msg)
    return dict(out)
