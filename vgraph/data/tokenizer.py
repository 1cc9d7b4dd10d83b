"""The tokenizer a corpus is prepared with: trained on a sample (`--vocab N`) or given (`--tokenizer FILE`).

Trained: a byte-level BPE (GPT-2 style: lossless on any UTF-8 text, the 256
byte symbols always in the vocabulary) with the special tokens
``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1), trained by the `tokenizers`
library; a vocabulary under 258 tokens is too small for that, and gets a
character-level tokenizer of the most frequent characters instead (ids 0-2
``<|endoftext|>``, ``<|pad|>``, ``<|unk|>``).  Given: any `tokenizers` JSON
file with an ``<|endoftext|>`` token (documents end with it).

Bounded work: the BPE's pre-tokenizer cuts every pre-token (GPT-2's regex:
a word, a number, a run of punctuation or of spaces) into pieces of at most
`MAX_PIECE_BYTES` bytes.  Without it a run with no whitespace is one "word"
to the trainer, whose merges are quadratic in its length (256 KB of ``-``
took 28 s, 1 MB over 120 s); the cut is in the tokenizer's definition, so
encoding cuts the same way it trained.  A trained vocabulary is at most
`MAX_TRAINED_VOCAB` tokens: the trainer's memory grows with the size asked
for (``--vocab 2**31`` aborted it out of memory); larger vocabularies come
from a given tokenizer.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from vgraph.base.diagnostics import printable
from vgraph.base.safeio import read_input

from vgraph.data.shards import DataError

__all__ = ["EOT_TOKEN", "PAD_TOKEN", "UNK_TOKEN", "SPECIAL_TOKENS", "MIN_BPE_VOCAB", "train_tokenizer",
           "MAX_TRAINED_VOCAB", "MAX_PIECE_BYTES", "load_tokenizer", "tokenizer_from_json", "tokenizer_kind",
           "vocabulary_span"]

EOT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOT_TOKEN, PAD_TOKEN)
#: Byte-level BPE always holds the 256 byte symbols plus the specials.
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_TOKENIZER_BYTES = 512 * 2**20
#: The largest vocabulary `train_tokenizer` trains (16,777,216: the trainer's memory measured at ~90 MB).
MAX_TRAINED_VOCAB = 2**24
#: The longest pre-token the BPE sees (longer words are cut): see the module docstring.
MAX_PIECE_BYTES = 128


def tokenizer_kind(vocab_size: int) -> str:
    """'bpe' when `vocab_size` fits a byte-level BPE, else 'char'."""
    return "bpe" if vocab_size >= MIN_BPE_VOCAB else "char"


def train_tokenizer(documents: Sequence[str], vocab_size: int):
    """A tokenizer of at most `vocab_size` tokens trained on `documents` (see the module docstring).

    BPE training stops at exactly `vocab_size` unless the text runs out of
    pairs to merge first; the caller compares `get_vocab_size()` with what it asked (prepare says so).
    """
    if not documents:
        raise DataError("no text to train a tokenizer on (the corpus is empty)")
    if not 1 <= vocab_size <= MAX_TRAINED_VOCAB:
        raise DataError(f"a trained tokenizer has at most {MAX_TRAINED_VOCAB:,} tokens, not {vocab_size:,} (give "
                        f"a larger vocabulary as a --tokenizer file)")
    if tokenizer_kind(vocab_size) == "char":
        return char_tokenizer(documents, vocab_size)
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # After ByteLevel every byte is one character, so the Split bounds pieces in bytes.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        pre_tokenizers.Split(Regex(f"[\\s\\S]{{1,{MAX_PIECE_BYTES}}}"), behavior="isolated")])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=0, special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet, so text the sample never showed stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def vocabulary_span(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce (its added tokens included).

    Why not `get_vocab_size()`: a given tokenizer's ids need not be dense (a vocabulary of 100 tokens may
    hold id 70,000), and the shards' dtype must hold the largest id, not the count."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(max(ids, default=-1) + 1, tokenizer.get_vocab_size(with_added_tokens=True))


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
    return tokenizer_from_json(read_input(path, what=what, limit=MAX_TOKENIZER_BYTES), path)


def tokenizer_from_json(text: str, path: str):
    """`load_tokenizer` of the text already read from `path` (a prepared corpus's, as its ids were checked)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises plain Exception subclasses for every malformed file
        raise DataError(f"{printable(path)}: not a `tokenizers` JSON file ({printable(exc, 200)})") from None
    if tokenizer.token_to_id(EOT_TOKEN) is None:
        raise DataError(f"{printable(path)}: the tokenizer has no {EOT_TOKEN} token (documents end with it)")
    return tokenizer
