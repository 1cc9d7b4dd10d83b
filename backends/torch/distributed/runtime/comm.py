"""Point-to-point tensor transport between the workers of a partitioned run (torch.distributed).

A `Transport` carries one round (a training step's messages, a validation
batch's, a weight sync) at a time.  `begin(expected)` tells it, per peer, the
messages that peer will send this round in its sending order (from
`plan.message_order`) with their shapes and dtypes.  Then:

* `send(dst, message, tensor)` posts a non-blocking `isend`; the tensor is
  kept alive until `end()` waits for every send of the round.
* `recv(src, message)` returns that message's tensor, receiving the peer's
  earlier messages first (in their order) and buffering them, so the
  receiver may consume messages in any order the schedule needs while the
  wire sees exactly the sender's order.

The next `PREPOSTED` messages from each peer always have a receive posted
(`irecv`), from `begin()` on.  gloo moves a message only once its receiver
has posted the matching receive (a rendezvous: the sender announces it, the
receiver answers "ready", then the bytes go), so a message the receiver had
not asked for yet waited for the receiver to reach it, plus the answer's trip
back, which queues behind whatever the receiver is sending on its own uplink.
On the testbed at 20 Mbit/s (tb-medium, 2-stage pipeline, 64 KiB messages)
a message sent behind another arrived 20-28 ms later than the link allows,
with and without a CPU quota, while raw TCP, both ways at once, and a message
whose receive was already posted, arrived on time (docs/benchmarks-history.md): the cost
model's pipelines (a message leaves when its op ends) were 0.71x the measured
step.  Two posted per peer cover a message queued behind one in flight; more
would hold more of a round's activations in receive buffers at once.  Only over
gloo: nccl runs a pair's sends and receives in order on one stream, so two
peers each receiving ahead before they send would wait for each other forever;
over nccl a receive is posted when it is needed, as before.

Bytes sent to other ranks are counted (`bytes_sent`), for comparison with the
partition's prediction, and the seconds spent blocked on peers (`wait_s`: a
receive waiting for its message, the end of a round waiting for its sends),
which is a pipeline's bubble as the PNode lives it (`vgraph report`, TensorBoard).  With `stage_through_cpu` (CUDA tensors over gloo,
when several workers share one GPU) tensors go through host memory.

`ControlGroup` carries the small collectives every rank joins on the control
group: the per-step reduction every decision rests on, and the objects rank 0
gathers or scatters (rank_zero.py).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["Transport", "TransportError", "ControlGroup", "PREPOSTED"]

PREPOSTED = 2  # receives kept posted ahead per peer (see the module docstring)


class TransportError(RuntimeError):
    """The peers disagree about a round's messages (a bug, never a user's mistake)."""


class Transport:
    def __init__(self, device: torch.device, *, group: Any = None, stage_through_cpu: bool = False,
                 offset: int = 0) -> None:
        self.device = device
        self.group = group
        self.offset = offset  # a replica's ranks are plan ranks + offset in the world (launch with replicas)
        self.stage = stage_through_cpu
        self.bytes_sent = 0
        self.wait_s = 0.0  # seconds blocked on peers (receives, send completions)
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._expected: dict[int, Sequence[tuple[Hashable, tuple[int, ...], torch.dtype]]] = {}
        self._position: dict[int, int] = {}  # per peer: how many of its messages have a receive posted
        self._buffer: dict[int, dict[Hashable, torch.Tensor]] = {}
        self._posted: dict[int, deque[tuple[Hashable, torch.Tensor, Any]]] = {}
        self._ahead = PREPOSTED if dist.get_backend(group) == "gloo" else 0  # see the module docstring

    def begin(self, expected: Mapping[int, Sequence[tuple[Hashable, tuple[int, ...], torch.dtype]]]) -> None:
        """Start a round: `expected[src]` = (message, shape, dtype) src will send, in order.  Over gloo the
        first PREPOSTED of each peer's get a receive posted now."""
        self._expected = dict(expected)
        self._position = {src: 0 for src in self._expected}
        self._buffer = {src: {} for src in self._expected}
        self._posted = {src: deque() for src in self._expected}
        for src in self._expected:
            self._post(src, self._ahead)

    def _post(self, src: int, outstanding: int) -> None:
        """Post receives for src's next messages until `outstanding` are posted (or none is left)."""
        queue, posted = self._expected[src], self._posted[src]
        while len(posted) < outstanding and self._position[src] < len(queue):
            key, shape, dtype = queue[self._position[src]]
            self._position[src] += 1
            tensor = torch.empty(shape, dtype=dtype, device=torch.device("cpu") if self.stage else self.device)
            posted.append((key, tensor, dist.irecv(tensor, src + self.offset, group=self.group)))

    def send(self, dst: int, message: Hashable, tensor: torch.Tensor) -> None:
        wire = tensor.detach()
        if self.stage and wire.device.type != "cpu":
            wire = wire.cpu()
        wire = wire.contiguous()
        work = dist.isend(wire, dst + self.offset, group=self.group)
        self._pending.append((work, wire))
        self.bytes_sent += wire.numel() * wire.element_size()

    def recv(self, src: int, message: Hashable) -> torch.Tensor:
        buffer = self._buffer.get(src)
        if buffer is None:
            raise TransportError(f"no messages from rank {src} are expected this round (wanted {message})")
        while message not in buffer:
            posted = self._posted[src]
            self._post(src, 1)
            if not posted:
                raise TransportError(f"rank {src} sends no {message} this round")
            key, tensor, work = posted.popleft()
            start = time.perf_counter()
            work.wait()
            self.wait_s += time.perf_counter() - start
            buffer[key] = tensor.to(self.device) if self.stage else tensor
            self._post(src, self._ahead)
        return buffer.pop(message)

    def end(self) -> None:
        """Wait for this round's sends; every expected message must have been read."""
        start = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self.wait_s += time.perf_counter() - start
        self._pending.clear()
        for src, queue in self._expected.items():
            if self._position[src] != len(queue) or self._posted[src] or self._buffer[src]:
                left = ([k for k, _, _ in self._posted[src]] + [k for k, _, _ in queue[self._position[src]:]]
                        + list(self._buffer[src]))
                raise TransportError(f"round ended with messages from rank {src} unread: {left[:4]}")


class ControlGroup:
    """Small collectives on the control group (gloo), for decisions every rank must take alike and for
    objects rank 0 gathers (metrics, checkpoint shares) or scatters (resume shares).

    A world of one rank (a one-PNode launch) answers locally: the same values, the objects themselves
    (nothing crosses a process, so nothing is pickled).  Through gloo the step's two calls cost an
    instrumented one-host tb-small worker 1.25 ms of a 26 ms step (gather_object alone 0.88 ms: it pickles,
    exchanges sizes, then the bytes), time no cost model priced and no rank needed; so a worker now gathers
    only at sync points, about once a second unless --log-every asks otherwise (worker.py)."""

    def __init__(self, rank: int, world: int, group: Any = None) -> None:
        self.rank, self.world, self.group = rank, world, group

    def all_reduce(self, values: Sequence[float]) -> list[float]:
        """Elementwise sums over all ranks (float64)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (in rank order); None elsewhere."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank r's element of rank 0's `objs`."""
        if self.world == 1:
            if objs is None or len(objs) != 1:
                raise ValueError(f"a world of one scatters a list of one object, got {objs!r:.80}")
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs, src=0, group=self.group)
        return out[0]
