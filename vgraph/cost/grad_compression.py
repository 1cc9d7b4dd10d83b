"""What gradient compression does to a step's bytes, FLOPs and memory: the replicas' PowerSGD all-reduce.

Two kinds of compression trade a little compute for a lot of link time on the
slow links volunteer PNodes sit behind:

* **Cut edges** (`compress` VNodes, vgraph/ops/boundary.py): the cost model
  prices an edge leaving a `compress` VNode in its wire format (costmodel.py);
  `partition{compress=auto}` prices plans as if every cut edge had one
  (passes/partition_compress.py).
* **The replicas' gradient all-reduce** (`vgraph launch --grad-compress`):
  PowerSGD (Vogels et al., NeurIPS 2019) as torch implements it
  (`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`): every
  gradient is viewed as a matrix of its first dimension's rows (n x m); one
  worth compressing (`(n + m) r * min_rate < n m`, r = min(n, m, rank), the
  hook's `_should_compress`) is all-reduced as two factors, P (n x r) and
  Q (m x r); every other gradient (biases, norms, small matrices) is
  all-reduced whole.  The first `start` steps run a plain all-reduce (torch
  needs two when error feedback or warm start is on).  So a stage all-reduces
  `allreduce_numel` elements a step instead of all its gradients, in three
  rounds (the rest, P, Q), and computes P = M Q, Q = M^T P, M' = P Q^T and two
  orthogonalisations (`powersgd_flops`); error feedback keeps one
  gradient-sized buffer (`ef_bytes`).

Why here and not in the backend: the partitioner and `placement.json` price
plans without torch, and the workers' byte counts must equal these numbers
(tests compare them).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from math import prod
from typing import Iterable, Sequence

import numpy as np

__all__ = ["GradCompression", "NO_GRAD_COMPRESSION", "parse_grad_compress", "allreduce_numel", "powersgd_flops",
           "per_node", "ef_and_factor_bytes", "MAX_RANK"]

MAX_RANK = 4096  # beyond it no layer vgraph trains is compressed at all (n m > (n + m) r * 2 needs r < min(n, m) / 2)
MAX_START = 10**9
_KINDS = ("none", "powersgd")


@dataclass(frozen=True)
class GradCompression:
    """How the replicas' gradients are all-reduced: `none`, or PowerSGD of `rank` after `start` plain steps."""

    kind: str = "none"
    rank: int = 4
    start: int = 2
    min_rate: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def text(self) -> str:
        if not self.enabled:
            return "none"
        # ';' between options, so that the text is one option value of a pipeline (partition{grad_compress=...})
        return f"powersgd:rank={self.rank};start={self.start}" + (
            f";min_rate={self.min_rate!r}" if self.min_rate != 2.0 else "")

    def compressed(self, n: int, m: int) -> bool:
        """Whether an n x m gradient travels as factors (torch's `_should_compress`)."""
        r = min(n, m, self.rank)
        return (n + m) * r * self.min_rate < n * m


NO_GRAD_COMPRESSION = GradCompression()


def parse_grad_compress(text: object) -> GradCompression:
    """'none' | 'powersgd' | 'powersgd:rank=R[,start=N][,min_rate=X]' (',' or ';' between options) -> the
    spec; ValueError says why not."""
    if isinstance(text, GradCompression):
        return text
    if text is None:
        return NO_GRAD_COMPRESSION
    if not isinstance(text, str):
        raise ValueError(f"expected none or powersgd[:rank=R,start=N], got {type(text).__name__} {text!r:.40}")
    body = text.strip()
    if not body or not body.isprintable():
        raise ValueError("expected none or powersgd[:rank=R,start=N], got an empty or unprintable value")
    kind, _, rest = body.partition(":")
    kind = kind.strip().lower()
    if kind not in _KINDS:
        raise ValueError(f"unknown gradient compression {kind[:40]!r}: one of none, powersgd[:rank=R,start=N]")
    if kind == "none":
        if rest.strip():
            raise ValueError("'none' takes no options")
        return NO_GRAD_COMPRESSION
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in re.split(r"[,;]", rest))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not re.fullmatch(r"[a-z_]+", key):
            raise ValueError(f"powersgd option {item[:40]!r} is not key=value")
        if key in values:
            raise ValueError(f"powersgd option {key!r} is given twice")
        values[key] = _option(key, value)
    return GradCompression("powersgd", **values)  # type: ignore[arg-type]


