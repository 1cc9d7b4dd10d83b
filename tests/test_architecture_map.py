"""ARCHITECTURE.md is the map of the code: every package folder has its section, and every module of that
folder is named in it.  A module added, moved or renamed without its line in the map fails here."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

HEADING = re.compile(r"^#{2,4} `(?P<folder>[\w/]+)/`", re.M)


def sections(text: str) -> dict[str, str]:
    """Folder -> the text of its section (up to the next heading of any folder)."""
    marks = list(HEADING.finditer(text))
    return {m["folder"]: text[m.end():(marks[i + 1].start() if i + 1 < len(marks) else len(text))]
            for i, m in enumerate(marks)}


def unmapped(root: Path) -> list[str]:
    """Every package folder without a section and every module its folder's section does not name."""
    mapped = sections((root / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    missing = []
    for top in ("vgraph", "passes", "backends"):
        for init in sorted((root / top).rglob("__init__.py")):
            folder = init.parent.relative_to(root).as_posix()
            if folder not in mapped:
                missing.append(f"{folder}/ (no section)")
                continue
            for module in sorted(init.parent.glob("*.py")):
                if module.name in ("__init__.py", "__main__.py"):
                    continue
                if not re.search(rf"`{re.escape(module.name)}`", mapped[folder]):
                    missing.append(f"{folder}/{module.name}")
    return missing


def test_every_module_is_on_the_map() -> None:
    assert unmapped(ROOT) == []


def test_a_module_missing_from_the_map_is_named(tmp_path: Path) -> None:
    for name in ("vgraph", "passes", "backends"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "vgraph" / "ir").mkdir()
    (tmp_path / "vgraph" / "ir" / "__init__.py").write_text("")
    (tmp_path / "vgraph" / "ir" / "graph.py").write_text("")
    (tmp_path / "vgraph" / "ir" / "newcomer.py").write_text("")
    (tmp_path / "ARCHITECTURE.md").write_text(
        "## `vgraph/`\n\nthe core\n\n### `vgraph/ir/`\n\n- `graph.py`: the graph\n\n## `passes/`\n\n## `backends/`\n")
    assert unmapped(tmp_path) == ["vgraph/ir/newcomer.py"]
