"""Sampling a batch of prompts: the loop `vgraph generate` runs, its KV cache on the torch backend, and the
prefill / decode speeds it reports.

Why a module of its own: the loop is shared by every way of computing logits (the torch decode program,
the recomputed window, onnxruntime), and the cache's bookkeeping (left padding, positions, the attention
mask, rows that finished) is more than the command line should hold.

The contract every way keeps is the reference's: the next token of a sequence is drawn from the logits at
the last position of its context, the last `context` tokens (the network's seq_len), computed as if that
context were run at once.  While a sequence fits, `CachedLogits` runs each new token against the cached
keys and values of the ones before; once it outgrows the context the window slides (the last `context`
tokens, positions from 0 again), which no cache can extend, so every further token recomputes its window:
exactly the tokens of the recomputing reference, at its speed.  `vgraph generate` says so when it happens.

A batch of prompts is left-padded to its longest: a row's positions start at 0 at its first real token and
the attention mask hides the padding, so each row's logits are those of its prompt alone (up to the
rounding of a differently shaped matmul).  Each row draws from its own generator seeded with the same seed,
so a prompt's tokens in a batch are those of its own single-prompt run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from vgraph.base.diagnostics import VGraphError

from .lowering.decode import ATTENTION_MASK, POSITION_IDS, past_names, present_names

__all__ = ["Speeds", "BatchLogits", "CachedLogits", "WindowLogits", "sample_batch", "draw"]


@dataclass
class Speeds:
    """Positions computed and seconds spent: prefill (the prompts' first logits) and decode (each next token)."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def line(self) -> str:
        def rate(tokens: int, seconds: float) -> str:
            return f"{tokens / seconds:,.1f} tokens/s" if seconds > 0 else "-"

        return (f"prefill {self.prefill_tokens:,} tokens in {self.prefill_s:.3f} s "
                f"({rate(self.prefill_tokens, self.prefill_s)}); decode {self.decode_tokens:,} tokens in "
                f"{self.decode_s:.3f} s ({rate(self.decode_tokens, self.decode_s)})")


class BatchLogits(Protocol):
    """Last-position logits ``[rows, vocab]`` (float32, CPU) of a batch of sequences."""

    def start(self, windows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Forget everything; the logits of these contexts (1 up to the context length tokens each)."""

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token to each row; the logits after it."""

    def keep(self, rows: Sequence[int]) -> None:
        """Go on with these rows only (indices into the current batch, in order)."""


class WindowLogits:
    """A `BatchLogits` from a function of one context (the recomputed window, onnxruntime's decoder)."""

    def __init__(self, next_logits: Callable[[list[int]], torch.Tensor]) -> None:
        self.next_logits = next_logits
        self.rows: list[list[int]] = []

    def start(self, windows: Sequence[Sequence[int]]) -> torch.Tensor:
        self.rows = [list(w) for w in windows]
        return torch.stack([self.next_logits(row) for row in self.rows])

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        for row, token in zip(self.rows, tokens):
            row.append(int(token))
        return torch.stack([self.next_logits(row) for row in self.rows])

    def keep(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in rows]


class CachedLogits:
    """A `BatchLogits` through the module's decode program (lowering/decode.py): the prompts once, then
    one position per row against the cache."""

    def __init__(self, module, token_feed: str, output: str, pad: int) -> None:
        self.module, self.token_feed, self.output, self.pad = module, token_feed, output, int(pad)
        self.device = next(module.parameters()).device
        self.dtype = next(module.parameters()).dtype
        graph = module.network
        from .lowering.ops import get_lowering

        self.caches = {node_id: get_lowering(graph.node(node_id)).caches_for(graph.node(node_id))
                       for node_id in module.decode_caches((output,))}  # refuses an undecodable network
        self.past: dict[str, torch.Tensor] = {}
        self.mask = torch.zeros(0, 0, dtype=torch.int64)
        self.lengths = torch.zeros(0, dtype=torch.int64)

    def start(self, windows: Sequence[Sequence[int]]) -> torch.Tensor:
        rows, longest = len(windows), max(len(w) for w in windows)
        ids = torch.full((rows, longest), self.pad, dtype=torch.int64)
        self.mask = torch.zeros(rows, longest, dtype=torch.int64)
        positions = torch.zeros(rows, longest, dtype=torch.int64)
        for r, window in enumerate(windows):  # left padding: the last column is every row's last token
            ids[r, longest - len(window):] = torch.as_tensor(list(window), dtype=torch.int64)
            self.mask[r, longest - len(window):] = 1
            positions[r, longest - len(window):] = torch.arange(len(window))
        self.lengths = torch.as_tensor([len(w) for w in windows], dtype=torch.int64)
        self.past = {}
        for node_id, shape in self.caches.items():
            for name in past_names(node_id):
                self.past[name] = torch.zeros((rows, *shape), dtype=self.dtype, device=self.device)
        return self._run(ids, positions)

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.int64).unsqueeze(1)
        positions = self.lengths.unsqueeze(1).clone()
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.int64)], dim=1)
        self.lengths = self.lengths + 1
        return self._run(ids, positions)

    def keep(self, rows: Sequence[int]) -> None:
        index = torch.as_tensor(list(rows), dtype=torch.int64)
        self.past = {name: t.index_select(0, index.to(t.device)) for name, t in self.past.items()}
        self.mask, self.lengths = self.mask.index_select(0, index), self.lengths.index_select(0, index)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        feeds = {self.token_feed: ids.to(self.device), POSITION_IDS: positions.to(self.device),
                 ATTENTION_MASK: self.mask.to(self.device), **self.past}
        with torch.no_grad():
            results = self.module(feeds, want=(self.output,), decode=True)
        for node_id in self.caches:
            for past, present in zip(past_names(node_id), present_names(node_id)):
                self.past[past] = results[present]
        return results[self.output][:, -1].float().cpu()


