"""The `vgraph train` and `vgraph generate` commands (entry points of group `vgraph.commands`).

    vgraph train NETWORK.yml [--data PATH] [--steps N] [--batch B] [--lr LR] [--out DIR] [--resume] ...
    vgraph generate CHECKPOINT (--prompt TEXT... | --prompts-file FILE | --prompt-ids 1,2,3...)
                    [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S] [--backend torch|onnx]
                    [--no-kv-cache]                                          (the loop: generation.py)
    vgraph eval RUN (--data DIR | --token-ids FILE.npy) [--json]          (model_api.py)

Also runnable without the entry points: `python -m vgraph.backends.torch.cli train ...`.
A user's mistake is a VGraphError: its message is printed and the exit status is 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from vgraph.base import options
from vgraph.base.diagnostics import Diagnostic, VGraphError, printable
from vgraph.cli.common import remember_parser
from vgraph.cli.main import add_plugin_option

from .training.options import add_train_options, print_result, resume_command, train_settings

__all__ = ["register_train", "register_generate", "register_eval", "generate", "generate_ids", "LogitsSource",
           "print_result", "resume_command", "main"]

# Every numeric option is checked as it is parsed (vgraph.base.options): a usage error, exit 2, nothing run.
_positive_int, _non_negative_int = options.positive_int, options.non_negative_int


def register_train(subparsers: argparse._SubParsersAction) -> None:
    """Add `train` to a `vgraph` subparser set (its options: training/options.py, shared with `launch`)."""
    p = subparsers.add_parser(
        "train", help="train a network YAML on text with PyTorch (checkpoints, metrics, resume)",
        description="Train a network on a text corpus (default: the embedded standard-library "
                    "docstrings) with the production precision policy. The run directory gets the "
                    "network, tokenizer, metrics.jsonl/csv, loss_curve.png and checkpoints.")
    add_train_options(p, "train")
    add_plugin_option(p)
    p.set_defaults(func=run_train)
    remember_parser(p)


def run_train(args: argparse.Namespace) -> int:
    from .training.train import TrainConfig, train

    result = train(TrainConfig(**train_settings(args, "train")))
    skipped = f"{result.skipped_steps} steps skipped by the loss scaler" if result.skipped_steps else None
    print_result(result, skipped)
    return 0


def register_generate(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate` to a `vgraph` subparser set."""
    p = subparsers.add_parser(
        "generate", help="sample text from a checkpoint of `vgraph train`",
        description="Continue prompts with a trained network. CHECKPOINT is a checkpoint directory or a run "
                    "directory (its latest checkpoint). Several prompts (--prompt repeated, or --prompts-file) run "
                    "as one batch, left-padded; each prompt's tokens are those of its own run. A prompt holds "
                    "at most the network's context (its seq_len) of tokens; past the context the window slides "
                    "(the last seq_len tokens), which is said once on stderr. Speeds (prefill and decode, "
                    "tokens/s) are printed on stderr at the end.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=options.path)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="text to continue (default: empty, from end-of-text); repeat it for a batch, whose "
                             "completions are printed one JSON string per line")
    prompt.add_argument("--prompts-file", metavar="FILE", type=options.path,
                        help="UTF-8 text, one prompt per line (no blank lines; tab is the only control character "
                             "allowed); completions one JSON string per line, in order")
    prompt.add_argument("--prompt-ids", metavar="IDS", type=options.token_ids, action="append",
                        help="token ids to continue, comma-separated (a model without a tokenizer); repeat it for "
                             "a batch; prints each prompt's and its generated ids, comma-separated, one line each")
    p.add_argument("--max-new-tokens", type=_non_negative_int, default=100)
    p.add_argument("--temperature", type=options.temperature, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=_non_negative_int, default=40, help="sample from the k likeliest; 0: all")
    p.add_argument("--seed", type=options.seed, default=0, help="seed of every prompt's draws (default 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available; --backend torch only)")
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="compute the logits with the torch backend (default) or with onnxruntime on the "
                        "network's inference export (float32; the same tokens as torch in float32)")
    p.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep past keys and values between tokens, or recompute the whole context for every "
                        "token (--no-kv-cache). Default: the cache; on torch, a network one of whose VNodes "
                        "cannot run on new positions alone recomputes instead, and says why")
    add_plugin_option(p)
    p.set_defaults(func=run_generate)


