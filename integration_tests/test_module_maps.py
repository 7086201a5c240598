"""The packages show their layers (issue 31): each README's module table lists exactly the
files under its ``src/``, and no module imports another that imports it back (even for
types only).

No processes: READMEs and sources are read as text and syntax trees. Independent
reference: the file system (``src/**/*.py``) for the tables.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "src").is_dir())

_ROW = re.compile(r"^\| `([^`]+\.py)` \| .+ \|$")


def _table(readme: Path) -> list[str]:
    """The file column of the README's ``## Modules`` table."""
    text = readme.read_text(encoding="utf-8")
    _, found, rest = text.partition("\n## Modules\n")
    assert found, f"{readme.relative_to(ROOT)} has no '## Modules' section"
    section = rest.split("\n## ", 1)[0]
    return [m[1] for line in section.splitlines() if (m := _ROW.match(line))]


def test_seven_packages() -> None:
    assert [p.name for p in PACKAGES] == [
        "mc-buffers",
        "mc-ddp",
        "mc-finalize",
        "mc-groups",
        "mc-moe",
        "mc-tp-layers",
        "mc-train",
    ]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_readme_module_table_lists_every_file(package: Path) -> None:
    src = package / "src"
    files = sorted(
        str(p.relative_to(src)) for p in src.rglob("*.py") if "__pycache__" not in p.parts
    )
    listed = _table(package / "README.md")
    assert len(listed) == len(set(listed)), "a file is listed twice"
    assert sorted(listed) == files, {
        "in the table, not in src/": sorted(set(listed) - set(files)),
        "in src/, not in the table": sorted(set(files) - set(listed)),
    }


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        src = package / "src"
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, anywhere in the file (under
    ``TYPE_CHECKING`` and inside functions too). ``from pkg import sub`` names the
    submodule, not the package's face."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            found |= subs or ({node.module} & modules.keys())
    return found - {name}


def test_no_two_modules_import_each_other() -> None:
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = []
    for start in edges:  # every path back to start (small graph: a depth-first walk)
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in path and nxt > start:  # each cycle once, from its least name
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []
