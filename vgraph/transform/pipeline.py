"""The pass manager: pipelines as values and text, dependency order, verification, instruments.

    fuse-heads,fuse-lm-head-ce,precision{target=cuda-sm80}

Passes run in the order written unless a declared dependency says otherwise
(a stable topological sort); a cycle or an unknown pass is an error before
anything runs.  After every pass the IR is verified (a pass that breaks the
graph is named), and instruments observe each run: timing, node counts and
change counts by default, a YAML (and SVG) dump per pass on request.
"""
from __future__ import annotations

import hashlib
import heapq
import os
import pickle
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from vgraph.base.diagnostics import Diagnostic, VGraphError
from vgraph.base.gcpause import paused_gc
from vgraph.ir.graph import Graph
from vgraph.plugins import Plugin, discover, guarded, shown
from vgraph.transform.pass_api import LOCAL_PASSES, Pass, PassContext, PassError, check_pass_name

APPLIED = "applied_passes"  # graph.meta key: names of passes whose results hold
# graph.meta key: the passes that changed what the network computes, in the order they ran, each
# {"pass": name, "spec": pipeline text with options, "origin": distribution or file}.  Empty or
# absent: the graph computes what the YAML it was loaded from computes (fusions keep `fused_from`,
# so its weights map back).  A trainer stores such a graph with its checkpoints.
SEMANTIC_CHANGES = "semantic_changes"
BOOKKEEPING = (APPLIED, SEMANTIC_CHANGES)  # meta the manager writes; not a pass's change


# -- finding passes -----------------------------------------------------------------

@dataclass(frozen=True)
class PassInfo:
    name: str
    origin: str
    plugin: Plugin | None = None
    cls: type[Pass] | None = None
    builtin: bool = False  # registered by vgraph itself
    overrides: str = ""  # the origin of the built-in pass of the same name this one replaces

    def load(self) -> type[Pass]:
        if self.cls is not None:
            return self.cls
        assert self.plugin is not None
        cls = self.plugin.load()
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise PassError(f"plugin {self.name!r} from {self.origin!r} is not a vgraph Pass class")
        if cls.name != self.name:
            raise PassError(f"plugin {self.name!r} from {self.origin!r} loads a pass named {cls.name!r}")
        cls.origin = self.origin
        return cls


def available_passes() -> dict[str, PassInfo]:
    """Every pass by name: entry points (not imported) and locally registered ones.

    A name belongs to one pass.  A plugin pass named like a built-in is
    refused unless its class says `overrides = "<that name>"`; two plugins
    claiming one name are refused: silently running another pass than the
    one the user named is the one thing a pipeline must never do.
    """
    found: dict[str, PassInfo] = {}
    for plugin in discover("vgraph.passes"):
        check_pass_name(plugin.name, plugin.who)
        info = PassInfo(plugin.name, plugin.origin, plugin=plugin, builtin=plugin.builtin)
        found[plugin.name] = _claim(found.get(plugin.name), info)
    for name, cls in LOCAL_PASSES.items():
        found[name] = _claim(found.get(name), PassInfo(name, cls.origin or "local", cls=cls))
    return dict(sorted(found.items()))


def _claim(current: PassInfo | None, new: PassInfo) -> PassInfo:
    """Who gets a pass name both `current` and `new` claim (see `available_passes`)."""
    if current is None or current.cls is new.cls is not None:
        return new
    if new.builtin and not current.builtin:
        current, new = new, current
    if not current.builtin:
        raise PassError(f"pass {new.name!r} is defined twice: by {current.origin} and by {new.origin}; "
                        f"uninstall or rename one of them")
    if new.load() is current.load():
        return current  # the built-in class itself, registered again in code
    if getattr(new.load(), "overrides", None) != new.name:
        raise PassError(f"pass {new.name!r} from {new.origin} has the name of a built-in pass "
                        f"({current.origin}); rename it, or set `overrides = {new.name!r}` in its class to "
                        f"replace the built-in (vgraph then says so on every run)")
    return replace(new, overrides=current.origin)


