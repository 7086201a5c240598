"""scripts/check_packages.py finds what it promises on hand-made packages (no processes).

Localizes each check against a throw-away package tree: an undeclared sibling import, a
declared sibling never imported, a relative README link, a missing LICENSE; and the real
packages pass the dependency and file checks (the version check runs in `hatch run all`).
"""

from __future__ import annotations

from pathlib import Path

from integration_tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


check = load_script("check_packages")


def _package(root: Path, deps: list[str], source: str, readme: str) -> Path:
    package = root / "mc-ddp"
    (package / "src" / "mc_ddp").mkdir(parents=True)
    (package / "src" / "mc_ddp" / "x.py").write_text(source, encoding="utf-8")
    listed = ", ".join(f'"{d}"' for d in deps)
    (package / "pyproject.toml").write_text(
        f'[project]\nname = "mc-ddp"\nversion = "0.1.0"\ndependencies = [{listed}]\n',
        encoding="utf-8",
    )
    (package / "README.md").write_text(readme, encoding="utf-8")
    return package


def test_undeclared_and_unused_siblings_and_relative_links(tmp_path: Path) -> None:
    source = "import mc_groups\nfrom mc_tp_layers.linear import x\nfrom . import y\nimport mc_ddp\n"
    package = _package(
        tmp_path,
        ["torch>=2.13", "mc-groups>=0.4", "mc-finalize"],
        source,
        "[a](../b) [c](https://d)",
    )
    assert check.imported_siblings(package) == {"mc-groups", "mc-tp-layers"}
    assert check.declared_siblings(package) == {"mc-groups", "mc-finalize"}
    assert sorted(check.check_dependencies(package)) == [
        "mc-ddp: declares mc-finalize but never imports it",
        "mc-ddp: imports mc-tp-layers but does not declare it",
    ]
    assert check.check_files(package) == [
        "mc-ddp: no LICENSE",
        "mc-ddp: README.md links to '../b', relative",
    ]


def test_the_real_packages_pass_the_dependency_and_file_checks() -> None:
    assert check.main(["--no-git"]) == 0
