"""The stable API of docs/plugins.md section 6 is kept: no name goes without a deprecation shim that warns.

The names are parsed from the doc itself (so the promise and the check cannot
drift apart) and compared with `tests/stable_api.txt`, the snapshot of every
name ever promised.  A name leaves the API in two steps: it leaves section
6's stable list (it moves to the doc's "Deprecated" line), its old path keeps
working and warns with a DeprecationWarning, and the snapshot marks it
`deprecated <release>`; one release later it may go, from the code and the
snapshot together.  So this test fails when

* a name of the snapshot no longer resolves (removed without a shim),
* a deprecated name resolves without a DeprecationWarning (a silent shim),
* a stable name warns, or left the doc's stable list without being marked
  deprecated, or the doc's "Deprecated" line and the snapshot disagree,
* the doc promises a name the snapshot does not hold yet (add it: the
  snapshot only grows until a deprecation has run its course).

TESTING.md shows it failing on a removed name.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "plugins.md"
SNAPSHOT = Path(__file__).resolve().parent / "stable_api.txt"


# -- the doc ----------------------------------------------------------------------------------------

def section_6(text: str) -> str:
    match = re.search(r"^## 6\..*?$(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "docs/plugins.md has no section '## 6.'"
    return match.group(1)


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _bullets(text: str) -> list[str]:
    """Markdown bullets ('* ...' and their indented continuation lines), each as one line."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("* "):
            out.append(line[2:])
        elif out and line.startswith("  ") and line.strip():
            out[-1] += " " + line.strip()
        elif not line.strip() and out and out[-1] is not None:
            out.append("")  # a blank line ends a bullet
    return [b for b in out if b]


def _items(module: str, owner: str | None, rest: str) -> Iterator[str]:
    """Dotted names of one list: `A` (module.A), `A` (`x`, `y`) (its attributes), `A` and its fields,
    `A.x`, `y` (attributes of A from there on)."""
    for item in _split_top(rest, ","):
        found = re.match(r"\s*`([\w.]+)`(.*)", item, re.S)
        if not found:  # prose such as "the entry point groups above"
            continue
        name, tail = found.groups()
        if "." in name:
            owner, name = name.split(".", 1)
        if owner is not None:
            yield f"{module}.{owner}.{name}"
            continue
        yield f"{module}.{name}"
        attrs = re.match(r"\s*\((.*)\)", tail, re.S)
        for attr in re.findall(r"`(\w+)`", attrs.group(1)) if attrs else ():
            yield f"{module}.{name}.{attr}"
        if "and its fields" in tail:
            yield f"{module}.{name}.<fields>"


def stable_names(text: str) -> list[str]:
    """Every name section 6 declares stable, as a dotted path (`vgraph.Graph.nodes`); `<fields>` stands
    for a dataclass's fields."""
    stable = section_6(text).split("Everything else", 1)[0].split("Deprecated", 1)[0]
    names: list[str] = []
    for bullet in _bullets(stable):
        module: str | None = None
        for segment in _split_top(bullet, ";"):
            head = re.match(r"\s*`([\w.]+)`:\s*(.*)", segment, re.S)
            owner = None
            if head:
                module, rest = head.groups()
            elif segment.strip().startswith("The graph methods passes use:"):
                module, owner, rest = "vgraph", "Graph", segment.split(":", 1)[1]
            else:
                rest = segment
            if module is not None:
                names += _items(module, owner, rest)
    return list(dict.fromkeys(names))


def deprecated_in_doc(text: str) -> list[str]:
    """The dotted names on section 6's 'Deprecated' line(s)."""
    part = section_6(text).split("Everything else", 1)[0]
    if "Deprecated" not in part:
        return []
    return re.findall(r"`(vgraph(?:\.\w+)+)`", part.split("Deprecated", 1)[1])


# -- the snapshot -------------------------------------------------------------------------------------

