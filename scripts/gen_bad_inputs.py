"""Regenerate ``docs/bad_inputs.md`` from the bad-input tests' own case tables.

The tests are the single source of truth: every catalogue row is one entry of a case table
in a package's test module (``SOURCES`` says which table and which test function asserts
it), and its cells come from that entry: the exception type and the asserted message
fragments from what the test checks, the "call" and "bad input" cells from the entry's
``doc_call`` / ``doc_input``. Only the prose around the tables and the run-time failure
table are written here.

    python scripts/gen_bad_inputs.py          # rewrite docs/bad_inputs.md
    python scripts/gen_bad_inputs.py --check  # exit 1 if it is out of date

``integration_tests/test_docs.py`` runs the check in the test suite.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad_inputs.md"
PACKAGES = ("mc-groups", "mc-buffers", "mc-ddp", "mc-tp-layers", "mc-finalize", "mc-moe")


class Source(NamedTuple):
    """A case table: ``module.table`` (a dict case id -> entry) asserted by ``test``."""

    package: str
    module: str
    table: str
    test: str


SOURCES = (
    Source(
        "mc-groups",
        "mc_groups_tests.test_bad_input",
        "CASES",
        "test_bad_input_is_named_before_any_collective",
    ),
    Source(
        "mc-buffers",
        "mc_buffers_tests.test_bad_input",
        "CASES",
        "test_bad_input_is_named_and_nothing_is_communicated",
    ),
    Source("mc-ddp", "mc_ddp_tests.test_bad_input", "CONSTRUCTION", "test_construction_errors"),
    Source("mc-ddp", "mc_ddp_tests.test_bad_input", "ORDER", "test_calls_out_of_order"),
    Source("mc-ddp", "mc_ddp_tests.test_bad_input", "FUNCTIONS", "test_function_arguments"),
    Source("mc-ddp", "mc_ddp_tests.test_bad_input", "FSDP2", "test_fsdp2_entry_points"),
    Source("mc-ddp", "mc_ddp_tests.test_config", "WRONG_TYPES", "test_wrong_types_are_type_errors"),
    Source(
        "mc-ddp",
        "mc_ddp_tests.test_config",
        "BAD_VALUES",
        "test_bad_values_and_combinations_are_value_errors",
    ),
    Source(
        "mc-ddp",
        "mc_ddp_tests.test_config",
        "NOT_IMPLEMENTED",
        "test_unimplemented_megatron_fields_are_refused",
    ),
    Source(
        "mc-ddp",
        "mc_ddp_tests.test_sharded_optimizer",
        "ERRORS",
        "test_bad_input_is_rejected_before_any_collective",
    ),
    Source(
        "mc-ddp",
        "mc_ddp_tests.test_optimizer_checkpoint",
        "ERRORS",
        "test_bad_input_is_rejected_before_any_collective",
    ),
    Source(
        "mc-tp-layers",
        "mc_tp_layers_tests.test_errors",
        "EXPECTED",
        "test_bad_input_is_a_clear_error_before_any_collective",
    ),
    Source(
        "mc-finalize",
        "mc_finalize_tests.test_finalize",
        "EXPECTED_ERRORS",
        "test_bad_input_fails_before_any_collective",
    ),
    Source(
        "mc-moe",
        "mc_moe_tests.test_bad_input",
        "CASES",
        "test_bad_input_is_named_before_anything_changes",
    ),
)


class Row(NamedTuple):
    """One catalogue row."""

    package: str
    call: str
    bad_input: str
    error: str
    words: tuple[str, ...]
    test: str
    case: str


def _import(source: Source) -> Any:
    tests = ROOT / "packages" / source.package / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    return importlib.import_module(source.module)


def regex_fragments(pattern: str) -> tuple[str, ...]:
    """The literal fragments a ``re.search`` pattern made of escaped text joined by ``.*``
    asserts, in order (``.`` read as itself); any other regex syntax is refused, since the
    catalogue could not show it as fragments."""
    fragments = []
    for part in pattern.split(".*"):
        if re.search(r"(?<!\\)[][(){}*+?|^$]", part):
            raise ValueError(f"pattern {pattern!r}: cannot show {part!r} as a literal fragment")
        fragments.append(re.sub(r"\\(.)", r"\1", part).strip())
    return tuple(f for f in fragments if f)


def _asserted(entry: Any) -> tuple[str, tuple[str, ...]]:
    """(exception type name, asserted fragments) of one table entry."""
    if isinstance(entry, list):  # [exception, *fragments]
        return entry[0], tuple(entry[1:])
    error = entry.error if isinstance(entry.error, str) else entry.error.__name__
    if hasattr(entry, "words"):
        return error, tuple(entry.words)
    return error, regex_fragments(entry.pattern)


def _cells(source: Source, case: str, entry: Any) -> tuple[str, str]:
    if not hasattr(entry, "doc_call"):
        raise ValueError(
            f"{source.module}.{source.table}[{case!r}] has no doc_call/doc_input: add them to "
            "the test's table entry"
        )
    return entry.doc_call, entry.doc_input


def _rows_of(source: Source) -> Iterator[Row]:
    table = getattr(_import(source), source.table)
    module_path = source.module.replace(".", "/") + ".py"
    for case, entry in table.items():
        error, words = _asserted(entry)
        call, bad_input = _cells(source, case, entry)
        test = f"{module_path}::{source.test}"
        yield Row(source.package, call, bad_input, error, words, test, case)


def collect_rows() -> list[Row]:
    """Every catalogue row, in ``SOURCES`` order (each table in its own order)."""
    return [row for source in SOURCES for row in _rows_of(source)]


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row_line(number: int, row: Row) -> str:
    excerpt = " … ".join(_code(w) for w in row.words)
    cells = [
        str(number),
        row.package,
        row.call,
        row.bad_input,
        row.error,
        excerpt,
        f"{_code(row.test)} [{row.case}]",
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _counts(rows: list[Row]) -> list[str]:
    lines = ["| package | cases |", "|---|---:|"]
    for package in PACKAGES:
        lines.append(f"| {package} | {sum(r.package == package for r in rows)} |")
    lines.append(f"| **all** | **{len(rows)}** |")
    return lines


def _run_commands() -> list[str]:
    lines = []
    for package in PACKAGES:
        modules = dict.fromkeys(s.module for s in SOURCES if s.package == package)
        paths = [f"packages/{package}/tests/{m.replace('.', '/')}.py" for m in modules]
        lines.append("python -m pytest -q " + " ".join(paths))
    return lines


_INTRO = """\
# Bad inputs: the catalogue

