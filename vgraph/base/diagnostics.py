"""Compiler-style diagnostics.

Every problem vgraph finds in a user's network is a `Diagnostic` that names
where it is (file, line) and which VNode it concerns, so a user can jump
straight to it.  Validation collects all of them before failing: a user fixing
a file wants the whole list, not one error per run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

MAX_MESSAGE_CHARS = 2000  # a diagnostic is one readable line: nothing it quotes may make it longer
MAX_DIAGNOSTICS = 1000  # a list longer than this is counted, not printed ("... and 4,497,500 more")
QUOTE_CHARS = 80  # how much of a user's value a message quotes


def printable(text: object, limit: int | None = None) -> str:
    """`text` safe to echo to a terminal or log: control, format and line-separator
    characters (escape sequences, newlines, bidi overrides) are written as
    Python escapes, so nothing a user wrote can move the cursor or forge a
    line; with `limit`, longer text is cut and says how much was left out."""
    s = str(text)
    if not s.isprintable():
        s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
    if limit is not None and len(s) > limit:
        s = f"{s[:limit]}... ({len(s) - limit} more characters)"
    return s


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """A user's value as a message quotes it: repr-like, escaped and cut to `limit` characters."""
    s = value if isinstance(value, str) else repr(value)
    return "'" + printable(s, limit) + "'"


@dataclass(frozen=True, order=True)
class SourceLoc:
    """Where something was written: a file and a 1-based line."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Diagnostic:
    message: str
    loc: SourceLoc | None = None
    node: str | None = None
    severity: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        # Everything a user wrote is escaped here, once, whoever built the message.
        where = f"{printable(self.loc)}: " if self.loc else ""
        what = f"node {quote(self.node, 200)}: " if self.node is not None else ""
        prefix = "warning: " if self.severity == "warning" else ""
        return f"{where}{prefix}{what}{printable(self.message, MAX_MESSAGE_CHARS)}"


class VGraphError(Exception):
    """A user-facing failure carrying one or more diagnostics.

    The CLI prints the diagnostics and exits 2; library callers can inspect
    `.diagnostics`.  It is never used for internal bugs.
    """

    def __init__(self, diagnostics: Iterable[Diagnostic] | str):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(diagnostics)]
        self.diagnostics: list[Diagnostic] = bounded(diagnostics)
        super().__init__("\n".join(str(d) for d in self.diagnostics))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]


@dataclass(frozen=True)
class NotListed(Diagnostic):
    """The line that counts the diagnostics a bounded list left out."""

    count: int = 0


def bounded(diagnostics: Iterable[Diagnostic], more: int = 0) -> list[Diagnostic]:
    """The first MAX_DIAGNOSTICS of `diagnostics`, then one line counting the rest (and `more` dropped
    earlier): a hostile file can make millions of mistakes, and printing them is a denial of service.
    Bounding a bounded list again keeps its count."""
    kept: list[Diagnostic] = []
    rest = more
    for d in diagnostics:
        if isinstance(d, NotListed):
            rest += d.count
        elif len(kept) < MAX_DIAGNOSTICS:
            kept.append(d)
        else:
            rest += 1
    if rest:
        kept.append(NotListed(f"... and {rest:,} more problem(s) not listed (the first {len(kept):,} are above)",
                              count=rest))
    return kept


class DiagnosticSink:
    """Collects diagnostics while a pipeline stage keeps going; keeps MAX_DIAGNOSTICS of them and counts
    the rest (`dropped`), so a file with millions of problems costs neither memory nor minutes."""

    def __init__(self) -> None:
        self.items: list[Diagnostic] = []
        self.dropped = 0
        self._errors = False

    def add(self, diagnostic: Diagnostic) -> None:
        self._errors = self._errors or diagnostic.severity == "error"
        if len(self.items) < MAX_DIAGNOSTICS:
            self.items.append(diagnostic)
        else:
            self.dropped += 1

    def error(self, message: str, loc: SourceLoc | None = None, node: str | None = None) -> None:
        self.add(Diagnostic(message, loc, node, "error"))

    def warning(self, message: str, loc: SourceLoc | None = None, node: str | None = None) -> None:
        self.add(Diagnostic(message, loc, node, "warning"))

    @property
    def has_errors(self) -> bool:
        return self._errors or any(d.severity == "error" for d in self.items)

    def sorted(self) -> list[Diagnostic]:
        """The kept diagnostics by file and line, and the count of the rest."""
        return bounded(sorted_diagnostics(self.items), self.dropped)

    def raise_if_errors(self) -> None:
        if self.has_errors:
            raise VGraphError(self.sorted())


def sorted_diagnostics(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Order by file and line, keeping discovery order for ties (stable)."""
    return sorted(diags, key=lambda d: (d.loc.file, d.loc.line) if d.loc else ("", 0))
