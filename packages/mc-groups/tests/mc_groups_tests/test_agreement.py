"""``mc_groups.agree``: the ranks of a group compare named values once; a difference is the
same structured ``AgreementError`` on every rank.

Localizes the primitive that DDP's and the TP layers' checks at construction are built on:
agreeing ranks exchange one fingerprint and nothing is recorded; ranks that differ in a
scalar, in one entry of a tuple, in a tuple's length or in a field one rank lacks all raise
the same error, whose ``differences`` name the field, each value and the global ranks
holding it (read as attributes, not parsed from the text); a peer comparing something else
gets the schedule check's error, whose ``variants`` say what each rank was about to run.
Independent reference: which rank holds what is known by construction (rank 1 differs),
and the world still reduces ``sum(1) = 2`` afterwards (the exchange left it usable).
``differences`` alone is checked without processes against hand-written rows.
"""

from __future__ import annotations

import pickle
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.comm import agreement, schedule_check
from mc_groups.comm.agreement import ABSENT, Difference
from mc_groups.testing import RankPools, error_kind

BASE: dict[str, Any] = {"hidden": 8, "dtype": "float32", "params": ("a (2,)", "b (3,)")}

CASES: dict[str, dict[str, Any]] = {  # rank 1's fields; rank 0 always holds BASE
    "same": BASE,
    "scalar": {**BASE, "hidden": 16},
    "entry": {**BASE, "params": ("a (2,)", "b (4,)")},
    "length": {**BASE, "params": ("a (2,)",)},
    "absent": {"hidden": 8, "params": BASE["params"]},
}


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _grid() -> dict[str, Any]:
    """Every case on this rank (rank 1 passes the case's fields), then a peer comparing
    another ``what``; what each raised, as attributes and text."""
    group, me = _world(), dist.get_rank()
    out: dict[str, Any] = {}
    spy = mock.patch.object(agreement, "exchange_plans", wraps=schedule_check.exchange_plans)
    with spy as exchanges, mg.record_collectives(status_exchanges=True) as log:
        for case, theirs in CASES.items():
            try:
                mg.agree(group, "the test's sizes", BASE if me == 0 else theirs)
                out[case] = ("no error", "", ())
            except mg.AgreementError as err:
                out[case] = (error_kind(err), str(err), err.differences)
                out[f"{case} attributes"] = (err.what, err.group_ranks)
        try:
            mg.agree(group, "A" if me == 0 else "B", BASE)
            out["other what"] = ("no error", "", ())
        except mg.CollectiveScheduleError as err:
            labels = [(v.ranks, v.plan.planned.label) for v in err.variants]
            out["other what"] = (error_kind(err), str(err), (err.group_ranks, labels))
    out["exchanges"], out["recorded"] = exchanges.call_count, len(log)
    total = torch.ones(1)
    mg.all_reduce(total, group)
    out["usable"] = total.item()
    return out


def test_ranks_agree_or_raise_the_same_structured_error(rank_pools: RankPools) -> None:
    outs = rank_pools.get(2).run(_grid)
    for out in outs:
        assert out["same"] == ("no error", "", ())
        assert out["exchanges"] == len(CASES) + 1  # one fingerprint exchange per call
        assert out["recorded"] == 0  # not a collective of the run's schedule
        assert out["usable"] == 2.0
    expected = {
        "scalar": (Difference("hidden", (("8", (0,)), ("16", (1,)))),),
        "entry": (Difference("params", (("b (3,)", (0,)), ("b (4,)", (1,))), 1),),
        "length": (Difference("params", (("2 entries", (0,)), ("1 entries", (1,)))),),
        "absent": (Difference("dtype", (("float32", (0,)), (ABSENT, (1,)))),),
    }
    for case, differences in expected.items():
        kinds, texts, found = zip(*(out[case] for out in outs), strict=True)
        assert kinds == ("AgreementError", "AgreementError"), texts[0]
        assert texts[0] == texts[1]  # the same message on every rank
        assert found == (differences, differences)
        assert texts[0].startswith("the test's sizes: the ranks [0, 1] of the group hold")
        for out in outs:
            assert out[f"{case} attributes"] == ("the test's sizes", (0, 1))
        assert f"  {differences[0].describe()}" in texts[0].splitlines()
    assert "  params, entry #1: b (3,) on rank(s) [0]; b (4,) on rank(s) [1]" in (
        outs[0]["entry"][1].splitlines()
    )
    for out in outs:
        kind, text, (ranks, labels) = out["other what"]
        assert kind == "CollectiveScheduleError"
        assert ranks == (0, 1)
        assert labels == [((0,), "A"), ((1,), "B")]
        assert "rank(s) [1]: agreement 'B' of 3 field(s)" in text


def test_differences_by_hand() -> None:
    rows = [
        {"tp": 2, "order": "tp-dp", "sizes": (1, 2)},
        {"tp": 2, "order": "dp-tp", "sizes": (1, 2)},
        {"tp": 4, "order": "tp-dp", "sizes": (1, 3), "extra": None},
    ]
    assert agreement.differences([4, 5, 6], rows) == (
        Difference("tp", (("2", (4, 5)), ("4", (6,)))),
        Difference("order", (("tp-dp", (4, 6)), ("dp-tp", (5,)))),
        Difference("sizes", (("2", (4, 5)), ("3", (6,))), 1),
        Difference("extra", ((ABSENT, (4, 5)), ("None", (6,)))),
    )
    assert agreement.differences([0, 1], [rows[0], dict(rows[0])]) == ()


def test_the_error_keeps_its_attributes_across_processes() -> None:
    found = (Difference("hidden", (("8", (0,)), ("16", (1,)))),)
    err = mg.AgreementError("text", "sizes", [0, 1], found)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.what, back.group_ranks, back.differences) == (
        "text",
        "sizes",
        (0, 1),
        found,
    )
    assert isinstance(back, mg.InputValueError)
