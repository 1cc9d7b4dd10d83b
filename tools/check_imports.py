"""Every third-party import is declared in pyproject.toml, where its code needs it.

    python tools/check_imports.py        # a table of imports and where each is declared; exit 1 if one is not

Why: a package imported but not declared works in the checkout's .venv (some
other dependency pulled it in) and breaks a user's install (numpy and pillow
were imported and not declared), and a runtime dependency only the tests use
costs every user an install (PuLP, pymetis).  The rules, by where the import
is:

* installed code (vgraph/, passes/, backends/, networks/): in
  `dependencies`; or in an extra when it is imported inside a function
  (optional: the code says what to install when it is missing) or in a
  module nothing installed reaches, by import or entry point (the ILP
  oracles of tests and benchmarks);
* tests/ and tools/: `dependencies` or the `dev` extra;
* benchmarks/: `dependencies`, `dev` or `bench`.

Imports are read with `ast` (nothing is imported), mapped to distributions
through the installed metadata (`importlib.metadata.packages_distributions`).
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ("vgraph", "passes", "backends", "networks")
EXTRAS_ALLOWED = {"tests": ("dev",), "tools": ("dev",), "benchmarks": ("dev", "bench")}
# Imports no extra declares, with the reason.
NOT_DEPENDENCIES = {"cosmic_ray": "tools/mutation.py installs cosmic-ray into .venv on first use (not in CI)",
                    "pip": "tools/pip_for_platform.py drives the pip it runs under (every virtual environment has one)"}


@dataclass(frozen=True)
class Use:
    module: str  # the top-level import name
    file: str  # relative to the checkout
    lazy: bool  # inside a function


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(root: Path = ROOT) -> dict[str, set[str]]:
    """Distribution name -> where pyproject declares it ("dependencies" and/or extra names)."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out: dict[str, set[str]] = {}
    groups = {"dependencies": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    for group, reqs in groups.items():
        for req in reqs:
            name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if name:
                out.setdefault(_norm(name.group(1)), set()).add(group)
    return out


def uses(root: Path, folders: tuple[str, ...]) -> list[Use]:
    """Every absolute import in the .py files under `folders`, with whether it sits inside a function."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                          for n in ast.walk(f)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                rel = path.relative_to(root).as_posix()
                found += [Use(n.split(".")[0], rel, id(node) in lazy_nodes) for n in names]
    return found


def _local_names(root: Path) -> set[str]:
    """Names that are this checkout's own code (the package, the test and benchmark helpers, tools)."""
    names = {"vgraph", "tests", "tools", "benchmarks"}
    for folder in ("tests", "benchmarks", "tools"):
        names |= {p.stem for p in (root / folder).glob("*.py")}
    return names


def check(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(rows of the table, problems)."""
    skip = set(sys.stdlib_module_names) | _local_names(root)
    dists = {k: [_norm(d) for d in v] for k, v in packages_distributions().items()}
    where = declared(root)
    imported = _installed_targets(root)
    rows, problems = [], []
    for area, folders in (("installed", INSTALLED), *((a, (a,)) for a in EXTRAS_ALLOWED)):
        by_module: dict[str, list[Use]] = {}
        for use in uses(root, folders):
            if use.module not in skip:
                by_module.setdefault(use.module, []).append(use)
        for module, found in sorted(by_module.items()):
            candidates = dists.get(module, [_norm(module)])
            groups = set().union(*(where.get(d, set()) for d in candidates))
            rows.append(f"{area:<10} {module:<12} {'/'.join(candidates):<22} {', '.join(sorted(groups)) or '-'}")
            if module in NOT_DEPENDENCIES:
                continue
            if "dependencies" in groups:
                continue
            for use in found:
                if area == "installed":
                    optional = use.lazy or _dotted(root, use.file) not in imported
                    if groups and optional:
                        continue
                    problems.append(f"{use.file}: imports {module} ({'/'.join(candidates)}), which pyproject.toml "
                                    f"declares in {', '.join(sorted(groups)) or 'nothing'}; installed code needs it "
                                    f"in dependencies (or imported inside a function, with a message, from an extra)")
                elif not groups & set(EXTRAS_ALLOWED[area]):
                    problems.append(f"{use.file}: imports {module} ({'/'.join(candidates)}), declared in "
                                    f"{', '.join(sorted(groups)) or 'nothing'}; {area}/ may use dependencies or the "
                                    f"{' or '.join(EXTRAS_ALLOWED[area])} extra")
    return rows, sorted(set(problems))


def _dotted(root: Path, rel: str) -> str:
    """The installed module name of a file (pyproject's package-dir mapping: passes/ is vgraph.passes...)."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    folder, _, rest = rel.partition("/")
    package = next((pkg for pkg, d in mapping.items() if d == folder), folder)
    parts = [package, *Path(rest).with_suffix("").parts]
    return ".".join(p for p in parts if p != "__init__")


def _installed_targets(root: Path) -> set[str]:
    """Every vgraph module installed code reaches: imported (absolute or relative imports, resolved) or named
    by an entry point or script."""
    out = set()
    for folder in INSTALLED:
        for path in (root / folder).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            here = _dotted(root, rel).split(".")
            package = here if path.name == "__init__.py" else here[:-1]
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
                    if base.startswith("vgraph"):
                        out |= {base, *(f"{base}.{a.name}" for a in node.names)}
                elif isinstance(node, ast.Import):
                    out |= {a.name for a in node.names if a.name.startswith("vgraph")}
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for group in [project.get("scripts", {}), *project.get("entry-points", {}).values()]:
        out |= {target.split(":")[0].strip() for target in group.values()}  # loaded by name: reachable too
    return out


def main() -> int:
    rows, problems = check()
    print(f"{'where':<10} {'import':<12} {'distribution':<22} declared in")
    print("\n".join(rows))
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