<!-- Generated by `python scripts/gen_bad_inputs.py` from the tests' case tables: edit the
tables (or the script's prose), not this file. integration_tests/test_docs.py fails when
they disagree. -->

Every row is a wrong call of mc's public API and the test that proves what happens: the
exception type, message fragments that name the argument and its value (and the fix where
there is one), and that **no collective was issued** (each case runs inside
`mc_groups.record_collectives()` and the log must stay empty). An error raised before any
collective fails on the caller's rank at once; an error raised after its peers entered a
collective would leave them waiting for the group's timeout. The excerpts below are the
fragments the tests assert, in order, generated from the tests' own tables.

Categories: configs (`ModelParallelConfig`, `DistributedDataParallelConfig`, the TP layers'
config), sizes (layouts, divisibility, bucket sizes, split sizes), shapes and numels,
dtypes, devices, groups (missing, wrong type, wrong size), ranks, optimizer checkpoints
(`ShardedOptimizer.sharded_state_dict` / `load_sharded_state_dict`: wrong types, a missing
param entry or key, state that cannot be resharded), and call order (finish before start, a
second start, a step without `zero_grad_buffer()`, zero/offload with a reduction in flight,
`step()` before `finish_grad_sync()`, reset while offloaded, a checkpoint saved before the
first step or loaded before it was built). After a forward or backward that raised,
`discard_grad_sync()` recovers: the in-flight and first-iteration 'got no gradient' errors
name it. The multi-rank cases run on 2 gloo ranks through the `rank_pools` fixture.

**Accepted on purpose** (not errors; issue 41 looked at each): an empty input to a TP layer
(`[0, h]`, `[s, 0, h]`: an expert or a rank with no tokens, as in Megatron; the output is
empty and the collectives move zero bytes); a 0-D token id to `VocabParallelEmbedding` without
`reduce_scatter_embeddings` (a `[h]` embedding, as `torch.nn.Embedding`; with it the ids
must be `[b, s]`); a config at the default `tensor_model_parallel_size=1` beside a larger
TP group (read as unstated, the group decides: Megatron's own tests build layers so; any
other size that differs from the group is an error); a meta-device module in
`DistributedDataParallel` over torch's `"fake"` backend (the dry run); logits without
autograd history in `vocab_parallel_cross_entropy` (taken as this rank's slice, as
Megatron does: pass `vocab_size=` to have their width checked).

Run every package's catalogue:

```bash
{commands}
```

Test paths are relative to `packages/<package>/tests/`; `[case]` is the case's key in the
test's table.

{counts}

| # | package | call | bad input | exception | message excerpt (asserted) | test [case] |
|---|---|---|---|---|---|---|
"""

_FAILURES = """\

## Failures at run time

Not bad input, but the same promise (a clear error, where it happened, no hang); see the
packages' READMEs for details.

| what goes wrong | what every surviving / affected rank gets | test |
|---|---|---|
| a peer process dies during a collective (any path: sync, async handle, gloo all-to-all with finisher, coalesced batch, broadcast, all-to-all, barrier, objects, schedule check) | `mc_groups.CollectiveError`: `<op> on group ranks [..] (<numel> × <dtype>) for '<label>' [<detail>] failed: <backend error>`, at once on gloo | `mc_groups_tests/test_failures.py::test_a_dead_peer_fails_every_path_with_a_named_error` |
| a peer hangs (alive, never joins) | the same error after the group's timeout (groups from `initialize_model_parallel()` inherit the world's timeout; torch would give them 30 min) | `mc_groups_tests/test_failures.py::test_a_hung_peer_is_reported_within_twice_the_timeout` |
| a DDP rank dies in backward during a bucket reduction | `CollectiveError` naming `reduce_scatter … for 'grad reduce dense bucket group N' [bucket N: params …]` | `mc_ddp_tests/test_reliability.py::test_a_rank_dying_in_backward_fails_the_survivor_naming_the_bucket_collective` |
| a DDP rank dies in forward during a param all-gather | `CollectiveError` naming `all_gather … for 'param gather dense bucket group N'` | `mc_ddp_tests/test_reliability.py::test_a_rank_dying_in_forward_fails_the_survivor_naming_the_param_gather` |
| a TP rank dies in backward (async SP gather / dgrad reduce-scatter) | `CollectiveError` naming `all_gather … for 'tp gather dim 0'` (or the reduce-scatter) out of `loss.backward()` | `mc_tp_layers_tests/test_reliability.py::test_a_tp_rank_dying_in_backward_fails_the_survivor_naming_the_collective` |
| NaN/Inf in a local gradient with `check_for_nan_in_grad=True` | `mc_ddp.NonFiniteGradError` on **every** rank of the bucket group, naming each offending rank, bucket and first bad param, before any gradient is reduced | `mc_ddp_tests/test_features.py::test_non_finite_grads_fail_every_rank_before_the_bucket_collective` |
| ranks that pass different layouts to `initialize_model_parallel` (e.g. `tp` 2 on one rank, 1 on another) | `ValueError` on every rank naming the fields and the ranks holding each value, from one all-gather of ten int64 before any group exists | `mc_groups_tests/test_initialize.py::test_ranks_that_pass_different_layouts_all_raise_the_same_error` |
| DDP built differently on the ranks of a data-parallel group (any `DistributedDataParallelConfig` field, `calculate_per_token_loss`, param names/shapes/dtypes/order, grad dtypes, bucket layout, the params' values: an expert param left untagged) | `mc_ddp.DataParallelAgreementError` on every rank naming each field (each param whose values differ) and the ranks holding each value, at construction, before any buffer exists (one 8-byte fingerprint exchange per group, none per step) | `mc_ddp_tests/test_agreement.py::test_every_rank_names_the_field_that_differs`, `mc_ddp_tests/test_agreement.py::test_a_param_that_differs_across_its_reduction_group_is_refused_by_name` |
| TP layers built differently on the ranks of a TP group (sizes, bias, `gather_output`, `input_is_parallel`, dtypes, an extra layer) | `mc_tp_layers.TensorParallelAgreementError` on every rank naming the layer, the field and the ranks, at the layer's construction, before it communicates; cross-entropy arguments per call | `mc_tp_layers_tests/test_agreement.py::test_ranks_built_differently_fail_alike_naming_field_layer_and_ranks` |
| ranks about to run different collectives (params registered in another order; a rank skipping a TP layer), with `MC_CHECK_COLLECTIVE_SCHEDULE=1` | `mc_groups.CollectiveScheduleError` on every rank, listing which ranks were about to run what; nothing issued | `mc_groups_tests/test_schedule_check.py`, `mc_ddp_tests/test_reliability.py::test_params_registered_in_another_order_are_caught_by_the_schedule_check`, `mc_tp_layers_tests/test_reliability.py::test_a_rank_skipping_a_tp_layer_is_caught_by_the_schedule_check` |
| bad input (or misuse) on one rank only, at `initialize_model_parallel`, `DistributedDataParallel(...)`, `finalize_model_grads`, `ShardedOptimizer.step` / `sharded_state_dict` / `load_sharded_state_dict` | the failing rank its own error, every other rank of the group (the world) `mc_groups.PeerCheckError` naming the failing rank and its message, within seconds instead of the group's timeout; nothing allocated or changed (one 8-byte status exchange after the checks, `mc_groups.fail_together`; composed as the demo composes them in integration_tests/test_fail_together.py) | `mc_groups_tests/test_cross_rank.py::test_initialize_model_parallel_with_a_bad_size_on_one_rank`, `mc_groups_tests/test_cross_rank.py::test_a_failed_check_on_some_ranks_is_an_error_on_every_rank` |
"""  # noqa: E501 (markdown table rows are one line each)


def render(rows: Iterable[Row] | None = None) -> str:
    """The whole document for ``rows`` (default: collected from the tests' tables)."""
    rows = collect_rows() if rows is None else list(rows)
    intro = _INTRO.format(commands="\n".join(_run_commands()), counts="\n".join(_counts(rows)))
    table = "\n".join(_row_line(i, row) for i, row in enumerate(rows, start=1))
    return intro + table + "\n" + _FAILURES


def main(argv: list[str] | None = None) -> int:
    """Write the document, or with ``--check`` report whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        stale = current != text
        print(f"{DOC.relative_to(ROOT)} is {'out of date' if stale else 'up to date'}")
        return int(stale)
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}: {text.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
