"""A trained (or imported) run as a plain language model: `load_model` and `vgraph eval`.

    from vgraph.backends.torch import load_model
    model = load_model("runs/gpt2")            # a run directory (its latest checkpoint) or a checkpoint
    logits = model(input_ids)                  # [B, T] int64 -> [B, T, vocab], T <= the network's seq_len

Why a module of its own: the compiled `VGraphModule` takes a dict of named feeds and returns a dict, which is
what the training loop and the distributed workers need; a user comparing against another framework, or
scoring text, wants `forward(input_ids) -> logits`.  `CausalLM` is that view of the same module, in eval
mode (no dropout).  A sequence shorter than the network's runs as is: every op of a causal language model
reads only earlier positions, so its logits equal those of the sequence padded to the full length.

`vgraph eval RUN (--data DIR | --token-ids FILE.npy) [--json]` scores token ids with it: the mean next-token
cross-entropy (nats) over every predicted token, and its exponential, the perplexity.  A sequence longer
than the network's context is cut into windows of seq_len + 1 tokens overlapping by one, so every token but
the first is predicted exactly once; a prepared corpus is scored on its validation split, windows as
`vgraph train` validates.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from vgraph.base.diagnostics import VGraphError, printable, quote
from vgraph.base.safeio import read_input

__all__ = ["CausalLM", "load_model", "logits_output", "evaluate", "token_file_windows", "corpus_windows"]

MAX_TOKEN_FILE_BYTES = 2**32  # 4 GiB of ids (512M int64 tokens), read whole: larger is not an evaluation set


class CausalLM(nn.Module):
    """`forward(input_ids [B, T]) -> logits [B, T, vocab]` over a compiled network (see the module docstring)."""

    def __init__(self, module: nn.Module, graph, tokenizer=None) -> None:
        super().__init__()
        self.network = module
        self.graph = graph
        self.tokenizer = tokenizer
        embedder = graph.nodes_of_type("embedder")[0]
        self.seq_len = int(embedder.cfg["seq_len"])
        self.vocab_size = int(embedder.cfg["vocab_size"])
        self.output = logits_output(graph)
        self.token_feed = f"{embedder.id}:in0"
        needed = set(module.feeds_needed((self.output,)))
        if needed != {self.token_feed}:
            raise VGraphError(f"network {graph.name!r}: output {self.output!r} needs inputs besides token ids "
                              f"({', '.join(sorted(needed))})")
        self.eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be [batch, seq] integers; got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        if not 1 <= input_ids.shape[1] <= self.seq_len:
            raise ValueError(f"input_ids have {input_ids.shape[1]} positions; the network takes 1 to {self.seq_len}")
        device = next(self.network.parameters()).device
        return self.network({self.token_feed: input_ids.to(device, torch.int64)}, want=(self.output,))[self.output]


def logits_output(graph) -> str:
    """The network output holding next-token logits: 'logits', else the only [S, vocab] output."""
    names = [ep.name for ep in graph.outputs]
    if "logits" in names:
        return "logits"
    vocab = int(graph.nodes_of_type("embedder")[0].cfg["vocab_size"])
    candidates = [ep.name for ep in graph.outputs
                  if graph.node(ep.node).outputs and graph.node(ep.node).outputs[ep.slot].shape[-1:] == (vocab,)]
    if len(candidates) != 1:
        raise VGraphError(f"network {graph.name!r}: cannot tell which output holds the logits "
                          f"(outputs: {', '.join(names) or 'none'}); name it 'logits'")
    return candidates[0]


def load_model(path: str | Path, *, device: str | None = None) -> CausalLM:
    """The language model of a run directory (its latest checkpoint) or a checkpoint, in eval mode."""
    from .training.train import load_trained

    module, tokenizer, graph = load_trained(path, device=device)
    return CausalLM(module, graph, tokenizer)


# -- vgraph eval -----------------------------------------------------------------------------------------


def evaluate(model: CausalLM, windows: Iterable[torch.Tensor], *, batch: int = 8) -> tuple[float, int]:
    """(mean next-token cross-entropy, tokens predicted) of `windows` (1-D id tensors of 2 to seq_len + 1
    tokens), summed in float64."""
    total, count = 0.0, 0
    pending: list[torch.Tensor] = []

    def flush() -> None:
        nonlocal total, count
        by_len: dict[int, list[torch.Tensor]] = {}
        for w in pending:
            by_len.setdefault(len(w), []).append(w)
        for rows in by_len.values():
            ids = torch.stack(rows)
            with torch.no_grad():
                logits = model(ids[:, :-1]).double()
            targets = ids[:, 1:].to(logits.device)
            total += float(nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            count += targets.numel()
        pending.clear()

    for window in windows:
        pending.append(window)
        if len(pending) >= batch:
            flush()
    flush()
    if count == 0:
        raise VGraphError("nothing to evaluate: no sequence has two tokens")
    return total / count, count


def _windows(sequence: np.ndarray, seq_len: int) -> Iterator[torch.Tensor]:
    """`sequence` cut into windows of seq_len + 1 ids overlapping by one (every id but the first predicted)."""
    for start in range(0, max(len(sequence) - 1, 0), seq_len):
        yield torch.from_numpy(np.ascontiguousarray(sequence[start:start + seq_len + 1], dtype=np.int64))


def token_file_windows(path: str, seq_len: int, vocab: int) -> Iterator[torch.Tensor]:
    """The windows of a .npy file of token ids: one sequence [N], or one sequence per row [R, N]."""
    raw = read_input(path, what="token id file (.npy)", limit=MAX_TOKEN_FILE_BYTES, binary=True)
    shown = printable(path)
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise VGraphError(f"{shown}: not a .npy array of token ids: {quote(str(exc), 120)}") from None
    if array.ndim not in (1, 2) or array.dtype.kind not in "iu":
        raise VGraphError(f"{shown}: holds a {array.dtype} array of shape {list(array.shape)}; give integer token "
                          f"ids, [N] (one sequence) or [rows, N]")
    if array.size and (int(array.min()) < 0 or int(array.max()) >= vocab):
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise VGraphError(f"{shown}: token id {bad} is outside the network's vocabulary of {vocab}")
    rows = array.reshape(1, -1) if array.ndim == 1 else array
    for row in rows:
        yield from _windows(row, seq_len)


def corpus_windows(path: str, seq_len: int, vocab: int) -> Iterator[torch.Tensor]:
    """The validation windows of a prepared corpus (`vgraph data prepare`), as `vgraph train` reads them."""
    from vgraph.data.shards import DataError, is_prepared, open_prepared

    from .training.batches import TokenShards

    if not is_prepared(path):
        raise VGraphError(f"{printable(path)}: not a prepared corpus (`vgraph data prepare ... -o DIR` writes one)")
    try:
        shards = TokenShards(open_prepared(path, verify="full"), seq_len=seq_len, vocab=vocab, seed=0)
        for inputs, targets in shards.val_batches(1):
            yield torch.cat([inputs[0], targets[0, -1:]])
    except DataError as exc:
        raise VGraphError(f"--data {printable(path)}: {exc}") from None
