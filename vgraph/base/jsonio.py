"""The one JSON reader: every JSON document vgraph reads (a file, a JSONL line, a reply on a socket) is
parsed here, bounded and checked, or refused with a diagnostic naming where it came from.

Why one reader: `json.loads` trusts its input.  Nested ten thousand levels deep, a document is a
RecursionError (or, in code that walks it afterwards, a crash far from the read); an integer of 4,300
digits is a ValueError that is not a JSONDecodeError, and one of 400 digits parses but overflows the
first `float()`; `"\\ud800"` decodes to a string that cannot be written back as UTF-8; `NaN` and
`Infinity` are accepted although JSON has neither.  Each reader caught a different subset.  Here:

* size: a document longer than `limit` characters is refused before it is parsed;
* depth: nesting is measured before the parser runs (linear, on a copy without strings and without
  anything but brackets) and a document deeper than `max_depth` is refused, so the recursive parser
  never recurses past it;
* numbers: an integer longer than any float (309 digits) and a float literal that overflows to
  infinity are refused; `NaN`/`Infinity` only where a caller allows them (`allow_nonfinite`: vgraph's
  own metrics, where a diverged loss is written as NaN); ranges and types are the caller's, through
  `vgraph/base/numbers.py`;
* text: bytes must be UTF-8 (a BOM is refused by the parser), and no string or key may hold a lone
  surrogate;
* JSONL: `jsonl_lines` splits on "\\n" only; U+2028, U+2029 and U+0085 are valid inside a JSON string
  and `str.splitlines()` would cut a record there.

Every refusal is a VGraphError (or the caller's subclass, `error=`) whose diagnostic names the file and
line.  Reading the file itself (regular file, size cap) is `vgraph/base/safeio.py`'s `read_json`.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator

from vgraph.base.diagnostics import Diagnostic, SourceLoc, VGraphError, quote

__all__ = ["loads", "jsonl_lines", "decode_text", "MAX_DEPTH", "MAX_DOCUMENT_CHARS", "MAX_INT_DIGITS"]

MAX_DEPTH = 64  # vgraph writes at most 5 levels; deeper is damage or hostility
MAX_DOCUMENT_CHARS = 256 * 2**20
MAX_INT_DIGITS = 309  # sys.float_info.max has 309 digits: a longer integer is beyond every float

_STRING = re.compile(r'"[^"]*"')  # once escapes are gone, a string is a quote, anything but a quote, a quote
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
# an escaped surrogate not part of a pair, or a raw one (only a str handed in can hold it); the parsed
# value decides, this only finds the line
_LONE_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                             r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}|[\ud800-\udfff]")
_SURROGATE_CHAR = re.compile(r"[\ud800-\udfff]")


class _Refused(ValueError):
    """A number the parser's hooks refuse (raised from inside json.loads, turned into a diagnostic here)."""


