"""The replicas' gradient sum on torch's collectives: buckets all-reduced while the last backward still runs.

With R data-parallel replicas, stage s of every replica holds the same
parameters; each replica's loss is weighted by its share of the global batch,
so the *sum* of the R gradients is the gradient of the global batch's loss.
`GradientSync` sums them over the stage group's process group
(replica_groups.py: gloo on CPUs, nccl on GPUs) the way torch's
DistributedDataParallel does (Li et al., VLDB 2020):

* **buckets**: the rank's trainable parameters, in the order their gradients
  become final (StageRunner gives them: the deeper tasks first, each
  task's parameters in reverse, a remote tied weight's owner last), cut into
  buckets of at most `bucket_bytes` (25 MiB, DDP's default) of one dtype and
  device.  Each parameter's `.grad` is a view into its bucket's flat buffer,
  so backward accumulates straight into the buffer: nothing is flattened
  before the all-reduce or copied back after it;
* **readiness**: a post-accumulate-grad hook on every parameter marks it
  ready when it fires during the *last* backward (the last micro-batch) of
  the last task of this rank that uses the parameter; a parameter no
  gradient reached is ready when that backward returns; the owner of a
  remote tied weight is ready when its replica's gradient has been added
  (`ready`, tie_sync.py);
* **launch**: a bucket is all-reduced asynchronously as soon as all its
  parameters are ready *and* every bucket before it has been launched, so
  every member issues the same collectives in the same order (the rule of
  DDP's reducer too), whatever order its hooks fire in;
* **finish**: launches what is left and waits for every bucket before the
  optimizer step; the seconds spent waiting are `wait_s` (the part of the
  all-reduce the backward did not hide).  A parameter no gradient reached
  gets `.grad = None` again, as in `vgraph train` (its optimizer skips it).

A bucket's reduction is a DDP communication hook, `hook(state, bucket) ->
Future[Tensor]`, and `Bucket` answers the `torch.distributed.GradBucket`
methods such hooks call (`buffer`, `index`, `is_last`, `gradients`,
`parameters`), so gradient compression (torch's `fp16_compress_hook`,
`powerSGD_hook`) plugs in with `hook=` and `hook_state=`.  One difference:
DDP's hooks return the *mean*, and this sum must not be divided;
`summed(hook)` turns an averaging hook into a summing one.  A hook that
all-reduces something else than the bucket says what with `wire=`: the
elements of each all-reduce it runs for a bucket (grad_compress.py), each
counted by the ring formula below.

**Bytes** are not measured on the wire (gloo and NCCL pick their own
algorithms) but counted from the formula the step cost model prices
(`vgraph.cost.stepcost.ring_allreduce_bytes`): in a ring all-reduce of a bucket cut
into R chunks (as torch.tensor_split cuts it), a member sends every chunk but
one in the reduce-scatter and every chunk but another in the all-gather,
2 (R - 1) / R of the bucket, and the group 2 (R - 1) x the bucket, so the
workers' count equals placement.json's `bytes_per_step` (`ring_bytes_sent`).

**Why not torch's DistributedDataParallel around each stage module** (with
`no_sync` for all but the last micro-batch), which was considered first:

1. DDP arms its reducer in `forward`: the backward after a syncing forward
   reduces.  A pipeline schedule runs several forwards before their
   backwards (GPipe all M, 1F1B up to min(M, stages)), so the last
   micro-batch's (syncing) forward comes before the backwards of earlier
   micro-batches, which DDP would then reduce with partial gradients.
   torch's own pipelining (torch.distributed.pipelining.stage) gets round
   this only by calling the private `DDP.reducer.prepare_for_backward`
   itself (its comment calls it a hack).
2. A remote tied weight's gradient is complete only when its replica's
   gradient has come from another rank, after all backward ops; DDP would
   reduce the owner's part as soon as the owner's backward is done.
3. A weight tied between two tasks of one rank is one Parameter in two
   stage modules: DDP around each module would reduce it twice.
4. Parameters no gradient reaches on a stage need
   `find_unused_parameters=True`, a graph traversal every step, and DDP
   averages where unequal batch shares need the plain sum (a comm hook could
   fix that one; 1-3 it cannot).
Loss scaling, unequal shares and rematerialisation (non-reentrant
checkpointing fires the same hooks) work with this engine as with DDP.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from .comm_choice import DEFAULT_BUCKET_BYTES  # the launcher's default too, read without torch

__all__ = ["GradientSync", "Bucket", "DEFAULT_BUCKET_BYTES", "allreduce_sum", "summed", "ring_bytes_sent",
           "bucket_layout"]


CommHook = Callable[[Any, "Bucket"], "torch.futures.Future[torch.Tensor]"]


class Bucket:
    """One flat buffer of gradients, with the methods of `torch.distributed.GradBucket` that comm hooks call."""

    def __init__(self, index: int, count: int, params: list[torch.nn.Parameter]) -> None:
        self._index, self._count = index, count
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        first = params[0]
        self.flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)]
        self.pending = len(params)
        self.future: Any = None

    # -- torch.distributed.GradBucket's interface (what DDP communication hooks use) --------------
    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def gradients(self) -> list[torch.Tensor]:
        return list(self.views)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self.flat.copy_(tensor)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def allreduce_sum(group: Any, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """The default hook: the bucket summed over the group, in place (asynchronous)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def summed(hook: CommHook, size: int) -> CommHook:
    """An averaging DDP comm hook (torch's return the mean over `size` members) as a summing one."""
    def summing(state: Any, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket).then(lambda fut: fut.value().mul_(size))
    return summing


