"""BENCHMARKS.md stays the page of today's figures (issue 40 item 5), not a diary again.

Each area is a `## ` section whose table comes with the command that printed it (`Command: `...``, naming a
script of benchmarks/ that exists), then a `Machine:` line and a `Date: ... Load: ...` line; the page is at most
700 lines; the runs it replaced are in docs/benchmarks-history.md, linked at the top.  The checker is a
function so that it is itself tested on pages that break each rule.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT

PAGE = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmarks-history.md"
BENCH = ROOT / "benchmarks"
MAX_LINES = 700
SCRIPT = re.compile(r"benchmarks/([\w.-]+\.(?:py|sh))\b")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every `## ` section."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def area_problems(text: str, bench_dir: Path) -> list[str]:
    """What breaks the page's rules, one line each; empty when it keeps them."""
    problems = []
    areas = sections(text)
    if not areas:
        problems.append("no area section (## heading)")
    for heading, body in areas:
        lines = body.splitlines()
        commands = [i for i, line in enumerate(lines) if line.startswith("Command: `")]
        if not commands:
            problems.append(f"{heading}: no `Command: ` line")
        if not re.search(r"^\|\s*:?-{3,}|^```text\n", body, re.M):  # a markdown table, or the script's own text
            problems.append(f"{heading}: no table")
        for i in commands:
            scripts = SCRIPT.findall(lines[i])
            if not scripts:
                problems.append(f"{heading}: command names no script of benchmarks/: {lines[i]}")
            problems += [f"{heading}: benchmarks/{s} does not exist" for s in scripts if not (bench_dir / s).is_file()]
            after = lines[i + 1:i + 3]
            if len(after) < 2 or not after[0].startswith("Machine: "):
                problems.append(f"{heading}: no `Machine: ` line after {lines[i]}")
            if len(after) < 2 or not re.match(r"Date: .*(\d{4}-\d\d-\d\d|not run).*Load: ", after[1]):
                problems.append(f"{heading}: no `Date: ... Load: ...` line after {lines[i]}")
    return problems


def test_the_page_is_short_and_links_its_history() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    assert "(docs/benchmarks-history.md)" in "\n".join(text.splitlines()[:10])
    history = HISTORY.read_text(encoding="utf-8")
    # the diary came over whole: far longer than the page, with the areas' older runs
    assert len(history.splitlines()) > 2 * len(text.splitlines())
    assert "The development runs before it, kept for the record" in history


def test_every_area_names_its_command_machine_date_and_load() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert len(sections(text)) >= 10
    assert area_problems(text, BENCH) == []


def test_the_summary_table_links_to_sections_that_exist() -> None:
    text = PAGE.read_text(encoding="utf-8")
    anchors = {slug(h) for h, _ in sections(text)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 10
    assert [a for a in links if a not in anchors] == []


GOOD = """# B

## Area

Command: `.venv/bin/python benchmarks/bench_load.py --sizes 1`
Machine: a CPU.
Date: 2026-12-01. Load: 1.0.

| a | b |
|---|---:|
| x | 1 |
"""


@pytest.mark.parametrize("broken, problem", [
    (GOOD.replace("bench_load.py", "bench_gone.py"), "benchmarks/bench_gone.py does not exist"),
    (GOOD.replace("benchmarks/bench_load.py", "tools/netlab.py"), "names no script of benchmarks/"),
    (GOOD.replace("Command: `", "Run: `"), "no `Command: ` line"),
    (GOOD.replace("Machine: a CPU.\n", ""), "no `Machine: ` line"),
    (GOOD.replace(" Load: 1.0.", ""), "no `Date: ... Load: ...` line"),
    (GOOD.replace("2026-12-01", "yesterday"), "no `Date: ... Load: ...` line"),
    (GOOD.replace("|---|---:|\n", ""), "no table"),
    (GOOD.replace("## Area", "Area"), "no area section"),
])
def test_the_checker_finds_each_broken_rule(broken: str, problem: str) -> None:
    assert area_problems(GOOD, BENCH) == []  # the premise: the good page passes
    assert any(problem in p for p in area_problems(broken, BENCH)), area_problems(broken, BENCH)


def test_slug_is_githubs_anchor() -> None:
    assert slug("`vgraph launch` vs torch DDP and torch.distributed.pipelining") == \
        "vgraph-launch-vs-torch-ddp-and-torchdistributedpipelining"
    assert slug("GPU: not measured yet") == "gpu-not-measured-yet"
