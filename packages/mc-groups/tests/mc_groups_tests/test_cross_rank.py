"""``mc_groups.cross_check``, the one cross-rank primitive, and its two call forms
(``fail_together``: an entry point's local checks, then the exchange; ``CarriedStatus``: the
status riding in a reduction the entry point runs anyway).

- **fields**: agreeing ranks exchange one fingerprint per call and nothing else; ranks that
  differ in a scalar, in one entry of a tuple, in a tuple's length or in a field one rank
  lacks all raise the same ``AgreementError``, whose ``differences`` name the field, each
  value and the global ranks holding it (read as attributes, not parsed from the text); a
  peer at another point gets ``CollectiveScheduleError``, whose ``variants`` say what each
  rank was about to run.
- **failures**: a check failing on one rank of 2, one of 4 or two of 4 is an error on every
  rank within the issue's bound (5 s; the pools' group timeout is 20 s, so a rank left
  waiting in a collective would take 20 s); its use by ``initialize_model_parallel`` (a bad
  size on one rank: no group created on any rank); the carried form (no exchange at all).
- **records**: the exchanges are recorded only when asked (``status_exchanges=True``).

Independent reference: which rank holds or fails what is known by construction, and the
world still reduces ``sum(1) = world size`` afterwards (the exchange left it usable).
``differences`` alone is checked without processes against hand-written rows.
"""

from __future__ import annotations

import pickle
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.comm import cross_rank
from mc_groups.comm.cross_rank import CarriedStatus
from mc_groups.errors import ABSENT, Difference, InputValueError, ScheduleVariant
from mc_groups.testing import RankPools, error_kind

BOUND_S = 5.0


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _block(bad_ranks: list[int]) -> tuple[str, str, float, float]:
    """Ranks in ``bad_ranks`` fail a check inside ``fail_together``; what each raised, how
    long it took, and the world's sum afterwards."""
    me = dist.get_rank()
    start = time.monotonic()
    try:
        with mg.fail_together(None, "the test's entry point"):
            if me in bad_ranks:
                raise TypeError(f"x=3 on rank {me} must be a str")
        kind, text = "no error", ""
    except (ValueError, TypeError) as err:
        kind, text = error_kind(err), str(err)
    seconds = time.monotonic() - start
    t = torch.ones(1)
    mg.all_reduce(t, _world())
    return kind, text, seconds, float(t)


@pytest.mark.parametrize(("world", "bad"), [(2, [1]), (4, [2]), (4, [0, 3])])
def test_a_failed_check_on_some_ranks_is_an_error_on_every_rank(
    rank_pools: RankPools, world: int, bad: list[int]
) -> None:
    outs = rank_pools.get(world).run(_block, bad)
    for rank, (kind, text, seconds, total) in enumerate(outs):
        assert seconds < BOUND_S, (rank, seconds)
        assert total == world
        if rank in bad:
            assert (kind, text) == ("TypeError", f"x=3 on rank {rank} must be a str")
            continue
        assert kind == "PeerCheckError", (rank, kind, text)
        assert f"the test's entry point failed its checks on rank(s) {bad}" in text
        for r in bad:
            assert f"rank {r}: TypeError: x=3 on rank {r} must be a str" in text, text


def test_passing_checks_raise_nothing(rank_pools: RankPools) -> None:
    outs = rank_pools.get(2).run(_block, [])
    assert [(o[0], o[3]) for o in outs] == [("no error", 2.0)] * 2


def _different_entry_points(rank1_fails: bool) -> tuple[str, str]:
    """Rank 0 passes entry point A while rank 1 is at entry point B (a rank that skipped
    a call): failing there, or passing."""
    me = dist.get_rank()
    try:
        with mg.fail_together(None, "A" if me == 0 else "B"):
            if me == 1 and rank1_fails:
                raise ValueError("y=-1 must be >= 0")
        return "no error", ""
    except (ValueError, mg.CollectiveError) as err:
        return error_kind(err), str(err)