def snapshot(path: Path = SNAPSHOT) -> dict[str, str | None]:
    """name -> the release that deprecated it (None: stable)."""
    out: dict[str, str | None] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        assert not rest or (len(rest) == 2 and rest[0] == "deprecated"), f"stable_api.txt: cannot read {line!r}"
        out[name] = rest[-1] if rest else None
    return out


# -- resolving a name -------------------------------------------------------------------------------

def _samples() -> dict[type, Any]:
    """An instance of each class whose stable attributes are instance attributes."""
    import vgraph
    from vgraph.pass_api import PassContext
    from vgraph.passes.dead_nodes import DeadNodes
    from vgraph.rewrite import RuleContext

    graph = vgraph.load(FIXTURES / "tiny_2l.yml")
    return {vgraph.Graph: graph, vgraph.VNode: graph.nodes[0], PassContext: PassContext(),
            DeadNodes.__mro__[1]: DeadNodes(), RuleContext: RuleContext(), vgraph.OpDef: vgraph.get_op("linear")}


def resolve(name: str) -> Any:
    """The object `name` denotes; AttributeError/ImportError when it is gone."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            if cut == 1:
                raise
    for i, attr in enumerate(parts[cut:]):
        if attr == "<fields>":
            return [f.name for f in dataclasses.fields(obj)]
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            sample = _samples().get(obj) if isinstance(obj, type) else None
            if sample is None or i != len(parts) - cut - 1:
                raise
            obj = getattr(sample, attr)  # an instance attribute (VNode.id, Pass.opts, ...)
    return obj


def expand(names: list[str]) -> list[str]:
    """`<fields>` replaced by the dataclass's fields as they are now."""
    out = []
    for name in names:
        out += ([name.replace("<fields>", f) for f in resolve(name)] if name.endswith("<fields>") else [name])
    return out


def check(name: str) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return resolve(name), [w for w in caught if issubclass(w.category, DeprecationWarning)]


def problems(doc_text: str, snap: dict[str, str | None]) -> list[str]:
    """What breaks the promise (empty: kept)."""
    doc = expand(stable_names(doc_text))
    out = [f"{n}: promised by docs/plugins.md section 6 but not in tests/stable_api.txt (add it)"
           for n in doc if n not in snap]
    for name, since in snap.items():
        try:
            _, warned = check(name)
        except (AttributeError, ImportError) as exc:
            out.append(f"{name}: removed without a deprecation shim ({type(exc).__name__}: {exc})")
            continue
        if since is None and name not in doc:
            out.append(f"{name}: left docs/plugins.md section 6 without a deprecation (keep it, or shim it with a "
                       f"DeprecationWarning and mark it 'deprecated <release>' in tests/stable_api.txt)")
        elif since is None and warned:
            out.append(f"{name}: stable, but warns: {warned[0].message}")
        elif since is not None and not warned:
            out.append(f"{name}: deprecated since {since} but resolves without a DeprecationWarning")
    deprecated = {n for n, since in snap.items() if since is not None}
    if set(deprecated_in_doc(doc_text)) != deprecated:
        out.append(f"the doc's 'Deprecated' line lists {sorted(deprecated_in_doc(doc_text))}, "
                   f"tests/stable_api.txt {sorted(deprecated)}")
    return out


# -- the tests ----------------------------------------------------------------------------------------

def test_the_stable_api_is_kept() -> None:
    found = problems(DOC.read_text(encoding="utf-8"), snapshot())
    assert not found, "\n".join(found)


def test_the_doc_parses_into_every_bullet() -> None:
    """The parser reads each kind of entry section 6 uses (a parser that reads nothing checks nothing)."""
    names = stable_names(DOC.read_text(encoding="utf-8"))
    for expected in ("vgraph.load", "vgraph.ops.OpDef.<fields>", "vgraph.ops.same_as_input", "vgraph.Graph.copy",
                     "vgraph.VNode.outputs", "vgraph.pass_api.Pass.preserves_semantics",
                     "vgraph.pass_api.PassContext.data", "vgraph.rewrite.RuleContext.opts",
                     "vgraph.rewrite.inherited_config", "vgraph.plugins.load_plugins",
                     "vgraph.backends.torch.to_unfused_layout", "vgraph.backends.onnx.OPSET"):
        assert expected in names, expected
    assert len(names) > 70 and not any("entry" in n or "<vnode>" in n for n in names)


