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

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from .diagnostics import VGraphError
from .ir import Graph


@dataclass(frozen=True)
class Option:
    """A declared pass option: its type parses the text of a pipeline spec."""

    type: Callable[[str], Any] = str
    default: Any = None
    doc: str = ""
    choices: tuple[Any, ...] | None = None

    def parse(self, pass_name: str, key: str, text: str) -> Any:
        try:
            value = _parse_bool(text) if self.type is bool else self.type(text)
        except (TypeError, ValueError):
            raise PassError(f"pass {pass_name!r}: option {key}={text!r} is not a valid "
                            f"{getattr(self.type, '__name__', 'value')}") from None
        if self.choices is not None and value not in self.choices:
            raise PassError(f"pass {pass_name!r}: option {key}={text!r} must be one of "
                            f"{', '.join(map(str, self.choices))}")
        return value


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
    invalidates: ClassVar[tuple[str, ...]] = ()  # earlier passes whose results this undoes
    options: ClassVar[dict[str, Option]] = {}
    origin: ClassVar[str] = ""  # set by discovery: the distribution or file it came from
    # Does the rewritten network compute the same function, with the same (possibly fused) weights?
    # Fusions, precision annotation, dead-node removal and placement do; an architecture swap does
    # not.  The default is False because a wrong True lets a checkpoint silently describe another
    # function, while a wrong False only makes a run store the network it trained: a pass earns True
    # by declaring it.  The pass manager records every non-preserving pass that changed the graph.
    preserves_semantics: ClassVar[bool] = False

    def __init__(self, **opts: Any) -> None:
        unknown = set(opts) - set(self.options)
        if unknown:
            raise PassError(f"pass {self.name!r} has no option {', '.join(sorted(unknown))} "
                            f"(options: {', '.join(self.options) or 'none'})")
        self.opts = {k: o.default for k, o in self.options.items()}
        for key, value in opts.items():
            opt = self.options[key]
            self.opts[key] = opt.parse(self.name, key, value) if isinstance(value, str) else value

    @classmethod
    def doc(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    def run(self, graph: Graph, ctx: PassContext) -> Counter | dict[str, int] | None:
        raise NotImplementedError(f"pass {self.name!r} does not implement run()")

    def spec(self) -> str:
        """This pass as pipeline text, with the options that differ from the defaults."""
        changed = {k: v for k, v in self.opts.items() if v != self.options[k].default}
        inner = ",".join(f"{k}={v}" for k, v in changed.items())
        return f"{self.name}{{{inner}}}" if inner else self.name

    def __repr__(self) -> str:
        return f"<pass {self.spec()}>"


LOCAL_PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator for passes defined in a local plugin file or in code."""
    if not cls.name:
        raise PassError(f"{cls.__qualname__}: a pass needs a non-empty `name`")
    if not cls.origin:
        import inspect

        cls.origin = inspect.getsourcefile(cls) or cls.__module__
    LOCAL_PASSES[cls.name] = cls
    return cls