_announced: set[str] = set()


def get_pass(name: str) -> type[Pass]:
    passes = available_passes()
    if name not in passes:
        from vgraph.ops.schema import suggest

        raise PassError(f"unknown pass {name!r}{suggest(name, passes)}; "
                        f"available: {', '.join(passes) or 'none'}")
    info = passes[name]
    if info.overrides and name not in _announced:
        _announced.add(name)  # once per process: every run says it, no run says it twice
        print(f"warning: pass {name!r} is {info.origin}'s, which overrides the built-in pass of "
              f"{info.overrides}", file=sys.stderr)
    return info.load()


# -- pipeline text ----------------------------------------------------------------------

_ITEM = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


MAX_PIPELINE_PASSES = 1000  # a pipeline is a handful of passes; each runs and verifies the whole graph


def parse_pipeline(spec: str) -> list[tuple[str, dict[str, str]]]:
    """'a,b{k=v,k2=v2}' -> [('a', {}), ('b', {'k': 'v', 'k2': 'v2'})].  At most MAX_PIPELINE_PASSES items:
    a run naming 30,000 passes kept `report` and `generate` busy for minutes (each pass verifies the graph)."""
    out: list[tuple[str, dict[str, str]]] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        if len(out) >= MAX_PIPELINE_PASSES:
            raise PassError(f"pipeline {spec[:60]!r}...: more than {MAX_PIPELINE_PASSES} passes; a pipeline names "
                            f"each pass it runs, a handful in practice")
        m = _ITEM.match(spec, pos)
        if not m or m.end() == pos:
            raise PassError(f"pipeline {spec!r}: cannot parse at column {pos + 1}: {spec[pos:]!r} "
                            f"(expected name or name{{key=value,...}}, comma separated)")
        opts: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                raise PassError(f"pipeline {spec!r}: option {part!r} of {m.group(1)!r} is not key=value")
            if key.strip() in opts:  # which one would win was the parser's accident: say so instead
                raise PassError(f"pipeline {spec!r}: option {key.strip()!r} of {m.group(1)!r} is given twice")
            opts[key.strip()] = value.strip()
        out.append((m.group(1), opts))
        pos = m.end()
    return out


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # what the text form can name (_ITEM's name group)
_KEY = re.compile(r"[^\s,{}=][^,{}=]*[^\s,{}=]|[^\s,{}=]")  # an option key the text form carries unchanged
_VALUE = re.compile(r"(?:[^\s,{}][^,{}]*[^\s,{}]|[^\s,{}])?")  # a value likewise ('' allowed: `k=`)


