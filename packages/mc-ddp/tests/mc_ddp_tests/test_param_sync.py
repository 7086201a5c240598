"""Distributed-optimizer param all-gather controls (2 gloo ranks): align_param_gather,
disable/enable of the forward pre-hooks, reset_param_sync_dispatch_state, the
optimizer-step-owned dispatch, one group's sync, free_overlap_buffers.

Localizes who dispatches which all-gather and when, read from the recorder; values are
checked against the single-process reference after one SGD step (fp32: |Δ| ≤ 1e-6, the
same bound and reason as the parity matrix) or against stale values where a gather must
not have happened.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer
from mc_ddp_tests._harness import (
    Reference,
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    max_param_error,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools

TINY, GROUPS, LR = 16, 5, 0.3


def _gathers(log: list[mg.CollectiveRecord]) -> list[tuple[int, bool]]:
    """(group index, async) of each param all-gather, in issue order."""
    gathers = [r for r in log if r.label.startswith("param gather")]
    return [(int(r.label.rsplit(" ", 1)[1]), r.async_op) for r in gathers]


def _trained(pgc: Any, **fields: Any) -> tuple[DistributedDataParallel, Reference]:
    """A DDP (overlap on, distributed optimizer) after one optimizer step whose params are
    not yet gathered, and the reference after the same step."""
    model = mlp()
    ref = Reference(model, LR)
    cfg = ddp_config(
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        bucket_size=TINY,
        **fields,
    )
    ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9), ddp)
    x, y = global_batch(0, dist.get_world_size(), torch.float32)
    if cfg.align_param_gather:
        ddp.start_param_sync()  # the caller owns the dispatch
    ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
    ddp.finish_grad_sync()
    opt.step()
    ref.step(ref.grads(x, y))
    return ddp, ref


def _forward(ddp: DistributedDataParallel) -> list[tuple[int, bool]]:
    with mg.record_collectives() as log:
        ddp(torch.zeros(2, 8))
    return _gathers(log)


def _align_and_hook_controls() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model_parallel() as pgc:
        ddp, ref = _trained(pgc, align_param_gather=True)
        with mg.record_collectives() as log:
            ddp.start_param_sync()
        out["align_dispatch"] = _gathers(log)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["align_forward"] = _forward(ddp)  # only waits: the caller dispatched all
        out["align_warnings"] = len(caught)
        out["align_err"] = max_param_error(ddp.module, ref.model)

        ddp, ref = _trained(pgc)
        with mg.record_collectives() as log:
            ddp.disable_forward_pre_hook()  # param_sync=True: synchronous gather now
        out["disable_sync"] = _gathers(log)
        out["disable_err"] = max_param_error(ddp.module, ref.model)
        out["forward_without_hooks"] = _forward(ddp)
        ddp.enable_forward_pre_hook()
        ddp.reset_param_sync_dispatch_state()
        out["forward_after_reset"] = _forward(ddp)
        out["second_forward"] = _forward(ddp)  # a later microbatch: already gathered

        ddp, ref = _trained(pgc)
        with mg.record_collectives() as log:
            ddp.disable_forward_pre_hook(param_sync=False)
        out["disable_no_sync"] = _gathers(log)
        out["stale_err"] = max_param_error(ddp.module, ref.model)
        group = ddp.bucket_groups[GROUPS - 1]
        with mg.record_collectives() as log:
            ddp._start_bucket_group_param_sync(group, force_sync=True)
        out["one_group"] = _gathers(log)
        ddp.start_param_sync(force_sync=True)
        out["forced_err"] = max_param_error(ddp.module, ref.model)
    return out


def test_align_disable_enable_and_reset(rank_pools: RankPools) -> None:
    model_start_first = list(reversed(range(GROUPS)))
    for out in rank_pools.get(2).run(_align_and_hook_controls):
        assert out["align_dispatch"] == [(i, True) for i in model_start_first]
        assert out["align_forward"] == []
        assert out["align_warnings"] == 0
        assert out["align_err"] <= 1e-6
        assert out["disable_sync"] == [(i, False) for i in model_start_first]
        assert out["disable_err"] <= 1e-6
        assert out["forward_without_hooks"] == []
        assert out["forward_after_reset"] == [(i, True) for i in model_start_first]
        assert out["second_forward"] == []
        assert out["disable_no_sync"] == []
        assert out["stale_err"] > 1e-3  # the other rank's half of each bucket is old
        assert out["one_group"] == [(GROUPS - 1, False)]
        assert out["forced_err"] <= 1e-6


def _optimizer_owned_dispatch() -> dict[str, Any]:
    with model_parallel() as pgc:
        ddp, ref = _trained(pgc)
        ddp.overlap_param_gather_with_optimizer_step = True
        with mg.record_collectives() as log:
            ddp.start_param_sync()  # dispatched by the optimizer step: skipped here
            skipped = _gathers(log)
            ddp.start_param_sync(force_dispatch=True)
            dispatched = _gathers(log)
            in_flight = sum(g.param_gather_handle is not None for g in ddp.bucket_groups)
            ddp.free_overlap_buffers()
            drained = sum(g.param_gather_handle is not None for g in ddp.bucket_groups)
        return {
            "skipped": skipped,
            "dispatched": dispatched,
            "in_flight": in_flight,
            "drained": drained,
            "err": max_param_error(ddp.module, ref.model),
            "forward": _forward(ddp),
        }


def test_dispatch_owned_by_the_optimizer_step(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_optimizer_owned_dispatch):
        assert out["skipped"] == []
        assert out["dispatched"] == [(i, True) for i in reversed(range(GROUPS))]
        assert out["in_flight"] == GROUPS
        assert out["drained"] == 0
        assert out["err"] <= 1e-6
        assert out["forward"] == []


def _gathers_dispatched_by_step() -> dict[str, Any]:
    with model_parallel() as pgc:
        model = mlp()
        ref = Reference(model, LR)
        cfg = ddp_config(
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            use_distributed_optimizer=True,
            bucket_size=TINY,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        inner = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
        opt = ShardedOptimizer(inner, ddp, overlap_param_gather_with_optimizer_step=True)
        out: dict[str, Any] = {"flag": ddp.overlap_param_gather_with_optimizer_step}
        rank = dist.get_rank()
        for step in range(2):
            x, y = global_batch(step, dist.get_world_size(), torch.float32)
            ddp.zero_grad_buffer()
            with mg.record_collectives() as log:
                ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
            out[f"forward {step}"] = _gathers(log)
            ddp.finish_grad_sync()
            with mg.record_collectives() as log:
                opt.step()
            out[f"step {step}"] = _gathers(log)
            ref.step(ref.grads(x, y))
        with mg.record_collectives() as log:
            ddp(torch.zeros(2, 8))  # the pre-hooks only wait for the step's gathers
        out["last forward"] = _gathers(log)
        out["err"] = max_param_error(model, ref.model)
        return out


def test_gathers_dispatched_by_the_optimizer_step(rank_pools: RankPools) -> None:
    dispatched = [(i, True) for i in reversed(range(GROUPS))]
    for out in rank_pools.get(2).run(_gathers_dispatched_by_step):
        assert out["flag"] is True
        # before the first step each pre-hook gathers its own group, without chaining
        assert out["forward 0"] == dispatched
        assert out["step 0"] == dispatched
        assert out["forward 1"] == []
        assert out["step 1"] == dispatched
        assert out["last forward"] == []
        assert out["err"] <= 1e-6


def _replicated_overlap_param_gather() -> dict[str, Any]:
    """``overlap_param_gather`` without the distributed optimizer (Megatron's layer-wise
    optimizer setting): two steps of plain SGD on the replicated params, then the syncs."""
    with model_parallel() as pgc:
        model = mlp()
        ref = Reference(model, LR)
        cfg = ddp_config(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=TINY)
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        inner = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
        rank = dist.get_rank()
        gathers = []
        for step in range(2):
            x, y = global_batch(step, dist.get_world_size(), torch.float32)
            ddp.zero_grad_buffer()
            with mg.record_collectives() as log:
                ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
                ddp.finish_grad_sync()
                for p in ddp.parameters():
                    p.grad = p.main_grad  # type: ignore[attr-defined]
                inner.step()
                inner.zero_grad(set_to_none=True)  # autograd must not add into main_grad
                ddp.start_param_sync()
            gathers += _gathers(log)
            ref.step(ref.grads(x, y))
        dispatched = all(g.param_gather_dispatched for g in ddp.bucket_groups)
        group = ddp.bucket_groups[0]
        group.buckets[0].layerwise_param_flat_sizes = [3, 5]  # type: ignore[attr-defined]
        group.param_gather_dispatched = False
        try:
            group.start_param_sync()
            refused = ""
        except NotImplementedError as err:
            refused = str(err)
        return {
            "gathers": gathers,
            "dispatched": dispatched,
            "err": max_param_error(model, ref.model),
            "refused": refused,
        }


def test_overlap_param_gather_without_distributed_optimizer(rank_pools: RankPools) -> None:
    """Megatron accepts ``overlap_param_gather=True`` without the distributed optimizer (its
    layer-wise optimizer's setting) and so does mc: every rank holds every param, so the
    param syncs gather nothing and only mark themselves dispatched, and two SGD steps equal
    the one-process reference (|Δ| ≤ 1e-6, fp32 summation order). Params sharded by
    Megatron's layer-wise optimizer would need a gather mc does not have: refused by name."""
    for out in rank_pools.get(2).run(_replicated_overlap_param_gather):
        assert out["err"] <= 1e-6
        assert out["gathers"] == []
        assert out["dispatched"]
        assert "LayerWiseDistributedOptimizer" in out["refused"]
