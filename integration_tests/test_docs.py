"""docs/bad_inputs.md stays true to the tests (no processes: tables are read, not run).

Localizes drift between the bad-input catalogue and the tests that prove it: the document
must equal what ``scripts/gen_bad_inputs.py`` generates from the tests' case tables right
now, and every test it cites (``module::function`` and ``[case]``) must exist, found by
reading the test modules' source (independently of the generator). Exact text comparison,
no tolerance.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

from integration_tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


gen = load_script("gen_bad_inputs")
# `pkg_tests/test_x.py::test_y` [case], or a module alone, as the document cites them
_CITED = re.compile(r"`(\w+_tests)/(test_\w+)\.py(?:::(\w+))?`(?: \[([^\]]+)\])?")


def _cited() -> list[tuple[str, str, str | None, str | None]]:
    text = gen.DOC.read_text(encoding="utf-8")
    return [(m[1], m[2], m[3], m[4]) for m in _CITED.finditer(text)]


def _module_source(package_tests: str, module: str) -> ast.Module | None:
    found = list(ROOT.glob(f"packages/*/tests/{package_tests}/{module}.py"))
    return ast.parse(found[0].read_text(encoding="utf-8")) if len(found) == 1 else None


def _top_level_functions(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def _dict_keys(tree: ast.Module) -> set[str]:
    """Every string key of a dict literal in the module (where case tables keep their ids)."""
    dicts = [n for n in ast.walk(tree) if isinstance(n, ast.Dict)]
    keys = [k for d in dicts for k in d.keys if isinstance(k, ast.Constant)]
    return {k.value for k in keys if isinstance(k.value, str)}


def test_catalogue_equals_what_the_tests_tables_generate() -> None:
    expected = gen.render()
    current = gen.DOC.read_text(encoding="utf-8")
    diff = "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            "docs/bad_inputs.md",
            "generated",
            n=0,
        )
    )
    if current != expected:
        pytest.fail(
            "docs/bad_inputs.md is out of date with the tests' case tables: run "
            f"`python scripts/gen_bad_inputs.py` and commit the result.\n{diff[:4000]}"
        )


def test_every_cited_test_exists() -> None:
    cited = _cited()
    # every catalogue row cites its test with a [case]; the failure table cites without
    assert sum(case is not None for *_, case in cited) == len(gen.collect_rows())
    trees = {where: _module_source(*where) for where in {(p, m) for p, m, *_ in cited}}
    missing = []
    for package_tests, module, function, case in cited:
        tree = trees[package_tests, module]
        where = f"{package_tests}/{module}.py"
        if tree is None:
            missing.append(f"{where}: no such module")
        elif function is not None and function not in _top_level_functions(tree):
            missing.append(f"{where}::{function}: no such test function")
        elif case is not None and case not in _dict_keys(tree):
            missing.append(f"{where} [{case}]: no such case key in the module's tables")
    assert not missing, missing


@pytest.mark.parametrize(
    ("pattern", "fragments"),
    [
        (
            r"params\[1\] 'frozen.weight'.*requires_grad",
            ("params[1] 'frozen.weight'", "requires_grad"),
        ),
        (r"reset\(\): offloaded.*reload\(\)", ("reset(): offloaded", "reload()")),
        ("no elements", ("no elements",)),
    ],
)
def test_regex_patterns_show_as_their_literal_fragments(
    pattern: str, fragments: tuple[str, ...]
) -> None:
    assert gen.regex_fragments(pattern) == fragments
    # the fragments, joined back by .*, match a message that holds them in order
    assert re.search(pattern, " … ".join(fragments))


def test_a_pattern_the_catalogue_cannot_show_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot show 'a\|b'"):
        gen.regex_fragments("a|b")
