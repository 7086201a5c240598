"""Dead ranks and mismatched schedules in a DDP step: a named error on every survivor, fast.

Localizes (1) error propagation out of DDP's asynchronous paths when a peer process exits
mid-step: a bucket reduction issued from a backward hook and waited in finish_grad_sync,
and a param all-gather waited in a forward pre-hook; the survivor must raise mc_groups'
CollectiveError naming the operation, the group's ranks and the bucket group within
2 × the process-group timeout (each scenario owns a short-timeout pool: a dead rank ends
its world); (2) ranks whose models registered params in a different order (equal-sized
buckets holding different params): DDP's agreement at construction refuses them on every
rank; with that agreement bypassed (to test the second line of defense) they are silently
summed into each other without the opt-in schedule check, and with it every rank raises
before anything is reduced; with matching models the schedule check changes no number
(bit-identical params after training, same collective records).
"""

from __future__ import annotations

import os
import re
import time
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DataParallelAgreementError, DistributedDataParallel, ShardedOptimizer
from mc_ddp_tests._harness import (
    Reference,
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    loss_fn,
    max_grad_error,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankFailure, RankPool, RankPools, error_kind

MP = mg.ModelParallelConfig()
TIMEOUT_S = 3.0
EXIT_CODE = 3


def _exit(*unused: Any) -> None:
    os._exit(EXIT_CODE)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    return local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())


def _dies_in_backward() -> tuple[str, str, float]:
    """Rank 1 exits once the last layer's bucket reduction is in flight (a hook on an
    earlier layer's weight gradient); rank 0 must fail naming a bucket group's collective.
    (The groups are not destroyed: that is collective, and the pool is torn down anyway.)"""
    pgc = mg.initialize_model_parallel()
    model = mlp()
    cfg = ddp_config(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=16)
    ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc)
    x, y = _batch(0)
    ddp_backward(ddp, x, y, 1)  # a clean first iteration learns the ready counts
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    if dist.get_rank() == 1:
        middle: Any = model[2]
        middle.weight.register_hook(_exit)
    started = time.monotonic()
    try:
        ddp_backward(ddp, x, y, 1)
        ddp.finish_grad_sync()
    except mg.CollectiveError as err:
        return error_kind(err), str(err), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def _dies_in_forward() -> tuple[str, str, float]:
    """Rank 1 exits at the start of the second forward, before its param all-gathers;
    rank 0 waits for one in a forward pre-hook and must fail naming it."""
    pgc = mg.initialize_model_parallel()
    model = mlp()
    cfg = ddp_config(
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        bucket_size=16,
    )
    ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    x, y = _batch(0)
    ddp_backward(ddp, x, y, 1)
    ddp.finish_grad_sync()
    opt.step()  # the next forward's pre-hooks gather the updated params
    ddp.zero_grad_buffer()
    if dist.get_rank() == 1:
        model.register_forward_pre_hook(_exit)  # runs after DDP's own root pre-hook
    started = time.monotonic()
    try:
        ddp(x)
    except mg.CollectiveError as err:
        return error_kind(err), str(err), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def _survivor(scenario: Any) -> tuple[str, str, float]:
    with (
        RankPool(2, pg_timeout_s=TIMEOUT_S, failure_grace_s=10 * TIMEOUT_S) as pool,
        pytest.raises(RankFailure) as info,
    ):
        pool.run(scenario)
    outcomes = info.value.outcomes
    assert f"exit code {EXIT_CODE}" in outcomes[1].error
    assert outcomes[0].ok, outcomes[0].error
    result: tuple[str, str, float] = outcomes[0].result  # type: ignore[assignment]
    return result


def test_a_rank_dying_in_backward_fails_the_survivor_naming_the_bucket_collective() -> None:
    kind, message, elapsed = _survivor(_dies_in_backward)
    assert kind == "CollectiveError", message
    assert re.match(
        r"reduce_scatter on group ranks \[0, 1\] \(\d+ × float32\) for 'grad reduce dense "
        r"bucket group \d' \[bucket \d: \d params? '\d\.(weight|bias)' .*; layout [0-9a-f]{16}\] "
        r"failed: \[",
        message,
    ), message
    assert "by peer" in message  # gloo's own words follow
    assert elapsed < 2 * TIMEOUT_S


def test_a_rank_dying_in_forward_fails_the_survivor_naming_the_param_gather() -> None:
    kind, message, elapsed = _survivor(_dies_in_forward)
    assert kind == "CollectiveError", message
    # the first layer's params (one per bucket: the distributed-optimizer layout pads each
    # param to 64 elements and buckets close at 16) are gathered first
    assert re.match(
        r"all_gather on group ranks \[0, 1\] \(\d+ × float32\) for 'param gather dense bucket "
        r"group \d' \[bucket \d: 1 param '0\.(weight|bias)' \((16, 8|16,)\); layout [0-9a-f]{16}\] "
        r"failed: \[",
        message,
    ), message
    assert "by peer" in message
    assert elapsed < 2 * TIMEOUT_S