@dataclass(frozen=True)
class Step:
    """One pass of a pipeline with the options written for it (text values, as pipeline text gives them)."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # Refused here, not when printed: every Step's text form parses back to an equal Step.
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise PassError(f"pass name {self.name!r}: letters, digits, '_', '.' and '-' only")
        keys = [k for k, _ in self.options]
        for key, value in self.options:
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise PassError(f"pass {self.name!r}: option name {key!r} is empty, has ',', '{{', '}}' or '=', "
                                f"or starts or ends with a space")
            if not isinstance(value, str) or not _VALUE.fullmatch(value):
                raise PassError(f"pass {self.name!r}: option {key}={value!r} has ',', '{{' or '}}', or starts or "
                                f"ends with a space (pipeline text could not carry it)")
        if len(set(keys)) != len(keys):
            raise PassError(f"pass {self.name!r}: an option is given twice ({', '.join(keys)})")

    @property
    def opts(self) -> dict[str, str]:
        return dict(self.options)

    def __str__(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}{{{inner}}}" if inner else self.name


def _text(value: object) -> str:
    """An option value as pipeline text: bools as the option parser reads them, the rest as str()."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Pipeline:
    """A pass pipeline as a value: code builds these (`insert`, `with_options`), pipeline text is only input
    (`--passes`, read by `Pipeline.parse`) and the form written to a run's files (`str`).

        Pipeline.parse("dead-nodes,fuse-heads").insert("partition", after="dead-nodes", batch=8)
        -> dead-nodes,partition{batch=8},fuse-heads
    """

    steps: tuple[Step, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))  # a list given stays the caller's, not ours
        bad = [step for step in self.steps if not isinstance(step, Step)]
        if bad:
            raise PassError(f"a Pipeline holds Steps, not {type(bad[0]).__name__} ({bad[0]!r}): read text with "
                            f"Pipeline.parse")

    @classmethod
    def of(cls, *names: str) -> Pipeline:
        """The passes `names`, each with its default options."""
        return cls(tuple(Step(n) for n in names))

    @classmethod
    def parse(cls, text: str) -> Pipeline:
        """Pipeline text ('a,b{k=v}'; '' is the empty pipeline); a PassError says where it is malformed."""
        return cls(tuple(Step(name, tuple(opts.items())) for name, opts in parse_pipeline(text)))

    @classmethod
    def of_passes(cls, passes: Iterable[Pass]) -> Pipeline:
        """The pipeline that builds `passes` again: each with the options it sets away from the defaults."""
        return cls(tuple(Step(p.name, tuple((k, _text(v)) for k, v in p.changed_options().items()))
                         for p in passes))

    @property
    def names(self) -> list[str]:
        return [step.name for step in self.steps]

    def __str__(self) -> str:
        return ",".join(map(str, self.steps))

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __contains__(self, name: object) -> bool:
        return any(step.name == name for step in self.steps)

    def __add__(self, other: Pipeline) -> Pipeline:
        if not isinstance(other, Pipeline):
            return NotImplemented
        return Pipeline(self.steps + other.steps)

    def index(self, name: str) -> int:
        """Where the first pass named `name` stands; a PassError if none does."""
        for i, step in enumerate(self.steps):
            if step.name == name:
                return i
        raise PassError(f"pipeline {str(self)!r} has no pass {name!r}")

    def insert(self, name: str, *, before: str | Sequence[str] = (), after: str | Sequence[str] = (),
               **options: object) -> Pipeline:
        """This pipeline with pass `name` added: right after the last pass named in `after` that is present,
        else right before the first one named in `before` that is present, else at the end (a pass also
        runs in its declared order, `requires`/`after`/`before`, whatever its place)."""
        step = Step(name, tuple((k, _text(v)) for k, v in options.items()))
        after, before = _names(after), _names(before)
        at = max((i + 1 for i, s in enumerate(self.steps) if s.name in after), default=None)
        if at is None:
            at = min((i for i, s in enumerate(self.steps) if s.name in before), default=len(self.steps))
        return Pipeline(self.steps[:at] + (step,) + self.steps[at:])

    def with_options(self, name: str, **options: object) -> Pipeline:
        """Every pass named `name` with `options` set (over the ones written); a PassError if none is there."""
        self.index(name)
        return Pipeline(tuple(Step(s.name, tuple({**s.opts, **{k: _text(v) for k, v in options.items()}}.items()))
                              if s.name == name else s for s in self.steps))

    def without(self, name: str) -> Pipeline:
        """This pipeline less every pass named `name`."""
        return Pipeline(tuple(s for s in self.steps if s.name != name))

    def split(self, name: str) -> tuple[Pipeline, Step, Pipeline]:
        """(the passes before the first `name`, that pass, the passes after it)."""
        at = self.index(name)
        return Pipeline(self.steps[:at]), self.steps[at], Pipeline(self.steps[at + 1:])


DEFAULT_PIPELINE = Pipeline.of("dead-nodes", "precision", "fuse-heads", "fuse-lm-head-ce")  # the production one


def options_naming_files(spec: str | Pipeline) -> list[str]:
    """The `pass{option=value}` items of `spec` whose option names a file the pass would open
    (`Option.names_file`): a reader of someone else's run (`vgraph report`) must not run those."""
    named = []
    for step in Pipeline.parse(spec) if isinstance(spec, str) else spec:
        declared = get_pass(step.name).options
        named += [f"{step.name}{{{key}={value}}}" for key, value in step.options
                  if key in declared and declared[key].names_file]
    return named


