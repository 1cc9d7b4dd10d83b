"""tools/walk_layouts.py: the drafts it pins merge what it says, the table reads the walk's own figures, and a
missing or misbehaving farm-studio, or a bad --stops, is refused in a line (CI has no farm-studio: a fake one
stands in, so what is checked is the tool's reading and its drafts, not the studio's counting)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tools import walk_layouts

# The fake studio: a walk that enters two launcher modules and safeio, with figures that depend on the draft
# (so the table must carry each walk's own), `defs` that lists two definitions, and `sketch` that records the
# draft it was given and pins it under the next number.
FAKE = '''#!{python}
import json, os, sys
from pathlib import Path
record = Path({record!r})
args = sys.argv[1:]
if os.environ.get("FAKE_STUDIO_BROKEN") and args[0] == "walk":
    print("a studio that printed something else"); sys.exit(0)
if args[0] == "walk":
    draft = args[args.index("--draft") + 1] if "--draft" in args else "0"
    returns = {{"0": 7, "1": 5, "2": 6}}[draft]
    print("MY ROUTE\\n\\n" + str(12 - int(draft)) + " stays; 5 rooms; 2 climbs back up; " + str(returns) +
          " returns to a room I had left; 9 names for me and my parts.\\n")
    for i, room in enumerate(["launcher/launch.py", "base/safeio.py", "launcher/attempts.py",
                              "base/safeio.py", "vgraph/plugins.py"], 1):
        print(f"  {{i}}. floor  2  {{room}}      in by `x` as `y`")
elif args[0] == "defs":
    print("house: /x\\nfirst   3 lines  (line 1, fn)\\nSecond   9 lines  (line 5, type)\\n"
          "    Second.method   2 lines  (line 7, method)")
elif args[0] == "sketch":
    n = len(list(record.glob("*.json"))) + 1
    (record / f"{{n}}.json").write_text(Path(args[1]).read_text())
    print(json.dumps({{"picture": "p.png", "draft": n}}))
else:
    sys.exit(f"fake studio: {{args}}")
'''


@pytest.fixture
def fake_studio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    script = bin_dir / "farm-studio"
    script.write_text(FAKE.format(python=sys.executable, record=str(record)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def test_the_table_carries_each_walks_figures_and_the_drafts_merge_what_they_say(fake_studio: Path,
                                                                                  capsys) -> None:
    assert walk_layouts.main([]) == 0
    out = capsys.readouterr().out
    root, launcher_dir = walk_layouts.ROOT, Path(walk_layouts.LAUNCHER)
    n = len(walk_layouts.folder_files(root, launcher_dir))
    assert "| today | 12 | 5 | 7 |" in out
    assert f"| the {n} modules of {walk_layouts.LAUNCHER} as one room | 11 | 5 | 5 |" in out
    assert "| each of the 3 folders the walk enters as one room | 10 | 5 | 6 |" in out
    launcher, folders = (json.loads((fake_studio / f"{i}.json").read_text())["split"] for i in (1, 2))

    def merge(folder: Path) -> dict:
        modules = walk_layouts.folder_files(root, folder)
        assert len(modules) > 1  # the premise: a folder of several modules, all merged (not only those walked)
        return {m.as_posix(): {modules[0].as_posix(): ["first", "Second"]} for m in modules[1:]}

    assert launcher == merge(launcher_dir)
    # by folder: the launcher's, vgraph/base's and vgraph/'s own modules (plugins.py's folder), each into one
    assert folders == {**merge(launcher_dir), **merge(Path("vgraph/base")), **merge(Path("vgraph"))}


def test_another_checkout_is_walked_where_its_launcher_stood(fake_studio: Path, tmp_path: Path, capsys) -> None:
    other = tmp_path / "other"
    for f in ("backends/torch/distributed/launch.py", "backends/torch/distributed/worker.py",
              "backends/torch/distributed/launcher/launch.py", "backends/torch/distributed/launcher/attempts.py",
              "vgraph/base/safeio.py", "vgraph/plugins.py"):
        (other / f).parent.mkdir(parents=True, exist_ok=True)
        (other / f).write_text("")
    assert walk_layouts.main(["--repo", str(other), "--walk", "backends/torch/distributed/launch.py:launch:config",
                              "--launcher", "backends/torch/distributed"]) == 0
    assert "| the 2 modules of backends/torch/distributed as one room |" in capsys.readouterr().out
    launcher = json.loads((fake_studio / "1.json").read_text())["split"]
    assert launcher == {"backends/torch/distributed/worker.py": {"backends/torch/distributed/launch.py":
                                                                 ["first", "Second"]}}


def test_a_walk_without_its_figures_is_refused_in_a_line(fake_studio: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_STUDIO_BROKEN", "1")
    with pytest.raises(SystemExit, match="printed no 'stays; rooms; returns' line"):
        walk_layouts.main([])


def test_without_farm_studio_it_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no farm-studio
    assert walk_layouts.main([]) == 2
    assert "farm-studio is not on PATH" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-3", "1601", "10**9", "nan", "inf", "", "1.5", "../x", "a\x00b"])
def test_bad_stops_are_refused_by_the_parser(bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        walk_layouts.main(["--stops", bad])
    assert exit_.value.code == 2
    assert "--stops" in capsys.readouterr().err


@pytest.mark.parametrize("given, says", [
    (["--repo", "/nonexistent/x"], "is not a directory"),
    (["--repo", "a\x00b"], "is not a directory"),
    (["--walk", "launch.py"], "is not FILE:FUNCTION:PARAM"),
    (["--walk", "no/such.py:launch:config"], "is not FILE:FUNCTION:PARAM"),
    (["--walk", "../main/backends/torch/distributed/launcher/launch.py:launch:config"], "is not FILE:FUNCTION:PARAM"),
    (["--walk", "backends/torch/cli.py:main:argv\nx"], "is not FILE:FUNCTION:PARAM"),
    (["--launcher", "/etc"], "is not a folder inside"),
    (["--launcher", "../x"], "is not a folder inside"),
    (["--launcher", "no/such"], "is not a folder inside"),
    (["--launcher", "tools/walk_layouts.py"], "is not a folder inside"),
    (["--launcher", "networks"], "fewer than two modules"),  # YAML files and an __init__.py
    (["--launcher", ""], "fewer than two modules"),
])
def test_a_bad_repo_walk_or_launcher_is_refused_in_a_line(given, says, fake_studio: Path, capsys) -> None:
    assert walk_layouts.main(given) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not list(fake_studio.glob("*.json"))  # refused before any draft was pinned
