"""Property-based tests of the loader, the writer and the config schemas.

- Mutating a valid network (its YAML text, or its structure) gives either a
  valid graph or a VGraphError, never another exception; and the fast reader
  for the canonical layout and the general PyYAML reader agree on every
  outcome: the same graph (with the same lines) or the same diagnostics.
- Generated valid networks round-trip through `dumps`/`loads`.
- Every config field accepts exactly what it formats.
"""
from __future__ import annotations

import copy
import math
import string
from collections import Counter

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY, TINY_FP32
from vgraph import REGISTRY, Graph, VGraphError, dumps, loads, verify
from vgraph.base.diagnostics import DiagnosticSink
from vgraph.ir.builder import NetBuilder
from vgraph.ir.verify import id_problem
from vgraph.ops.schema import COMMON_FIELDS, PRECISIONS, ConfigError, Field
from vgraph.yamlio import NETWORK_KEYS
from vgraph.yamlio.build import Builder
from vgraph.yamlio.fast_reader import read_fast
from vgraph.yamlio.loading import read_network

FAST = settings(max_examples=250, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

BASES = [TINY_FP32.read_text(), TINY.read_text()]
BASE_DOCS = [yaml.safe_load(t) for t in BASES]
TYPE_NAMES = sorted(REGISTRY.aliases())
FIELD_NAMES = sorted({f.name for op in REGISTRY for f in op.schema.by_name.values()})

# Text that stresses YAML: indicators, quotes, escapes, line breaks, unicode.
TRICKY = st.one_of(
    st.text(alphabet=st.sampled_from(list(string.ascii_letters + string.digits + " _-.:/#&*!%@[]{}\"'\\|>,?~")
                                     + ["\t", "\n", "\u00e9", "\u2028", "\x85", "\ufeff", "\u4e2d"]),
            max_size=12),
    st.sampled_from(["null", "~", "", "yes", "0x1F", "1e3", "- a", "? k", "&a", "*a", "!!str x", "{", "]"]))
SCALARS = st.one_of(TRICKY, st.integers(-3, 10**6), st.floats(allow_nan=True), st.booleans(), st.none())
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(TRICKY, SCALARS, max_size=2))


# -- outcomes ---------------------------------------------------------------------------

def outcome(text: str, **kw):
    """What loading gives, in a comparable form; any exception but VGraphError propagates."""
    warnings: list = []
    try:
        g = read_network(text, "m.yml", warnings=warnings, **kw)
    except VGraphError as exc:
        return ("invalid", [str(d) for d in exc.diagnostics])
    return ("valid", g, _locations(g), [str(w) for w in warnings])


def _locations(g: Graph) -> list:
    """Source lines are not part of graph equality; compare them separately."""
    return ([(n.id, n.loc) for n in g.nodes] + [(str(e), e.loc) for e in g.edges]
            + [(ep.name, ep.loc) for ep in g.iter_endpoints()])


def check_text(text: str) -> None:
    """The text loads or is rejected cleanly, both readers agree, and valid graphs round-trip."""
    read_fast(text, Builder("m.yml", DiagnosticSink()))  # never raises: it reads the text or declines it
    default = outcome(text)
    general = outcome(text, fast=False)
    assert default == general
    if default[0] == "valid":
        g = default[1]
        verify(g)
        again = loads(dumps(g))
        assert again == g and dumps(again) == dumps(g)


# -- mutations of the text --------------------------------------------------------------

