"""The baseline of bench_grad_sync.py: vgraph's former home-made gradient ring, kept here only to be measured.

Until issue 25, `vgraph launch` summed the replicas' gradients with this
ring: every gradient flattened with `torch.cat`, a ring of blocking
isend/recv (R - 1 reduce-scatter and R - 1 all-gather steps, one chunk at a
time), each gradient cloned back, all after the whole backward.  The
runtime now uses torch's collectives in buckets overlapped with backward
(backends/torch/distributed/runtime/grad_sync.py); this copy lets the benchmark put
the old figure beside the new one in the same run.  Unchanged from the
runtime's last version except this docstring.
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