def decode_text(raw: bytes, shown: str, first_line: int = 1, error: type[VGraphError] = VGraphError) -> str:
    """`raw` as UTF-8 text, or a VGraphError naming the line of the first byte that is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw.count(b"\n", 0, exc.start)
        raise error(f"{shown}:{line}: not UTF-8 text (byte {exc.start}: "
                    f"{raw[exc.start:exc.start + 1]!r})") from None


def loads(text: str | bytes, shown: str, *, line: int = 1, max_depth: int = MAX_DEPTH,
          limit: int = MAX_DOCUMENT_CHARS, allow_nonfinite: bool = False,
          on_bad_number: Callable[[str], Any] | None = None, error: type[VGraphError] = VGraphError) -> Any:
    """The JSON value of `text`, read from `shown` (a file name, already printable) starting at `line`
    (a JSONL line's number), or `error` with a diagnostic naming both.  See the module docstring for
    what is refused.  `on_bad_number`, for a reader that keeps what it can (a run's report), is called
    with each number literal that would be refused and its result stands in the number's place."""
    def refuse(message: str, at: int = 0) -> VGraphError:
        return error([Diagnostic(message, SourceLoc(shown, line + at))])

    if isinstance(text, (bytes, bytearray)):
        text = decode_text(bytes(text), shown, line, error)
    if len(text) > limit:
        raise refuse(f"a JSON document of {len(text):,} characters; at most {limit:,} are read")
    if text.startswith("\ufeff"):
        raise refuse("not JSON: starts with a byte-order mark (U+FEFF); save it as UTF-8 without one")
    too_deep = _too_deep(text, max_depth)
    if too_deep:
        raise refuse(too_deep)

    def constant(name: str) -> Any:
        if allow_nonfinite:
            return float(name)
        if on_bad_number is not None:
            return on_bad_number(name)
        raise _Refused(f"{name} is not a number (JSON has no NaN or infinity)")

    def checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
        if on_bad_number is None:
            return parse

        def lenient(literal: str) -> Any:
            try:
                return parse(literal)
            except _Refused:
                return on_bad_number(literal)
        return lenient

    try:
        value = json.loads(text, parse_int=checked(_int), parse_float=checked(_float), parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise refuse(f"not JSON: {exc.msg} (column {exc.colno})", exc.lineno - 1) from None
    except _Refused as exc:
        raise refuse(str(exc), _line_of(text, _first_number_over(text))) from None
    except RecursionError:  # below max_depth only when the caller's stack is already nearly full
        raise refuse(f"not JSON: nested too deeply to read here (at most {max_depth} levels)") from None
    if ("\\u" in text or not text.isascii()) and _has_lone_surrogate(value):
        m = _LONE_SURROGATE.search(text)
        raise refuse(f"a string holds the lone surrogate {quote(m.group() if m else '')}: not Unicode text "
                      f"(a surrogate is only valid as half of a pair)", _line_of(text, m.start() if m else 0))
    return value


def jsonl_lines(text: str, first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(line number, line) for each line of JSON Lines `text`, split on "\\n" only (a "\\r" before it is
    dropped): JSON strings may hold U+2028, U+2029, U+0085 and the other characters `splitlines` cuts
    at.  Blank lines are skipped.  Lines are sliced one at a time, so no list of every line is built."""
    start, number, end = 0, first_line, len(text)
    while start < end:
        stop = text.find("\n", start)
        stop = end if stop < 0 else stop
        piece = text[start:stop]
        if piece.endswith("\r"):
            piece = piece[:-1]
        if piece.strip():
            yield number, piece
        start, number = stop + 1, number + 1


def _int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS + digits.startswith("-"):
        raise _Refused(f"an integer of {len(digits.lstrip('-')):,} digits: beyond any number vgraph reads")
    return int(digits)


def _float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"the number {quote(literal, 40)} is beyond any float")
    return value


def _first_number_over(text: str) -> int:
    """Where the first overlong number literal or non-finite constant starts (for the diagnostic's line)."""
    m = re.search(r"\d{%d}|\d[eE]\+?\d{3}|NaN|-?Infinity" % (MAX_INT_DIGITS + 1), text)
    return m.start() if m else 0


def _line_of(text: str, offset: int) -> int:
    """0-based line of `offset` in `text` (added to the document's first line)."""
    return text.count("\n", 0, offset)


def _too_deep(text: str, max_depth: int) -> str | None:
    """Why `text` must not reach the recursive parser (nested deeper than `max_depth`), or None.

    Linear and in C: escapes and then strings are cut out, then everything but brackets, and brackets of
    either kind are made one kind (the parser's depth does not care which); each `replace(b"[]", b"")`
    then removes exactly the innermost level, so the text is empty after k rounds if and only if it is
    nested k deep (a run of max_depth + 1 opens ends it early).  When a round removes nothing the
    brackets do not balance: the parser fails at the first close left, having gone no deeper than the
    opens before it plus the rounds done, which is what is bounded."""
    if text.count("[") + text.count("{") <= max_depth:
        return None
    outside = _STRING.sub("", text.replace("\\\\", "").replace('\\"', ""))
    brackets = outside.encode("ascii", "ignore").translate(None, _NOT_BRACKET).replace(b"{", b"[").replace(b"}", b"]")
    deep, rounds = b"[" * (max_depth + 1), 0
    while brackets:
        if rounds == max_depth or deep in brackets:
            return f"nested deeper than {max_depth} levels"
        fewer = brackets.replace(b"[]", b"")
        if len(fewer) == len(brackets):
            opens = len(brackets) - len(brackets.lstrip(b"["))
            return (f"nested deeper than {max_depth} levels, or brackets left unclosed"
                    if opens + rounds > max_depth else None)
        brackets, rounds = fewer, rounds + 1
    return None


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string or key anywhere in `value` holds a surrogate (after parsing, pairs are joined)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE_CHAR.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
