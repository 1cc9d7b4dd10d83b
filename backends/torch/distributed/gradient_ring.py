"""The gradient all-reduce of data-parallel replicas: a ring over point-to-point sends, bytes counted.

With R replicas, stage s of every replica holds the same parameters; after
the backward pass the R workers of stage s sum their gradients (each replica's
loss is already weighted by its share of the global batch, so the sum is the
gradient of the global batch's loss).  The ring all-reduce: the flattened
gradients are cut into R chunks; in R - 1 reduce-scatter steps every member
sends one chunk to the next member and adds the chunk it receives from the
previous one, so each member ends up owning one fully summed chunk; in R - 1
all-gather steps the summed chunks travel once round the ring.  Every member
sends 2 (R - 1) chunks, the group 2 (R - 1) x the gradients in all: exactly
what the step cost model predicts (`vgraph.stepcost.ring_allreduce_bytes`),
and what `bytes_sent` counts, so a run's measured traffic can be compared
with placement.json's `bytes_per_step`.

Done by hand on isend/recv rather than `dist.all_reduce` so that the bytes
on the wire are the ones counted and the algorithm is the one priced; every
member ends with the owner's copy of each chunk, so replicas stay bit-identical.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["GradientRing"]


class GradientRing:
    """One stage group: `members` (world ranks, in replica order); this worker is `members[position]`."""

    def __init__(self, members: Sequence[int], position: int) -> None:
        self.members = list(members)
        self.position = position
        self.bytes_sent = 0
        self.wait_s = 0.0  # seconds blocked on the ring's neighbours (idle time, like Transport.wait_s)

    @property
    def size(self) -> int:
        return len(self.members)

    def all_reduce(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the group, in place (a missing gradient counts as zeros)."""
        R = self.size
        if R == 1 or not params:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._ring(flat)
            offset = 0
            for p in group:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n

    def _ring(self, flat: torch.Tensor) -> None:
        R, me = self.size, self.position
        send_to = self.members[(me + 1) % R]
        recv_from = self.members[(me - 1) % R]
        chunks = list(torch.tensor_split(flat, R))
        wire = flat.device.type != "cpu" and dist.get_backend() == "gloo"
        for k in range(R - 1):  # reduce-scatter: chunk (me - k) goes on, chunk (me - k - 1) comes in and adds
            out, into = (me - k) % R, (me - k - 1) % R
            incoming = self._exchange(chunks[out], chunks[into], send_to, recv_from, wire)
            chunks[into].add_(incoming)
        for k in range(R - 1):  # all-gather: the summed chunk (me + 1 - k) goes on, (me - k) comes in
            out, into = (me + 1 - k) % R, (me - k) % R
            incoming = self._exchange(chunks[out], chunks[into], send_to, recv_from, wire)
            chunks[into].copy_(incoming)

    def _exchange(self, out: torch.Tensor, like: torch.Tensor, dst: int, src: int, through_cpu: bool
                  ) -> torch.Tensor:
        payload = out.detach().contiguous()
        if through_cpu:
            payload = payload.cpu()
        work = dist.isend(payload, dst)
        incoming = torch.empty_like(like, device=payload.device)
        start = time.perf_counter()
        dist.recv(incoming, src)
        work.wait()
        self.wait_s += time.perf_counter() - start
        self.bytes_sent += payload.numel() * payload.element_size()
        return incoming.to(like.device)
