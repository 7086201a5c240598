"""Collective schedules of DDP, read from mc_groups' recorder (2 gloo ranks).

Localizes when and where each collective is issued: one per bucket per step on the right
group, none inside no_sync, dispatch from the backward hooks (after the first iteration)
before the last gradient is computed, param all-gathers model-start-first from the forward
pre-hooks or the optimizer step, and the warning when forward order differs from
registration order. No numeric tolerance: these tests compare lists of records exactly.
The MLP with TINY buckets has 5 bucket groups: group i holds, in backprop order,
[out.bias+out.weight], [mid.bias], [mid.weight], [in.bias], [in.weight].
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer
from mc_ddp_tests._harness import (
    GATHER_OP,
    LOCAL_BATCH,
    SCATTER_OP,
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    loss_fn,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools

TINY = 16
GROUPS = 5


def _entries(log: list[mg.CollectiveRecord]) -> list[tuple[Any, ...]]:
    return [(r.op, r.label, r.numel, r.group_ranks, r.async_op) for r in log]


def _labels(kind: str, order: range | list[int]) -> list[str]:
    return [f"{kind} dense bucket group {i}" for i in order]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    return local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())


def _probe_first_layer(model: nn.Sequential, current: list[list[mg.CollectiveRecord]]) -> list[int]:
    """Record how many collectives were issued when each first-layer grad arrived.

    Registered before DDP wraps the model, so each probe runs before DDP's own hook for
    that param (hooks run in registration order)."""
    seen: list[int] = []
    for param in model[0].parameters():
        param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda _p: seen.append(len(current[-1]) if current else -1)
        )
    return seen


def _grad_schedule() -> dict[str, Any]:
    with model_parallel() as pgc:
        model = mlp()
        current: list[list[mg.CollectiveRecord]] = []
        seen = _probe_first_layer(model, current)
        cfg = ddp_config(overlap_grad_reduce=True, bucket_size=TINY)
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        out: dict[str, Any] = {"numels": [b.numel for g in ddp.bucket_groups for b in g.buckets]}
        with mg.record_collectives() as log:  # iteration 1 learns the ready counts
            ddp_backward(ddp, *_batch(0), microbatches=1)
            out["first_backward"] = len(log)
            ddp.finish_grad_sync()
            out["first_finish"] = _entries(log)
        ddp.zero_grad_buffer()
        with mg.record_collectives() as log:
            current.append(log)
            x, y = _batch(1)
            with ddp.no_sync():
                torch.autograd.backward(loss_fn(ddp(x[:3]), y[:3]))
            out["no_sync"] = len(log)
            seen.clear()
            torch.autograd.backward(loss_fn(ddp(x[3:]), y[3:]))
            out["before_first_layer"] = [r.label for r in log[: min(seen)]]
            out["backward"] = _entries(log)
            ddp.finish_grad_sync()
            ddp.finish_grad_sync()  # safe to call twice: nothing more is issued
            out["after_finish"] = len(log)
        return out


def test_grad_reduction_schedule(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_grad_schedule):
        numels = out["numels"]
        assert len(numels) == GROUPS
        # the first iteration issues nothing from the hooks, everything in finish (sync)
        assert out["first_backward"] == 0
        assert out["first_finish"] == [
            ("all_reduce", label, n, (0, 1), True)
            for label, n in zip(_labels("grad reduce", range(GROUPS)), numels, strict=True)
        ]
        assert out["no_sync"] == 0
        # groups 0-2 hold no first-layer param: issued before the first-layer grads exist
        assert out["before_first_layer"] == _labels("grad reduce", range(3))
        assert out["backward"] == out["first_finish"]
        assert out["after_finish"] == GROUPS


def _param_gather_schedule(overlap: bool) -> dict[str, Any]:
    with model_parallel() as pgc:
        model = mlp()
        cfg = ddp_config(
            overlap_grad_reduce=True,
            overlap_param_gather=overlap,
            use_distributed_optimizer=True,
            bucket_size=TINY,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
        numels = [b.numel for g in ddp.bucket_groups for b in g.buckets]
        phases: dict[str, list[tuple[Any, ...]]] = {}
        for step in range(3):
            ddp.zero_grad_buffer()
            x, y = _batch(step)
            with mg.record_collectives() as fwd:
                loss = loss_fn(ddp(x), y)
            with mg.record_collectives() as bwd:
                torch.autograd.backward(loss)
                ddp.finish_grad_sync()
            with mg.record_collectives() as stp:
                opt.step()
            phases = {"forward": _entries(fwd), "backward": _entries(bwd), "step": _entries(stp)}
        return {"numels": numels, **phases}


def test_param_gather_schedule_overlapped_with_forward(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_param_gather_schedule, True):
        numels = out["numels"]
        # an all-gather's record counts this rank's shard: bucket numel / dp (dp = 2)
        gathers = [
            (GATHER_OP, f"param gather dense bucket group {i}", numels[i] // 2, (0, 1), True)
            for i in reversed(range(GROUPS))  # model start first
        ]
        assert out["forward"] == gathers
        assert out["backward"] == [
            (SCATTER_OP, f"grad reduce dense bucket group {i}", numels[i], (0, 1), True)
            for i in range(GROUPS)
        ]
        assert out["step"] == []  # the next forward gathers


def test_param_gather_schedule_in_optimizer_step(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_param_gather_schedule, False):
        numels = out["numels"]
        assert out["forward"] == []
        assert [e[:2] for e in out["backward"]] == [
            (SCATTER_OP, f"grad reduce dense bucket group {i}") for i in range(GROUPS)
        ]
        assert out["step"] == [
            (GATHER_OP, f"param gather dense bucket group {i}", numels[i] // 2, (0, 1), False)
            for i in reversed(range(GROUPS))
        ]


class _Reversed(nn.Module):
    """Registers three layers in one order and runs them in the other."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.first(self.second(self.third(x)))
        return out


def _order_warnings(reverse: bool) -> list[str]:
    with model_parallel() as pgc:
        model: nn.Module = _Reversed() if reverse else nn.Sequential(*_Reversed().children())
        cfg = ddp_config(
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            use_distributed_optimizer=True,
            bucket_size=64,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.autograd.backward(ddp(torch.ones(LOCAL_BATCH, 8)).sum())
        ddp.finish_grad_sync()
        return [str(w.message) for w in caught]


def test_forward_order_differing_from_registration_warns(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    for messages in pool.run(_order_warnings, True):
        assert len(messages) == 2  # the 2nd and 3rd modules find their successor dispatched
        assert all("different order" in m for m in messages)
    assert pool.run(_order_warnings, False) == [[], []]
