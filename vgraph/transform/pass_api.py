"""What a pass is.

A pass is declared once, as a class: its name, a one-line doc (the first
line of the docstring), the passes it requires before it and those it must
run after when both are present, the annotations it invalidates, and its
options.  `run` mutates the graph through the Graph API and returns counts
of what it did, per kind of change; the pass manager decides whether the
graph changed by comparing it, not by trusting those counts.

Passes are found like any plugin: entry points in the `vgraph.passes` group
(the built-ins register there too), or `@register_pass` in a file loaded with
`--plugin`.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.numbers import NumberError, checked_number
from vgraph.base.options import MAX_COUNT
from vgraph.ir.graph import Graph


@dataclass(frozen=True)
class Option:
    """A declared pass option: its type parses the text of a pipeline spec.

    `choices` (a closed set) or `min`/`max` (a numeric range) say which values
    are allowed; `vgraph passes` shows them.  Every value is checked the same
    way whether it comes from pipeline text or from code.
    """

    type: Callable[[str], Any] = str
    default: Any = None
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    names_file: bool = False  # the value is a path the pass opens (a pipeline read from a run may not set it)

    @property
    def type_name(self) -> str:
        return getattr(self.type, "__name__", "value")

    def allowed(self) -> str:
        """The allowed values in words ('' when any value of the type is)."""
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        if self.min is not None and self.max is not None:
            return f"{self.min} to {self.max}"
        if self.min is not None:
            return f">= {self.min}"
        return f"<= {self.max}" if self.max is not None else ""

    def parse(self, pass_name: str, key: str, text: str) -> Any:
        """The value of pipeline text `text` for this option, checked."""
        return self.check(pass_name, key, text)

    def check(self, pass_name: str, key: str, value: Any) -> Any:
        """`value` (text to parse, or a value from code) as this option's type, or a PassError saying why not."""
        given = value

        def bad(why: str) -> PassError:
            return PassError(f"pass {pass_name!r}: option {key}={quote(given)} {why}")

        if isinstance(value, str):
            if not value:
                raise bad("is empty (give a value, or leave the option out for its default)")
            if not value.isprintable():
                raise bad("contains control characters")
            try:
                value = _parse_bool(value) if self.type is bool else self.type(value)
            except (TypeError, ValueError, OverflowError):
                raise bad(f"is not a valid {self.type_name}") from None
        elif value is None and self.default is None:
            return None
        elif self.type in _PLAIN and not _is_a(value, self.type):
            raise bad(f"is not a valid {self.type_name}")
        elif self.type is float:
            value = float(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise bad("must be a finite number")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:  # an option with no declared range still holds no count past 2**62 and no subnormal
                checked_number(value, integer=isinstance(value, int), low=None if self.min is not None else -MAX_COUNT,
                               high=None if self.max is not None else MAX_COUNT)
            except NumberError as exc:
                raise bad(str(exc).replace("value ", "", 1)) from None
        if self.choices is not None and value not in self.choices:
            raise bad(f"must be {self.allowed()}")
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise bad(f"must be {self.allowed()}")
        return value


_PLAIN = (int, float, str, bool)


def _is_a(value: Any, type_: type) -> bool:
    """isinstance, except that a bool is not a number and an int is a float."""
    if isinstance(value, bool):
        return type_ is bool
    return isinstance(value, (int, float) if type_ is float else type_)


def _parse_bool(text: str) -> bool:
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


class PassError(VGraphError):
    """A pipeline that cannot run as asked (unknown pass or option, cycle, ...)."""


@dataclass
class PassContext:
    """What a pass may consult besides the graph.

    `target` is the compile target ('cpu', 'cuda-sm80', ...) when a backend
    or the user named one; `explain` asks rewrites to record why they did not
    match; `notes` collects human-readable remarks for the user.
    """

    target: str | None = None
    explain: bool = False
    explanations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # e.g. a fleet for partitioning


class Pass:
    """Base class of passes.  Subclasses set `name` and implement `run`."""

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()  # must have run before (in this pipeline or earlier)
    after: ClassVar[tuple[str, ...]] = ()  # if also in the pipeline, run after these
    before: ClassVar[tuple[str, ...]] = ()  # if also in the pipeline, run before these
    # A plugin pass named like a built-in replaces it only when it says so (`overrides = "<name>"`):
    # vgraph refuses the clash otherwise, and announces the override on every run.
    overrides: ClassVar[str] = ""
    invalidates: ClassVar[tuple[str, ...]] = ()  # earlier passes whose results this undoes
    options: ClassVar[dict[str, Option]] = {}
    origin: ClassVar[str] = ""  # set by discovery: the distribution or file it came from
    # Does the rewritten network compute the same function, with the same (possibly fused) weights?
    # Fusions, precision annotation, dead-node removal and placement do; an architecture swap does
    # not.  The default is False because a wrong True lets a checkpoint silently describe another
    # function, while a wrong False only makes a run store the network it trained: a pass earns True
    # by declaring it.  The pass manager records every non-preserving pass that changed the graph.
    preserves_semantics: ClassVar[bool] = False
    # Does it rewrite VNodes into fused ones that record `fused_from` (so weights map through
    # `vgraph.run.layout`)?  A preserving pass that does is run on both sides when a checkpoint is matched
    # with a network (`vgraph.run.network_match`), so weights trained with or without it fit either form.
    # Rule-based passes (`RewritePass`) do; a hand-written `run()` fusion says so.
    fuses: ClassVar[bool] = False
    # A pass that changes the function may still leave every weight as it was: it adds no weighted VNode and
    # changes, fuses or removes none (compress-boundary rounds what crosses a cut).  Checkpoints of the
    # network as given then fit the rewritten one, and a run trained through it is a run of the network as
    # given.  Meaningful only with preserves_semantics False; earned by declaring it, like that one.
    keeps_weights: ClassVar[bool] = False

    def __init__(self, **opts: Any) -> None:
        unknown = set(opts) - set(self.options)
        if unknown:
            raise PassError(f"pass {self.name!r} has no option {', '.join(sorted(unknown))} "
                            f"(options: {', '.join(self.options) or 'none'})")
        self.opts = {k: o.default for k, o in self.options.items()}
        for key, value in opts.items():
            self.opts[key] = self.options[key].check(self.name, key, value)

    @classmethod
    def doc(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    def run(self, graph: Graph, ctx: PassContext) -> Counter | dict[str, int] | None:
        raise NotImplementedError(f"pass {self.name!r} does not implement run()")

    def changed_options(self) -> dict[str, Any]:
        """The options this instance sets away from their defaults (what its pipeline text must say)."""
        return {k: v for k, v in self.opts.items() if v != self.options[k].default}

    def spec(self) -> str:
        """This pass as pipeline text, with the options that differ from the defaults."""
        inner = ",".join(f"{k}={v}" for k, v in self.changed_options().items())
        return f"{self.name}{{{inner}}}" if inner else self.name

    def __repr__(self) -> str:
        return f"<pass {self.spec()}>"


LOCAL_PASSES: dict[str, type[Pass]] = {}


PASS_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")  # what pipeline text can name (pipeline.py's grammar)


def check_pass_name(name: object, who: str) -> str:
    """`name` if a pipeline can name it, else a PassError saying so about `who`: a name that is not text
    (`name = 5` sorted against the others was a TypeError traceback), or has spaces, braces, commas or
    control characters (registered, listed, and never runnable)."""
    if not isinstance(name, str) or not name:
        raise PassError(f"{who}: a pass needs a `name` that is text, got {quote(name)}")
    if not PASS_NAME.fullmatch(name):
        raise PassError(f"{who}: pass name {quote(name)} cannot be named in a pipeline: use letters, digits, "
                        f"'-', '_' and '.' (at most 100)")
    return name


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator for passes defined in a local plugin file or in code."""
    check_pass_name(getattr(cls, "name", None), cls.__qualname__)
    if not cls.origin:
        import inspect

        cls.origin = inspect.getsourcefile(cls) or cls.__module__
    LOCAL_PASSES[cls.name] = cls
    return cls