def ring_bytes_sent(numel: int, element_size: int, size: int, position: int) -> int:
    """Bytes member `position` of `size` sends in a ring all-reduce of `numel` elements (see the docstring)."""
    if size < 2:
        return 0
    base, extra = divmod(numel, size)
    chunk = [base + (1 if i < extra else 0) for i in range(size)]
    return (2 * numel - chunk[(position + 1) % size] - chunk[(position + 2) % size]) * element_size


def bucket_layout(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Indices of `params` per bucket: in order, one dtype and device a bucket, at most `bucket_bytes`
    each (a larger parameter alone; as DDP assigns them), buckets in the order of their first parameter."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        key = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        members, used = open_.get(key, ([], 0))
        if members and used + size > bucket_bytes:
            out.append(members)
            members, used = [], 0
        open_[key] = (members + [i], used + size)
    out.extend(members for members, _ in open_.values() if members)
    return sorted(out, key=lambda b: b[0])


class GradientSync:
    """Sums the gradients of `params` over `group` (R = `size` members; this one at `position`).

    `users[task]`: the parameters task `task`'s program uses (a parameter is
    final after the last backward of its last user on this rank); `late`:
    parameters made ready only by `ready()` (a remote tied weight's owner).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: Any, *, size: int, position: int,
                 users: Mapping[str, Collection[torch.nn.Parameter]], late: Collection[torch.nn.Parameter] = (),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, hook: CommHook | None = None,
                 hook_state: Any = None, wire: Callable[[Bucket], list[int]] | None = None) -> None:
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter is listed twice")
        self.group, self.size, self.position = group, size, position
        self.hook = hook or allreduce_sum
        self.hook_state = group if hook is None else hook_state
        self.wire = wire  # elements of each all-reduce the hook runs for a bucket (None: the bucket)
        layout = bucket_layout(self.params, bucket_bytes)
        self.buckets = [Bucket(i, len(layout), [self.params[j] for j in members])
                        for i, members in enumerate(layout)]
        self._where = {id(p): (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        mine = {id(p) for p in self.params}
        self._late = {id(p) for p in late if id(p) in mine}
        self._users = {task: {id(p) for p in ps if id(p) in mine} for task, ps in users.items()}
        self._user_count = {id(p): 0 for p in self.params}
        for keys in self._users.values():
            for key in keys:
                self._user_count[key] += 1
        self.bytes_sent = 0
        self.wait_s = 0.0  # seconds finish() waited for the all-reduce (what the backward did not hide)
        self._armed = False
        self._current: str | None = None
        self._left: dict[int, int] = {}
        self._ready: set[int] = set()
        self._touched: set[int] = set()
        self._next = 0
        self._round_bytes = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def close(self) -> None:
        """Remove the hooks (the parameters keep working without a sync)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def launched(self) -> int:
        """Buckets of the current round already handed to the collective."""
        return self._next

    @property
    def grad_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def begin(self) -> None:
        """Before a training round: empty buckets, each parameter's .grad a view into its bucket."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.pending = len(bucket.params)
            bucket.future = None
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
        self._left = dict(self._user_count)
        self._ready.clear()
        self._touched.clear()
        self._next = 0
        self._armed = True

    @contextlib.contextmanager
    def last_backward(self, task: str) -> Iterator[None]:
        """Around the backward of task `task`'s last micro-batch: the gradients its hooks see are final when
        no later task of this rank uses them."""
        self._current = task
        try:
            yield
        finally:
            self._current = None
        for key in self._users.get(task, ()):
            self._left[key] -= 1
            if self._left[key] == 0 and key not in self._late:
                self._mark(key)

    def ready(self, param: torch.nn.Parameter) -> None:
        """A late parameter's gradient is complete (its tied replica's gradient was added)."""
        key = id(param)
        if self._armed and key in self._where:
            self._touched.add(key)
            self._mark(key)

    def finish(self) -> int:
        """Launch what is left, wait for every bucket; the gradients are the group's sums.  Returns the bytes
        this member sent for the round (the ring formula)."""
        if not self._armed:
            return 0
        for key in list(self._where):
            self._mark(key)
        start = time.perf_counter()
        for bucket in self.buckets:
            result = bucket.future.wait()
            if isinstance(result, torch.Tensor) and result.data_ptr() != bucket.flat.data_ptr():
                bucket.flat.copy_(result)
        self.wait_s += time.perf_counter() - start
        self._armed = False
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                if view.numel() and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                    raise RuntimeError(f"a gradient of shape {tuple(p.shape)} was replaced during the round "
                                       f"instead of accumulated into its bucket (a bug in vgraph)")
                if id(p) not in self._touched:
                    p.grad = None  # no gradient reached it on any replica (they run the same program)
        sent, self._round_bytes = self._round_bytes, 0
        return sent

    # -- internals ----------------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        key = id(param)
        self._touched.add(key)
        if (self._current is not None and self._left.get(key) == 1 and key not in self._late
                and key in self._users.get(self._current, ())):
            self._mark(key)

    def _mark(self, key: int) -> None:
        if key in self._ready:
            return
        self._ready.add(key)
        bucket, _ = self._where[key]
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    @property
    def layout(self) -> list[int]:
        """Elements per bucket (what a compression hook's state is keyed by)."""
        return [b.flat.numel() for b in self.buckets]

    def _launch(self, bucket: Bucket) -> None:
        numels = self.wire(bucket) if self.wire is not None else [bucket.flat.numel()]  # before the hook runs
        bucket.future = self.hook(self.hook_state, bucket)
        sent = sum(ring_bytes_sent(n, bucket.flat.element_size(), self.size, self.position) for n in numels)
        self.bytes_sent += sent
        self._round_bytes += sent
