"""Write the generated sections of docs/network-yaml.md from the op registry.

Why generated: the format reference lists every op type with its config keys,
types, defaults and allowed values, and the registry (vgraph/ops) is where
those are defined.  Written by hand, the two would drift the first time
someone adds an op type or a config key; generated, a new registry entry
shows up in the reference by running this script, and
tests/test_format_doc.py fails while the committed doc differs from what this
script writes.

Only the built-in op types are listed (origin "vgraph"): plugin op types
depend on what is installed, and `vgraph ops` lists them on each machine.

Each section sits between two marker lines in the doc:

    <!-- BEGIN GENERATED (tools/gen_format_doc.py): NAME -->
    ...
    <!-- END GENERATED: NAME -->

    python tools/gen_format_doc.py           rewrite the sections in place (atomically)
    python tools/gen_format_doc.py --check   exit 1 if the doc differs, print the section names
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "network-yaml.md"
BUILTIN = "vgraph"  # OpDef.origin of the built-in op types
CATEGORIES = ("layer", "activation", "structural", "text", "training", "boundary")
CATEGORY_TITLES = {"layer": "Trainable layers", "activation": "Activations", "structural": "Structural",
                   "text": "Text input and output", "training": "Training", "boundary":
                   "Partition boundaries (written by `vgraph partition`)"}
_BLOCK = re.compile(r"(<!-- BEGIN GENERATED \(tools/gen_format_doc\.py\): (?P<name>[a-z-]+) -->\n)"
                    r"(?P<body>.*?)"
                    r"(<!-- END GENERATED: (?P=name) -->)", re.S)


def _cell(text: str) -> str:
    """Markdown table cells cannot hold a bare '|' or a line break."""
    return text.replace("|", "\\|").replace("\n", " ")


def _sentence(text: str) -> str:
    """An op's one-line doc as a sentence: a capital first letter unless it is a one-letter
    variable (`y = x W^T + b`), a full stop at the end."""
    if not re.match(r"[a-z] = ", text):
        text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def _number(value: float) -> str:
    return f"{value:g}"


def field_row(f) -> str:
    """One config key as a table row: key, type, required or default, allowed values, meaning."""
    from vgraph.ops import Field

    if f.required:
        default = "**required**"
    elif f.default is None:
        default = "unset"
    else:
        default = f'`"{Field.format(f.default)}"`'
    allowed = []
    if f.choices is not None:
        allowed.append(", ".join(f"`{c}`" for c in f.choices))
    if f.min is not None and f.max is not None:
        allowed.append(f"{_number(f.min)} to {_number(f.max)}")
    elif f.min is not None:
        allowed.append(f">= {_number(f.min)}")
    elif f.max is not None:
        allowed.append(f"<= {_number(f.max)}")
    if not allowed and f.kind == "precision":
        allowed.append("a precision (table above)")
    return (f"| `{f.name}` | {f.kind} | {default} | {_cell('; '.join(allowed)) or '-'} | "
            f"{_cell(f.doc)} |")


FIELD_HEADER = "| key | type | default | allowed | meaning |\n|---|---|---|---|---|"


def _arity(op) -> tuple[str, str]:
    """How many inputs and outputs, in words ("1 or more", "set by its config")."""
    lo, hi = op.input_range()
    inputs = str(lo) if lo == hi else f"{lo} or more" if hi is None else f"{lo} to {hi}"
    if isinstance(op.num_outputs, int):
        outputs = str(op.num_outputs)
    else:
        try:
            outputs = f"{op.outputs_for(op.schema.resolve({}))} by default, set by its config"
        except Exception:  # a rule that needs a required key: no default count to show
            outputs = "set by its config"
    return inputs, outputs


def _input_kind(op) -> str:
    kind = op.input_kind
    if isinstance(kind, str):
        return {"float": "floating-point tensors", "int": "integer tensors (token ids)",
                "str": "text", "any": "any tensor"}.get(kind, kind)
    return "the kind of each slot is in the description"


def section_op_types() -> str:
    from vgraph.ops import REGISTRY

    ops = [op for op in REGISTRY if op.origin == BUILTIN]
    order = {c: i for i, c in enumerate(CATEGORIES)}
    out: list[str] = []
    for category in sorted({op.category for op in ops}, key=lambda c: (order.get(c, len(order)), c)):
        out.append(f"### {CATEGORY_TITLES.get(category, category.capitalize())}\n")
        for op in sorted((o for o in ops if o.category == category), key=lambda o: o.name):
            inputs, outputs = _arity(op)
            aliases = ", ".join(f"`{a}`" for a in op.aliases)
            out.append(f"#### `{op.name}`" + (f" (aliases: {aliases})" if aliases else "") + "\n")
            if op.doc:
                out.append(_sentence(op.doc) + "\n")
            facts = [f"inputs: {inputs} ({_input_kind(op)})" if inputs != "0" else "inputs: none",
                     f"outputs: {outputs}",
                     "trainable" if op.trainable else "not trainable"]
            if op.tied_params is not None:
                facts.append("can use the weight another node publishes (`tie_weight_alias`) instead of its own")
            if op.is_cost:
                facts.append("a cost (its output 0 is a loss)")
            out.append("- " + "\n- ".join(facts) + "\n")
            if op.schema.fields:
                out.append(FIELD_HEADER + "\n" + "\n".join(field_row(f) for f in op.schema.fields) + "\n")
            else:
                out.append("No config keys of its own.\n")
    return "\n".join(out)


def section_common_config() -> str:
    from vgraph.ops import COMMON_FIELDS

    return FIELD_HEADER + "\n" + "\n".join(field_row(f) for f in COMMON_FIELDS) + "\n"


def section_precisions() -> str:
    from vgraph.ops.schema import DTYPE_OF_PRECISION, PRECISIONS

    rows = ["| written | means | written back as | tensor dtype |", "|---|---|---|---|"]
    for spelling, canon in PRECISIONS.items():
        rows.append(f"| `{spelling}` | {canon} | `{canon}` | {DTYPE_OF_PRECISION[canon]} |")
    return "\n".join(rows) + "\n"


def section_metric_types() -> str:
    from vgraph.ir.verify import METRIC_TYPES

    return ", ".join(f"`{t}`" for t in METRIC_TYPES if t is not None) + "\n"


def section_type_names() -> str:
    """Every accepted spelling of a built-in type -> the type it names."""
    from vgraph.ops import REGISTRY

    rows = ["| written | type |", "|---|---|"]
    for op in REGISTRY:
        if op.origin == BUILTIN:
            rows += [f"| `{a}` | `{op.name}` |" for a in op.aliases]
    return "\n".join(rows) + "\n"


def section_limits() -> str:
    """The sizes past which input is refused, from the constants that enforce them."""
    from vgraph.base.safeio import MAX_INPUT_BYTES
    from vgraph.ir.verify import MAX_ID_CHARS
    from vgraph.yamlio.yaml_reader import MAX_ALIAS_EXPANSION, MAX_NESTING

    rows = ["| what | at most |", "|---|---|",
            f"| a file | {MAX_INPUT_BYTES / 2**20:g} MiB, a regular file (not a directory, FIFO or device) |",
            f"| a node id | {MAX_ID_CHARS} characters |",
            f"| YAML nodes that aliases repeat, in the whole document | {MAX_ALIAS_EXPANSION:,} beyond those "
            f"written out, or as many as are written out if that is more |",
            f"| lists and mappings nested in one another | {MAX_NESTING:,} levels |"]
    return "\n".join(rows) + "\n"


SECTIONS: dict[str, Callable[[], str]] = {
    "limits": section_limits,
    "precisions": section_precisions,
    "common-config": section_common_config,
    "type-aliases": section_type_names,
    "metric-types": section_metric_types,
    "op-types": section_op_types,
}


def render(text: str) -> tuple[str, list[str]]:
    """`text` with every generated section rewritten; the names of the sections that changed.

    A marker pair naming an unknown section, or a section with no marker pair,
    is an error: the doc and this script must name the same sections."""
    found: list[str] = []
    changed: list[str] = []

    def replace(m: re.Match) -> str:
        name = m.group("name")
        if name not in SECTIONS:
            raise SystemExit(f"{DOC}: unknown generated section {name!r} (known: {', '.join(SECTIONS)})")
        found.append(name)
        body = SECTIONS[name]()
        if m.group("body") != body:
            changed.append(name)
        return m.group(1) + body + m.group(4)

    out = _BLOCK.sub(replace, text)
    missing = [n for n in SECTIONS if n not in found]
    if missing:
        raise SystemExit(f"{DOC}: no marker pair for generated section(s) {', '.join(missing)}")
    return out, changed


def _write_atomic(path: Path, text: str) -> None:
    from vgraph.base.safeio import atomic_write  # the one atomic writer: keeps the document's mode

    atomic_write(path, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed doc differs")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = DOC.read_text(encoding="utf-8")
    new, changed = render(text)
    for name in changed:
        print(f"{'stale' if args.check else 'wrote'}: {DOC.relative_to(ROOT)} section {name!r}")
    if args.check:
        return 1 if changed else 0
    if new != text:
        _write_atomic(DOC, new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
