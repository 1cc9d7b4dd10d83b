"""What a command prints cannot drive the terminal.

Why: vgraph prints text that came from other people's files (node ids are
checked, but group names, config values, a network's name, plugin docs,
worker output are free text).  An escape sequence in any of them, echoed
raw, could recolour or clear the screen, rewrite earlier lines or set the
window title; a U+2028 or a bidi override could forge or hide text.  While a
command runs, `escaped_output` puts a filter in front of stdout and stderr
that writes every such character as a Python escape.  Newline, tab and
carriage return pass (tables and the progress bar need them).
"""
from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

# C0 controls but \t \n \r, DEL, C1 controls, line/paragraph separators, bidi embeddings/overrides/isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")


def _escape(match: re.Match) -> str:
    return repr(match.group())[1:-1]


def escape_controls(text: str) -> str:
    """`text` with every character that could drive a terminal written as an escape."""
    return _UNSAFE.sub(_escape, text)


class EscapingStream:
    """A text stream that escapes `escape_controls` characters on the way to the one it wraps."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(escape_controls(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding, fileno, ...
        return getattr(self._stream, name)


@contextmanager
def escaped_output() -> Iterator[None]:
    """Filter sys.stdout and sys.stderr for the duration of the block (idempotent when nested)."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, EscapingStream):
        sys.stdout = EscapingStream(sys.stdout)  # type: ignore[assignment]
    if not isinstance(sys.stderr, EscapingStream):
        sys.stderr = EscapingStream(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


__all__ = ["escaped_output", "escape_controls", "EscapingStream"]
