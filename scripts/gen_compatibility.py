"""Generate ``docs/compatibility.md``: every public name of the three spec modules and of
Megatron-Core main's FSDP2 wrapper, and every field of ``DistributedDataParallelConfig``,
with how mc matches Megatron-Core.

Usage: ``python scripts/gen_compatibility.py`` (writes the file) or ``--check`` (exit 1 when
the file is stale); ``--upstream-run RUN.json`` first records a run of Megatron-LM's own
tests against mc (``../shared/upstream/run --json RUN.json``) into ``records/upstream_run.json``,
``--upstream-run-main RUN.json`` one of Megatron-LM main's (``../shared/upstream/run-main``)
into ``records/upstream_run_main.json``
(per test: pass / fail / n.a. and the reason), from which the measured table is drawn.
``integration_tests/test_compatibility_doc.py`` runs the same checks, so the document
cannot drift from the code. The words live beside this script: ``compat_notes.py`` (the
notes per name and the deliberate differences), ``compat_upstream.py`` (the upstream tests,
the recorded runs and why each failing test fails); this file checks and renders.

- the names come from ``docs/spec/*.txt``, a copy of ``../shared/spec`` (Megatron-Core's API
  documentation; the copy travels with the repository so CI can read it); each
  module's mc counterpart must hold every name not marked absent, and none marked absent;
- a signature status is computed, not declared: ``same`` when mc's parameters equal the
  spec's (names and order), ``extended`` when the spec's are a prefix of mc's (mc adds
  keyword arguments after them); anything else must be declared ``differs`` with the
  reason in ``NOTES``, and a name declared ``differs`` must have a reason;
- config rows are probed: a field whose non-default value raises ``NotImplementedError``
  is reported absent (accepted at Megatron's default only);
- the measured table counts the recorded run; every upstream test that failed in it must
  have its reason in ``UPSTREAM_FAILING``, and every entry there must have failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mc_ddp import DistributedDataParallelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below
from compat_notes import CONFIG_NOTES, DELIBERATE, FSDP2_NOTES, NOTES
from compat_upstream import (
    RUN_MAIN,
    SUITES,
    check_failing_reasons,
    measured_section,
    record_run,
    upstream_section,
)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compatibility.md"
SPEC_DIRS = (ROOT / "docs" / "spec", ROOT.parent / "shared" / "spec")

MODULES = {
    "core.distributed.distributed_data_parallel": (
        "distributed_data_parallel.txt",
        "mc_ddp.distributed_data_parallel",
    ),
    "core.distributed.finalize_model_grads": ("finalize_model_grads.txt", "mc_finalize"),
    "core.tensor_parallel.layers": ("tensor_parallel_layers.txt", "mc_tp_layers.layers"),
}


class Param(NamedTuple):
    """One parameter of a signature: its name and kind (``"*"`` var-positional, ``"kw"``
    keyword-only, ``""`` positional-or-keyword)."""

    name: str
    kind: str


class Row(NamedTuple):
    """One line of the document."""

    module: str
    name: str
    status: str
    note: str


def _spec_dir() -> Path:
    for folder in SPEC_DIRS:
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"no spec folder among {[str(p) for p in SPEC_DIRS]}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _parse_params(text: str | None) -> list[Param] | None:
    if text is None:
        return None
    params: list[Param] = []
    keyword_only = False
    for part in _split_top_level(text):
        name = re.split(r"[:=]", part, maxsplit=1)[0].strip()
        if name.startswith("**"):
            continue  # **kwargs: mc's side drops VAR_KEYWORD too
        if name == "*":
            keyword_only = True
        elif name.startswith("*"):
            params.append(Param(name.lstrip("*"), "*"))
            keyword_only = True
        elif name not in ("self", "ctx"):
            params.append(Param(name, "kw" if keyword_only else ""))
    return params


_METHOD = re.compile(r"^(?:static )?(\w+)\((.*?)\)(?: → [^#]*)?#")


def spec_names(spec_module: str) -> dict[str, list[Param] | None]:
    """``{name: parameters}`` of the spec module's API section (methods as ``Class.method``;
    parameters None for data)."""
    prefix = re.escape(spec_module)
    class_line = re.compile(rf"^class {prefix}\.(\w+)(?:\((.*)\))?#")
    func_line = re.compile(rf"^{prefix}\.(\w+)(?:\((.*?)\))?(?: → [^#]*)?#")
    text = (_spec_dir() / MODULES[spec_module][0]).read_text(encoding="utf-8")
    api = text.split("\nAPI#\n", 1)[1]
    names: dict[str, list[Param] | None] = {}
    owner: str | None = None
    for line in api.splitlines():
        if m := class_line.match(line):
            owner = m[1]
            names.setdefault(owner, _parse_params(m[2]))
        elif m := func_line.match(line):
            owner = None
            names.setdefault(m[1], _parse_params(m[2]))
        elif owner and (m := _METHOD.match(line)):
            names.setdefault(f"{owner}.{m[1]}", _parse_params(m[2]))
    return names


def _lookup(module: Any, name: str) -> tuple[bool, Any]:
    """Whether ``module`` holds the dotted ``name`` (a field whose value is None too), and
    its value."""
    value = module
    for part in name.split("."):
        if not hasattr(value, part):
            return False, None
        value = getattr(value, part)
    return True, value


def _resolve(module: Any, name: str) -> Any:
    return _lookup(module, name)[1]


def _mc_params(obj: Any) -> list[Param] | None:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    kinds: dict[inspect._ParameterKind, str] = {
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.KEYWORD_ONLY: "kw",
    }
    return [
        Param(p.name, kinds.get(p.kind, ""))
        for p in signature.parameters.values()
        if p.name not in ("self", "ctx") and p.kind != inspect.Parameter.VAR_KEYWORD
    ]


def signature_status(spec: list[Param] | None, mine: list[Param] | None) -> str:
    """``same`` (equal parameter lists), ``extended`` (the spec's are a prefix of mc's and the
    extra ones are keyword-only), else ``differs``; data and non-callables are ``same``."""
    if spec is None or mine is None or not spec:
        return "same"
    if [p.name for p in spec] == [p.name for p in mine]:
        return "same"
    if [p.name for p in mine[: len(spec)]] == [p.name for p in spec]:
        return "extended"
    return "differs"


def _row(
    spec_module: str,
    mc_module: Any,
    name: str,
    spec_params: list[Param] | None,
    declared: str | None,
    note: str,
) -> Row:
    """One name's row, checked against mc (``ValueError`` on any mismatch)."""
    mc_name = mc_module.__name__
    found, obj = _lookup(mc_module, name)
    if declared == "absent":
        if found:
            raise ValueError(f"{name} is marked absent but {mc_name} has it")
        return Row(spec_module, name, "absent", note)
    if not found:
        raise ValueError(f"{mc_name} lacks {name} (spec {spec_module}); add it or mark it")
    computed = signature_status(spec_params, _mc_params(obj))
    status = declared or computed
    if computed == "differs" and status != "differs":
        raise ValueError(f"{name}: the signature differs from the spec; explain it in NOTES")
    if status in ("differs", "extended") and not note:
        raise ValueError(f"{name} is '{status}' without a note saying how")
    if declared == "extended" and computed == "differs":
        raise ValueError(f"{name}: declared extended but the spec's parameters are no prefix")
    return Row(spec_module, name, status, note)


