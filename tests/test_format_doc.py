"""docs/network-yaml.md: its generated sections equal the op registry, and nothing points outside the repo."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vgraph.ops
from conftest import ROOT
from tools import gen_format_doc as G
from vgraph.ops import COMMON_FIELDS, REGISTRY, F, OpDef, OpRegistry, Schema


def test_committed_doc_equals_the_generated_text():
    """In a fresh process: only the built-in op types, whatever other tests registered here."""
    run = subprocess.run([sys.executable, "tools/gen_format_doc.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"docs/network-yaml.md is stale: run python tools/gen_format_doc.py\n" \
                                f"{run.stdout}{run.stderr}"


def test_every_builtin_type_alias_and_common_key_is_in_the_doc():
    text = G.DOC.read_text(encoding="utf-8")
    for op in REGISTRY:
        if op.origin == G.BUILTIN:
            assert f"#### `{op.name}`" in text
            for alias in op.aliases:
                assert f"| `{alias}` | `{op.name}` |" in text
    for f in COMMON_FIELDS:
        assert f"| `{f.name}` |" in text


def test_a_new_registry_entry_appears_without_touching_the_generator(monkeypatch):
    """What a later op type or config key gets: its row, from its schema alone."""
    fresh = OpRegistry()
    fresh.register(OpDef("scale_by", "activation", "multiplies by a factor", aliases=("Scale",),
                         schema=Schema((F("factor", "float", 2.0, min=0.0, max=8.0, doc="the factor"),
                                        F("mode", choices=("a", "b|c"), required=True),
                                        F("remat", "bool", False, doc="recompute in backward"))),
                         num_inputs=(1, None), num_outputs=lambda cfg: 3))
    fresh.register(OpDef("plugin_op", "activation", "not ours", origin="some-plugin"))
    monkeypatch.setattr(vgraph.ops, "REGISTRY", fresh)
    section = G.section_op_types()
    assert "#### `scale_by` (aliases: `Scale`)" in section
    assert "Multiplies by a factor." in section
    assert '| `factor` | float | `"2.0"` | 0 to 8 | the factor |' in section
    assert "| `mode` | str | **required** | `a`, `b\\|c` |  |" in section  # a '|' cannot break the table
    assert '| `remat` | bool | `"false"` | - | recompute in backward |' in section
    assert "- inputs: 1 or more" in section and "- outputs: 3 by default, set by its config" in section
    assert "plugin_op" not in section  # plugins: `vgraph ops` lists them, per machine
    assert "| `Scale` | `scale_by` |" in G.section_type_names()


def test_a_stale_or_edited_section_is_reported_and_rewritten():
    text = G.DOC.read_text(encoding="utf-8")
    stale = text.replace("| `dense` | `linear` |", "| `dense` | `embedder` |")
    assert stale != text
    new, changed = G.render(stale)
    assert changed == ["type-aliases"] and new == text
    assert G.render(text) == (text, [])


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("): metric-types -->", "): metric-kinds -->").replace(
        "END GENERATED: metric-types", "END GENERATED: metric-kinds"), "unknown generated section 'metric-kinds'"),
    (lambda t: t.replace("<!-- END GENERATED: precisions -->", ""), "no marker pair"),
])
def test_markers_that_do_not_match_the_sections_are_an_error(edit, message):
    with pytest.raises(SystemExit, match=message):
        G.render(edit(G.DOC.read_text(encoding="utf-8")))


def test_check_leaves_the_doc_alone_and_exits_1_when_stale(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "network-yaml.md"
    stale = G.DOC.read_text(encoding="utf-8").replace("| `fp32` | float32 |", "| `fp32` | fp16 |")
    doc.write_text(stale, encoding="utf-8")
    monkeypatch.setattr(G, "DOC", doc)
    monkeypatch.setattr(G, "ROOT", tmp_path)
    assert G.main(["--check"]) == 1
    assert doc.read_text(encoding="utf-8") == stale
    assert "section 'precisions'" in capsys.readouterr().out
    assert G.main([]) == 0 and G.main(["--check"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["network-yaml.md"]  # no temporary file left


def test_nothing_in_the_repository_points_outside_it():
    """Users who pip-install or clone vgraph have no sibling folders: the format is docs/network-yaml.md."""
    outside = ("../" + "shared", "shared/" + "spec", "shared/" + "seeds")
    skip_dirs = {".git", ".venv", "__pycache__", "build", "dist", ".hypothesis", ".pytest_cache"}
    suffixes = (".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".txt", ".cfg", ".json")
    hits = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith(suffixes):
                path = Path(folder, name)
                text = path.read_text(encoding="utf-8", errors="replace")
                hits += [f"{path.relative_to(ROOT)}: {needle}" for needle in outside if needle in text]
    assert not hits, hits