def build_pipeline(spec: Pipeline | str | Sequence[str | Pass] | None) -> list[Pass]:
    """Pass instances from a Pipeline, its text, names or instances (None: the default pipeline)."""
    if spec is None:
        spec = DEFAULT_PIPELINE
    if isinstance(spec, str):
        spec = Pipeline.parse(spec)
    items: list[Pass] = []
    if isinstance(spec, Pipeline):
        classes: dict[str, type[Pass]] = {}  # one look-up per name, not per item
        for step in spec:
            if step.name not in classes:
                classes[step.name] = get_pass(step.name)
            items.append(classes[step.name](**step.opts))
    else:
        for item in spec:
            items.extend(build_pipeline(item) if isinstance(item, str) else [item])
    return items


def must_follow(p: Pass, q: Pass) -> str | None:
    """Why `p` must run after `q` when both are in one pipeline (None: nothing they declare says so)."""
    if q.name in p.requires:
        return f"{p.name!r} requires {q.name!r}"
    if q.name in p.after:
        return f"{p.name!r} declares after={q.name!r}"
    if p.name in getattr(q, "before", ()):
        return f"{q.name!r} declares before={p.name!r}"
    return None


MAX_ORDER_NOTES = 20  # pairs named one by one; the rest counted (a long pipeline could name n^2 pairs)


def order_notes(written: Sequence[Pass], ordered: Sequence[Pass]) -> list[str]:
    """One line per pair of passes that runs in the opposite order to the one written, and why: the first
    MAX_ORDER_NOTES pairs in written order, then how many more.  O(n log n + MAX_ORDER_NOTES x n)."""
    at = {id(p): i for i, p in enumerate(ordered)}
    pos = [at[id(p)] for p in written]
    later_min = [len(pos)] * (len(pos) + 1)  # later_min[i]: the earliest run position among written[i:]
    for i in range(len(pos) - 1, -1, -1):
        later_min[i] = min(pos[i], later_min[i + 1])
    notes: list[str] = []
    for i, p in enumerate(written):
        if len(notes) >= MAX_ORDER_NOTES:
            break
        if later_min[i + 1] > pos[i]:
            continue  # nothing written after p runs before it
        for j in range(i + 1, len(written)):
            if pos[j] < pos[i]:
                q = written[j]
                why = must_follow(p, q) or "through the order other passes in the pipeline declare"
                notes.append(f"pipeline order: {q.spec()!r} runs before {p.spec()!r}, although written "
                             f"after it: {why}")
                if len(notes) >= MAX_ORDER_NOTES:
                    break
    more = _inversions(pos) - len(notes)
    if more > 0:
        notes.append(f"pipeline order: {more:,} more pair(s) of passes run in the opposite order to the one written")
    return notes


def _inversions(pos: Sequence[int]) -> int:
    """Pairs i < j with pos[j] < pos[i] (a Fenwick tree over the positions: O(n log n))."""
    tree = [0] * (len(pos) + 1)
    count = 0
    for seen, x in enumerate(pos):
        k, below = x + 1, 0  # how many earlier entries are at most x
        while k > 0:
            below += tree[k]
            k -= k & -k
        count += seen - below
        k = x + 1
        while k <= len(pos):
            tree[k] += 1
            k += k & -k
    return count


