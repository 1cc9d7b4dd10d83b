"""Typed config schemas.

Network YAML stores every config value as a string.  Each op type declares a
`Schema` of `Field`s; parsing turns the string map into typed values (with
defaults, required keys, allowed values and ranges) and formatting turns them
back into the canonical strings the orchestrator expects.  Errors are returned
as (key, message) pairs so the loader can attach file, line and node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

PRECISIONS = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
"""Accepted spellings of a precision -> its canonical spelling in the YAML."""

DTYPE_OF_PRECISION = {"fp16": "float16", "bf16": "bfloat16", "float32": "float32"}
"""Canonical precision -> the tensor dtype name the IR types carry."""


class ConfigError(ValueError):
    """A malformed config value; the message is shown to the user verbatim."""


def _parse_int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        pass
    try:  # "1e3" or "512.0" are ints if they are whole numbers
        value = float(text)
    except ValueError:
        raise ConfigError(f"expected an integer, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise ConfigError(f"expected an integer, got {text!r}")
    return int(value)


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise ConfigError(f"expected a number, got {text!r}")
    return value


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "yes", "on", "1"):
        return True
    if low in ("false", "no", "off", "0"):
        return False
    raise ConfigError(f'expected "true" or "false", got {text!r}')


def _parse_shape(text: str) -> tuple[int, ...]:
    body = text.strip()
    bracketed = body.startswith("[") and body.endswith("]")
    if bracketed:
        body = body[1:-1]
    parts = [p.strip() for p in body.replace("x", ",").split(",") if p.strip()]
    if not parts:
        if bracketed and not body.strip():
            return ()  # "[]", how a scalar's shape is written (and formatted)
        raise ConfigError(f"expected a shape like [128, 512], got {text!r}")
    dims = tuple(_parse_int(p) for p in parts)
    if any(d < 1 and d != -1 for d in dims) or dims.count(-1) > 1:
        raise ConfigError(f"shape dimensions must be positive (one -1 allowed), got {text!r}")
    return dims


def _parse_precision(text: str) -> str:
    try:
        return PRECISIONS[text.strip().lower()]
    except KeyError:
        raise ConfigError(
            f"unknown precision {text!r} (expected one of fp16, bf16, float32)") from None


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "str": str,
    "shape": _parse_shape,
    "precision": _parse_precision,
}


@dataclass(frozen=True)
class Field:
    """One config key of an op type."""

    name: str
    kind: str = "str"  # int | float | bool | str | shape | precision
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None
    doc: str = ""

    def parse(self, text: str) -> Any:
        value = _PARSERS[self.kind](text)
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"must be one of {', '.join(self.choices)}; got {text!r}")
        if self.min is not None and value < self.min:
            raise ConfigError(f"must be >= {_format(self.min)}; got {text!r}")
        if self.max is not None and value > self.max:
            raise ConfigError(f"must be <= {_format(self.max)}; got {text!r}")
        return value

    @staticmethod
    def format(value: Any) -> str:
        return _format(value)


def F(name: str, kind: str = "str", default: Any = None, **kw: Any) -> Field:
    """Short constructor used by the op catalog so each op reads as a table."""
    return Field(name, kind, default, **kw)


COMMON_FIELDS: tuple[Field, ...] = (
    F("optimizer", choices=("adam", "adamw", "sgd", "none"), doc="per-node optimizer"),
    F("learning_rate", "float", min=0.0, doc="per-node learning rate"),
    F("weight_decay", "float", min=0.0, doc="per-node decoupled (AdamW) weight decay of its matrices; default: "
      "--weight-decay (0), 0.01 for adamw"),
    F("precision", "precision", doc="parameter and activation precision of this node"),
    F("param_precision", "precision", doc="parameter precision of this node (wins over precision)"),
    F("activation_precision", "precision", doc="activation precision of this node (wins over precision)"),
    F("colocate_group", doc="nodes sharing a group name are placed on the same PNode"),
    F("colocate_policy", choices=("required", "preferred"), doc="required: never split"),
    F("shared_weight_alias", doc="publishes this node's weight under an alias"),
    F("tie_weight_alias", doc="uses the weight published under that alias"),
    F("input_shape", "shape", doc="explicit per-sample input shape where it cannot be inferred"),
    F("output_shape", "shape", doc="explicit per-sample output shape override check"),
    F("fused_from", doc="comma-separated ids of the VNodes a fusion pass replaced with this one"),
    F("remat", choices=("recompute",), doc="recompute: this node's outputs are not kept for backward but "
      "recomputed from the kept ones (set by the remat pass; absent: kept)"),
)


@dataclass(frozen=True)
class Schema:
    fields: tuple[Field, ...] = ()
    by_name: Mapping[str, Field] = field(init=False, repr=False, compare=False)
    defaults: Mapping[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = {f.name: f for f in COMMON_FIELDS}
        table.update({f.name: f for f in self.fields})
        object.__setattr__(self, "by_name", table)
        object.__setattr__(self, "defaults", {f.name: f.default for f in table.values()})

    def parse(self, raw: Mapping[str, str]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
        """Typed values of the keys present in `raw`, plus (key, problem) pairs.

        Defaults are not filled in here: the IR keeps what the user wrote so a
        round trip reproduces the file; `resolve` adds the defaults.
        """
        values: dict[str, Any] = {}
        problems: list[tuple[str, str]] = []
        for key, text in raw.items():
            fld = self.by_name.get(key)
            if fld is None:
                problems.append((key, f"unknown config key {key!r}{_suggest(key, self.by_name)}"))
                continue
            try:
                values[key] = fld.parse(text)
            except ConfigError as exc:
                problems.append((key, f"config {key!r}: {exc}"))
        for fld in self.fields:
            if fld.required and fld.name not in raw:
                problems.append((fld.name, f"missing required config {fld.name!r}"))
        return values, problems

    def resolve(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Explicit values with every declared default filled in."""
        return {**self.defaults, **values}  # one C-level merge: passes resolve every node

    def format(self, values: Mapping[str, Any]) -> dict[str, str]:
        return {k: Field.format(v) for k, v in values.items()}


def _suggest(word: str, candidates: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


suggest = _suggest
