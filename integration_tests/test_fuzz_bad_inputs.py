"""Property-based fuzzing of the public API (issue 16): any bad value in any slot is a clear
error, never a crash, a hang, a raw AttributeError/KeyError/IndexError or silent acceptance.

The slots (an argument of a public function, or a misuse sequence) and the classification
are the sweep's (:mod:`integration_tests._sweep_cases`, :mod:`integration_tests._sweep_runner`,
``scripts/sweep_bad_inputs.py``): the sweep tries a fixed list of values per kind, this test
lets hypothesis draw them (any int <= 0 for a size, any non-bool for a flag, NaN/±inf or a
wrong type for a real, strings that are not devices, non-float dtypes, ...), together with
each slot's own values. Every example runs in a worker process (a one-rank gloo world,
memory capped; replaced after a crash or a hang), so a segfault fails the example instead of
the test session. A second test runs every class of two ranks that disagree (issue 16 §2)
on a fresh pair of ranks: every rank must raise a clear error within 5 s.

Bounded for CI: ``derandomize=True`` (the same examples on every run), ``database=None``
(nothing written), ``MAX_EXAMPLES`` examples, about a minute for both tests on 2 cores.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from integration_tests import _sweep_cases as cases
from integration_tests import _sweep_runner as runner

MAX_EXAMPLES = 4000


def _not_a_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return True
    return False


_SHORT_TEXT = st.text(max_size=4)
_NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
_WRONG_DTYPES = st.sampled_from(
    [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, float, int]
)

KIND_STRATEGIES: dict[str, st.SearchStrategy[object]] = {
    # a bool is the only flag: ints, floats, strings, lists and numpy's bool are not
    "flag": st.one_of(
        st.integers(),
        st.floats(),
        _SHORT_TEXT,
        st.lists(st.booleans(), max_size=1),
        st.just(np.bool_(True)),
    ),
    # sizes are ints >= 1: anything <= 0, floats (2.0 too), bools, strings
    "size": st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), _SHORT_TEXT),
    # counts are ints >= 0
    "count": st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(), _SHORT_TEXT),
    # reals are finite numbers
    "real": st.one_of(_NON_FINITE, st.booleans(), _SHORT_TEXT),
    "tensor": st.one_of(
        st.none(), st.lists(st.floats(allow_nan=False), max_size=3), _SHORT_TEXT, st.integers()
    ),
    "group": st.one_of(
        st.none(), _SHORT_TEXT, st.integers(), st.just(cases.Ref("pgc")), st.just({})
    ),
    "opt_group": st.one_of(_SHORT_TEXT, st.integers(), st.just(cases.Ref("pgc"))),
    "dtype": st.one_of(_SHORT_TEXT, _WRONG_DTYPES, st.none()),
    "opt_dtype": st.one_of(_SHORT_TEXT, _WRONG_DTYPES),
    "device": st.one_of(_SHORT_TEXT.filter(_not_a_device), st.floats()),
    "text": st.one_of(st.integers(), st.floats(), st.binary(max_size=3), st.none()),
    "opt_text": st.one_of(st.integers(), st.floats(), st.binary(max_size=3)),
    "collection": st.one_of(
        _SHORT_TEXT,
        st.integers(),
        st.just(cases.Ref("world")),
        st.dictionaries(st.sampled_from(["tp", "dp"]), st.none(), max_size=1),
    ),
}
"""For each kind of slot, the bad values hypothesis draws (see :data:`cases.KINDS` for the
sweep's fixed ones)."""

FUZZ_SLOTS = [s for s in cases.SLOTS if s.world == 1]
TWO_RANK_SLOTS = [
    s for s in cases.SLOTS if s.world == 2 and not s.key.endswith("(schedule check on)")
]


def _values(slot: cases.Slot) -> st.SearchStrategy[object]:
    own = st.sampled_from(slot.values) if slot.values else None
    if slot.kind == "misuse":
        return own if own is not None else st.just(None)
    drawn = KIND_STRATEGIES[slot.kind]
    if own is None or slot.only:
        return drawn if own is None else own
    return st.one_of(drawn, own)


# Built once (the same strategies, so the same examples): hypothesis computes a strategy's
# label from its elements, and a sampled_from over 400+ slots built anew for every example
# cost more than the examples themselves.
_SLOT_STRATEGY = st.sampled_from(FUZZ_SLOTS)
_VALUE_STRATEGIES = {slot.key: _values(slot) for slot in FUZZ_SLOTS}


@st.composite
def _slot_and_value(draw: st.DrawFn) -> tuple[cases.Slot, object]:
    slot = draw(_SLOT_STRATEGY)
    return slot, draw(_VALUE_STRATEGIES[slot.key])


@pytest.fixture(scope="module")
def case_numbers() -> Iterator[int]:
    """Numbers for the worker's messages, one per example (unique within the module)."""
    return itertools.count(1)


@pytest.fixture(scope="module")
def worker() -> Iterator[runner.OneProcessRunner]:
    with runner.OneProcessRunner() as one:
        yield one


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,  # each example is bounded by the runner (10 s, then a "hang")
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=_slot_and_value())
def test_any_bad_value_in_any_slot_is_a_clear_error(
    worker: runner.OneProcessRunner, case_numbers: Iterator[int], case: tuple[cases.Slot, object]
) -> None:
    slot, value = case
    result = worker.run(
        ("value", next(case_numbers), slot.key, value),
        f"{slot.key} <- {cases.show(value)}",
        slot.package,
    )
    assert result.outcome == "clear", f"[{result.outcome}] {result.case_id}: {result.detail}"


def test_every_slot_kind_has_a_strategy() -> None:
    kinds = {s.kind for s in FUZZ_SLOTS} - {"misuse"}
    assert kinds <= set(KIND_STRATEGIES), kinds - set(KIND_STRATEGIES)
    assert len(FUZZ_SLOTS) > 400  # the sweep's one-process slots, all of them fuzzed


@pytest.mark.parametrize("slot", TWO_RANK_SLOTS, ids=[s.key for s in TWO_RANK_SLOTS])
def test_two_ranks_that_disagree_both_get_a_clear_error(slot: cases.Slot) -> None:
    case_id = next(c.id for c in cases.all_cases() if c.slot is slot)
    result = runner.run_two_rank(case_id, slot.package)
    assert result.outcome == "clear", f"[{result.outcome}] {case_id}: {result.ranks}"