def test_ranks_at_different_entry_points(rank_pools: RankPools) -> None:
    failing = rank_pools.get(2).run(_different_entry_points, True)
    assert failing[1] == ("ValueError", "y=-1 must be >= 0")
    assert failing[0][0] == "PeerCheckError"
    assert "rank 1: (at B) ValueError: y=-1 must be >= 0" in failing[0][1]
    passing = rank_pools.get(2).run(_different_entry_points, False)
    assert [kind for kind, _ in passing] == ["CollectiveScheduleError"] * 2
    assert "  rank(s) [0]: A" in passing[0][1].splitlines()
    assert "  rank(s) [1]: B" in passing[0][1].splitlines()


def _initialize(kw_by_rank: list[dict[str, object]]) -> tuple[str, str, float, int]:
    me = dist.get_rank()
    before = len(dist.distributed_c10d._world.pg_map)
    start = time.monotonic()
    try:
        mg.destroy_model_parallel(mg.initialize_model_parallel(**kw_by_rank[me]))  # type: ignore[arg-type]
        kind, text = "no error", ""
    except ValueError as err:
        kind, text = error_kind(err), str(err)
    return kind, text, time.monotonic() - start, len(dist.distributed_c10d._world.pg_map) - before


@pytest.mark.parametrize("world", [2, 4])
def test_initialize_model_parallel_with_a_bad_size_on_one_rank(
    rank_pools: RankPools, world: int
) -> None:
    kw: list[dict[str, object]] = [{"tensor_model_parallel_size": 2} for _ in range(world)]
    kw[1] = {"tensor_model_parallel_size": 3}  # does not divide the world: rank 1's check
    outs = rank_pools.get(world).run(_initialize, kw)
    assert outs[1][0] == "ValueError"
    assert "tp=3" in outs[1][1] or "tensor_model_parallel_size=3" in outs[1][1]
    for rank, (kind, text, seconds, created) in enumerate(outs):
        assert seconds < BOUND_S, (rank, seconds)
        assert created == 0, (rank, created)
        if rank != 1:
            assert kind == "PeerCheckError", text
            assert "initialize_model_parallel failed its checks on rank(s) [1]" in text
            assert outs[1][1] in text


def _carried(bad_ranks: list[int]) -> tuple[str, str, float, list[str]]:
    """``CarriedStatus``: the flag rides in a SUM all-reduce that also adds the ranks'
    numbers; what each rank raised, the sum read back, and what a recorder opened with
    ``status_exchanges=True`` saw (one all-reduce; no status exchange)."""
    me = dist.get_rank()
    status = CarriedStatus("the test's carrying entry point")
    with status.checks():
        if me in bad_ranks:
            raise TypeError(f"x=3 on rank {me} must be a str")
    payload = torch.tensor([float(me), status.flag])
    kind, text = "no error", ""
    with mg.record_collectives(status_exchanges=True) as log:
        mg.all_reduce(payload, _world(), label="the work the entry point runs anyway")
    try:
        status.settle(_world(), float(payload[1]))
    except (ValueError, TypeError) as err:
        kind, text = error_kind(err), str(err)
    return kind, text, float(payload[0]), [r.op for r in log]


@pytest.mark.parametrize(("world", "bad"), [(2, []), (2, [1]), (4, [0, 3])])
def test_a_carried_status_fails_every_rank_without_an_exchange(
    rank_pools: RankPools, world: int, bad: list[int]
) -> None:
    outs = rank_pools.get(world).run(_carried, bad)
    for rank, (kind, text, total, ops) in enumerate(outs):
        assert total == sum(range(world))  # the carrying reduction did its own work too
        assert ops == ["all_reduce"]
        if not bad:
            assert kind == "no error"
        elif rank in bad:
            assert (kind, text) == ("TypeError", f"x=3 on rank {rank} must be a str")
        else:
            assert kind == "PeerCheckError", text
            assert text.startswith(
                f"the test's carrying entry point failed its checks on rank(s) {bad}"
            )
            for r in bad:
                assert f"rank {r}: TypeError: x=3 on rank {r} must be a str" in text


