"""docs/compatibility.md stays true to the code and the spec (no processes).

Localizes drift between the compatibility table and mc: the document must equal what
``scripts/gen_compatibility.py`` generates now (which itself fails when a spec name is
missing from mc, a signature differs without a reason, or a name marked absent exists),
the spec copy in ``docs/spec`` must equal the team's ``../shared/spec`` where that folder
exists, and the signature comparison must tell same, extended and differs apart on
hand-made signatures. Exact comparisons.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from integration_tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


gen = load_script("gen_compatibility")


def test_document_equals_what_the_code_and_spec_generate() -> None:
    expected = gen.render()
    current = gen.DOC.read_text(encoding="utf-8")
    if current != expected:
        diff = "".join(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                expected.splitlines(keepends=True),
                "docs/compatibility.md",
                "generated",
                n=0,
            )
        )
        pytest.fail(
            "docs/compatibility.md is out of date: run `python scripts/gen_compatibility.py` "
            f"and commit the result.\n{diff[:4000]}"
        )


def test_every_spec_module_name_has_a_row() -> None:
    text = gen.DOC.read_text(encoding="utf-8")
    for module in gen.MODULES:
        names = gen.spec_names(module)
        assert len(names) >= 15, module  # the parser found the API section
        for name in names:
            assert f"| `{name}` |" in text, (module, name)


def test_spec_copy_equals_the_shared_spec() -> None:
    shared = ROOT.parent / "shared" / "spec"
    if not shared.is_dir():
        pytest.skip(f"{shared} is not here (a clone outside the team's workspace)")
    for path in sorted(shared.glob("*.txt")):
        copy = ROOT / "docs" / "spec" / path.name
        assert copy.read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), path.name


def _params(*names: str) -> list[object]:
    return [gen.Param(n.lstrip("*"), "*" if n.startswith("*") else "") for n in names]


@pytest.mark.parametrize(
    ("spec", "mine", "status"),
    [
        (("a", "b"), ("a", "b"), "same"),
        (("a", "b"), ("a", "b", "device"), "extended"),
        (("a", "b"), ("b", "a"), "differs"),
        (("a", "b"), ("a",), "differs"),
        (("input", "weight", "*args"), ("input", "weight", "*args"), "same"),
    ],
)
def test_signature_status(spec: tuple[str, ...], mine: tuple[str, ...], status: str) -> None:
    assert gen.signature_status(_params(*spec), _params(*mine)) == status


def test_spec_signatures_parse_into_parameter_names() -> None:
    params = gen._parse_params("input_size, output_size, *, config: X[int, str] = None, **kw")
    assert params == [
        gen.Param("input_size", ""),
        gen.Param("output_size", ""),
        gen.Param("config", "kw"),
    ]


def test_a_difference_without_a_reason_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    notes = dict(gen.NOTES)
    del notes["ColumnParallelLinear.backward_dw"]
    notes["RowParallelLinear"] = ("differs", "")
    monkeypatch.setattr(gen, "NOTES", notes)
    with pytest.raises(ValueError, match="RowParallelLinear is 'differs' without a note"):
        gen.module_rows("core.tensor_parallel.layers")


def test_a_name_marked_absent_that_exists_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen, "NOTES", {**gen.NOTES, "finalize_model_grads": ("absent", "x")})
    with pytest.raises(ValueError, match="marked absent but mc_finalize has it"):
        gen.module_rows("core.distributed.finalize_model_grads")


def test_readme_states_the_recorded_upstream_runs() -> None:
    """The README's conformance claims are the recorded runs' numbers and dates (issue 20:
    the 0.19 suite; issue 29: the main suite)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for suite in gen.SUITES:
        run = json.loads(suite.record.read_text(encoding="utf-8"))
        kinds = [t["kind"] for t in run["tests"].values()]
        passed, failed = kinds.count("pass"), kinds.count("fail")
        claim = f"{passed}/{passed + failed}"
        where = f"records/{suite.record.name}"
        assert claim in readme, f"README.md must state the measured {claim} ({where})"
        assert run["date"] in readme, f"README.md must give the run's date {run['date']}"
