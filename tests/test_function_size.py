"""No function over 60 lines without a reason: a long function says why in its docstring ("Long because ...").

Lines are counted from the first statement after the docstring to the end of the body, so a thorough
docstring never counts against a function.  The reason is for the reader who would otherwise split it: a
tight loop whose calls would cost (the cost model), a declaration list (a command's options), a loop that
must stay in view (the training loop's stop handling)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

MAX_LINES = 60
REASON = "long because"


def long_functions_without_a_reason(root: Path) -> list[str]:
    found = []
    for top in ("vgraph", "passes", "backends"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node) or ""
                body = node.body[1:] if doc and len(node.body) > 1 else node.body
                lines = node.end_lineno - body[0].lineno + 1
                if lines > MAX_LINES and REASON not in doc.lower():
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name} ({lines} lines)")
    return found


def test_every_long_function_says_why() -> None:
    assert long_functions_without_a_reason(ROOT) == []


def test_a_long_function_without_a_reason_is_named(tmp_path: Path) -> None:
    for top in ("vgraph", "passes", "backends"):
        (tmp_path / top).mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    (tmp_path / "vgraph" / "m.py").write_text(
        f'def long():\n    """Does a lot."""\n{body}\n\n\ndef reasoned():\n    """Long because it must.\n\n    More."""\n{body}\n\n\n'
        f'def short():\n    """Short."""\n' + "\n".join(f"    y{i} = {i}" for i in range(MAX_LINES)) + "\n")
    assert long_functions_without_a_reason(tmp_path) == [f"vgraph/m.py:1: long ({MAX_LINES + 1} lines)"]