@st.composite
def mutated_text(draw) -> str:
    lines = draw(st.sampled_from(BASES)).split("\n")
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "value", "value", "token", "token", "char",
                                     "truncate", "indent"]))
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "value" and '"' in lines[i]:
            head = lines[i].split('"')[0]
            lines[i] = head + '"' + draw(st.one_of(TRICKY, st.integers(-5, 10**5).map(str))) + '"'
        elif kind == "token":
            # replace one word (an id, a type, a slot, a key) keeping the layout
            words = [w for w in lines[i].replace("{", " ").replace("}", " ").replace(",", " ").split() if w]
            if words:
                old = draw(st.sampled_from(words))
                new = draw(st.one_of(st.sampled_from(TYPE_NAMES + FIELD_NAMES), TRICKY,
                                     st.integers(-3, 40).map(str)))
                lines[i] = lines[i].replace(old, new, 1)
        elif kind == "char":
            pos = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:pos] + draw(TRICKY) + lines[i][pos:]
        elif kind == "truncate":
            lines = lines[:i]
        elif kind == "indent" and lines:
            lines[i] = " " * draw(st.integers(0, 7)) + lines[i].lstrip()
        if not lines:
            lines = [""]
    return "\n".join(lines)


@FAST
@given(mutated_text())
def test_mutated_text_loads_or_fails_cleanly_and_the_readers_agree(text: str) -> None:
    check_text(text)


# -- mutations of the structure ---------------------------------------------------------

def _containers(doc, path=()):
    """Every (path, container) in a YAML document."""
    yield path, doc
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list)):
            yield from _containers(value, path + (key,))


@st.composite
def mutated_structure(draw) -> str:
    doc = copy.deepcopy(draw(st.sampled_from(BASE_DOCS)))
    ids = [n["id"] for n in doc["nodes"]]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["drop_key", "set_value", "duplicate_item", "drop_item", "retarget",
                                     "retype", "reslot", "config_value", "config_key", "shuffle_nodes",
                                     "declare_shapes"]))
        nodes, edges = doc.get("nodes") or [], doc.get("edges") or []
        if kind in ("drop_key", "set_value"):
            where = [c for _, c in _containers(doc) if isinstance(c, dict) and c]
            if where:
                target = draw(st.sampled_from(where))
                key = draw(st.sampled_from(sorted(target, key=str)))
                if kind == "drop_key":
                    del target[key]
                else:
                    target[key] = draw(VALUES)
        elif kind in ("duplicate_item", "drop_item"):
            lists = [c for _, c in _containers(doc) if isinstance(c, list) and c]
            if lists:
                target = draw(st.sampled_from(lists))
                i = draw(st.integers(0, len(target) - 1))
                if kind == "drop_item":
                    del target[i]
                else:
                    target.insert(i, copy.deepcopy(target[i]))
        elif kind == "retarget" and edges and isinstance(edges, list):
            e = draw(st.sampled_from(edges))
            if isinstance(e, dict):
                e[draw(st.sampled_from(["from", "to"]))] = draw(st.one_of(st.sampled_from(ids), TRICKY))
        elif kind == "retype" and nodes and isinstance(nodes, list):
            n = draw(st.sampled_from(nodes))
            if isinstance(n, dict):
                n["type"] = draw(st.one_of(st.sampled_from(TYPE_NAMES), st.sampled_from(TYPE_NAMES).map(str.upper),
                                           TRICKY))
        elif kind == "reslot" and edges and isinstance(edges, list):
            e = draw(st.sampled_from(edges))
            if isinstance(e, dict):
                e[draw(st.sampled_from(["from_slot", "to_slot"]))] = draw(
                    st.one_of(st.integers(-2, 12), TRICKY, st.floats(-2, 12)))
        elif kind in ("config_value", "config_key") and nodes and isinstance(nodes, list):
            n = draw(st.sampled_from(nodes))
            if isinstance(n, dict):
                cfg = n.setdefault("config", {})
                if isinstance(cfg, dict):
                    if kind == "config_key" or not cfg:
                        key = draw(st.one_of(st.sampled_from(FIELD_NAMES), TRICKY))
                    else:
                        key = draw(st.sampled_from(sorted(cfg, key=str)))
                    cfg[key] = draw(st.one_of(SCALARS, st.integers(-10, 4096).map(str),
                                              st.sampled_from(["true", "no", "1e3", "512.0", "[2, 3]", "fp16",
                                                               "rope", "adam", "-1", "inf", "nan"])))
        elif kind == "shuffle_nodes" and isinstance(nodes, list):
            doc["nodes"] = draw(st.permutations(nodes))
        elif kind == "declare_shapes" and nodes and isinstance(nodes, list):
            n = draw(st.sampled_from(nodes))
            if isinstance(n, dict):
                n[draw(st.sampled_from(["input_shapes", "output_shapes"]))] = draw(
                    st.lists(st.lists(st.integers(-1, 70), max_size=3), max_size=2))
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=draw(st.booleans()),
                          default_flow_style=draw(st.sampled_from([False, None])))