BACKENDS = ("torch", "onnx")
DECODERS = "vgraph.decoders"  # the entry point group of the decoders other backends provide
MAX_PROMPTS = 1024  # one batch: the KV cache grows with prompts x layers x context
MAX_PROMPTS_FILE_BYTES = 64 * 2**20


def run_generate(args: argparse.Namespace) -> int:
    import json

    texts = None
    if args.prompt_ids is None:  # the prompts are checked before the run is loaded
        texts = read_prompts(args.prompts_file) if args.prompts_file is not None else (args.prompt or [""])
        if args.prompt is not None:
            for text, where in zip(texts, prompt_labels(args, texts)):
                check_prompt_text(text, where)
    count = len(texts if texts is not None else args.prompt_ids)
    if count > MAX_PROMPTS:
        raise VGraphError(f"{count:,} prompts: at most {MAX_PROMPTS:,} run as one batch; split them")
    source = LogitsSource(args.checkpoint, backend=args.backend, kv_cache=args.kv_cache, device=args.device)
    if texts is None:
        prompts = [source.checked_ids(ids, f"--prompt-ids {n + 1}") for n, ids in enumerate(args.prompt_ids)]
    else:
        prompts = [source.encode(text, where) for text, where in zip(texts, prompt_labels(args, texts))]
    rows = source.sample_many(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, seed=args.seed)
    if texts is None:
        for row in rows:
            print(",".join(map(str, row)))
    else:
        completions = [source.completion(text, row, len(ids))
                       for text, row, ids in zip(texts, rows, prompts)]
        for text in completions:
            print(json.dumps(text, ensure_ascii=False) if len(completions) > 1 or args.prompts_file else text)
    print(f"generate: {len(rows)} prompt{'s' if len(rows) > 1 else ''}, {source.way}; {source.speeds.line()}",
          file=sys.stderr)
    return 0


def prompt_labels(args: argparse.Namespace, texts: Sequence[str]) -> list[str]:
    """How a message names each prompt: its option and number, or the file and line."""
    if args.prompts_file is not None:
        return [f"{args.prompts_file}:{n + 1}" for n in range(len(texts))]
    return [f"--prompt {n + 1}" if len(texts) > 1 else "--prompt" for n in range(len(texts))]


def check_prompt_text(text: str, where: str) -> None:
    """A prompt is text: a control character other than tab and newline (an escape sequence, NUL) is a
    mistake of quoting, refused by position."""
    bad = next((i for i, c in enumerate(text) if c not in "\t\n" and (ord(c) < 32 or 0x7F <= ord(c) < 0xA0)), None)
    if bad is not None:
        raise VGraphError(f"{printable(where)}: control character U+{ord(text[bad]):04X} at character {bad + 1}; "
                          f"a prompt is text (tab and newline are the control characters it may hold)")


def read_prompts(path: str) -> list[str]:
    """The prompts of a --prompts-file: one per line; a blank line, a control character or no prompt at all
    is refused naming the line."""
    from vgraph.base.safeio import read_input

    text = read_input(path, what="prompts file", limit=MAX_PROMPTS_FILE_BYTES)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    prompts = []
    for n, line in enumerate(lines, 1):
        line = line[:-1] if line.endswith("\r") else line
        where = f"{printable(path)}:{n}"
        if not line.strip():
            raise VGraphError(f"{where}: a blank line; every line is a prompt (give --prompt '' to start from "
                              f"end-of-text)")
        check_prompt_text(line, where)
        prompts.append(line)
    if not prompts:
        raise VGraphError(f"{printable(path)}: holds no prompts (one per line)")
    return prompts


