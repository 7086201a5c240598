"""Dead and hung peers: every path of the collective layer raises a ``CollectiveError``
naming the operation, the group's ranks and the label, within 2 × the group's timeout.

Localizes error wrapping per path (sync call, async handle, gloo all-to-all with a
finisher, coalesced batch, broadcast, all-to-all, barrier, objects, the schedule check's
exchange) and the timeout that bounds a hung peer, including on groups built by
``initialize_model_parallel`` (torch would give them 30 minutes). Each test owns a
short-timeout pool because a dead or hung rank leaves its world unusable. Timing bounds
are the issue's (2 × timeout); the measured times are far below them for a dead peer
(gloo reports a closed connection at once) and about 1 × timeout for a hung one.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.testing import RankFailure, RankPool, error_kind

TIMEOUT_S = 2.0


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _coalesced_pair(g: dist.ProcessGroup) -> None:
    with mg.coalesced(g, async_op=True, label="bucket batch") as batch:
        for n in (4, 6):
            flat = torch.ones(n)
            batch.reduce_scatter(flat[: n // 2], flat)
    batch.handle.wait()


def _paths(g: dist.ProcessGroup) -> dict[str, Callable[[], object]]:
    def checked() -> None:
        with mg.check_collective_schedule():
            mg.all_reduce(torch.ones(4), g, label="checked")

    return {
        "sync all_reduce": lambda: mg.all_reduce(torch.ones(4), g, label="sync"),
        "async all_reduce": lambda: mg.all_reduce(
            torch.ones(4), g, async_op=True, label="async"
        ).wait(),
        "async reduce_scatter": lambda: mg.reduce_scatter(
            torch.zeros(2), torch.ones(4), g, async_op=True, label="finisher"
        ).wait(),
        "all_gather": lambda: mg.all_gather(torch.zeros(4), torch.ones(2), g, label="gather"),
        "coalesced": lambda: _coalesced_pair(g),
        "broadcast": lambda: mg.broadcast(torch.ones(2), g, group_src=1, label="bcast"),
        "all_to_all": lambda: mg.all_to_all(torch.zeros(2), torch.ones(2), g, label="a2a"),
        "barrier": lambda: mg.barrier(g, label="fence"),
        "objects": lambda: mg.all_gather_objects(0, g, label="objs"),
        "schedule check": checked,
    }


def _after_peer_exit() -> dict[str, tuple[str, str, float]]:
    if dist.get_rank() == 1:
        time.sleep(0.3)  # let rank 0 enter its first collective
        os._exit(3)
    out = {}
    for name, call in _paths(_world()).items():
        started = time.monotonic()
        try:
            call()
            out[name] = ("no error", "", 0.0)
        except mg.CollectiveError as err:
            out[name] = (error_kind(err), str(err), time.monotonic() - started)
    return out


_NAMED = {
    "sync all_reduce": r"^all_reduce on group ranks \[0, 1\] \(4 × float32\) for 'sync' failed",
    "async all_reduce": r"^all_reduce on group ranks \[0, 1\] \(4 × float32\) for 'async'",
    "async reduce_scatter": r"^reduce_scatter on group ranks \[0, 1\] \(4 × float32\) for "
    "'finisher' failed",
    "all_gather": r"^all_gather on group ranks \[0, 1\] \(2 × float32\) for 'gather' failed",
    "coalesced": r"^coalesced batch of \d × reduce_scatter\(sum\) on group ranks \[0, 1\] for "
    "'bucket batch' failed",
    "broadcast": r"^broadcast on group ranks \[0, 1\] \(2 × float32\) for 'bcast' failed",
    "all_to_all": r"^all_to_all on group ranks \[0, 1\] \(2 × float32\) for 'a2a' failed",
    "barrier": r"^barrier on group ranks \[0, 1\] for 'fence' failed",
    "objects": r"^all_gather_object on group ranks \[0, 1\] for 'objs' failed",
    "schedule check": r"^all_reduce\(sum\) 'checked' of 4 × float32: the cross-rank check on "
    r"group ranks \[0, 1\] failed",
}


def test_a_dead_peer_fails_every_path_with_a_named_error() -> None:
    with (
        RankPool(2, pg_timeout_s=TIMEOUT_S, failure_grace_s=10 * TIMEOUT_S) as pool,
        pytest.raises(RankFailure) as info,
    ):
        pool.run(_after_peer_exit)
    outcomes = info.value.outcomes
    assert "exit code 3" in outcomes[1].error
    assert outcomes[0].ok, outcomes[0].error
    found: dict[str, tuple[str, str, float]] = outcomes[0].result  # type: ignore[assignment]
    assert list(found) == list(_NAMED)
    for name, pattern in _NAMED.items():
        kind, message, elapsed = found[name]
        assert kind == "CollectiveError", (name, message)
        assert re.search(pattern, message), (name, message)
        assert elapsed < 2 * TIMEOUT_S, (name, elapsed)


def _hung_peer() -> dict[str, Any]:
    pgc = mg.initialize_model_parallel()  # no timeout given: must inherit the world's
    dp = pgc.require("dp", "the test")
    backend_timeout = dp._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    if dist.get_rank() == 1:
        return {"timeout": backend_timeout}  # alive, but never joins rank 0's collectives
    out: dict[str, Any] = {"timeout": backend_timeout}
    calls: dict[str, Callable[[], object]] = {
        "async reduce_scatter on dp": lambda: mg.reduce_scatter(
            torch.zeros(2), torch.ones(4), dp, async_op=True, label="grad reduce"
        ).wait(),
        "schedule check on world": lambda: _checked_all_reduce(_world()),
    }
    for name, call in calls.items():
        started = time.monotonic()
        try:
            call()
            out[name] = ("no error", 0.0)
        except mg.CollectiveError as err:
            out[name] = (str(err), time.monotonic() - started)
    return out


def _checked_all_reduce(g: dist.ProcessGroup) -> None:
    with mg.check_collective_schedule():
        mg.all_reduce(torch.ones(4), g, label="loss")


def test_a_hung_peer_is_reported_within_twice_the_timeout() -> None:
    with RankPool(2, pg_timeout_s=TIMEOUT_S, call_deadline_s=60) as pool:
        outs = pool.run(_hung_peer)
    # groups built without a timeout carry the world's (torch's default would be 1800 s)
    assert [o["timeout"] for o in outs] == [TIMEOUT_S, TIMEOUT_S]
    message, elapsed = outs[0]["async reduce_scatter on dp"]
    assert message.startswith(
        "reduce_scatter on group ranks [0, 1] (4 × float32) for 'grad reduce' failed"
    )
    assert "Timed out" in message
    assert TIMEOUT_S * 0.9 < elapsed < 2 * TIMEOUT_S
    message, elapsed = outs[0]["schedule check on world"]
    assert message.startswith("all_reduce(sum) 'loss' of 4 × float32: the cross-rank check")
    assert "the other ranks did not reach it" in message
    assert TIMEOUT_S * 0.9 < elapsed < 2 * TIMEOUT_S
