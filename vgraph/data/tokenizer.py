"""The tokenizer a corpus is prepared with: trained on a sample (`--vocab N`) or given (`--tokenizer FILE`).

Trained: a byte-level BPE (GPT-2 style: lossless on any UTF-8 text, the 256
byte symbols always in the vocabulary) with the special tokens
``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1), trained by the `tokenizers`
library; a vocabulary under 258 tokens is too small for that, and gets a
character-level tokenizer of the most frequent characters instead (ids 0-2
``<|endoftext|>``, ``<|pad|>``, ``<|unk|>``).  Given: any `tokenizers` JSON
file with an ``<|endoftext|>`` token (documents end with it).
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Iterable, Sequence

from vgraph.base.diagnostics import printable
from vgraph.base.safeio import read_input

from .shards import DataError

__all__ = ["EOT_TOKEN", "PAD_TOKEN", "UNK_TOKEN", "SPECIAL_TOKENS", "MIN_BPE_VOCAB", "train_tokenizer",
           "load_tokenizer", "tokenizer_kind"]

EOT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOT_TOKEN, PAD_TOKEN)
#: Byte-level BPE always holds the 256 byte symbols plus the specials.
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_TOKENIZER_BYTES = 512 * 2**20


def tokenizer_kind(vocab_size: int) -> str:
    """'bpe' when `vocab_size` fits a byte-level BPE, else 'char'."""
    return "bpe" if vocab_size >= MIN_BPE_VOCAB else "char"


def train_tokenizer(documents: Sequence[str], vocab_size: int):
    """A tokenizer of at most `vocab_size` tokens trained on `documents` (see the module docstring).

    BPE training stops at exactly `vocab_size` unless the text runs out of
    pairs to merge first; a warning then gives the real size.
    """
    if not documents:
        raise DataError("no text to train a tokenizer on (the corpus is empty)")
    if tokenizer_kind(vocab_size) == "char":
        return char_tokenizer(documents, vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=0, special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet, so text the sample never showed stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    actual = tokenizer.get_vocab_size()
    if actual != vocab_size:
        warnings.warn(f"tokenizer trained to {actual} tokens instead of the requested {vocab_size}: the text has "
                      f"too few distinct byte pairs", stacklevel=2)
    return tokenizer


def char_tokenizer(documents: Iterable[str], vocab_size: int):
    """A character-level tokenizer of the `vocab_size - 3` most frequent characters (ties by character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [EOT_TOKEN, PAD_TOKEN, UNK_TOKEN]
    if vocab_size < len(specials) + 1:
        raise DataError(f"a vocabulary of {vocab_size} tokens is too small even for a character tokenizer "
                        f"(at least {len(specials) + 1})")
    counts: Counter[str] = Counter()
    for doc in documents:
        counts.update(doc)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch, _ in ranked:
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return tokenizer


def load_tokenizer(path: str, *, what: str = "tokenizer"):
    """A `tokenizers` JSON file, checked: it loads and has an end-of-text token."""
    from tokenizers import Tokenizer

    text = read_input(path, what=what, limit=MAX_TOKENIZER_BYTES)
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises plain Exception subclasses for every malformed file
        raise DataError(f"{printable(path)}: not a `tokenizers` JSON file ({printable(exc, 200)})") from None
    if tokenizer.token_to_id(EOT_TOKEN) is None:
        raise DataError(f"{printable(path)}: the tokenizer has no {EOT_TOKEN} token (documents end with it)")
    return tokenizer