def generate(checkpoint: str, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0, device: str | None = None, backend: str = "torch",
             kv_cache: bool | None = None) -> str:
    """The prompt followed by up to `max_new_tokens` sampled tokens (stops at end-of-text)."""
    ids, prompt_len, tokenizer = generate_ids(checkpoint, prompt, max_new_tokens=max_new_tokens,
                                              temperature=temperature, top_k=top_k, seed=seed, device=device,
                                              backend=backend, kv_cache=kv_cache)
    new = tokenizer.decode(ids[prompt_len:] if prompt else ids[1:], skip_special_tokens=True)
    return prompt + new


def generate_ids(checkpoint: str, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8,
                 top_k: int = 40, seed: int = 0, device: str | None = None, backend: str = "torch",
                 kv_cache: bool | None = None):
    """(token ids: the prompt's, then the sampled ones; the prompt's length; the tokenizer)."""
    if not (temperature == 0 or options.MIN_TEMPERATURE <= temperature <= 1e30):  # also NaN
        raise VGraphError(f"--temperature must be 0 (greedy) or from 1.2e-38 to 1e30, got {temperature}")
    source = LogitsSource(checkpoint, backend=backend, kv_cache=kv_cache, device=device)
    ids = source.encode(prompt)
    return source.sample(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         seed=seed), len(ids) if prompt else 0, source.tokenizer


