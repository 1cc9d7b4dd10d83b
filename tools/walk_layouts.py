"""How many of a walk's returns any file layout could remove: issue 40's walk, today and in two coarser layouts
that farm-studio sketches as drafts (no code moves).

    .venv/bin/python tools/walk_layouts.py          # this checkout; needs `farm-studio` (the tool library's)
    .venv/bin/python tools/walk_layouts.py --repo ../filed --walk backends/torch/distributed/launch.py:launch:config \\
        --launcher backends/torch/distributed         # another checkout, where the launcher stood then

A walk counts a return each time the value enters a file it had left.  Merging files takes away the returns
between the files merged, so the walk in a coarser layout shows about what any regrouping of today's files
into those rooms could reach (about: inside a draft the studio resolves some calls anew, so one coarser layout
can read a few returns more than another).  The layouts: today; the launcher's modules as one room; each
folder the walk enters as one room (its modules merged into one, its sub-folders apart).  What the last keeps
is not where code stands but the order of its calls: a function that calls into another folder, then into
its own again.

Prints one row per layout: stays, rooms, returns.  The drafts are written to a temporary directory outside
the checkout (farm-studio refuses drafts inside a repository) and pinned on farm-studio's board, which
farm-studio empties when the session ends.
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
MAX_STOPS = 1600  # farm-studio's most
SUMMARY = re.compile(r"^(\d+) stays; (\d+) rooms; .*?(\d+) returns to a room I had left", re.M)
STAY = re.compile(r"^\s*\d+\.\s+floor\s+\d+\s+(\S+)", re.M)
DEF = re.compile(r"^(\S+)\s+\d+ lines?\s+\(line \d+, ")
START = re.compile(r"[\w./-]+\.py:[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # FILE:FUNCTION:PARAM, as farm-studio takes it


def studio(repo: Path, *args: str) -> str:
    done = subprocess.run(["farm-studio", *args], cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"walk_layouts: farm-studio {' '.join(args)} failed: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


def walk(repo: Path, start: str, stops: int, draft: int | None = None) -> tuple[tuple[int, int, int], str]:
    out = studio(repo, "walk", start, "--stops", str(stops), *(["--draft", str(draft)] if draft is not None else []))
    m = SUMMARY.search(out)
    if m is None:
        sys.exit(f"walk_layouts: farm-studio's walk printed no 'stays; rooms; returns' line:\n{out[:500]}")
    return (int(m[1]), int(m[2]), int(m[3])), out


def source_file(repo: Path, shown: str) -> Path:
    """The checkout's file a walk line names by its tail (`launcher/launch.py`); one, or a clear refusal."""
    hits = {p for top in ("vgraph", "backends", "passes") for p in (repo / top).rglob(Path(shown).name)
            if (p.relative_to(repo).as_posix() == shown or p.as_posix().endswith("/" + shown))}
    if len(hits) != 1:
        sys.exit(f"walk_layouts: the walk's room {shown!r} matches {len(hits)} files of {repo}")
    return hits.pop().relative_to(repo)


def folder_files(repo: Path, folder: Path) -> list[Path]:
    """A folder's modules (not its sub-folders'), the first of which a merge carries the others into."""
    return sorted(p.relative_to(repo) for p in (repo / folder).glob("*.py") if p.name != "__init__.py")


def merged(repo: Path, folders: list[Path], why: str) -> dict:
    """A draft that carries every definition of each folder's modules into the folder's first module."""
    split: dict[str, dict[str, list[str]]] = {}
    for folder in folders:
        into, *rest = folder_files(repo, folder)
        for f in rest:
            lines = studio(repo, "defs", f.as_posix()).splitlines()[1:]  # the first line names the house
            names = [m[1] for m in map(DEF.match, lines) if m]
            if names:
                split[f.as_posix()] = {into.as_posix(): names}
    return {"why": why, "split": split}


def pin(repo: Path, draft: dict, folder: Path, name: str) -> int:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(draft))
    first = studio(repo, "sketch", str(path)).splitlines()[0]
    return int(json.loads(first)["draft"])


def stops(text: str) -> int:
    """farm-studio's --stops: a whole number of events, 1 to MAX_STOPS."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= MAX_STOPS:
        raise argparse.ArgumentTypeError(f"{n} is outside 1..{MAX_STOPS} (farm-studio walks at most {MAX_STOPS} "
                                         f"events)")
    return n


def checked(args: argparse.Namespace) -> str | None:
    """What is wrong with the repository, walk and launcher folder given, or None."""
    repo = args.repo
    if not repo.is_dir():
        return f"--repo {str(repo)!r} is not a directory"
    walked = Path(args.walk.split(":")[0])
    if not START.fullmatch(args.walk) or ".." in walked.parts or not (repo / walked).is_file():
        return (f"--walk {args.walk!r} is not FILE:FUNCTION:PARAM with FILE a Python file of {repo} "
                f"(farm-studio's form, e.g. {WALK})")
    launcher = Path(args.launcher)
    if launcher.is_absolute() or ".." in launcher.parts or not (repo / launcher).is_dir():
        return f"--launcher {args.launcher!r} is not a folder inside {repo}"
    if len(folder_files(repo, launcher)) < 2:
        return f"--launcher {args.launcher!r} holds fewer than two modules: nothing to merge"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout to walk (default: this one)")
    ap.add_argument("--walk", default=WALK, metavar="FILE:FUNCTION:PARAM", help=f"the walk (default {WALK})")
    ap.add_argument("--launcher", default=LAUNCHER, metavar="FOLDER",
                    help=f"the folder merged into one room in the second layout (default {LAUNCHER})")
    ap.add_argument("--stops", type=stops, default=MAX_STOPS, help="the walk's --stops (1600: the whole trip)")
    args = ap.parse_args(argv)
    if shutil.which("farm-studio") is None:
        print("walk_layouts: farm-studio is not on PATH (it is the tool library's, not a vgraph dependency)",
              file=sys.stderr)
        return 2
    problem = checked(args)
    if problem is not None:
        print(f"walk_layouts: {problem}", file=sys.stderr)
        return 2
    repo = args.repo.resolve()
    today, out = walk(repo, args.walk, args.stops)
    folders = sorted({source_file(repo, shown).parent for shown in STAY.findall(out)})
    rows = [("today", today)]
    with tempfile.TemporaryDirectory(prefix="walk-layouts-") as tmp:
        for label, merge in ((f"the {len(folder_files(repo, Path(args.launcher)))} modules of {args.launcher} as "
                              f"one room", [Path(args.launcher)]),
                             (f"each of the {len(folders)} folders the walk enters as one room", folders)):
            draft = pin(repo, merged(repo, merge, label), Path(tmp), f"d{len(rows)}")
            rows.append((label, walk(repo, args.walk, args.stops, draft)[0]))
    print(f"walk {args.walk} --stops {args.stops} in {repo}\n")
    print("| layout | stays | rooms | returns |\n|---|---:|---:|---:|")
    for label, (n_stays, rooms, returns) in rows:
        print(f"| {label} | {n_stays} | {rooms} | {returns} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
