"""The prepared-corpus format: token shards, their document index, the manifest; written and read checked.

A prepared directory holds, per split (``train``, ``val``), shards named
``<split>-NNNNN.bin`` (the tokens, raw little-endian ``uint16`` when the
vocabulary has at most 65,536 tokens, else ``uint32``: ``numpy.memmap(path,
dtype)`` reads one as it is, as nanoGPT's ``train.bin``) and
``<split>-NNNNN.idx`` (the document boundaries, in the spirit of Megatron's
``.bin``/``.idx`` pairs: the 8-byte magic ``IDX_MAGIC``, the number of
documents D as little-endian uint64, then D + 1 uint64 token offsets, the
first 0, the last the shard's token count, strictly increasing: every
document ends with the end-of-text token).  ``tokenizer.json`` is the HF
tokenizers file, and ``manifest.json``, written last and atomically, counts
and hashes everything (``FORMAT``, ``FORMAT_VERSION``).

`open_prepared` trusts nothing: the manifest's types, file names (plain names
inside the directory only), sizes against counts, index headers and offsets,
and (``verify="full"``) every SHA-256.  Whatever it finds wrong is a
`DataError` naming the file, so a truncated shard or a manifest describing
other shards is a diagnostic, never a wrong run or a traceback.  The dtype
follows the vocabulary (the largest id + 1, not the count of tokens), and a
full check also reads ``tokenizer.json``: a tokenizer with ids past the
manifest's vocabulary (ids that would have wrapped in uint16) is refused.

Shards are read through a bounded pool of open descriptors (`ShardFile`):
a corpus of thousands of shards never holds more than `MAX_OPEN_SHARDS`.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vgraph.base.diagnostics import VGraphError, printable
from vgraph.base.jsonio import decode_text, loads
from vgraph.base.safeio import read_input

__all__ = ["DataError", "FORMAT", "FORMAT_VERSION", "IDX_MAGIC", "SPLITS", "MANIFEST", "TOKENIZER_FILE",
           "token_dtype", "encode_index", "ShardFile", "TokenStream", "PreparedCorpus", "open_prepared", "is_prepared",
           "sha256_file"]

FORMAT = "vgraph-token-shards"
FORMAT_VERSION = 1
IDX_MAGIC = b"VGIDX\x00\x01\x00"
IDX_HEADER = len(IDX_MAGIC) + 8
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
MAX_MANIFEST_BYTES = 64 * 2**20
_SHARD_NAME = re.compile(r"(train|val)-[0-9]{5,9}\.(bin|idx)")
_DTYPES = {"uint16": 2**16, "uint32": 2**32}
#: Shard files open at once per process (least recently read closed first): far under any `ulimit -n`.
MAX_OPEN_SHARDS = 64


class DataError(VGraphError):
    """Training text that cannot be found, read, prepared or trusted (a user's problem: exit 2)."""


def token_dtype(vocab_size: int) -> str:
    """'uint16' when every id of a `vocab_size` vocabulary fits 16 bits, else 'uint32'."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit 32-bit token ids")


def encode_index(doc_lengths: np.ndarray) -> bytes:
    """The .idx bytes of a shard whose documents have `doc_lengths` tokens each (all > 0)."""
    offsets = np.zeros(len(doc_lengths) + 1, dtype="<u8")
    np.cumsum(doc_lengths, out=offsets[1:])
    return IDX_MAGIC + np.uint64(len(doc_lengths)).astype("<u8").tobytes() + offsets.tobytes()


def sha256_file(path: Path, chunk: int = 8 * 2**20) -> str:
    """SHA-256 of a file, read in chunks (through the page cache, not into resident memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenStream:
    """One split: its shards' tokens concatenated, read a window at a time (`ShardFile`).

    `window(start, length)` copies tokens ``[start, start + length)`` of the
    concatenation (a window may span shards) into a fresh int64 array, so
    resident memory holds only what a batch reads, whatever the corpus size.
    """

    shards: tuple[ShardFile, ...]
    starts: np.ndarray  # the first token of each shard in the concatenation, then the total
    documents: int
    names: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        if start < 0 or length < 0 or start + length > self.tokens:
            raise IndexError(f"tokens [{start}, {start + length}) are outside the split's {self.tokens}")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            local = start + done - int(self.starts[shard])
            take = min(length - done, self.shards[shard].tokens - local)
            out[done:done + take] = self.shards[shard].read(local, take)
            done += take
            shard += 1
        return out

    def shard_of(self, position: int) -> str:
        """The .bin file holding token `position` (for messages)."""
        return self.names[int(np.searchsorted(self.starts, position, side="right")) - 1]


@dataclass(frozen=True)
class PreparedCorpus:
    """An opened prepared directory: its manifest, tokenizer file and the two splits."""

    root: Path
    manifest: dict[str, Any]
    digest: str  # SHA-256 of manifest.json: names this exact corpus (run.json, a launch worker's copy checked)
    train: TokenStream
    val: TokenStream
    # verify="full": the tokenizer file's text as its ids were checked, so a run loads the tokenizer that was
    # checked without reading the file again (None: not read, verify="size")
    tokenizer_json: str | None = None

    @property
    def content_digest(self) -> str:
        """SHA-256 of what a run reads: the encoding, the tokenizer's file and every shard's tokens (their hashes),
        without how the corpus was built (its sources, settings, plan, the tokenizers version).  A resume compares
        this rather than `digest`: the same text prepared again under a tokenizers patch release writes the same
        files and a manifest that differs only in its provenance, and refusing that run would strand it."""
        m = self.manifest
        content = {"format": m["format"], "version": m["version"], "dtype": m["dtype"], "vocab_size": m["vocab_size"],
                   "eot_id": m["eot_id"], "val_split": m.get("val_split"),
                   "tokenizer": {k: m["tokenizer"].get(k) for k in ("sha256", "kind", "vocab_size")},
                   "splits": {name: m["splits"][name] for name in SPLITS}}
        return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self.manifest["eot_id"])

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE

    def split(self, name: str) -> TokenStream:
        return {"train": self.train, "val": self.val, "validation": self.val}[name]


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding a manifest (a prepared corpus, complete or claimed to be)."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def open_prepared(path: str | os.PathLike, *, verify: str = "full") -> PreparedCorpus:
    """Open a prepared directory after checking it against its manifest (see the module docstring).

    `verify`: "full" also recomputes every file's SHA-256 (reads each file
    once, through the page cache); "size" checks names, sizes, headers and
    offsets only (what a launch worker does after its launcher verified).
    """
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{printable(str(root))}: not a directory (a prepared corpus is the directory "
                        f"`vgraph data prepare` wrote)")
    manifest_path = root / MANIFEST
    raw = read_input(manifest_path, what="manifest", limit=MAX_MANIFEST_BYTES, binary=True)
    manifest = loads(raw, printable(str(manifest_path)), error=DataError)
    _check_manifest(manifest, manifest_path)
    tokenizer = root / TOKENIZER_FILE
    _check_file(tokenizer, None, manifest["tokenizer"]["sha256"], verify)
    tokenizer_json = (_check_tokenizer_ids(tokenizer, manifest["vocab_size"], manifest["dtype"]) if verify == "full"
                      else None)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    streams = [_open_split(root, name, manifest["splits"][name], dtype, verify) for name in SPLITS]
    return PreparedCorpus(root, manifest, hashlib.sha256(raw).hexdigest(), *streams, tokenizer_json=tokenizer_json)


# -- the manifest's schema -------------------------------------------------------------------------------


def _fail(where: Path, message: str) -> DataError:
    return DataError(f"{printable(str(where))}: {message}")


def _need(obj: Any, key: str, kind: type | tuple[type, ...], where: Path, what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise _fail(where, f"{what} has no {key!r}")
    value = obj[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise _fail(where, f"{what}: {key!r} is {printable(repr(value), 80)}, not {getattr(kind, '__name__', kind)}")
    return value


def _count(obj: Any, key: str, where: Path, what: str) -> int:
    value = _need(obj, key, int, where, what)
    if not 0 <= value < 2**62:
        raise _fail(where, f"{what}: {key!r} is {value}, not a count")
    return value


def _check_manifest(m: Any, where: Path) -> None:
    if not isinstance(m, dict):
        raise _fail(where, "the manifest is not a JSON object")
    if m.get("format") != FORMAT:
        raise _fail(where, f"not a {FORMAT} manifest (format {printable(repr(m.get('format')), 80)})")
    if m.get("version") != FORMAT_VERSION:
        raise _fail(where, f"format version {printable(repr(m.get('version')), 40)}; this vgraph reads version "
                           f"{FORMAT_VERSION}: prepare the corpus again")
    dtype = _need(m, "dtype", str, where, "the manifest")
    if dtype not in _DTYPES:
        raise _fail(where, f"dtype {printable(dtype, 40)!r} is not uint16 or uint32")
    vocab = _count(m, "vocab_size", where, "the manifest")
    if not 1 <= vocab <= _DTYPES[dtype] or token_dtype(vocab) != dtype:
        raise _fail(where, f"vocab_size {vocab} does not go with dtype {dtype} (uint16 up to 65536 tokens)")
    if not _count(m, "eot_id", where, "the manifest") < vocab:
        raise _fail(where, f"eot_id {m['eot_id']} is outside the vocabulary of {vocab}")
    tok = _need(m, "tokenizer", dict, where, "the manifest")
    _hex(_need(tok, "sha256", str, where, "tokenizer"), where, "tokenizer")
    splits = _need(m, "splits", dict, where, "the manifest")
    for name in SPLITS:
        split = _need(splits, name, dict, where, "splits")
        shards = _need(split, "shards", list, where, f"split {name!r}")
        tokens = docs = 0
        for i, shard in enumerate(shards):
            what = f"split {name!r} shard {i}"
            for key in ("bin", "idx"):
                file = _need(shard, key, str, where, what)
                if not _SHARD_NAME.fullmatch(file) or not file.startswith(name + "-") or not file.endswith(key):
                    raise _fail(where, f"{what}: {key} file {printable(repr(file), 80)} is not a {name}-NNNNN.{key} "
                                       f"name inside the directory")
                _hex(_need(shard, f"{key}_sha256", str, where, what), where, what)
            if shard["bin"][:-4] != shard["idx"][:-4]:
                raise _fail(where, f"{what}: {shard['bin']} and {shard['idx']} are not one shard's pair")
            n_tokens, n_docs = _count(shard, "tokens", where, what), _count(shard, "documents", where, what)
            if n_docs < 1 or n_tokens < n_docs:
                raise _fail(where, f"{what}: {n_tokens} tokens in {n_docs} documents (each document ends with "
                                   f"the end-of-text token)")
            tokens, docs = tokens + n_tokens, docs + n_docs
        if len({s["bin"] for s in shards}) != len(shards):
            raise _fail(where, f"split {name!r} names a shard twice")
        if _count(split, "tokens", where, f"split {name!r}") != tokens or \
                _count(split, "documents", where, f"split {name!r}") != docs:
            raise _fail(where, f"split {name!r} counts {split['tokens']} tokens in {split['documents']} documents, "
                               f"its shards {tokens} in {docs}")


def _hex(value: str, where: Path, what: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise _fail(where, f"{what}: {printable(repr(value), 80)} is not a SHA-256")


# -- the files ------------------------------------------------------------------------------------------


def _check_tokenizer_ids(path: Path, vocab: int, dtype: str) -> str:
    """The tokenizer's text, once its largest id (model vocabulary and added tokens) is inside the manifest's
    vocabulary."""
    shown = printable(str(path))
    text = decode_text(read_input(path, what="tokenizer", limit=512 * 2**20, binary=True), shown, error=DataError)
    try:
        doc = loads(text, shown, limit=512 * 2**20, error=DataError)
        model_vocab = doc["model"].get("vocab") if isinstance(doc.get("model"), dict) else None
        ids = [t["id"] for t in doc.get("added_tokens") or [] if isinstance(t, dict) and "id" in t]
        if isinstance(model_vocab, dict):
            ids += list(model_vocab.values())
        elif isinstance(model_vocab, list):  # Unigram: the position is the id
            ids.append(len(model_vocab) - 1)
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError, TypeError, KeyError) as exc:
        raise DataError(f"{printable(str(path))}: not a `tokenizers` JSON file ({type(exc).__name__})") from None
    top = max((i for i in ids if type(i) is int), default=-1)
    if top >= vocab:
        raise DataError(f"{printable(str(path))}: holds token id {top}, outside the manifest's vocabulary of {vocab} "
                        f"({dtype} shards); prepare the corpus again")
    return text


def _check_file(path: Path, size: int | None, sha256: str, verify: str) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise DataError(f"{printable(str(path))}: missing; the manifest lists it (prepare the corpus again)") from None
    except OSError as exc:
        raise DataError(f"{printable(str(path))}: cannot read: {exc.strerror}") from None
    if not path.is_file() or path.is_symlink():
        raise DataError(f"{printable(str(path))}: not a regular file")
    if size is not None and st.st_size != size:
        raise DataError(f"{printable(str(path))}: {st.st_size} bytes, the manifest says {size} (truncated or "
                        f"replaced; prepare the corpus again)")
    if verify == "full" and sha256_file(path) != sha256:
        raise DataError(f"{printable(str(path))}: its SHA-256 differs from the manifest's (the file changed "
                        f"after `vgraph data prepare`; prepare the corpus again)")


def _open_split(root: Path, name: str, split: dict, dtype: np.dtype, verify: str) -> TokenStream:
    maps, starts, names = [], [0], []
    for shard in split["shards"]:
        bin_path, idx_path = root / shard["bin"], root / shard["idx"]
        _check_file(bin_path, shard["tokens"] * dtype.itemsize, shard["bin_sha256"], verify)
        _check_file(idx_path, IDX_HEADER + 8 * (shard["documents"] + 1), shard["idx_sha256"], verify)
        _check_index(idx_path, shard["tokens"], shard["documents"])
        maps.append(ShardFile(bin_path, dtype))
        starts.append(starts[-1] + shard["tokens"])
        names.append(shard["bin"])
    return TokenStream(tuple(maps), np.array(starts, dtype=np.int64), int(split["documents"]), tuple(names))


class ShardFile:
    """One .bin shard, read a window at a time with `os.pread` through the pool of open descriptors.

    Why not a memory map (nanoGPT's np.memmap): the pages a mapping touches count in the process's resident
    memory, and training touches pages all over the corpus; the kernel also maps in its neighbours (read-
    ahead, fault-around).  Measured (benchmarks/bench_data.py, 6-layer network, 200 steps of batch 8, the
    run on a 4 MB corpus against the same run on 2 GB): through np.memmap the resident memory grew by 646 MB
    more on the big corpus, through a map advised MADV_RANDOM still 474 MB (RssFile), through pread by the
    same as on the small one.  A window is a few KiB, so one system call per window costs nothing next to a
    training step; the page cache still serves repeated reads.  Why a pool: one descriptor per shard ever
    read made a corpus of 1,000+ one-document files die mid-run with "Too many open files"; a reopened
    shard must still be the file checked (device and inode), so a swap after the check is refused."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        st = path.stat()
        self.tokens = st.st_size // self.dtype.itemsize
        self._identity: tuple[int, int] | None = (st.st_dev, st.st_ino)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of this shard."""
        size = self.dtype.itemsize
        raw = _POOL.pread(self, count * size, start * size)
        if len(raw) != count * size:
            raise DataError(f"{printable(str(self.path))}: ends before token {start + count} (truncated after "
                            f"it was opened; prepare the corpus again)")
        return np.frombuffer(raw, dtype=self.dtype)

    def open(self) -> int:
        """A new descriptor of this shard, checked to be the file `open_prepared` checked."""
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        shown = printable(str(self.path))
        try:
            fd = os.open(self.path, flags)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise DataError(f"{shown}: cannot open: too many open files (this process's limit, `ulimit -n`, "
                                f"is reached by descriptors other than the shards'; raise it)") from None
            if exc.errno in (errno.ENOENT, errno.ELOOP):
                raise DataError(f"{shown}: cannot read: {exc.strerror} (removed or replaced by a link after it "
                                f"was checked; prepare the corpus again)") from None
            raise DataError(f"{shown}: cannot read: {exc.strerror}") from None
        st = os.fstat(fd)
        if self._identity is None:  # unpickled in another process: the file it opens first is the one read
            self._identity = (st.st_dev, st.st_ino)
        elif (st.st_dev, st.st_ino) != self._identity:
            os.close(fd)
            raise DataError(f"{shown}: replaced by another file after it was checked; prepare the corpus again")
        return fd

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_identity": None}  # a device and inode mean nothing on another machine

    def __del__(self) -> None:
        pool = globals().get("_POOL")  # None at interpreter shutdown
        if pool is not None:
            pool.release(id(self))


class _DescriptorPool:
    """At most `limit` shard descriptors open in this process, the least recently read closed first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fds: OrderedDict[int, int] = OrderedDict()  # id(ShardFile) -> descriptor
        self.lock = threading.Lock()

    def pread(self, shard: ShardFile, length: int, offset: int) -> bytes:
        with self.lock:
            fd = self.fds.get(id(shard))
            if fd is None:
                while len(self.fds) >= self.limit:
                    os.close(self.fds.popitem(last=False)[1])
                fd = self.fds[id(shard)] = shard.open()
            else:
                self.fds.move_to_end(id(shard))
            return os.pread(fd, length, offset)

    def release(self, key: int) -> None:
        with self.lock:
            fd = self.fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # a lock held by another thread at fork time stays held in the child


_POOL = _DescriptorPool(MAX_OPEN_SHARDS)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.after_fork)


def _check_index(path: Path, tokens: int, documents: int) -> None:
    with open(path, "rb") as fh:
        header = fh.read(IDX_HEADER)
        offsets = np.frombuffer(fh.read(8 * (documents + 1)), dtype="<u8")
    if header[:len(IDX_MAGIC)] != IDX_MAGIC:
        raise DataError(f"{printable(str(path))}: not a vgraph document index (bad magic)")
    if int(np.frombuffer(header[len(IDX_MAGIC):], dtype="<u8")[0]) != documents:
        raise DataError(f"{printable(str(path))}: its header counts other documents than the manifest's {documents}")
    if len(offsets) != documents + 1 or offsets[0] != 0 or int(offsets[-1]) != tokens or \
            bool(np.any(offsets[1:] <= offsets[:-1])):
        raise DataError(f"{printable(str(path))}: document offsets are not 0 < ... < {tokens}, strictly increasing")
