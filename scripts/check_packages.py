"""Check that the packages ship like real ones; exit 1 naming every problem.

For each package under ``packages/``:

1. **Declared dependencies equal imports.** The mc siblings its ``src/`` imports (read with
   ``ast``, so nothing is imported) are exactly the mc siblings its ``pyproject.toml``
   declares: an undeclared import breaks a user's install, a declared sibling it never
   imports makes users install it for nothing.
2. **Versions move with the code.** No commit after the one that last changed the
   ``version = `` line of its ``pyproject.toml`` touched its ``src/`` (ask git), and its
   ``CHANGELOG.md`` has a ``## <version>`` heading for the current version.
3. **Files an index page shows.** ``LICENSE`` and ``README.md`` exist, and the README has
   no relative link (on a package index a relative link points nowhere).

Run by ``hatch run all``; ``--no-git`` skips check 2 (an export without history).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
_MC_MODULE = re.compile(r"^mc_(groups|buffers|ddp|tp_layers|finalize|moe|train)(?:_pytest)?$")
_RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)]+)\)")


def _distribution(module: str) -> str | None:
    """``mc_tp_layers`` → ``mc-tp-layers``; None for a module that is not an mc package."""
    match = _MC_MODULE.match(module)
    return f"mc-{match[1].replace('_', '-')}" if match else None


def imported_siblings(package: Path) -> set[str]:
    """The mc distributions whose modules ``package``'s sources import (itself excluded)."""
    found: set[str] = set()
    for path in (package / "src").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                dist = _distribution(name.split(".")[0])
                if dist is not None:
                    found.add(dist)
    found.discard(package.name)
    return found


def _project(package: Path) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(
        (package / "pyproject.toml").read_text(encoding="utf-8")
    )["project"]
    return project


def declared_siblings(package: Path) -> set[str]:
    """The mc distributions ``package`` declares as dependencies."""
    deps = _project(package).get("dependencies", [])
    assert isinstance(deps, list)
    names = {re.split(r"[<>=!~ \[;]", str(d), maxsplit=1)[0] for d in deps}
    return {n for n in names if n.startswith("mc-")}


def check_dependencies(package: Path) -> list[str]:
    imported, declared = imported_siblings(package), declared_siblings(package)
    problems = [
        f"{package.name}: imports {name} but does not declare it" for name in imported - declared
    ]
    problems += [
        f"{package.name}: declares {name} but never imports it" for name in declared - imported
    ]
    return problems


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


def check_version(package: Path) -> list[str]:
    version = str(_project(package)["version"])
    problems = []
    changelog = package / "CHANGELOG.md"
    if not changelog.is_file():
        problems.append(f"{package.name}: no CHANGELOG.md")
    elif not re.search(rf"^## {re.escape(version)}\b", changelog.read_text(encoding="utf-8"), re.M):
        problems.append(f"{package.name}: CHANGELOG.md has no '## {version}' heading")
    pyproject = f"packages/{package.name}/pyproject.toml"
    bumped = _git("log", "-1", "--format=%H", "-G", "^version = ", "--", pyproject)
    if not bumped:
        return [*problems, f"{package.name}: git knows no commit that set its version"]
    later = _git("log", "--format=%h %s", f"{bumped}..HEAD", "--", f"packages/{package.name}/src")
    if later:
        first = later.splitlines()[-1][:100]
        count = len(later.splitlines())
        problems.append(
            f"{package.name}: src/ changed in {count} commit(s) since version {version} was "
            f"set (first: {first}); bump the version and add a CHANGELOG entry"
        )
    return problems


def check_files(package: Path) -> list[str]:
    problems = [
        f"{package.name}: no {name}"
        for name in ("LICENSE", "README.md")
        if not (package / name).is_file()
    ]
    readme = package / "README.md"
    if readme.is_file():
        for link in _RELATIVE_LINK.findall(readme.read_text(encoding="utf-8")):
            problems.append(f"{package.name}: README.md links to {link!r}, relative")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Run every check on every package; print the problems; 1 if there are any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--no-git", action="store_true", help="skip the version check")
    args = parser.parse_args(argv)
    problems: list[str] = []
    packages = sorted(p for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file())
    for package in packages:
        problems += check_dependencies(package) + check_files(package)
        if not args.no_git:
            problems += check_version(package)
    for problem in problems:
        print(problem)
    print(f"check_packages: {len(packages)} packages, {len(problems)} problem(s)")
    return int(bool(problems))


if __name__ == "__main__":
    sys.exit(main())
