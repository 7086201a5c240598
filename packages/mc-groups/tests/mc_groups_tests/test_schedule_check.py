"""The opt-in collective-schedule check: matching schedules run unchanged, every kind of
mismatch is one error on every rank, before anything is issued.

Localizes the check itself on real gloo groups (2 and 4 ranks): which fields of a
collective are compared (op, reduce op, numel, dtype, label, detail, broadcast source,
coalesced batch contents), that the error names the disagreeing ranks and what each was
about to run, that a mismatch leaves nothing recorded and the group usable, and how the
switch is read (environment variable at call time, context manager, bad values). Values
are small integers, exact in fp32 (no tolerance).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import ReduceOp
from mc_groups.comm import cross_rank
from mc_groups.comm.collectives import schedule_check_enabled
from mc_groups.testing import RankPools, error_kind


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _records(log: list[mg.CollectiveRecord]) -> list[tuple[Any, ...]]:
    return [(r.op, r.reduce_op, r.numel, r.async_op, r.coalesced, r.label) for r in log]


def _every_op(check: bool) -> dict[str, Any]:
    """Each collective once, with values derivable by hand (rank r contributes r + 1)."""
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    counter = mock.patch.object(cross_rank, "_exchange_keys", wraps=cross_rank._exchange_keys)
    with mg.check_collective_schedule(check), counter as exchanges, mg.record_collectives() as log:
        s = torch.full((3,), float(r + 1))
        mg.all_reduce(s, g, label="sum", detail="three ones")
        flat = torch.arange(2.0 * w) * (r + 1)
        shard = flat[2 * r : 2 * r + 2]
        mg.reduce_scatter(shard, flat, g, async_op=True).wait()
        gathered = torch.zeros(2 * w)
        mg.all_gather(gathered, torch.full((2,), float(r)), g)
        b = torch.full((2,), float(r))
        mg.broadcast(b, g, group_src=w - 1)
        # uneven all-to-all: rank r sends r + 1 rows to every rank (sizes differ by rank)
        sends = torch.full(((r + 1) * w,), float(r))
        received = torch.zeros(sum(k + 1 for k in range(w)))
        mg.all_to_all(
            received,
            sends,
            g,
            input_split_sizes=[r + 1] * w,
            output_split_sizes=[k + 1 for k in range(w)],
        )
        with mg.coalesced(g, async_op=True, label="batch") as batch:
            x = torch.full((4,), float(r + 1))
            y = torch.full((2,), float(r + 1))
            batch.all_reduce(x)
            batch.all_reduce(y)
        batch.handle.wait()
        objects = mg.all_gather_objects(r, g)
        mg.barrier(g)
    return {
        "values": [
            s.tolist(),
            shard.tolist(),
            gathered.tolist(),
            b.tolist(),
            received.tolist(),
            x.tolist(),
            y.tolist(),
            objects,
        ],
        "log": _records(log),
        "exchanges": exchanges.call_count,
    }


def test_a_matching_schedule_runs_unchanged_and_unrecorded(rank_pools: RankPools) -> None:
    w = 2
    total = w * (w + 1) / 2  # sum of (r + 1)
    plain = rank_pools.get(w).run(_every_op, False)
    checked = rank_pools.get(w).run(_every_op, True)
    for r, (off, on) in enumerate(zip(plain, checked, strict=True)):
        assert on["values"] == off["values"]  # the check changes no number...
        assert on["log"] == off["log"]  # ...and no record (its exchange is not recorded)
        assert off["exchanges"] == 0
        # one exchange per collective; the coalesced batch is checked once as a whole
        assert on["exchanges"] == 8
        s, shard, gathered, b, received, x, y, objects = on["values"]
        assert s == [total] * 3
        assert shard == [(2 * r + i) * total for i in range(2)]
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert b == [w - 1.0] * 2
        assert received == [0.0, 1.0, 1.0]  # 1 row from rank 0, 2 rows from rank 1
        assert (x, y) == ([total] * 4, [total] * 2)
        assert objects == [0, 1]


def _tensor_mismatch(g: dist.ProcessGroup, r: int) -> Callable[[], object]:
    return lambda: mg.all_reduce(torch.ones(4 + 2 * r), g, label="grads")


_MISMATCHES: dict[str, Callable[[dist.ProcessGroup, int], Callable[[], object]]] = {
    "numel": _tensor_mismatch,
    "dtype": lambda g, r: (
        lambda: mg.all_reduce(
            torch.ones(4, dtype=(torch.float32, torch.bfloat16)[r]), g, label="grads"
        )
    ),
    "reduce_op": lambda g, r: (
        lambda: mg.all_reduce(torch.ones(4), g, op=(ReduceOp.SUM, ReduceOp.AVG)[r], label="grads")
    ),
    "op": lambda g, r: (
        lambda: (
            mg.all_reduce(torch.ones(4), g, label="grads")
            if r == 0
            else mg.all_gather(torch.ones(4), torch.ones(2), g, label="grads")
        )
    ),
    "label": lambda g, r: lambda: mg.all_reduce(torch.ones(4), g, label=f"layer {r}"),
    "detail": lambda g, r: (
        lambda: mg.all_reduce(torch.ones(4), g, label="grads", detail=("'a' (4,)", "'b' (4,)")[r])
    ),
    "broadcast_src": lambda g, r: lambda: mg.broadcast(torch.ones(2), g, group_src=r),
    "batch": lambda g, r: lambda: _batch_of(g, 2 + r),
    "reduce_scatter_async": lambda g, r: (
        lambda: mg.reduce_scatter(
            torch.zeros(2 + r), torch.zeros(4 + 2 * r), g, async_op=True, label="rs"
        )
    ),
}


def _batch_of(g: dist.ProcessGroup, count: int) -> None:
    with mg.coalesced(g, label="bucket group 0") as batch:
        for _ in range(count):
            batch.all_reduce(torch.ones(3))


def _mismatches() -> dict[str, Any]:
    g, r = _world(), dist.get_rank()
    out: dict[str, Any] = {}
    with mg.check_collective_schedule():
        for name, make in _MISMATCHES.items():
            with mg.record_collectives() as log:
                try:
                    make(g, r)()
                    out[name] = ("no error", "", 0)
                except mg.CollectiveScheduleError as err:
                    out[name] = (error_kind(err), str(err), len(log))
        after = torch.full((2,), float(r + 1))
        mg.all_reduce(after, g)  # the group is still usable
    out["after"] = after.tolist()
    return out


_EXPECTED_LINES = {
    "numel": [
        "rank(s) [0]: all_reduce(sum) 'grads' of 4 × float32, shape (4,)",
        "rank(s) [1]: all_reduce(sum) 'grads' of 6 × float32, shape (6,)",
    ],
    "dtype": ["of 4 × float32", "of 4 × bfloat16"],
    "reduce_op": ["rank(s) [0]: all_reduce(sum)", "rank(s) [1]: all_reduce(avg)"],
    "op": ["rank(s) [0]: all_reduce(sum) 'grads' of 4 × float32", "rank(s) [1]: all_gather"],
    "label": ["rank(s) [0]: all_reduce(sum) 'layer 0'", "rank(s) [1]: all_reduce(sum) 'layer 1'"],
    "detail": ["of 4 × float32 ['a' (4,)], shape (4,)", "of 4 × float32 ['b' (4,)], shape (4,)"],
    "broadcast_src": ["broadcast from group rank 0", "broadcast from group rank 1"],
    "batch": [
        "rank(s) [0]: coalesced 2 × all_reduce(sum) 'bucket group 0' of 3 × float32, 3 × float32",
        "rank(s) [1]: coalesced 3 × all_reduce(sum) 'bucket group 0'",
    ],
    "reduce_scatter_async": ["reduce_scatter(sum) 'rs' of 4 × float32", "of 6 × float32"],
}


def test_every_mismatch_is_one_error_on_every_rank(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_mismatches):
        for name, lines in _EXPECTED_LINES.items():
            kind, message, issued = out[name]
            assert (kind, issued) == ("CollectiveScheduleError", 0), (name, message)
            assert message.startswith(
                "collective schedule mismatch on group ranks [0, 1]: the ranks were about to "
                "run 2 different collectives or checks (none was issued):"
            ), name
            for line in lines:
                assert line in message, (name, line, message)
        assert out["after"] == [3.0, 3.0]


def _one_rank_differs() -> str:
    g, r = _world(), dist.get_rank()
    with mg.check_collective_schedule():
        try:
            mg.all_reduce(torch.ones(8 if r == 2 else 4), g, label="grads")
        except mg.CollectiveScheduleError as err:
            return str(err)
    return "no error"


def test_the_disagreeing_rank_is_named_among_four(rank_pools: RankPools) -> None:
    for message in rank_pools.get(4).run(_one_rank_differs):
        assert "rank(s) [0, 1, 3]: all_reduce(sum) 'grads' of 4 × float32" in message
        assert "rank(s) [2]: all_reduce(sum) 'grads' of 8 × float32" in message


def _switches() -> dict[str, Any]:
    g = _world()
    env = "MC_CHECK_COLLECTIVE_SCHEDULE"
    out: dict[str, Any] = {"start": os.environ.get(env)}
    os.environ[env] = "maybe"
    try:
        with mg.record_collectives() as log:
            mg.all_reduce(torch.ones(2), g)
    except ValueError as err:
        out["bad_value"] = (str(err), len(log))
    os.environ[env] = "on"  # read at call time: no context manager needed
    out["on"] = schedule_check_enabled()
    with mg.check_collective_schedule(False):
        out["inner_off"] = (os.environ.get(env), schedule_check_enabled())
    out["restored"] = os.environ.get(env)
    del os.environ[env]
    with mg.check_collective_schedule():
        out["inside"] = schedule_check_enabled()
    out["end"] = os.environ.get(env)
    try:
        with mg.check_collective_schedule("yes"):  # type: ignore[arg-type]
            pass
    except TypeError as err:
        out["bad_flag"] = str(err)
    return out


def test_the_switch_is_read_at_call_time(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_switches):
        assert out["start"] is None
        message, issued = out["bad_value"]
        assert message.startswith("MC_CHECK_COLLECTIVE_SCHEDULE='maybe' is not a switch")
        assert "1/true/yes/on" in message
        assert issued == 0
        assert out["on"] is True
        assert out["inner_off"] == ("0", False)
        assert out["restored"] == "on"
        assert out["inside"] is True
        assert out["end"] is None
        assert out["bad_flag"] == "enabled='yes' must be a bool (True or False)"


def test_fingerprints_are_stable_and_distinguish_fields() -> None:
    entry = cross_rank._Entry("all_reduce(sum) 'a' of 4 × float32 [d]", "", {"n": 4})
    # BLAKE2b, not hash(): the same entry gives the same key in every process
    assert entry.key() == cross_rank._Entry(*entry).key()
    changed = [
        entry._replace(where="all_reduce(sum) 'b' of 4 × float32 [d]"),
        entry._replace(failure="TypeError: x"),
        entry._replace(fields={"n": 5}),
        entry._replace(fields={"n": 4, "m": 1}),
    ]
    assert len({e.key() for e in changed} | {entry.key()}) == 5
    assert entry._replace(shown=", shape (2, 2)").key() == entry.key()  # shape is only shown
    assert entry._replace(failure="ValueError: y").key() == changed[1].key()  # failed or not


@pytest.mark.parametrize("value", ["", "0", "off", "False", " no "])
def test_off_values(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_CHECK_COLLECTIVE_SCHEDULE", value)
    assert schedule_check_enabled() is False


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), ("1", True), (" YES ", True), ("off", False), ("", False), ("maybe", None)],
)
def test_switch_reads_what_os_environ_holds(
    value: str | None, expected: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the per-collective read (the byte mapping behind os.environ on POSIX) sees every
    # write through os.environ, set or unset
    if value is None:
        monkeypatch.delenv("MC_CHECK_COLLECTIVE_SCHEDULE", raising=False)
    else:
        monkeypatch.setenv("MC_CHECK_COLLECTIVE_SCHEDULE", value)
    if expected is None:
        with pytest.raises(ValueError, match="is not a switch"):
            schedule_check_enabled()
    else:
        assert schedule_check_enabled() is expected