def test_only_feeds_is_back_as_a_deprecated_alias_that_behaves_as_before() -> None:
    import vgraph

    with pytest.warns(DeprecationWarning, match="only_feeds is deprecated since vgraph 0.2.0.*replace"):
        from vgraph.rewrite import only_feeds
    g = vgraph.load(FIXTURES / "tiny_2l.yml")
    node = next(n for n in g.nodes if len(g.out_edges(n.id)) == 1 and not any(
        ep.node == n.id for ep in g.iter_endpoints()))
    reader = g.node(g.out_edges(node.id)[0].dst)
    assert only_feeds(g, node, [reader]) is None
    assert only_feeds(g, node, []) == f"'{node.id}' also feeds '{reader.id}'"
    read = next(ep for ep in g.iter_endpoints())
    assert only_feeds(g, g.node(read.node), [g.node(e.dst) for e in g.out_edges(read.node)]) == \
        f"'{read.node}' is read by {read.name!r}"


def test_a_removed_name_fails_the_check(monkeypatch) -> None:
    """What the check says when a stable name goes without a shim, when a shim is silent, and when a name
    leaves the doc unannounced (the snapshot is the real one, the damage is done here)."""
    import vgraph.rewrite

    text, snap = DOC.read_text(encoding="utf-8"), snapshot()
    monkeypatch.delattr(vgraph.rewrite, "fused")
    assert problems(text, snap) == ["vgraph.rewrite.fused: removed without a deprecation shim "
                                    "(AttributeError: module 'vgraph.rewrite' has no attribute 'fused')"]
    monkeypatch.undo()
    monkeypatch.setattr(vgraph.rewrite, "_DEPRECATED", {})
    assert problems(text, snap)[0].startswith("vgraph.rewrite.only_feeds: removed without a deprecation shim")
    monkeypatch.setattr(vgraph.rewrite, "only_feeds", lambda *a: None, raising=False)
    assert problems(text, snap) == ["vgraph.rewrite.only_feeds: deprecated since 0.2.0 but resolves without a "
                                    "DeprecationWarning"]
    monkeypatch.undo()
    assert problems(text.replace("`copy`;", ";"), snap) == [
        "vgraph.Graph.copy: left docs/plugins.md section 6 without a deprecation (keep it, or shim it with a "
        "DeprecationWarning and mark it 'deprecated <release>' in tests/stable_api.txt)"]
    assert problems(text.replace("`Reject`,", "`Reject`, `NewNode`,"), snap) == [
        "vgraph.rewrite.NewNode: promised by docs/plugins.md section 6 but not in tests/stable_api.txt (add it)"]


def test_a_damaged_snapshot_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "stable_api.txt"
    bad.write_text("vgraph.load\nvgraph.x removed 0.2.0\n")
    with pytest.raises(AssertionError, match="cannot read 'vgraph.x removed 0.2.0'"):
        snapshot(bad)


def test_the_changelog_covers_this_version_and_its_module_table_is_true() -> None:
    """CHANGELOG.md has this version's section, and its table of moved modules says the truth: every new
    path imports, every old flat module is gone (rows whose old name is still a package say so)."""
    import vgraph

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## {re.escape(vgraph.__version__)}\b", text, re.M)
    rows = re.findall(r"^\| `(vgraph[\w.]*)`( \([^)]*\))? \| `(vgraph[\w.]*)`", text, re.M)
    assert len(rows) >= 30
    for old, note, new in rows:
        importlib.import_module(new)
        if not note:
            with pytest.raises(ImportError):
                importlib.import_module(old)