def _recorded_exchanges() -> tuple[list[str], list[str]]:
    with mg.record_collectives() as plain, mg.record_collectives(status_exchanges=True) as full:
        with mg.fail_together(None, "the test's entry point"):
            pass
        mg.all_reduce(torch.ones(1), _world(), label="work")
    return [r.op for r in plain], [f"{r.op} {r.label} {r.bytes}" for r in full]


def test_status_exchanges_are_recorded_on_request(rank_pools: RankPools) -> None:
    for plain, full in rank_pools.get(2).run(_recorded_exchanges):
        assert plain == ["all_reduce"]
        assert full == ["status_exchange the test's entry point 8", "all_reduce work 4"]


BASE: dict[str, Any] = {"hidden": 8, "dtype": "float32", "params": ("a (2,)", "b (3,)")}

CASES: dict[str, dict[str, Any]] = {  # rank 1's fields; rank 0 always holds BASE
    "same": BASE,
    "scalar": {**BASE, "hidden": 16},
    "entry": {**BASE, "params": ("a (2,)", "b (4,)")},
    "length": {**BASE, "params": ("a (2,)",)},
    "absent": {"hidden": 8, "params": BASE["params"]},
}


def _grid() -> dict[str, Any]:
    """Every case on this rank (rank 1 passes the case's fields), then a peer comparing
    another ``what``; what each raised, as attributes and text."""
    group, me = _world(), dist.get_rank()
    out: dict[str, Any] = {}
    spy = mock.patch.object(cross_rank, "_exchange_keys", wraps=cross_rank._exchange_keys)
    with spy as exchanges, mg.record_collectives() as log:
        for case, theirs in CASES.items():
            try:
                mg.cross_check(group, "the test's sizes", BASE if me == 0 else theirs)
                out[case] = ("no error", "", ())
            except mg.AgreementError as err:
                out[case] = (error_kind(err), str(err), err.differences)
                out[f"{case} attributes"] = (err.what, err.group_ranks)
        try:
            mg.cross_check(group, "A" if me == 0 else "B", BASE)
            out["other what"] = ("no error", "", ())
        except mg.CollectiveScheduleError as err:
            out["other what"] = (error_kind(err), str(err), (err.group_ranks, err.variants))
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
        assert out["recorded"] == 0  # not a collective of the run's schedule (not asked)
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
        kind, text, (ranks, variants) = out["other what"]
        assert kind == "CollectiveScheduleError"
        assert ranks == (0, 1)
        assert variants == (ScheduleVariant((0,), "A"), ScheduleVariant((1,), "B"))
        assert "  rank(s) [1]: B" in text.splitlines()


def test_differences_by_hand() -> None:
    rows = [
        {"tp": 2, "order": "tp-dp", "sizes": (1, 2)},
        {"tp": 2, "order": "dp-tp", "sizes": (1, 2)},
        {"tp": 4, "order": "tp-dp", "sizes": (1, 3), "extra": None},
    ]
    assert cross_rank.differences([4, 5, 6], rows) == (
        Difference("tp", (("2", (4, 5)), ("4", (6,)))),
        Difference("order", (("tp-dp", (4, 6)), ("dp-tp", (5,)))),
        Difference("sizes", (("2", (4, 5)), ("3", (6,))), 1),
        Difference("extra", ((ABSENT, (4, 5)), ("None", (6,)))),
    )
    assert cross_rank.differences([0, 1], [rows[0], dict(rows[0])]) == ()


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
    assert isinstance(back, InputValueError)
    for other in (
        mg.PeerCheckError("text", {1: "TypeError: x"}),
        mg.CollectiveScheduleError("text", [0, 1], [ScheduleVariant((0,), "A")]),
    ):
        again = pickle.loads(pickle.dumps(other))
        assert (type(again), str(again), vars(again)) == (type(other), str(other), vars(other))