def _option(key: str, value: str) -> int | float:
    if key in ("rank", "start"):
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"powersgd {key}={value[:40]!r} is not a whole number") from None
        low, high = (1, MAX_RANK) if key == "rank" else (2, MAX_START)
        if not low <= number <= high:
            why = ("error feedback and warm start need 2 plain steps first (torch's PowerSGD)" if key == "start"
                   else f"a rank above {MAX_RANK} compresses no layer")
            raise ValueError(f"powersgd {key}={value[:40]} must be from {low} to {high} ({why})")
        return number
    if key == "min_rate":
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"powersgd min_rate={value[:40]!r} is not a number") from None
        if not math.isfinite(rate) or not 0 < rate <= 1e6:
            raise ValueError(f"powersgd min_rate={value[:40]} must be a finite number above 0")
        return rate
    raise ValueError(f"unknown powersgd option {key[:40]!r}: rank, start or min_rate")


def _matrix(shape: Sequence[int]) -> tuple[int, int]:
    """A gradient as the hook sees it: `tensor.view(shape[0], -1)`."""
    if not shape:
        return 1, 1
    n = int(shape[0])
    return n, (prod(shape) // n if n else 0)


def allreduce_numel(shapes: Iterable[Sequence[int]], spec: GradCompression) -> tuple[int, int, int]:
    """(elements all-reduced whole, elements of P, elements of Q) for gradients of these shapes."""
    whole = p = q = 0
    for shape in shapes:
        n, m = _matrix(shape)
        if spec.enabled and spec.compressed(n, m):
            r = min(n, m, spec.rank)
            p += n * r
            q += m * r
        else:
            whole += n * m
    return whole, p, q


def powersgd_flops(shapes: Iterable[Sequence[int]], spec: GradCompression) -> int:
    """FLOPs of one PowerSGD round over gradients of these shapes (three products and two Gram-Schmidts of
    the factors; the error feedback's add and subtract over every element)."""
    if not spec.enabled:
        return 0
    total = 0
    for shape in shapes:
        n, m = _matrix(shape)
        total += 2 * n * m
        if spec.compressed(n, m):
            r = min(n, m, spec.rank)
            total += 3 * 2 * n * m * r + 2 * (n + m) * r * r
    return total


def ef_and_factor_bytes(shapes: Iterable[Sequence[int]], spec: GradCompression, element: int) -> int:
    """Memory PowerSGD keeps: the error-feedback buffer (every gradient) and the P, Q factors (warm start)."""
    if not spec.enabled:
        return 0
    shapes = list(shapes)
    _, p, q = allreduce_numel(shapes, spec)
    return (sum(prod(s) for s in shapes) + p + q) * element


def per_node(shapes_column: Sequence[Sequence[Sequence[int]]], grad_bytes: np.ndarray, params: np.ndarray,
             spec: GradCompression) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per VNode: gradient bytes all-reduced, PowerSGD FLOPs, extra memory (columns for the step cost)."""
    n = len(shapes_column)
    reduced, flops, memory = np.array(grad_bytes, dtype=float), np.zeros(n), np.zeros(n)
    if not spec.enabled:
        return reduced, flops, memory
    for i, shapes in enumerate(shapes_column):
        if not shapes or not params[i]:
            continue
        element = grad_bytes[i] / params[i]
        reduced[i] = sum(allreduce_numel(shapes, spec)) * element
        flops[i] = powersgd_flops(shapes, spec)
        memory[i] = ef_and_factor_bytes(shapes, spec, int(element))
    return reduced, flops, memory