def module_rows(spec_module: str) -> list[Row]:
    """Rows of one spec module, each checked against mc (``ValueError`` on any mismatch)."""
    mc_module = importlib.import_module(MODULES[spec_module][1])
    return [
        _row(spec_module, mc_module, name, spec_params, *NOTES.get(name, (None, "")))
        for name, spec_params in spec_names(spec_module).items()
    ]


FSDP2_MODULE = "core.distributed.torch_fully_sharded_data_parallel"
FSDP2_MC = "mc_ddp.torch_fully_sharded_data_parallel"


def fsdp2_rows() -> list[Row]:
    """Rows of Megatron-Core main's FSDP2 wrapper, which the spec pages do not document:
    its parameters are copied from Megatron's source into ``FSDP2_NOTES``; each row is
    checked against mc as a spec module's is."""
    mc_module = importlib.import_module(FSDP2_MC)
    return [
        _row(FSDP2_MODULE, mc_module, name, _parse_params(params), declared, note)
        for name, (params, declared, note) in FSDP2_NOTES.items()
    ]


def _check_notes() -> None:
    known = {name for module in MODULES for name in spec_names(module)}
    unknown = set(NOTES) - known
    if unknown:
        raise ValueError(f"NOTES names that no spec module has: {sorted(unknown)}")


def _other_value(name: str, default: object) -> object:
    """A value of the field's type other than Megatron's default."""
    if isinstance(default, tuple):
        return ("all",)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, str):
        return "optim"
    if "dtype" in name:
        return torch.bfloat16
    return 1


def config_rows() -> list[Row]:
    """One row per DistributedDataParallelConfig field, its status probed: a field whose
    other value raises ``NotImplementedError`` is absent; one whose other value is accepted,
    or refused only for a missing companion setting (ValueError), is implemented."""
    defaults = DistributedDataParallelConfig()
    rows = []
    for field in dataclasses.fields(DistributedDataParallelConfig):
        default = getattr(defaults, field.name)
        note = CONFIG_NOTES.get(field.name, "")
        status = "same"
        try:
            build: Any = DistributedDataParallelConfig  # values of every field type
            build(**{field.name: _other_value(field.name, default)})
        except NotImplementedError:
            status = "absent"
            note = (
                f"accepted at Megatron's default {default!r}; any other value raises "
                "NotImplementedError naming the field"
            )
        except ValueError:
            pass  # needs a companion setting (e.g. overlap_param_gather): implemented
        rows.append(Row("DistributedDataParallelConfig", field.name, status, note))
    return rows