def draw(last: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """The next token from last-position logits: argmax at temperature 0, else top-k sampling."""
    if temperature == 0:
        return int(last.argmax())
    last = (last - last.max()) / temperature  # the largest is 0, not inf/inf = NaN, however small T is
    if 0 < top_k < last.numel():
        threshold = torch.topk(last, top_k).values[-1]
        last = last.masked_fill(last < threshold, float("-inf"))
    return int(torch.multinomial(torch.softmax(last, dim=-1), 1, generator=generator))


def sample_batch(logits: BatchLogits, prompts: Sequence[Sequence[int]], *, context: int, max_new_tokens: int,
                 temperature: float, top_k: int, seed: int, eot: int | None, speeds: Speeds,
                 on_slide: Callable[[int], None] | None = None) -> list[list[int]]:
    """Each prompt followed by up to `max_new_tokens` drawn tokens (a row stops at end-of-text).

    `on_slide(length)` is called once, when the first row outgrows the context (see the module docstring).
    """
    if any(not 1 <= len(p) <= context for p in prompts):
        raise VGraphError(f"a prompt holds 1 to {context} tokens (the network's context)")
    rows = [list(map(int, p)) for p in prompts]
    if max_new_tokens == 0 or not rows:
        return rows
    generators = [torch.Generator(device="cpu").manual_seed(seed) for _ in rows]
    active = list(range(len(rows)))
    start = time.perf_counter()
    last = logits.start(rows)
    speeds.prefill_tokens += sum(len(r) for r in rows)
    speeds.prefill_s += time.perf_counter() - start
    slid = False
    for new in range(max_new_tokens):
        going = []
        for k, i in enumerate(active):
            token = draw(last[k], temperature, top_k, generators[i])
            if token != eot:
                rows[i].append(token)
                going.append(k)
        if new == max_new_tokens - 1 or not going:
            break
        if len(going) < len(active):
            logits.keep(going)
            active = [active[k] for k in going]
        start = time.perf_counter()
        if any(len(rows[i]) > context for i in active):
            if not slid and on_slide is not None:
                on_slide(max(len(rows[i]) for i in active))
            slid = True
            last = logits.start([rows[i][-context:] for i in active])
        else:
            last = logits.extend([rows[i][-1] for i in active])
        speeds.decode_tokens += len(active)
        speeds.decode_s += time.perf_counter() - start
    return rows