@FAST
@given(mutated_structure())
def test_mutated_structure_loads_or_fails_cleanly_and_the_readers_agree(text: str) -> None:
    check_text(text)


PLAIN_IDS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_./-]{0,8}", fullmatch=True)
QUOTABLE = st.text(alphabet=st.characters(blacklist_characters='"\\', blacklist_categories=("Cs", "Cc")),
                   max_size=8)


def _blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(start, end) line ranges of the node blocks of a canonical text."""
    starts = [i for i, line in enumerate(lines) if line.startswith("  - id: ")]
    end = next((i for i, line in enumerate(lines) if line.startswith("edges:")), len(lines))
    return list(zip(starts, starts[1:] + [end]))


@st.composite
def canonical_mutant(draw) -> str:
    """A text still laid out as `dumps` writes it, with mistakes in what it says."""
    lines = draw(st.sampled_from(BASES)).split("\n")
    ids = [line[8:] for line in lines if line.startswith("  - id: ")]
    words = st.one_of(st.sampled_from(ids), PLAIN_IDS, QUOTABLE.map(lambda t: f'"{t}"'))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["config", "id", "type", "slot", "drop", "duplicate", "swap_blocks",
                                     "drop_block", "duplicate_block", "config_key", "shapes"]))
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        if kind == "config" and line.startswith("      ") and '"' in line:
            lines[i] = line.split('"')[0] + '"' + draw(st.one_of(
                QUOTABLE, st.integers(-3, 5000).map(str), st.sampled_from(
                    ["true", "no", "1e3", "512.0", "[2, 3]", "fp16", "rope", "adam", "-1", "inf", "nan", ""]))) + '"'
        elif kind == "id" and (line.startswith("  - {") or line.startswith("  - id: ")):
            old = draw(st.sampled_from([w for w in ids if w in line] or [""]))
            if old:
                lines[i] = line.replace(old, draw(words), 1)
        elif kind == "type" and line.startswith("    type: "):
            lines[i] = "    type: " + draw(st.one_of(st.sampled_from(TYPE_NAMES), PLAIN_IDS))
        elif kind == "slot" and line.startswith("  - {") and line.endswith("}"):
            lines[i] = line[:-1] + ", " + draw(st.sampled_from(["from_slot", "to_slot"])) + ": " + str(
                draw(st.integers(0, 12))) + "}"
        elif kind in ("drop", "duplicate") and line.startswith("  - {"):
            if kind == "drop":
                del lines[i]
            else:
                lines.insert(i, line)
        elif kind in ("swap_blocks", "drop_block", "duplicate_block"):
            blocks = _blocks(lines)
            if len(blocks) >= 2:
                a, b = sorted(draw(st.lists(st.sampled_from(blocks), min_size=2, max_size=2, unique=True)))
                first, second = lines[a[0]:a[1]], lines[b[0]:b[1]]
                if kind == "swap_blocks":
                    lines[a[0]:b[1]] = second + lines[a[1]:b[0]] + first
                elif kind == "drop_block":
                    del lines[a[0]:a[1]]
                else:
                    lines[b[1]:b[1]] = first
        elif kind == "config_key" and line.startswith("      ") and ": " in line:
            lines[i] = "      " + draw(st.one_of(st.sampled_from(FIELD_NAMES), PLAIN_IDS)) + ": " + line.split(": ", 1)[1]
        elif kind == "shapes" and line.startswith("    type: "):
            shapes = draw(st.lists(st.lists(st.integers(1, 70), max_size=3), min_size=1, max_size=2))
            block_end = next((j for j in range(i + 1, len(lines))
                              if not lines[j].startswith("    ") and not lines[j].startswith("      ")), len(lines))
            lines.insert(block_end, f"    {draw(st.sampled_from(['input_shapes', 'output_shapes']))}: "
                                    + "[" + ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes) + "]")
    return "\n".join(lines)


@FAST
@given(canonical_mutant())
def test_canonical_text_with_mistakes_and_the_readers_agree(text: str) -> None:
    check_text(text)


def test_the_mutated_texts_exercise_both_readers() -> None:
    """The agreement properties above prove something only if the fast reader takes a good share of
    their texts and leaves a good share to the general reader.  Counted here on the same three
    strategies, so the check does not depend on which tests ran before it (or on their order)."""
    used: Counter = Counter()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.one_of(mutated_text(), mutated_structure(), canonical_mutant()))
    def count(text: str) -> None:
        used[read_fast(text, Builder("m.yml", DiagnosticSink()))] += 1

    count()
    assert used[True] >= 30 and used[False] >= 30, used


def test_fast_reader_accepts_what_dumps_writes_and_agrees_on_lines() -> None:
    for text in BASES:
        assert read_fast(text, Builder("m.yml", DiagnosticSink()))
        assert outcome(text) == outcome(text, fast=False)
        assert outcome(text) == outcome(text, fast=True)


def test_fast_reader_rejects_texts_outside_its_layout() -> None:
    text = BASES[0]
    for variant in (text.replace("nodes:\n", "nodes:  # the VNodes\n"), "---\n" + text,
                    text.replace("  - id: embedder", "  -   id: embedder"), text.replace("\n", "\r\n"),
                    text.replace('dim: "32"', "dim: 32", 1), text + "owner: me\n",
                    text.replace("name: tiny-1l-fp32", "name: null")):
        assert not read_fast(variant, Builder("m.yml", DiagnosticSink()))
        assert outcome(variant) == outcome(variant, fast=False)


# -- generated valid networks round-trip ------------------------------------------------

# Valid ids (vgraph.ir.verify.id_problem): printable unicode, including quotes, '#', ':' and inner spaces.
IDS = st.text(alphabet=st.characters(whitelist_categories=("L", "M", "N", "P", "S")), min_size=1, max_size=10)


@st.composite
def networks(draw) -> Graph:
    attrs = draw(st.sampled_from([{}, {"precision": "fp16"}, {"precision": "bf16"},
                                  {"param_precision": "float32", "activation_precision": "fp16"}]))
    b = NetBuilder(draw(IDS), **attrs)
    ids = iter(draw(st.lists(IDS, min_size=60, max_size=60, unique=True)))
    group = draw(st.one_of(st.none(), IDS))
    common = {"colocate_group": group, "colocate_policy": "required" if group is not None else None}
    seq, dim, vocab = draw(st.integers(1, 9)), 2 * draw(st.integers(1, 8)), draw(st.integers(2, 50))
    alias = draw(IDS)
    g_dim = dim
    x = b.node(next(ids), "embedder", vocab_size=vocab, dim=dim, seq_len=seq, shared_weight_alias=alias,
               position_encoding=draw(st.sampled_from(["none", "learned", "rope"])), optimizer="adam", **common)
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["layernorm", "linear", "act", "dropout", "residual", "heads", "swiglu"]))
        if kind == "layernorm":
            x = b.chain(x, b.node(next(ids), "layernorm", dim=dim, eps=draw(st.floats(1e-9, 1e-2)), **common))
        elif kind == "linear" or (kind == "swiglu" and dim % 2):
            out = 2 * draw(st.integers(1, 8))
            x = b.chain(x, b.node(next(ids), draw(st.sampled_from(["linear", "dense", "Linear"])), in_dim=dim,
                                  out_dim=out, **common))
            dim = out
        elif kind == "act":
            x = b.chain(x, b.node(next(ids), draw(st.sampled_from(["relu", "gelu", "silu"])), **common))
        elif kind == "dropout":
            x = b.chain(x, b.node(next(ids), "dropout", rate=draw(st.floats(0, 0.9)), **common))
        elif kind == "swiglu":
            x = b.chain(x, b.node(next(ids), "swiglu", **common))
            dim //= 2
        elif kind == "residual":
            split = b.node(next(ids), "broadcast", num_outputs=2, **common)
            inner = b.node(next(ids), "linear", in_dim=dim, out_dim=dim, **common)
            join = b.node(next(ids), "add", **common)
            b.edge(x, split)
            b.edge(split, inner, 0)
            b.edge(inner, join)
            b.edge(split, join, 1, 1)
            x = join
        else:
            heads, hd = draw(st.integers(1, 3)), 2 * draw(st.integers(1, 3))
            fan = b.node(next(ids), "broadcast", num_outputs=heads, **common)
            stack = b.node(next(ids), "stack", axis=draw(st.sampled_from([-1, 1])), **common)
            b.edge(x, fan)
            for h in range(heads):
                head = b.node(next(ids), "attention_head", head_dim=hd, input_dim=dim, seq_len=seq,
                              causal=draw(st.booleans()), position_encoding=draw(st.sampled_from(["rope", "none"])),
                              rope_theta=draw(st.floats(1.0, 1e6)), **common)
                b.edge(fan, head, h)
                b.edge(head, stack, 0, h)
            x, dim = stack, heads * hd
    if draw(st.booleans()):
        tie = alias if dim == g_dim else None  # a tied head reads the [vocab, dim] embedding
        head = b.chain(x, b.node(next(ids), "linear", in_dim=dim, out_dim=vocab, tie_weight_alias=tie, **common))
        loss = b.chain(head, b.node(next(ids), "cost", cost_function="ce_logits", vocab_size=vocab,
                                    cost_precision=draw(st.sampled_from([None, "float32"])), **common))
        b.cost(draw(IDS), loss)
        b.metric(draw(IDS), head, type=draw(st.sampled_from(["learning_rate", "loss", "grad_norm"])))
        x = head
    b.output(draw(IDS), x)
    g = b.build()
    for n in g.nodes:  # declare some shapes (consistent with inference)
        if draw(st.integers(0, 4)) == 0:
            n.output_shapes = tuple(t.shape for t in n.outputs)
    if draw(st.booleans()):
        g.extra = draw(st.dictionaries(IDS.filter(lambda k: k not in NETWORK_KEYS),
                                       st.one_of(IDS, st.lists(IDS, max_size=2)), max_size=2))
    return verify(g)


@FAST
@given(networks())
def test_generated_networks_round_trip(g: Graph) -> None:
    text = dumps(g)
    again = loads(text, warnings=[])
    assert again == g, again.diff(g)
    assert dumps(again) == text
    assert [n.outputs for n in again.nodes] == [n.outputs for n in g.nodes]
    if not g.extra and "\\" not in text:  # escapes in quoted text are left to PyYAML
        assert read_fast(text, Builder("m.yml", DiagnosticSink()))
    assert outcome(text) == outcome(text, fast=False)


# -- config schemas accept exactly what they format -------------------------------------

ALL_FIELDS = sorted({(f.name, f.kind, f.choices, f.min, f.max): f
                     for op in REGISTRY for f in op.schema.by_name.values()}.values(), key=lambda f: f.name)
ALL_FIELDS += [f for f in COMMON_FIELDS if f not in ALL_FIELDS]


def typed_values(f: Field) -> st.SearchStrategy:
    """Values a field can hold after parsing (within its range and choices)."""
    if f.choices is not None:
        return st.sampled_from(f.choices)
    lo = f.min if f.min is not None else None
    hi = f.max if f.max is not None else None
    if f.kind == "int":
        return st.integers(int(math.ceil(lo)) if lo is not None else -10**30,
                           int(math.floor(hi)) if hi is not None else 10**30)
    if f.kind == "float":
        return st.floats(lo, hi, allow_nan=False, allow_infinity=hi is None)
    if f.kind == "bool":
        return st.booleans()
    if f.kind == "shape":
        dims = st.lists(st.integers(1, 10**6), max_size=4)
        return st.one_of(dims, dims.flatmap(lambda d: st.permutations(d + [-1]))).map(tuple)
    if f.kind == "precision":
        return st.sampled_from(sorted(set(PRECISIONS.values())))
    return st.text()


@pytest.mark.parametrize("f", ALL_FIELDS, ids=[f"{f.name}:{f.kind}" for f in ALL_FIELDS])
def test_every_field_accepts_what_it_formats(f: Field) -> None:
    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(typed_values(f))
    def prop(value) -> None:
        text = Field.format(value)
        parsed = f.parse(text)
        assert parsed == value and type(parsed) is type(value)
        assert Field.format(parsed) == text

    prop()


@pytest.mark.parametrize("f", ALL_FIELDS, ids=[f"{f.name}:{f.kind}" for f in ALL_FIELDS])
def test_whatever_a_field_accepts_formats_to_its_normal_form(f: Field) -> None:
    texts = st.one_of(st.text(max_size=8), st.integers(-10**6, 10**6).map(str),
                      st.floats().map(repr), st.sampled_from(["true", "No", "1e3", "512.0", "[2, 3]", "4x5",
                                                              "[]", "FP16", "half", " adam", "-1", "0x10"]))

    @settings(max_examples=80, deadline=None, derandomize=True)
    @given(texts)
    def prop(text: str) -> None:
        try:
            value = f.parse(text)
        except ConfigError:
            return
        normal = Field.format(value)
        assert f.parse(normal) == value
        assert Field.format(f.parse(normal)) == normal

    prop()


def test_a_scalar_shape_round_trips() -> None:
    f = Field("target_shape", "shape")
    assert f.parse(Field.format(())) == ()
    with pytest.raises(ConfigError):
        f.parse("")


@FAST
@given(st.dictionaries(st.sampled_from(FIELD_NAMES + ["bogus"]), st.one_of(
    st.text(max_size=6), st.integers(-3, 5000).map(str), st.sampled_from(["true", "rope", "adam", "fp16"])),
    max_size=6), st.sampled_from(sorted(op.name for op in REGISTRY)))
def test_schema_parse_reports_instead_of_raising(raw: dict, type_name: str) -> None:
    schema = REGISTRY.get(type_name).schema
    values, problems = schema.parse(raw)
    assert set(values) | {k for k, _ in problems} >= set(raw)  # every key accounted for
    assert set(values).isdisjoint(k for k, _ in problems)  # a key either parses or is a problem
    cfg = schema.resolve(values)
    assert all(cfg[k] == v for k, v in values.items())
    assert set(cfg) == set(schema.by_name)


def test_awkward_identifiers_round_trip() -> None:
    """Names YAML would otherwise read differently: line breaks (a plain-scalar
    check once let "C\\n" through unquoted), nulls, indicators, spaces, escapes.
    Node ids must be printable (verify.id_problem), so the unprintable names
    travel as colocation groups and the network's name instead."""
    names = ["C\n", "a\u2028b", "x\x85", "null", "~", "", " lead", "trail ", "#c", "- d", "e: f", "yes",
             'q"uote', "back\\slash", "tab\there", "\ufeffbom", "\x00", "\u00e9t\u00e9"]
    ids = [name if id_problem(name) is None else f"n{i}" for i, name in enumerate(names)]
    assert len(set(ids)) == len(ids) and ids.count("null") == 1
    b = NetBuilder("awkward\n")
    b.node(ids[0], "reshape", target_shape=(2,), colocate_group=names[0])
    for prev, name, group in zip(ids, ids[1:], names[1:]):
        b.node(name, "relu", colocate_group=group)
        b.edge(prev, name)
    b.graph.node(ids[0]).input_shapes = ((2,),)
    b.output(names[-1], ids[-1])
    g = b.build()
    text = dumps(g)
    assert loads(text) == g and dumps(loads(text)) == text
    assert outcome(text) == outcome(text, fast=False)
