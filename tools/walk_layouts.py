"""How many of a walk's returns any file layout could remove: the walk of issue 40's figure, today and in two
coarser layouts that farm-studio sketches as drafts (no code moves).

    .venv/bin/python tools/walk_layouts.py            # needs `farm-studio` on PATH (the tool library's)

A walk counts a return each time the value enters a file it had left.  Merging files takes away the returns
between the files merged, so the walk in a layout coarser than today's shows about what any regrouping of
today's files into those rooms could reach (about: in a draft the studio resolves some calls anew, so one
coarser layout can read a few returns more than another).  The layouts: today; the launcher's modules as one
room; and every folder the walk enters as one room (each folder's modules merged into one, its
sub-folders apart).  What is left in
the last is not a matter of where code stands but of the order of its calls: a function that calls into
another folder and then calls its own folder again.

Prints one row per layout: stays, rooms, returns.  Drafts are written under a temporary directory outside
the checkout (farm-studio refuses drafts inside a repository) and pinned on farm-studio's board, which the
tool empties at the end of the session.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WALK = "backends/torch/distributed/launcher/launch.py:launch:config"
LAUNCHER = "backends/torch/distributed/launcher"
SUMMARY = re.compile(r"^(\d+) stays; (\d+) rooms; .*?(\d+) returns to a room I had left", re.M)
STAY = re.compile(r"^\s*\d+\.\s+floor\s+\d+\s+(\S+)", re.M)
DEF = re.compile(r"^(\S+)\s+\d+ lines?\s+\(line \d+, ")


def studio(*args: str) -> str:
    done = subprocess.run(["farm-studio", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"walk_layouts: farm-studio {' '.join(args)} failed: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


def walk(stops: int, draft: int | None = None) -> tuple[tuple[int, int, int], str]:
    out = studio("walk", WALK, "--stops", str(stops), *(["--draft", str(draft)] if draft is not None else []))
    m = SUMMARY.search(out)
    if m is None:
        sys.exit(f"walk_layouts: farm-studio's walk printed no 'stays; rooms; returns' line:\n{out[:500]}")
    return (int(m[1]), int(m[2]), int(m[3])), out


def source_file(shown: str) -> Path:
    """The checkout's file a walk line names by its tail (`launcher/launch.py`); one, or a clear refusal."""
    hits = {p for top in ("vgraph", "backends", "passes") for p in (ROOT / top).rglob(Path(shown).name)
            if (p.relative_to(ROOT).as_posix() == shown or p.as_posix().endswith("/" + shown))}
    if len(hits) != 1:
        sys.exit(f"walk_layouts: the walk's room {shown!r} matches {len(hits)} files of the checkout")
    return hits.pop().relative_to(ROOT)


def top_level_defs(path: Path) -> list[str]:
    lines = studio("defs", path.as_posix()).splitlines()[1:]  # the first line names the house
    return [m[1] for m in map(DEF.match, lines) if m]


def folder_files(folder: Path) -> list[Path]:
    """A folder's modules (not its sub-folders'), the first of which a merge carries the others into."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")


def merged(folders: list[Path], why: str) -> dict:
    """A draft that carries every definition of each folder's modules into the folder's first module."""
    split: dict[str, dict[str, list[str]]] = {}
    for folder in folders:
        into, *rest = folder_files(folder)
        for f in rest:
            names = top_level_defs(f)
            if names:
                split[f.as_posix()] = {into.as_posix(): names}
    return {"why": why, "split": split}


def pin(draft: dict, folder: Path, name: str) -> int:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(draft))
    first = studio("sketch", str(path)).splitlines()[0]
    return int(json.loads(first)["draft"])


def stops(text: str) -> int:
    """farm-studio's --stops: a whole number of events, 1 to 1600."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= 1600:
        raise argparse.ArgumentTypeError(f"{n} is outside 1..1600 (farm-studio walks at most 1600 events)")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stops", type=stops, default=1600, help="the walk's --stops (1600: the whole trip)")
    args = ap.parse_args(argv)
    if shutil.which("farm-studio") is None:
        print("walk_layouts: farm-studio is not on PATH (it is the tool library's, not a vgraph dependency)",
              file=sys.stderr)
        return 2
    today, out = walk(args.stops)
    folders = sorted({source_file(shown).parent for shown in STAY.findall(out)})
    rows = [("today", today)]
    with tempfile.TemporaryDirectory(prefix="walk-layouts-") as tmp:
        for label, merge in (("the launcher's modules as one room", [Path(LAUNCHER)]),
                             (f"each of the {len(folders)} folders the walk enters as one room", folders)):
            rows.append((label, walk(args.stops, pin(merged(merge, label), Path(tmp), f"d{len(rows)}"))[0]))
    print(f"walk {WALK} --stops {args.stops}\n")
    print("| layout | stays | rooms | returns |\n|---|---:|---:|---:|")
    for label, (stays, n, returns) in rows:
        print(f"| {label} | {stays} | {n} | {returns} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
