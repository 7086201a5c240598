"""A dead TP peer in backward, and a rank skipping a TP layer: named errors, no hang.

Localizes (1) error propagation out of the linear layers' asynchronous backward
collectives (the sequence-parallel input re-gather and the dgrad reduce-scatter issued in
``LinearWithGradAccumulationAndAsyncCommunication.backward``) when the other TP rank
exits mid-backward: the survivor's ``loss.backward()`` raises mc_groups' CollectiveError
naming the operation, the group's ranks and the TP label within 2 × the process-group
timeout (own short-timeout pool: a dead rank ends its world); (2) the opt-in schedule
check on a residual stack of identical TP blocks where one rank skips a block: every TP
collective of such blocks has the same size, so the mismatch shows up where one rank's
forward all-reduce meets the other's backward dgrad all-reduce (different labels), and
both ranks raise there; with no rank skipping, the check changes no number (exact
equality: the same operations run in the same order).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankFailure, RankPool, RankPools, error_kind
from mc_tp_layers_tests._helpers import backward, config, randn, world

S, B, H, F = 4, 2, 8, 16  # sequence, batch, hidden, ffn
TIMEOUT_S = 3.0
EXIT_CODE = 3


def _blocks(
    pgc: mg.ProcessGroupCollection, count: int, sp: bool
) -> list[tuple[tpl.ColumnParallelLinear, tpl.RowParallelLinear]]:
    cfg = config(2, sequence_parallel=sp)
    torch.manual_seed(0)
    return [
        (
            tpl.ColumnParallelLinear(
                H, F, config=cfg, init_method=torch.nn.init.normal_, pg_collection=pgc
            ),
            tpl.RowParallelLinear(
                F,
                H,
                config=cfg,
                init_method=torch.nn.init.normal_,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
                pg_collection=pgc,
            ),
        )
        for _ in range(count)
    ]


def _exit(*unused: Any) -> None:
    os._exit(EXIT_CODE)


def _dies_in_backward() -> tuple[str, str, float]:
    """Rank 1 exits when the column layer's output gradient is ready, i.e. after the row
    layer's backward and before the column layer's async SP gather / dgrad reduce-scatter."""
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)  # the world's timeout
    (column, row) = _blocks(pgc, 1, sp=True)[0]
    x = randn(S // 2, B, H, seed=mg.group_rank(pgc.require("tp", "test"))).requires_grad_()
    hidden, _ = column(x)
    if torch.distributed.get_rank() == 1:
        hidden.register_hook(_exit)
    out, _ = row(hidden)
    started = time.monotonic()
    try:
        backward(out, torch.ones_like(out))
    except mg.CollectiveError as err:
        return error_kind(err), str(err), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def test_a_tp_rank_dying_in_backward_fails_the_survivor_naming_the_collective() -> None:
    with (
        RankPool(2, pg_timeout_s=TIMEOUT_S, failure_grace_s=10 * TIMEOUT_S) as pool,
        pytest.raises(RankFailure) as info,
    ):
        pool.run(_dies_in_backward)
    outcomes = info.value.outcomes
    assert f"exit code {EXIT_CODE}" in outcomes[1].error
    assert outcomes[0].ok, outcomes[0].error
    result: tuple[str, str, float] = outcomes[0].result  # type: ignore[assignment]
    kind, message, elapsed = result
    assert kind == "CollectiveError", message
    # the re-gathered input shard is [S/2, B, H] = 32 elements, the dgrad [S, B, H] = 64
    assert re.match(
        r"(all_gather on group ranks \[0, 1\] \(32 × float32\) for 'tp gather dim 0'|"
        r"reduce_scatter on group ranks \[0, 1\] \(64 × float32\) for 'tp reduce-scatter "
        r"dim 0') failed: \[",
        message,
    ), message
    assert "by peer" in message
    assert elapsed < 2 * TIMEOUT_S


def _run(
    blocks: list[tuple[tpl.ColumnParallelLinear, tpl.RowParallelLinear]],
    x: torch.Tensor,
    skip: int | None,
) -> torch.Tensor:
    """``h ← h + row(column(h))`` per block, except block ``skip``."""
    h = x
    for i, (column, row) in enumerate(blocks):
        if i == skip:
            continue
        inner, _ = column(h)
        out, _ = row(inner)
        h = h + out
    return h


def _skipping_a_layer() -> dict[str, str]:
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        blocks = _blocks(pgc, 3, sp=False)
        x = randn(S, B, H, seed=1).requires_grad_()
        where = "forward"
        with mg.check_collective_schedule():
            try:
                y = _run(blocks, x, skip=1 if rank == 1 else None)
                where = "backward"
                backward(y, torch.ones_like(y))
            except mg.CollectiveScheduleError as err:
                return {"where": where, "message": str(err)}
        return {"where": "nowhere", "message": ""}
    finally:
        mg.destroy_model_parallel(pgc)


def test_a_rank_skipping_a_tp_layer_is_caught_by_the_schedule_check(
    rank_pools: RankPools,
) -> None:
    outs = rank_pools.get(2).run(_skipping_a_layer)
    # rank 0 is at block 2's Row all-reduce (block 1's matched rank 1's block 2: same op,
    # size and label) when rank 1 (blocks 0 and 2 only) has started backward with block 2's
    # dgrad all-reduce
    assert [o["where"] for o in outs] == ["forward", "backward"]
    assert outs[0]["message"] == outs[1]["message"]
    assert outs[0]["message"].startswith(
        "collective schedule mismatch on group ranks [0, 1]: the ranks were about to run 2 "
        "different collectives or checks (none was issued):\n"
        "  rank(s) [0]: all_reduce(sum) 'tp all-reduce' of 64 × float32, shape (4, 2, 8)\n"
        "  rank(s) [1]: all_reduce(sum) 'tp dgrad all-reduce' of 64 × float32, shape (4, 2, 8)"
    )


def _forward_backward(check: bool) -> list[torch.Tensor]:
    pgc = world(2)
    try:
        rank = mg.group_rank(pgc.require("tp", "test"))
        blocks = _blocks(pgc, 2, sp=True)
        x = randn(S // 2, B, H, seed=10 + rank).requires_grad_()
        with mg.check_collective_schedule(check):
            y = _run(blocks, x, skip=None)
            backward(y, randn(S // 2, B, H, seed=20 + rank))
        weights = [w for column, row in blocks for w in (column.weight, row.weight)]
        grads = [w.grad for w in weights if w is not None]
        return [y.detach(), x.grad, *grads]  # type: ignore[list-item]
    finally:
        mg.destroy_model_parallel(pgc)


def test_the_schedule_check_changes_no_tp_number(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    for off, on in zip(
        pool.run(_forward_backward, False), pool.run(_forward_backward, True), strict=True
    ):
        assert len(off) == len(on) == 6
        for a, b in zip(off, on, strict=True):
            assert torch.equal(a, b)