def _names(value: object) -> tuple[str, ...]:
    """A pass's `requires`/`after`/`before` as names (a lone string is one name)."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def order_pipeline(passes: list[Pass], applied: Iterable[str] = ()) -> list[Pass]:
    """Stable topological order by `requires`/`after`/`before`; errors for cycles and missing passes.

    The order is the one that repeatedly runs the first pass (as written) whose predecessors have all run
    (Kahn's algorithm on a heap of indices).  Pass i must follow pass j != i when j's name is in i's
    `requires` or `after`, or i's name in j's `before`; each such set of passes is one group whose
    completion is counted, so the work is linear in passes and declared names (times log n), not in
    pairs of passes: a run naming 30,000 passes had `report` and `generate` busy for minutes."""
    by_name: dict[str, list[int]] = {}
    for i, p in enumerate(passes):
        by_name.setdefault(p.name, []).append(i)
    done = set(applied)
    for p in passes:
        missing = [r for r in _names(p.requires) if r not in by_name and r not in done]
        if missing:
            raise PassError(f"pass {p.name!r} requires {', '.join(map(repr, missing))}, which is "
                            f"not in the pipeline: add it before {p.name!r}")
    # Groups: ("name", r) = the passes named r; ("before", b) = the passes declaring before=b.
    members: dict[tuple[str, str], list[int]] = {("name", r): ix for r, ix in by_name.items()}
    for j, q in enumerate(passes):
        for b in dict.fromkeys(_names(getattr(q, "before", ()))):
            if b in by_name:
                members.setdefault(("before", b), []).append(j)
    waits: list[set[tuple[str, str]]] = []
    dependents: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(passes):
        groups = {("name", r) for r in (*_names(p.requires), *_names(p.after)) if r in by_name}
        if ("before", p.name) in members:
            groups.add(("before", p.name))
        waits.append(groups)
        for g in groups:
            dependents.setdefault(g, []).append(i)
    return [passes[i] for i in _kahn(passes, members, dependents, waits)]


def _kahn(passes: Sequence[Pass], members: dict, dependents: dict, waits: list[set]) -> list[int]:
    """The smallest ready index first; a dependent of a group waits for its members other than itself."""
    blocked = [len(g) for g in waits]
    left = {g: len(m) for g, m in members.items()}
    finished = [False] * len(passes)
    ready: list[int] = []

    def release(i: int) -> None:
        blocked[i] -= 1
        if blocked[i] == 0:
            heapq.heappush(ready, i)

    def settle(g: tuple[str, str]) -> None:
        """After `g`'s count changed: release who waits for it (its last member waits only for the others)."""
        if left[g] == 1:
            last = next(m for m in members[g] if not finished[m])
            if g in waits[last]:
                release(last)
        elif left[g] == 0:
            for i in dependents.get(g, ()):
                if not finished[i] and i not in members_set(g):
                    release(i)

    member_sets: dict[tuple[str, str], set[int]] = {}

    def members_set(g: tuple[str, str]) -> set[int]:
        if g not in member_sets:
            member_sets[g] = set(members[g])
        return member_sets[g]

    for i, b in enumerate(blocked):
        if b == 0:
            ready.append(i)
    heapq.heapify(ready)
    for g in members:
        if g in dependents:
            settle(g)
    belongs: dict[int, list[tuple[str, str]]] = {}
    for g, ix in members.items():
        for m in ix:
            belongs.setdefault(m, []).append(g)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        finished[i] = True
        for g in belongs.get(i, ()):
            left[g] -= 1
            if g in dependents:
                settle(g)
    if len(order) < len(passes):
        cycle = " -> ".join(p.name for k, p in enumerate(passes) if not finished[k])
        raise PassError(f"pass dependencies form a cycle among: {cycle}")
    return order


# -- running ---------------------------------------------------------------------------------

@dataclass
class PassRecord:
    name: str
    spec: str
    seconds: float
    nodes_before: int
    nodes_after: int
    changed: bool
    changes: dict[str, int] = field(default_factory=dict)
    preserves_semantics: bool = True


class Instrument(Protocol):
    def before(self, index: int, p: Pass, graph: Graph) -> None: ...
    def after(self, index: int, p: Pass, graph: Graph, record: PassRecord) -> None: ...


class DumpInstrument:
    """Writes the graph after each pass as DIR/NN_passname.yml, and its drawing as NN_passname.svg when given
    a `draw` function (the CLI passes Graphviz's; the pass manager itself draws nothing, so the transform
    layer never imports the report layer).

    DIR is an `OutputDir` (base/safeio.py): no dump replaces one of `inputs` (the network being optimised
    may be DIR/00_input.yml) or a file the dumps did not write there."""

    def __init__(self, directory: str | Path, draw: Callable[[Graph], str] | None = None,
                 inputs: Sequence[str | Path | None] = ()) -> None:
        from vgraph.base.safeio import OutputDir

        self.out = OutputDir(directory, command="optimize --dump-dir", inputs=inputs)
        self.dir = self.out.path
        self.draw = draw

    def before(self, index: int, p: Pass, graph: Graph) -> None:
        if index == 0:
            self._write(graph, "00_input")

    def after(self, index: int, p: Pass, graph: Graph, record: PassRecord) -> None:
        self._write(graph, f"{index + 1:02d}_{p.name}")

    def _write(self, graph: Graph, stem: str) -> None:
        from vgraph.yamlio import save

        save(graph, self.out.check(f"{stem}.yml"))
        self.out.wrote(f"{stem}.yml")
        if self.draw is None:
            return
        try:
            svg = self.draw(graph)
        except VGraphError:
            self.draw = None  # no Graphviz here: YAML dumps only
            return
        self.out.write(f"{stem}.svg", svg)


def fingerprint(graph: Graph) -> str:
    """A digest of everything a pass can change: nodes, config, annotations, edges, endpoints.

    Pickle serialises the node records in C (a repr-based digest cost a quarter
    of the whole pipeline); edges are compared as a set, so re-adding the same
    edge is not a change.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(pickle.dumps([(n.id, n.type, n.config, n.input_shapes, n.output_shapes, n.meta)
                           for n in graph.nodes], protocol=pickle.HIGHEST_PROTOCOL))
    edges = frozenset((e.src, e.src_slot, e.dst, e.dst_slot) for e in graph.edges)
    h.update(hash(edges).to_bytes(8, "little", signed=True))
    h.update(pickle.dumps((graph.name, graph.attrs, dict(graph.endpoints),
                           {k: v for k, v in graph.meta.items() if k not in BOOKKEEPING})))
    return h.hexdigest()


class LintInstrument:
    """Debug mode: `Graph.lint()` after every pass, so a pass that corrupts the use-def storage (by reaching
    around `Graph`'s methods) is named at once instead of by whatever trips over it later."""

    def before(self, index: int, p: Pass, graph: Graph) -> None:
        if index == 0:
            graph.lint()

    def after(self, index: int, p: Pass, graph: Graph, record: PassRecord) -> None:
        try:
            graph.lint()
        except VGraphError as exc:
            raise VGraphError([Diagnostic(f"pass {p.spec()!r} broke the graph's use-def links:")]
                              + exc.diagnostics) from None


def debug_mode() -> bool:
    """VGRAPH_DEBUG=1 (the test suite sets it): pass managers lint the graph after every pass."""
    return os.environ.get("VGRAPH_DEBUG", "").strip().lower() in ("1", "true", "yes")


class PassManager:
    def __init__(self, passes: str | Sequence[str | Pass] | None = None, *, verify: bool = True,
                 instruments: Sequence[Instrument] = (), ctx: PassContext | None = None,
                 debug: bool | None = None) -> None:
        self.passes = build_pipeline(passes)
        self.verify = verify
        self.instruments = list(instruments)
        if debug_mode() if debug is None else debug:
            self.instruments.insert(0, LintInstrument())
        self.ctx = ctx or PassContext()
        self.records: list[PassRecord] = []

    def run(self, graph: Graph) -> Graph:
        """Run the pipeline in place; returns the graph for chaining."""
        with paused_gc():
            return self._run(graph)

    def _run(self, graph: Graph) -> Graph:
        from vgraph.ir.verify import verify as verify_graph

        applied: list[str] = graph.meta.setdefault(APPLIED, [])
        current_fp = fingerprint(graph)  # each pass's "after" is the next one's "before"
        ordered = order_pipeline(self.passes, applied)
        self.ctx.notes.extend(order_notes(self.passes, ordered))  # never reorder without a word
        for index, p in enumerate(ordered):
            for inst in self.instruments:
                inst.before(index, p, graph)
            before_fp, before_n = current_fp, len(graph)
            start = time.perf_counter()
            counts = run_pass(p, graph, self.ctx)
            seconds = time.perf_counter() - start
            if self.verify:
                try:
                    verify_graph(graph)
                except VGraphError as exc:
                    raise VGraphError([Diagnostic(f"pass {p.spec()!r} broke the graph:")]
                                      + exc.diagnostics) from None
            for gone in p.invalidates:
                if gone in applied:
                    applied.remove(gone)
            if p.name not in applied:
                applied.append(p.name)
            current_fp = fingerprint(graph)
            changed = current_fp != before_fp
            record = PassRecord(p.name, p.spec(), seconds, before_n, len(graph), changed,
                                {k: v for k, v in Counter(counts).items() if v}, p.preserves_semantics)
            if changed and not p.preserves_semantics:
                graph.meta.setdefault(SEMANTIC_CHANGES, []).append(
                    {"pass": p.name, "spec": p.spec(), "origin": p.origin or "local",
                     "keeps_weights": p.keeps_weights})
                self.ctx.notes.append(f"{p.spec()}: changed what the network computes (the pass does not declare "
                                      f"preserves_semantics); " + (
                                          "it keeps every weight, so checkpoints of the network as given still fit"
                                          if p.keeps_weights else "weights trained before it do not fit the result"))
            self.records.append(record)
            for inst in self.instruments:
                inst.after(index, p, graph, record)
        return graph

    def report(self) -> str:
        rows = [("pass", "time ms", "nodes", "changed", "changes")]
        for r in self.records:
            rows.append((r.spec, f"{r.seconds * 1e3:.2f}", f"{r.nodes_before} -> {r.nodes_after}",
                         "yes" if r.changed else "no",
                         ", ".join(f"{k}={v}" for k, v in sorted(r.changes.items())) or "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def run_pass(p: Pass, graph: Graph, ctx: PassContext) -> dict[str, int]:
    """`p.run`, its counts checked; a plugin pass that raises (or exits) is named in a diagnostic."""
    if type(p).__module__.startswith("vgraph."):
        counts = p.run(graph, ctx)  # a built-in's exception is vgraph's bug: keep its traceback
    else:
        who = f"pass {p.spec()!r} ({p.origin or type(p).__module__})"
        counts = guarded(who, "while running", lambda: p.run(graph, ctx))
    if counts is None:
        return {}
    if not isinstance(counts, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in counts.items()):
        raise PassError(f"pass {p.spec()!r} ({p.origin or type(p).__module__}) returned "
                        f"{shown(repr(counts)[:80])}; a pass returns counts of what it did: a Counter or "
                        f"dict of str -> int, or None")
    return dict(counts)


def semantic_changes(graph: Graph) -> list[str]:
    """Pipeline specs of the passes that changed what `graph` computes (empty: the same function)."""
    return [change["spec"] for change in graph.meta.get(SEMANTIC_CHANGES, ())]


def run_pipeline(graph: Graph, passes: str | Sequence[str | Pass] | None = None, *,
                 target: str | None = None, explain: bool = False, dump_dir: str | Path | None = None,
                 verify: bool = True, data: dict | None = None,
                 instruments: Sequence[Instrument] = ()) -> PassManager:
    """Convenience: run a pipeline on `graph` in place and return the manager (records, report).
    `dump_dir` dumps YAML after each pass; pass a `DumpInstrument` with a drawer for SVGs too."""
    ctx = PassContext(target=target, explain=explain, data=dict(data or {}))
    instruments = [*instruments, *([DumpInstrument(dump_dir)] if dump_dir else [])]
    pm = PassManager(passes, verify=verify, instruments=instruments, ctx=ctx)
    pm.run(graph)
    return pm
