"""Every kind of bad input the loader must reject, each with file, line and node.

Each case edits the small fp32 fixture (or writes a tiny document), loads it
from a file and checks that one diagnostic reads "FILE:LINE: node 'ID': ..."
(or "FILE:LINE: ..." where no node is involved) with the expected
words.  The same text read by the general PyYAML reader must give the same
diagnostics as the default (fast) path, and `vgraph validate` exits 2 printing
the same line, without a traceback.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TINY_FP32
from vgraph import VGraphError, load, loads
from vgraph.cli.main import main
from vgraph.yamlio.loading import read_network

BASE = TINY_FP32.read_text()


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    line: int  # expected line of the diagnostic
    node: str | None  # expected node, None for a network-level problem
    words: tuple[str, ...]  # all must appear in that diagnostic's message


def edit(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, f"fixture changed: {old!r} is not unique"
    return text.replace(old, new)


def line_of(text: str, needle: str) -> int:
    assert text.count(needle) >= 1, needle
    return text[:text.index(needle)].count("\n") + 1


def node_line(node_id: str, text: str = BASE) -> int:
    return line_of(text, f"  - id: {node_id}\n")


def _cases() -> list[Case]:
    cases = []

    def add(name, text, needle_or_line, node, *words):
        line = needle_or_line if isinstance(needle_or_line, int) else line_of(text, needle_or_line)
        cases.append(Case(name, text, line, node, words))

    ln1 = '  - id: block0_ln1\n    type: layernorm\n    config:\n      dim: "32"\n'
    t = edit(ln1, ln1 + '      dim: "33"\n')
    add("duplicate config key", t, 'dim: "33"', "block0_ln1", "duplicate key 'dim' in 'config'",
        f"first at line {node_line('block0_ln1', t) + 3}")

    t = edit("  - id: block0_ln1\n    type: layernorm\n", "  - id: block0_ln1\n    kind: layernorm\n")
    add("node without type", t, node_line("block0_ln1", t), "block0_ln1", "node has no 'type'")
    add("unknown node key", t, "kind: layernorm", "block0_ln1", "unknown node key 'kind'")

    t = edit("  - id: block0_ln1\n    type: layernorm\n", "  - name: block0_ln1\n    type: layernorm\n")
    add("node without id", t, "name: block0_ln1", None, "node has no 'id'")

    t = edit("  - {from: block0_ln1, to: block0_heads}\n", "  - {from: block0_ln1, too: block0_heads}\n")
    add("edge without 'to'", t, "too: block0_heads", None, "edge has no 'to'")

    t = edit("  - {from: block0_heads, to: block0_head1, from_slot: 1}\n",
             "  - {from: block0_heads, to: block0_head1, from_slot: one}\n")
    add("edge slot not an integer", t, "from_slot: one", "block0_head1", "edge 'from_slot' must be an integer")

    t = edit("    type: gelu\n", "    type: gelux\n")
    add("unknown type", t, "type: gelux", "block0_ffn_gelu", "unknown node type 'gelux'", "did you mean 'gelu'")

    t = edit(ln1, '  - id: block0_ln1\n    type: layernorm\n    config:\n')
    add("missing config value", t, node_line("block0_ln1", t), "block0_ln1", "missing required config 'dim'")

    t = edit(ln1, ln1 + '      dimm: "32"\n')
    add("unknown config key", t, 'dimm: "32"', "block0_ln1", "unknown config key 'dimm'")

    t = edit('      num_outputs: "2"\n      colocate_group: "transformer_block_0"\n      colocate_policy: "required"\n'
             '  - id: block0_ln1', '      num_outputs: "two"\n      colocate_group: "transformer_block_0"\n'
             '      colocate_policy: "required"\n  - id: block0_ln1')
    add("malformed config value", t, '"two"', "block0_in", "config 'num_outputs'", "expected an integer", "'two'")

    t = edit(ln1, ln1.replace('dim: "32"', "dim: [32]"))
    add("config value not a scalar", t, "dim: [32]", "block0_ln1", "config 'dim' must be a single value")

    t = edit('      rate: "0.1"\n      colocate_group: "transformer_block_0"\n      colocate_policy: "required"\n'
             '  - id: block0_attn_residual', '      rate: "1.5"\n      colocate_group: "transformer_block_0"\n'
             '      colocate_policy: "required"\n  - id: block0_attn_residual')
    add("out of range (max)", t, 'rate: "1.5"', "block0_attn_dropout", "config 'rate'", "must be <=")

    t = edit(ln1, ln1.replace('"32"', '"0"'))
    add("out of range (min)", t, 'dim: "0"', "block0_ln1", "config 'dim'", "must be >= 1")

    t = edit('      position_encoding: "none"\n', '      position_encoding: "sinusoidal"\n')
    add("value not among the choices", t, '"sinusoidal"', "embedder", "position_encoding", "must be one of")

    t = edit("  - id: block0_ln2\n", "  - id: block0_ln1\n")
    second = t.index("  - id: block0_ln1\n", t.index("  - id: block0_ln1\n") + 1)
    add("duplicate id", t, t[:second].count("\n") + 1, "block0_ln1",
        f"duplicate node id (first defined at line {node_line('block0_ln1', t)})")

    t = edit("  - {from: block0_ln1, to: block0_heads}\n", "  - {from: block0_ln1, to: block0_headz}\n")
    add("dangling edge", t, "to: block0_headz", "block0_ln1", "'to' names unknown node 'block0_headz'",
        "did you mean 'block0_heads'")

    t = edit("  - {from: block0_heads, to: block0_head1, from_slot: 1}\n",
             "  - {from: block0_heads, to: block0_head1, from_slot: 5}\n")
    add("output slot out of range", t, "from_slot: 5", "block0_head1", "output slot 5 is out of range",
        "broadcast 'block0_heads' has 2 outputs")

    t = edit("  - {from: block0_mid, to: block0_ffn_residual, from_slot: 1, to_slot: 1}\n",
             "  - {from: block0_mid, to: block0_ffn_residual, from_slot: 1, to_slot: 3}\n")
    add("input slot out of range", t, "to_slot: 3", "block0_ffn_residual", "input slot 3 is out of range",
        "add takes 2 inputs")

    t = edit("  - {from: block0_ln1, to: block0_heads}\n",
             "  - {from: block0_ln1, to: block0_heads}\n  - {from: block0_in, to: block0_heads}\n")
    add("two edges into one input", t, "{from: block0_in, to: block0_heads}", "block0_heads",
        "input slot 0 already receives block0_ln1:0 -> block0_heads:0",
        f"first at line {line_of(t, '{from: block0_ln1, to: block0_heads}')}")

    t = edit("  - {from: block0_in, to: block0_ln1}\n", "")
    add("unconnected input of unknown shape", t, node_line("block0_ln1", t), "block0_ln1",
        "input 0 is not connected and its shape cannot be known")

    t = edit("  - {from: embedder, to: block0_in}\n", "  - {from: block0_ffn_residual, to: block0_in}\n")
    add("cycle", t, node_line("block0_in", t), "block0_in", "cycle: block0_in -> ", "block0_ffn_residual",
        "-> block0_in")

    t = edit('      in_dim: "32"\n      out_dim: "64"\n      colocate_group: "transformer_block_0"\n',
             '      in_dim: "32"\n      out_dim: "48"\n      colocate_group: "transformer_block_0"\n')
    add("shape mismatch along an edge", t, node_line("block0_ffn_down", t), "block0_ffn_down",
        "input 0 has shape [8, 48]", "in_dim=64", "float32[8, 48] from 'block0_ffn_gelu' output 0")

    t = edit("  - {from: lm_head, to: loss}\n", "  - {from: lm_head, to: loss}\n"
             "  - {from: head_down, to: loss, to_slot: 1}\n")
    add("dtype mismatch along an edge", t, "{from: head_down, to: loss, to_slot: 1}", "loss",
        "input 1 expects int data but receives float32[8, 32] from 'head_down' output 0")

    t = edit(ln1, "  - id: block0_ln1\n    type: layernorm\n    input_shapes: [[8, 30]]\n    config:\n"
                  '      dim: "32"\n')
    # the general reader reads it; keys out of the usual order only leave the fast path
    add("declared input shape contradicts", t, node_line("block0_ln1", t), "block0_ln1",
        "declared input shape [8, 30] for input 0 contradicts [8, 32] arriving from 'block0_in' output 0")

    t = edit('      optimizer: "adam"\n  - id: block0_heads\n',
             '      optimizer: "adam"\n    output_shapes: [[8, 31]]\n  - id: block0_heads\n')
    add("declared output shape contradicts", t, node_line("block0_ln1", t), "block0_ln1",
        "declared output shape [8, 31] for output 0 contradicts the inferred [8, 32]")

    t = edit("  - {name: logits, node_id: lm_head, slot_id: 0}\n", "  - {name: logits, node_id: lm_headx, slot_id: 0}\n")
    add("output names an unknown node", t, "node_id: lm_headx", "lm_headx",
        "'outputs' entry 'logits' refers to unknown node 'lm_headx'")

    t = edit("  - {name: logits, node_id: lm_head, slot_id: 0}\n", "  - {name: logits, node_id: lm_head, slot_id: 2}\n")
    add("output reads an unknown slot", t, "slot_id: 2", "lm_head", "reads output slot 2 but a linear has 1 output")

    t = edit("  - {name: ce_loss, node_id: loss, slot_id: 0}\n", "  - {name: ce_loss, node_id: losss, slot_id: 0}\n")
    add("cost names an unknown node", t, "node_id: losss", "losss", "'costs' entry 'ce_loss' refers to unknown node")

    t = edit("  - {name: learning_rate, node_id: lm_head, slot_id: 0, type: learning_rate}\n",
             "  - {name: learning_rate, node_id: lm_head, slot_id: 4, type: learning_rate}\n")
    add("metric reads an unknown slot", t, "slot_id: 4", "lm_head", "'metrics' entry 'learning_rate' reads output slot 4")

    t = edit('      tie_weight_alias: "token_embedding"\n', '      tie_weight_alias: "token_embeddings"\n')
    add("tie alias without publisher", t, node_line("lm_head", t), "lm_head",
        "tie_weight_alias 'token_embeddings' has no publisher")

    head_up = '  - id: head_up\n    type: linear\n    config:\n'
    t = edit(head_up, head_up + '      shared_weight_alias: "token_embedding"\n')
    add("duplicate alias", t, node_line("head_up", t), "head_up",
        "shared_weight_alias 'token_embedding' is already published by 'embedder'",
        f"line {node_line('embedder', t)}")

    add("empty file", "", 1, None, "empty file")
    add("only a comment", "# nothing here\n", 1, None, "empty file")
    add("not a mapping", "- id: a\n  type: relu\n", 1, None, "the document (a network) must be a mapping, got a list")
    add("a scalar document", "just text\n", 1, None, "must be a mapping")
    add("YAML syntax error", "name: x\nnodes: [\n  - {id: a, type: relu\n", 3, None, "YAML syntax error")
    add("bad indentation", "name: x\nnodes:\n  - id: a\n   type: relu\n", 4, None, "YAML syntax error")
    t = edit("name: tiny-1l-fp32\n", "name: !!python/object/apply:os.system ['echo pwned']\n")
    add("unsafe tag", t, 1, None, "unsafe or unsupported YAML tag", "python/object/apply:os.system")
    t = edit("    type: gelu\n", "    type: !!python/name:builtins.eval gelu\n")
    add("unsafe tag in a node", t, "!!python/name", "block0_ffn_gelu", "unsafe or unsupported YAML tag")
    t = edit("name: tiny-1l-fp32\n", "name: tiny-1l-fp32\nprecision: fp12\n")
    add("unknown network precision", t, "precision: fp12", None, "'precision'", "unknown precision 'fp12'")
    return cases


CASES = _cases()


def _where(case: Case, file: str) -> str:
    """How a diagnostic starts: "FILE:LINE: node 'ID': " (no node part for the network)."""
    return f"{file}:{case.line}: " + (f"node '{case.node}': " if case.node is not None else "")


def _expected(d, case: Case, file: str) -> bool:
    where = _where(case, file)
    return str(d).startswith(where) and all(w in d.message for w in case.words)


def _problems(text: str, file: str, **kw) -> list[str]:
    with pytest.raises(VGraphError) as info:
        read_network(text, file, **kw)
    return [str(d) for d in info.value.diagnostics]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_reported_with_file_line_and_node(case: Case, tmp_path: Path) -> None:
    path = tmp_path / "net.yml"
    path.write_text(case.text, encoding="utf-8")
    with pytest.raises(VGraphError) as info:
        load(path)
    diags = info.value.diagnostics
    assert any(_expected(d, case, str(path)) for d in diags), "\n".join(map(str, diags))
    # Both readers give the same verdict, word for word.
    assert _problems(case.text, "net.yml") == _problems(case.text, "net.yml", fast=False)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_validate_exits_2_with_the_message(case: Case, tmp_path: Path, capsys) -> None:
    path = tmp_path / "net.yml"
    path.write_text(case.text, encoding="utf-8")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    where = _where(case, str(path))
    assert where in err and all(w in err for w in case.words), err
    assert "Traceback" not in err
    assert f"{path}: invalid" in err


def test_every_problem_is_reported_not_just_the_first() -> None:
    text = edit("    type: gelu\n", "    type: gelux\n")
    text = edit("  - {from: block0_ln1, to: block0_heads}\n", "  - {from: block0_ln1, to: block0_headz}\n", text)
    text = edit('      tie_weight_alias: "token_embedding"\n', '      tie_weight_alias: "nobody"\n', text)
    with pytest.raises(VGraphError) as info:
        loads(text, "net.yml")
    messages = [d.message for d in info.value.errors]
    assert any("unknown node type 'gelux'" in m for m in messages)
    assert any("unknown node 'block0_headz'" in m for m in messages)
    assert any("tie_weight_alias 'nobody'" in m for m in messages)
    lines = [d.loc.line for d in info.value.diagnostics]
    assert lines == sorted(lines)  # compiler-style: in file order


def test_a_broken_node_does_not_cascade() -> None:
    """Nodes downstream of an unknown type are not reported again."""
    text = edit("    type: gelu\n", "    type: gelux\n")
    with pytest.raises(VGraphError) as info:
        loads(text, "net.yml")
    assert [d.node for d in info.value.errors] == ["block0_ffn_gelu"]


def test_unquoted_numbers_are_accepted() -> None:
    text = BASE.replace('"32"', "32").replace('"0.1"', "0.1").replace('"true"', "true")
    assert loads(text) == loads(BASE)


def test_unknown_top_level_key_is_a_warning_and_kept() -> None:
    warnings: list = []
    g = loads(BASE + "owner: research\n", "net.yml", warnings=warnings)
    assert g.extra == {"owner": "research"}
    assert [w.severity for w in warnings] == ["warning"] and "unknown top-level key 'owner'" in str(warnings[0])


def test_an_alias_bomb_in_an_uninterpreted_key_is_refused_quickly() -> None:
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefgh"):
        prev = "abcdefgh"[i]
        bomb.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    with pytest.raises(VGraphError, match="alias bomb"):
        loads("\n".join(bomb) + "\nnodes: []\n", "bomb.yml")


def test_deep_nesting_is_a_syntax_error_not_a_crash() -> None:
    with pytest.raises(VGraphError):
        loads("name: x\nextra: " + "[" * 5000 + "]" * 5000 + "\nnodes: []\n")
    warnings: list = []
    g = loads("name: x\nextra: " + "[" * 900 + "]" * 900 + "\nnodes: []\n", warnings=warnings)
    value, depth = g.extra["extra"], 1
    while value:
        value, depth = value[0], depth + 1
    assert value == [] and depth == 900


@pytest.mark.parametrize("reader", ["network", "fleet"])
@pytest.mark.parametrize("nested, lines", [
    ("[" * 1001 + "]" * 1001, {3}),
    ("{a: " * 1001 + "1" + "}" * 1001, {3}),
    ("\n  " + "- " * 1001 + "1", {4}),  # block sequences, all on one line
    ("\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 1002)) + " " * 1002 + "v", set(range(1000, 1006))),
], ids=["flow-sequences", "flow-mappings", "block-sequences-one-line", "block-mappings"])
def test_nesting_past_the_limit_is_refused_before_pyyaml_composes_it(reader, nested, lines, monkeypatch) -> None:
    """PyYAML 6.0.3's C composer recursed until the stack ran out (a SIGSEGV at 200,000 levels): the readers
    count levels on the parser's events first, whatever the PyYAML, and never hand such a text to compose.
    The line is where the nesting passes the limit (libyaml 6.0.4 may count a level differently)."""
    import re

    import yaml

    from vgraph.cost.fleet import FleetError, loads_fleet

    def compose(*a, **k):
        raise AssertionError("composed a text nested past the limit")

    monkeypatch.setattr(yaml, "compose", compose)
    text = ("name: x\nnodes: []\nextra: " if reader == "network" else "name: f\npnodes: []\nextra: ") + nested
    with pytest.raises(FleetError if reader == "fleet" else VGraphError) as caught:
        loads(text, "deep.yml") if reader == "network" else loads_fleet(text, "deep.yml")
    found = re.fullmatch(r"deep\.yml:(\d+): (fleet: )?YAML syntax error: .*nest.*", str(caught.value))
    assert found and int(found.group(1)) in lines, str(caught.value)


@pytest.mark.parametrize("nested", ["[" * 200_000 + "]" * 200_000, "\n  " + "- " * 200_000 + "1"],
                         ids=["flow", "block-one-line"])
def test_a_network_nested_200000_deep_is_a_diagnostic_not_a_segfault(tmp_path: Path, nested: str) -> None:
    import re
    import subprocess
    import sys

    path = tmp_path / "deep.yml"
    path.write_text("name: x\nnodes: []\nextra: " + nested + "\n")
    done = subprocess.run([sys.executable, "-m", "vgraph", "validate", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and re.search(rf"{re.escape(str(path))}:[34]: YAML syntax error", done.stderr), done
    assert "Traceback" not in done.stderr


def test_explicit_tags_on_uninterpreted_values_do_not_crash() -> None:
    g = loads('name: x\nnodes: []\nbad_int: !!int "abc"\nbad_bool: !!bool "maybe"\n', "x.yml", warnings=[])
    assert g.extra == {"bad_int": "abc", "bad_bool": "maybe"}


def test_empty_node_list_forms_are_an_empty_network() -> None:
    for text in ("name: x\nnodes:\n", "name: x\nnodes: []\n", "name: x\nnodes: ~\nedges:\n"):
        assert len(loads(text)) == 0


def test_missing_nodes_list_is_reported() -> None:
    with pytest.raises(VGraphError, match="no 'nodes' list"):
        loads("name: x\nedges: []\n")


def test_unreadable_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(VGraphError, match="missing.yml: no such network file"):
        load(tmp_path / "missing.yml")
    bad = tmp_path / "latin1.yml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(VGraphError, match="latin1.yml:1: not UTF-8"):
        load(bad)