class _Ordered(nn.Module):
    """The MLP of the harness, its layers registered in ``order`` (forward order fixed)."""

    def __init__(self, order: tuple[int, ...]) -> None:
        super().__init__()
        layers = dict(enumerate(mlp()))
        for i in order:
            self.add_module(f"l{i}", layers[2 * i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.get_submodule("l0")(x))
        hidden = torch.tanh(self.get_submodule("l1")(hidden))
        out: torch.Tensor = self.get_submodule("l2")(hidden)
        return out


def _registration_order(check: bool, agree: bool = False) -> dict[str, Any]:
    """One bucket (484 elements on both ranks), params registered in opposite orders;
    ``agree=False`` bypasses DDP's agreement at construction (which refuses the model)."""
    order = (0, 1, 2) if dist.get_rank() == 0 else (2, 1, 0)
    bypass = nullcontext() if agree else mock.patch("mc_ddp._agreement.agree")
    with model_parallel() as pgc:
        model = _Ordered(order)
        ref = Reference(_Ordered((0, 1, 2)), 0.1)
        with bypass:
            try:
                ddp = DistributedDataParallel(MP, ddp_config(), model, pg_collection=pgc)
            except DataParallelAgreementError as err:
                return {"construction": str(err)}
        x, y = global_batch(0, dist.get_world_size(), torch.float32)
        rows = local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())
        torch.autograd.backward(loss_fn(ddp(rows[0]), rows[1]))
        with mg.check_collective_schedule(check), mg.record_collectives() as log:
            try:
                ddp.finish_grad_sync()
                message = "no error"
            except mg.CollectiveScheduleError as err:
                message = str(err)
        grads = ref.grads(x, y)
        names = [n for n, _ in ref.model.named_parameters()]
        named = dict(zip(names, grads, strict=True))
        ordered = [named[n] for n, _ in model.named_parameters()]
        return {
            "message": message,
            "issued": [r.label for r in log],
            "error": max_grad_error(ddp, ordered),
        }


def test_params_registered_in_another_order_are_refused_at_construction(
    rank_pools: RankPools,
) -> None:
    for out in rank_pools.get(2).run(_registration_order, False, True):
        assert out["construction"].startswith(
            "DistributedDataParallel: the ranks [0, 1] of group dp_cp were built differently"
        )
        assert (
            "dense params, entry #0: 'l0.weight' (16, 8) float32 on rank(s) [0]; "
            "'l2.weight' (4, 16) float32 on rank(s) [1]"
        ) in out["construction"]


def test_params_registered_in_another_order_are_caught_by_the_schedule_check(
    rank_pools: RankPools,
) -> None:
    pool = rank_pools.get(2)
    unchecked = pool.run(_registration_order, False)
    for out in unchecked:  # same bucket size: the all-reduce "works" and mixes gradients
        assert out["message"] == "no error"
        assert out["error"] > 1e-2
    checked = pool.run(_registration_order, True)
    for out in checked:
        assert out["issued"] == []
        message = out["message"]
        assert message.startswith(
            "collective schedule mismatch on group ranks [0, 1]: the ranks were about to run "
            "2 different collectives or checks (none was issued):"
        )
        assert (
            "rank(s) [0]: all_reduce(sum) 'grad reduce dense bucket group 0' of 484 × float32 "
            "[bucket 0: 6 params 'l2.bias' (4,), 'l2.weight' (4, 16), 'l1.bias' "
            "(16,) and 3 more; layout "
        ) in message
        assert (
            "rank(s) [1]: all_reduce(sum) 'grad reduce dense bucket group 0' of 484 × float32 "
            "[bucket 0: 6 params 'l0.bias' (16,), 'l0.weight' (16, 8), 'l1.bias' "
            "(16,) and 3 more; layout "
        ) in message


def _train(check: bool) -> tuple[list[torch.Tensor], list[tuple[Any, ...]]]:
    with model_parallel() as pgc, mg.check_collective_schedule(check):
        model = mlp()
        cfg = ddp_config(
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            bucket_size=16,
        )
        ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
        with mg.record_collectives() as log:
            for step in range(3):
                ddp.zero_grad_buffer()
                x, y = _batch(step)
                ddp_backward(ddp, x, y, 3)
                ddp.finish_grad_sync()
                opt.step()
            ddp.disable_forward_pre_hook()  # gathers the last step's params
        records = [(r.op, r.label, r.numel, r.async_op) for r in log]
        return [p.detach().clone() for p in model.parameters()], records


def _with_and_without_check() -> dict[str, Any]:
    params_off, log_off = _train(False)
    params_on, log_on = _train(True)
    return {
        "identical": all(torch.equal(a, b) for a, b in zip(params_off, params_on, strict=True)),
        "same_log": log_on == log_off,
        "gathers": sum(label.startswith("param gather") for _, label, _, _ in log_on),
    }


def test_the_schedule_check_changes_no_number(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_with_and_without_check):
        assert out["identical"]
        assert out["same_log"]
        assert out["gathers"] >= 3 * 3  # 3 bucket groups gathered after each of 3 steps