class LogitsSource:
    """A trained run's next-token logits through one backend, and the sampling loop over them.

    The network has a fixed context length S: the context is the last S
    tokens and the next token is drawn from the logits at its last position
    (generation.py).  Every way computes those logits as if the context were
    run at once: the torch decode program against its KV cache, the torch
    window recomputed (`_torch_logits`), onnxruntime (the ONNX backend's
    `Decoder`, found through the `vgraph.decoders` entry points); the draw is
    the same code on the same generator, so equal logits give equal tokens.
    """

    def __init__(self, checkpoint: str, *, backend: str = "torch", kv_cache: bool | None = None,
                 device: str | None = None) -> None:
        from .generation import Speeds
        from .model_api import logits_output
        from .training.batches import EOT_TOKEN, PAD_TOKEN
        from .training.train import load_trained

        if backend not in BACKENDS:
            raise VGraphError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if backend == "onnx" and device is not None:
            raise VGraphError("--device applies to --backend torch; onnxruntime runs on CUDA when this machine has "
                              "it, else on the CPU")
        module, self.tokenizer, graph = load_trained(checkpoint, device="cpu" if backend == "onnx" else device)
        self.seq_len = int(graph.nodes_of_type("embedder")[0].cfg["seq_len"])
        self.vocab = int(graph.nodes_of_type("embedder")[0].cfg["vocab_size"])
        output = logits_output(graph)
        self.eot = self.tokenizer.token_to_id(EOT_TOKEN) if self.tokenizer is not None else None
        self.pad = (self.tokenizer.token_to_id(PAD_TOKEN) if self.tokenizer is not None else None) or 0
        self.speeds = Speeds()
        self.batched = None
        if backend == "onnx":
            self.next_logits = _onnx_logits(module, graph, output, kv_cache=kv_cache is not False)
            self.way = f"onnxruntime, {'KV cache' if kv_cache is not False else 'context recomputed'}"
            return
        token_feed = _token_feed(module, graph, output)
        self.next_logits = _torch_logits(module, token_feed, output, self.seq_len, self.pad)
        self.way = "torch, window recomputed"
        if kv_cache is not False:
            self.batched = _torch_cache(module, token_feed, output, self.pad, required=kv_cache is True)
            if self.batched is not None:
                self.way = "torch, KV cache"

    def encode(self, prompt: str, where: str = "--prompt") -> list[int]:
        """The prompt's ids (an empty prompt starts from end-of-text, or padding), refused when longer than
        the context."""
        if self.tokenizer is None:
            raise VGraphError("this checkpoint has no tokenizer (a model imported without tokenizer.json): give "
                              "--prompt-ids 1,2,3 instead of --prompt")
        ids = self.tokenizer.encode(prompt).ids if prompt else [self.eot if self.eot is not None else self.pad]
        return self._fits(ids, where)

    def checked_ids(self, ids: list[int], where: str = "--prompt-ids") -> list[int]:
        """`--prompt-ids`, refused unless every id is inside the network's vocabulary."""
        bad = [i for i in ids if i >= self.vocab]
        if bad:
            raise VGraphError(f"{where}: token id {bad[0]} is outside the network's vocabulary of {self.vocab}")
        return self._fits(list(ids), where)

    def _fits(self, ids: list[int], where: str) -> list[int]:
        if len(ids) > self.seq_len:
            raise VGraphError(f"{printable(where)}: the prompt is {len(ids):,} tokens, longer than the network's "
                              f"context of {self.seq_len:,}; give at most its last {self.seq_len:,} tokens")
        return ids

    def completion(self, prompt: str, row: list[int], prompt_len: int) -> str:
        """A row's text: the prompt, then its new tokens decoded."""
        new = self.tokenizer.decode(row[prompt_len:] if prompt else row[1:], skip_special_tokens=True)
        return prompt + new

    def sample(self, ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> list[int]:
        """`ids` followed by up to `max_new_tokens` drawn tokens (stops at end-of-text)."""
        return self.sample_many([ids], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                seed=seed)[0]

    def sample_many(self, prompts: Sequence[list[int]], *, max_new_tokens: int, temperature: float, top_k: int,
                    seed: int) -> list[list[int]]:
        """Each prompt followed by its drawn tokens: one batch through the torch KV cache, else one prompt after
        another (each draws from its own generator seeded with `seed`, so the results are equal)."""
        from .generation import WindowLogits, sample_batch

        ways = ([(self.batched, list(prompts))] if self.batched is not None else
                [(WindowLogits(self.next_logits), [p]) for p in prompts])
        rows = []
        for logits, batch in ways:
            rows += sample_batch(logits, batch, context=self.seq_len, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, seed=seed, eot=self.eot, speeds=self.speeds,
                                 on_slide=self._say_slide)
        return rows

    def _say_slide(self, length: int) -> None:
        print(f"generate: a sequence reached {length:,} tokens, past the network's context of {self.seq_len:,}: "
              f"each further token is drawn from the last {self.seq_len:,} (a sliding window, recomputed for "
              f"every token)", file=sys.stderr)


def _token_feed(module, graph, output: str) -> str:
    """The token-id feed, refused unless the logits need nothing else."""
    embedder = graph.nodes_of_type("embedder")[0]
    token_feed = f"{embedder.id}:in0"
    if set(module.feeds_needed((output,))) != {token_feed}:
        raise VGraphError(f"network {graph.name!r}: output {output!r} needs inputs besides token ids "
                          f"({', '.join(module.feeds_needed((output,)))})")
    return token_feed


def _torch_cache(module, token_feed: str, output: str, pad: int, *, required: bool):
    """The torch KV cache (generation.CachedLogits), or None, said on stderr, when the network has a VNode
    that cannot run on new positions alone (then --kv-cache refuses)."""
    from .generation import CachedLogits

    try:
        return CachedLogits(module, token_feed, output, pad)
    except VGraphError as exc:
        if required:
            raise VGraphError(exc.diagnostics + [Diagnostic("without --kv-cache (or with --no-kv-cache) generate "
                                                            "recomputes the context for every token instead",
                                                            severity="warning")]) from None
        more = f" (and {len(exc.diagnostics) - 1} more)" if len(exc.diagnostics) > 1 else ""
        print(f"generate: no KV cache, the context is recomputed for every token: {exc.diagnostics[0]}{more}",
              file=sys.stderr)
        return None


def _torch_logits(module, token_feed: str, output: str, seq_len: int, pad: int):
    """The torch backend's next-token logits without a cache: the context right-padded to S (causal attention
    never looks at the padding), the logits at its last real position."""
    import torch

    device = next(module.parameters()).device

    def next_logits(context: list[int]) -> torch.Tensor:
        window = torch.full((1, seq_len), pad, dtype=torch.int64)
        window[0, : len(context)] = torch.tensor(context, dtype=torch.int64)
        with torch.no_grad():
            logits = module({token_feed: window.to(device)}, want=(output,))[output]
        return logits[0, len(context) - 1].float().cpu()

    return next_logits


def _onnx_logits(module, graph, output: str, *, kv_cache: bool):
    """onnxruntime's next-token logits on the network's inference export, with the trained weights."""
    import torch

    from vgraph.plugins import find_plugin

    found = find_plugin(DECODERS, "onnx")  # an entry point: the torch backend imports nothing of the ONNX one
    if found is None:
        raise VGraphError(f"--backend onnx needs the ONNX backend's decoder (entry point 'onnx' in {DECODERS!r}): "
                          f"reinstall vgraph (pip install -e .) so its entry points are registered")
    Decoder = found.load()
    weights = {k: v.detach().float().cpu().numpy() for k, v in module.state_dict().items()}
    try:
        decoder = Decoder.for_network(graph, weights, kv_cache=kv_cache, logits_output=output,
                                      threads=torch.get_num_threads())
    except VGraphError as exc:
        if not kv_cache:
            raise
        raise VGraphError(exc.diagnostics + [Diagnostic("--no-kv-cache samples without a cache, recomputing the "
                                                        "context for every token", severity="warning")]) from None
    return lambda context: torch.from_numpy(decoder.last_logits(context).copy())


def register_eval(subparsers: argparse._SubParsersAction) -> None:
    """Add `eval` to a `vgraph` subparser set (the work: model_api.py)."""
    p = subparsers.add_parser("eval", help="mean next-token cross-entropy and perplexity of a run on token ids",
                              description="Score a run (its latest checkpoint) or a checkpoint: the mean "
                                          "next-token cross-entropy in nats over every predicted token, and the "
                                          "perplexity exp(loss). Sequences longer than the network's are cut "
                                          "into windows of seq_len + 1 tokens overlapping by one.")
    p.add_argument("checkpoint", metavar="RUN", type=options.path, help="a run directory or a checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DIR", type=options.path,
                     help="a prepared corpus (vgraph data prepare): its validation split")
    src.add_argument("--token-ids", metavar="FILE.npy", type=options.path,
                     help="a .npy array of token ids: [N] one sequence, or [rows, N]")
    p.add_argument("--batch", type=_positive_int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--json", action="store_true", help='print {"loss": ..., "perplexity": ..., "tokens": ...}')
    add_plugin_option(p)
    p.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    import json
    import math

    from .model_api import corpus_windows, evaluate, load_model, token_file_windows

    model = load_model(args.checkpoint, device=args.device)
    windows = (corpus_windows(args.data, model.seq_len, model.vocab_size) if args.data is not None
               else token_file_windows(args.token_ids, model.seq_len, model.vocab_size))
    loss, tokens = evaluate(model, windows, batch=args.batch)
    perplexity = math.exp(loss) if loss < 709 else float("inf")
    if args.json:
        print(json.dumps({"loss": loss, "perplexity": perplexity if math.isfinite(perplexity) else None,
                          "tokens": tokens}))
    else:
        print(f"loss {loss:.6f} nats/token, perplexity {perplexity:.4f} over {tokens:,} tokens")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vgraph.backends.torch.cli train|generate|eval ...`."""
    from vgraph.cli.main import run_commands

    return run_commands([register_train, register_generate, register_eval], argv,
                        prog="python -m vgraph.backends.torch.cli")


if __name__ == "__main__":
    sys.exit(main())