CONFIG_MODULE = "core.distributed.distributed_data_parallel_config"


def megatron_name(row: Row) -> str:
    """The row's full Megatron-Core name (``megatron.core.<module>.<name>``)."""
    if row.module == "DistributedDataParallelConfig":
        return f"megatron.{CONFIG_MODULE}.DistributedDataParallelConfig.{row.name}"
    return f"megatron.{row.module}.{row.name}"


def _table(rows: list[Row]) -> list[str]:
    # Each row carries an HTML id, its Megatron name, in the status cell (the name cell stays
    # `name` alone): the API reference links every mc name to its row (docs/_ext/mc_api.py).
    lines = ["| name | status | how |", "|---|---|---|"]
    lines += [
        f'| `{r.name}` | <a id="{megatron_name(r)}"></a>{r.status} | {r.note} |' for r in rows
    ]
    return lines


def _counts(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in ("same", "extended", "differs")}
    counts["absent"] = sum(r.status == "absent" for r in rows)
    return ", ".join(f"{n} {s}" for s, n in counts.items())


_INTRO = """\
# Compatibility with Megatron-Core

<!-- Generated by `python scripts/gen_compatibility.py`; integration_tests/test_docs.py fails
when it disagrees with the code or the spec. Edit the script's NOTES, not this file. -->

One row per public name of the three spec modules (`docs/spec/`, a copy of the team's
`../shared/spec/`: Megatron-Core's API documentation), of Megatron-Core main's FSDP2
wrapper and per field of `DistributedDataParallelConfig`. **same**: mc has the name
with the spec's parameters, in order; **extended**: the spec's parameters, then mc's
keyword additions; **differs**: a deliberate difference, said how and why; **absent**: not
implemented (config fields: accepted only at Megatron's default). Statuses of signatures are
computed from the code and the spec each time the document is generated; behaviour beyond
the signature is held by the conformance tests (`test_conformance_*.py` in each package,
each naming the Megatron-LM unit test it follows) and the end-to-end parity tests
(`integration_tests/test_parity*.py`).
"""


_FSDP2_INTRO = """\
Megatron-Core main's FSDP2 wrapper
(`megatron/core/distributed/torch_fully_sharded_data_parallel.py`, its config and the
`_BaseDataParallel` methods it keeps) is not in the spec pages: its parameters are copied
from Megatron's source into `scripts/compat_notes.py` (`FSDP2_NOTES`), and the statuses
are computed against them as above.
"""


def render() -> str:
    """The whole document (raises ``ValueError`` when code, spec and notes disagree)."""
    _check_notes()
    parts = [_INTRO]
    for spec_module, (_, mc_name) in MODULES.items():
        rows = module_rows(spec_module)
        parts.append(f"## `{spec_module}` → `{mc_name}` ({_counts(rows)})\n")
        parts.append("\n".join(_table(rows)) + "\n")
    rows = fsdp2_rows()
    parts.append(f"## `{FSDP2_MODULE}` → `{FSDP2_MC}` ({_counts(rows)})\n")
    parts.append(_FSDP2_INTRO)
    parts.append("\n".join(_table(rows)) + "\n")
    rows = config_rows()
    parts.append(f"## `DistributedDataParallelConfig` → `mc_ddp` ({_counts(rows)})\n")
    parts.append(f'<a id="megatron.{CONFIG_MODULE}.DistributedDataParallelConfig"></a>\n')
    parts.append("\n".join(_table(rows)) + "\n")
    parts.append(DELIBERATE)
    check_failing_reasons()
    parts += [measured_section(suite) for suite in SUITES]
    parts.append(upstream_section())
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Write the document, or with ``--check`` report whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument(
        "--upstream-run",
        type=Path,
        help="record this harness --json run first (records/upstream_run.json)",
    )
    parser.add_argument(
        "--upstream-run-main",
        type=Path,
        help="record this run-main --json run first (records/upstream_run_main.json)",
    )
    args = parser.parse_args(argv)
    if args.upstream_run is not None:
        record_run(args.upstream_run)
    if args.upstream_run_main is not None:
        record_run(args.upstream_run_main, RUN_MAIN)
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        print(f"{DOC.relative_to(ROOT)} is {'out of date' if current != text else 'up to date'}")
        return int(current != text)
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
