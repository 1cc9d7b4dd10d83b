"""Argument types for every command line: each numeric option is checked when it is parsed.

Why here: a learning rate of -1 trains by gradient ascent and exits 0, NaN
is noticed only when the loss turns NaN, a seed of 10**22 or a port of
70000 ends in a traceback deep inside torch.  Checked by argparse's `type=`,
a bad value is a usage error naming the option (exit 2) before anything runs
or is written.  The core and every backend use these same checks.
"""
from __future__ import annotations

import argparse
import math
import re

from vgraph.base.diagnostics import quote
from vgraph.base.numbers import SMALLEST_NORMAL

MAX_SEED = 2**63 - 1  # torch, numpy and Python's random all take it
MAX_COUNT = 2**62  # steps, batches, tokens: beyond this no run ends; past it int64 arithmetic overflows
MAX_BATCH = 2**31  # --batch: samples in one step; beyond it no machine holds the activations, and the cost
# model's bytes (batch x per-sample bytes) leave float range
MIN_TEMPERATURE = 2.0**-126  # float32's smallest normal number: 1 / T of anything smaller overflows float32


def _int(text: str) -> int:
    try:
        return int(str(text).strip().replace("_", ""), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {quote(text)}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {quote(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {quote(text)}")
    if value != 0 and abs(value) < SMALLEST_NORMAL:  # 1e-320: 1 / x is infinite, x * x is 0
        raise argparse.ArgumentTypeError(f"expected a number, got the subnormal {quote(text)} (closer to 0 than any "
                                         f"normal float: no setting is that small)")
    return value


def _int_in(text: str, low: int, high: int, expected: str) -> int:
    value = _int(text)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {quote(text)}")
    return value


def positive_int(text: str) -> int:
    """1, 2, ... (at most 2**62)."""
    return _int_in(text, 1, MAX_COUNT, "a positive integer (1 to 2**62)")


def non_negative_int(text: str) -> int:
    """0, 1, ... (at most 2**62)."""
    return _int_in(text, 0, MAX_COUNT, "an integer from 0 to 2**62")


def seed(text: str) -> int:
    """A random seed: 0 to 2**63 - 1."""
    return _int_in(text, 0, MAX_SEED, "a seed from 0 to 2**63-1")


MAX_TOKEN_IDS = 1_000_000  # a prompt longer than this is no prompt


def token_ids(text: str) -> list[int]:
    """Comma-separated token ids (`generate --prompt-ids 1,2,3`): at least one, each 0 to 2**62; whether
    each is inside the vocabulary is the model's to say."""
    parts = str(text).split(",")
    if not str(text).strip() or len(parts) > MAX_TOKEN_IDS:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_TOKEN_IDS} comma-separated token ids, got "
                                         f"{quote(text)}")
    return [_int_in(part, 0, MAX_COUNT, "token ids from 0 to 2**62") for part in parts]


def port(text: str) -> int:
    """A TCP port: 1 to 65535."""
    return _int_in(text, 1, 65535, "a TCP port from 1 to 65535")


def positive_float(text: str) -> float:
    """A finite number > 0 (a learning rate, a clipping norm, a timeout)."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {quote(text)}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a temperature, a tolerance)."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {quote(text)}")
    return value


def batch(text: str) -> int:
    """--batch: samples in one step, 1 to MAX_BATCH (2**31)."""
    return _int_in(text, 1, MAX_BATCH, "a batch of 1 to 2**31 samples")


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or from MIN_TEMPERATURE (2**-126, float32's smallest normal
    number, below which 1/T overflows float32: `--temperature 1e-300` was a traceback in torch) to 1e30."""
    value = _float(text)
    if value != 0 and not MIN_TEMPERATURE <= value <= 1e30:
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or a temperature from 1.2e-38 to 1e30, got "
                                         f"{quote(text)}")
    return value


def byte_size(text: str) -> int:
    """'512M', '2G', '1.5GiB' or a plain number of bytes: finite, at least one byte."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 8G, got {quote(text)}") from None
    if not (math.isfinite(value) and 1 <= value <= 2.0**62):
        raise argparse.ArgumentTypeError(f"expected a size from 1 byte to 4 EiB, got {quote(text)}")
    return int(value)


def path(text: str) -> str:
    """A file or directory name: not empty (an empty name would silently mean "the default" or the
    current directory) and without NUL (no file system accepts it)."""
    if text == "" or "\x00" in text:
        raise argparse.ArgumentTypeError(f"expected a file or directory name, got {quote(text)}")
    return text


def network_file(text: str) -> str:
    """A network YAML file, or the name of a network that ships with vgraph (`vgraph networks`)."""
    from vgraph.base.shipped import resolve

    return resolve(path(text), "network")


def fleet_file(text: str) -> str:
    """A fleet YAML file to read, or the name of a fleet that ships with vgraph (`vgraph networks`)."""
    from vgraph.base.shipped import resolve

    return resolve(path(text), "fleet")


def op_type(text: str) -> str:
    """An op type's name (`check-onnx --ops TYPE`): printable, no spaces, at most 200 characters.  Whether
    it exists is known only once plugins are loaded, so the command says that."""
    if not text or len(text) > 200 or not text.isprintable() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected an op type name (vgraph ops lists them), got {quote(text)}")
    return text


def compile_target(text: str) -> str:
    """--target: cpu or cuda-smXY (the compute capability, e.g. cuda-sm80)."""
    if text != "cpu" and not re.fullmatch(r"cuda-sm[1-9][0-9]{1,2}", text):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda-smXY (e.g. cuda-sm80), got {quote(text)}")
    return text


def replicas(text: str) -> str:
    """--replicas: 'auto' or 1 to 1000000 data-parallel replicas (as the partition pass's option text)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    value = _int(text)
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"expected auto or a number of replicas from 1 to 1000000, got "
                                         f"{quote(text)}")
    return str(value)


MAX_MACHINES = 65536  # --nnodes: launchers of one run; a typo of 10**9 is a usage error, not a wait forever


def nnodes(text: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX (torchrun's spelling): the run starts when MIN machines are there and admits
    joins up to MAX; N means N:N.  Whole numbers from 1 to 65536, no spaces, MIN <= MAX."""
    raw = str(text)
    match = re.fullmatch(r"([0-9_]+)(?::([0-9_]+))?", raw)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX machines (e.g. 2 or 1:4), got {quote(raw)}")
    low = _int_in(match.group(1), 1, MAX_MACHINES, f"machines from 1 to {MAX_MACHINES}")
    high = low if match.group(2) is None else _int_in(match.group(2), 1, MAX_MACHINES,
                                                       f"machines from 1 to {MAX_MACHINES}")
    if high < low:
        raise argparse.ArgumentTypeError(f"MIN:MAX with MAX >= MIN, got {quote(raw)}")
    return low, high


def host_port(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 address in brackets: [::1]:29500): a host name or address without spaces or
    control characters, and a port from 1 to 65535."""
    raw = str(text)
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:([0-9]+)|([A-Za-z0-9._-]+):([0-9]+)", raw)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 10.0.0.1:29500, [::1]:29500), got {quote(raw)}")
    host = match.group(1) or match.group(3)
    return host, port(match.group(2) or match.group(4))


__all__ = ["nnodes", "host_port", "MAX_MACHINES",
           "positive_int", "non_negative_int", "seed", "port", "positive_float", "non_negative_float", "op_type",
           "token_ids", "temperature", "batch", "MAX_BATCH", "MIN_TEMPERATURE",
           "byte_size", "replicas", "path", "network_file", "fleet_file", "compile_target", "MAX_SEED"]
