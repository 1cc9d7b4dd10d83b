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
from typing import Any, Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["Transport", "TransportError", "ControlGroup"]


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
        self._position: dict[int, int] = {}
        self._buffer: dict[int, dict[Hashable, torch.Tensor]] = {}

    def begin(self, expected: Mapping[int, Sequence[tuple[Hashable, tuple[int, ...], torch.dtype]]]) -> None:
        """Start a round: `expected[src]` = (message, shape, dtype) src will send, in order."""
        self._expected = dict(expected)
        self._position = {src: 0 for src in self._expected}
        self._buffer = {src: {} for src in self._expected}

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
            pos = self._position[src]
            queue = self._expected[src]
            if pos >= len(queue):
                raise TransportError(f"rank {src} sends no {message} this round")
            key, shape, dtype = queue[pos]
            self._position[src] = pos + 1
            device = torch.device("cpu") if self.stage else self.device
            tensor = torch.empty(shape, dtype=dtype, device=device)
            start = time.perf_counter()
            dist.recv(tensor, src + self.offset, group=self.group)
            self.wait_s += time.perf_counter() - start
            buffer[key] = tensor.to(self.device) if self.stage else tensor
        return buffer.pop(message)

    def end(self) -> None:
        """Wait for this round's sends; every expected message must have been read."""
        start = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self.wait_s += time.perf_counter() - start
        self._pending.clear()
        for src, queue in self._expected.items():
            if self._position[src] != len(queue) or self._buffer[src]:
                left = [k for k, _, _ in queue[self._position[src]:]] + list(self._buffer[src])
                raise TransportError(f"round ended with messages from rank {src} unread: {left[:4]}")


class ControlGroup:
    """Small collectives on the control group (gloo), for decisions every rank must take alike and for
    objects rank 0 gathers (metrics, checkpoint shares) or scatters (resume shares)."""

    def __init__(self, rank: int, world: int, group: Any = None) -> None:
        self.rank, self.world, self.group = rank, world, group

    def all_reduce(self, values: Sequence[float]) -> list[float]:
        """Elementwise sums over all ranks (float64)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (in rank order); None elsewhere."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank r's element of rank 0's `objs`."""
        out = [None]
        dist.scatter_object_list(out, objs, src=0, group=self.group)
        return out[0]
