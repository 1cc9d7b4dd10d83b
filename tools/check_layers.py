"""Check the layer contracts in `.importlinter` with import-linter, on the installed package layout.

Why not plain `lint-imports`: `vgraph.passes` and `vgraph.backends` live in `passes/` and `backends/`
and join the `vgraph` namespace only through pyproject's `package-dir` mapping, while import-linter
(grimp) reads one package directory.  This script copies the sources into that installed layout in a
temporary directory (the mapping is read from pyproject.toml, so a new mapped package is covered) and
runs import-linter there, in a fresh interpreter whose first path entry is that directory.

    python tools/check_layers.py          # exit 0: every contract kept; 1: broken (the report says which)
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"


def installed_layout(root: Path, dest: Path) -> Path:
    """Copy every mapped package's Python files to where the installed package has them; returns dest."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    # Parents first, so a mapped sub-package lands inside its already copied parent.
    for package, source in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(root / source, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest


def check(root: Path = ROOT, config: Path = CONFIG) -> subprocess.CompletedProcess:
    """Run import-linter on `root`'s sources with `config`; the completed process (stdout: the report)."""
    with tempfile.TemporaryDirectory(prefix="vgraph-layers-") as tmp:
        layout = installed_layout(root, Path(tmp))
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from importlinter.cli import lint_imports; "
                "sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))")
        return subprocess.run([sys.executable, "-c", code, str(layout), str(config)], cwd=tmp,
                              capture_output=True, text=True, timeout=300)


def main() -> int:
    result = check()
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
