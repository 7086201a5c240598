"""mc-ddp: ``ShardedOptimizer``, clipping and loss scaling."""

from __future__ import annotations

from typing import Any

import torch

from integration_tests._sweep_cases.base import (
    NAN,
    Ctx,
    D,
    Opaque,
    Ref,
    arg,
    buffer,
    ddp,
    ddp_step,
    md,
    mg,
    misuse,
    mlp,
    step,
    z,
)
from mc_ddp.grad_checks import LargeGradMonitor, check_finite_grads


def _optimizer(model: Any) -> Any:
    return md.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def _optimizer_slots() -> None:
    arg(
        D,
        "ShardedOptimizer(optimizer=)",
        "misuse",
        lambda c, v: md.ShardedOptimizer(v, ddp(c)),
        ("optimizer",),
        values=(None, "sgd"),
        only=True,
    )
    arg(
        D,
        "ShardedOptimizer(model_chunks=)",
        "misuse",
        lambda c, v: md.ShardedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), v),
        ("model_chunks",),
        values=(None, [], "x", [Ref("module")]),
        only=True,
    )
    arg(
        D,
        "ShardedOptimizer(overlap_param_gather_with_optimizer_step=)",
        "flag",
        lambda c, v: _sharded(c, overlap_param_gather_with_optimizer_step=v),
    )
    arg(
        D,
        "ShardedOptimizer(max_grad_norm=)",
        "real",
        lambda c, v: _sharded(c, max_grad_norm=v),
        values=(0.0, -1.0, 0),
    )
    arg(
        D,
        "ShardedOptimizer(norm_type=)",
        "misuse",
        lambda c, v: _sharded(c, norm_type=v),
        ("norm_type",),
        values=("fro", "2", 0.5, 0, -2.0, NAN, True, None),
        only=True,
        good=float("inf"),
    )
    arg(
        D,
        "ShardedOptimizer(grad_scaler=)",
        "misuse",
        lambda c, v: _sharded(c, grad_scaler=v),
        ("grad_scaler",),
        values=("x", 2.0**16, Opaque()),
        only=True,
        good=None,
    )
    arg(
        D,
        "ShardedOptimizer(error_if_nonfinite=)",
        "flag",
        lambda c, v: _sharded(c, error_if_nonfinite=v),
    )
    arg(D, "ShardedOptimizer(peer_checks=)", "flag", lambda c, v: _sharded(c, peer_checks=v))
    arg(
        D,
        "ShardedOptimizer(pg_collection=)",
        "misuse",
        lambda c, v: _sharded(c, pg_collection=v),
        ("pg_collection",),
        values=("tp", Ref("world"), {"tp": None}, 3),
        only=True,
        good=Ref("pgc"),
    )
    arg(D, "ShardedOptimizer.clip_grad_norm(max_norm=)", "real", _clip, values=(0.0, -1.0))
    for name in ("initial_scale", "min_scale", "growth_factor", "backoff_factor"):
        arg(
            D,
            f"DynamicGradScaler({name}=)",
            "real",
            lambda c, v, n=name: md.DynamicGradScaler(**{n: v}),
            values={
                "initial_scale": (0.0, -1.0),
                "min_scale": (-1.0, 2.0**17),
                "growth_factor": (1.0, 0.5),
                "backoff_factor": (0.0, 1.0, 1.5),
            }[name],
            good={"initial_scale": 1024.0, "min_scale": 0.0}.get(
                name, 0.5 if "back" in name else 2.0
            ),
        )
    for name in ("growth_interval", "hysteresis"):
        arg(
            D,
            f"DynamicGradScaler({name}=)",
            "size",
            lambda c, v, n=name: md.DynamicGradScaler(**{n: v}),
        )
    arg(
        D,
        "DynamicGradScaler.update(found_inf=)",
        "flag",
        lambda c, v: md.DynamicGradScaler().update(v),
    )
    arg(
        D,
        "ShardedOptimizer.zero_grad(set_to_none=)",
        "flag",
        lambda c, v: _optimizer(ddp(c)).zero_grad(set_to_none=v),
    )
    arg(
        D,
        "ShardedOptimizer.load_state_dict(state_dict=)",
        "misuse",
        lambda c, v: _optimizer(ddp(c)).load_state_dict(v),
        ("state_dict",),
        values=(None, "x", {}, {"optimizer": {}, "master_params": "x"}),
        only=True,
    )
    arg(
        D,
        "ShardedOptimizer.load_sharded_state_dict(state_dict=)",
        "misuse",
        lambda c, v: _optimizer(ddp(c)).load_sharded_state_dict(v),
        ("state_dict",),
        values=(None, "x", {}),
        only=True,
    )
    misuse(
        D, "ShardedOptimizer.step before finish_grad_sync", _step_unsynced, ("finish_grad_sync",)
    )
    misuse(
        D,
        "ShardedOptimizer.step twice without a new backward",
        _step_twice,
        ("step", "twice", "already"),
    )
    misuse(D, "ShardedOptimizer.step after offload_grad_buffers", _step_offloaded, ("offload",))
    arg(
        D,
        "check_finite_grads(buckets=)",
        "misuse",
        lambda c, v: check_finite_grads(v, {}, "here"),
        ("buckets",),
        values=(None, "x", [None], []),
        only=True,
    )
    arg(
        D,
        "check_finite_grads(names=)",
        "misuse",
        lambda c, v: check_finite_grads(buffer().buckets, v, "here"),
        ("names",),
        values=(None, "x"),
        only=True,
        good={},
    )
    arg(
        D,
        "check_finite_grads(where=)",
        "text",
        lambda c, v: check_finite_grads(buffer().buckets, {}, v),
        ("where",),
    )
    arg(
        D,
        "check_finite_grads(groups=)",
        "misuse",
        lambda c, v: check_finite_grads(buffer().buckets, {}, "here", groups=v),
        ("groups",),
        values=("x", [None], Ref("world")),
        only=True,
        good=(),
    )
    arg(D, "LargeGradMonitor(num_buckets=)", "size", lambda c, v: LargeGradMonitor(v))
    arg(
        D,
        "LargeGradMonitor.check(buckets=)",
        "misuse",
        lambda c, v: LargeGradMonitor(1).check(v, "here"),
        ("buckets",),
        values=(None, "x", [None]),
        only=True,
    )
    rs = md.reduce_scatter_with_fp32_accumulation
    arg(
        D,
        "reduce_scatter_with_fp32_accumulation(output=)",
        "tensor",
        lambda c, v: rs(v, z(), c.world_group),
        values=(z(3),),
        good=z(),
    )
    arg(  # None is torch's default group there, as in Megatron (issue 20)
        D,
        "reduce_scatter_with_fp32_accumulation(group=)",
        "misuse",
        lambda c, v: rs(z(), z(), v),
        ("group",),
        values=("tp", 0, Ref("pgc")),
        only=True,
    )
    arg(
        D,
        "reduce_scatter_with_fp32_accumulation(op=)",
        "misuse",
        lambda c, v: rs(z(), z(), c.world_group, op=v),
        ("op",),
        values=("sum", None),
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        D,
        "reduce_scatter_with_fp32_accumulation(async_op=)",
        "flag",
        lambda c, v: rs(z(), z(), c.world_group, async_op=v),
    )
    arg(
        D,
        "ensure_params_ready(params=)",
        "misuse",
        lambda c, v: md.ensure_params_ready(v),
        ("params",),
        values=(None, 3, [None]),
        only=True,
        good=[],
    )
    arg(
        D,
        "partition_buckets(buffers=)",
        "misuse",
        lambda c, v: md.partition_buckets(v),
        ("buffers",),
        values=(None, "x", [None]),
        only=True,
        good=[],
    )
    arg(
        D,
        "partition_buckets(force_single_bucket_group=)",
        "flag",
        lambda c, v: md.partition_buckets([buffer()], v),
    )


def _clip(ctx: Ctx, max_norm: object) -> Any:
    model = ddp(ctx)
    opt = md.ShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, pg_collection=ctx.pgc
    )
    ddp_step(model)
    return opt.clip_grad_norm(max_norm)


def _sharded(ctx: Ctx, **kw: Any) -> Any:
    model = ddp(ctx)
    return md.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **kw)


def _step_unsynced(ctx: Ctx) -> None:
    model = ddp(ctx, overlap_grad_reduce=True)
    opt = _optimizer(model)
    model.zero_grad_buffer()
    step(model)
    opt.step()


def _step_twice(ctx: Ctx) -> None:
    model = ddp(ctx)
    opt = _optimizer(model)
    ddp_step(model)
    opt.step()
    opt.step()


def _step_offloaded(ctx: Ctx) -> None:
    model = ddp(ctx)
    opt = _optimizer(model)
    ddp_step(model)
    model.offload_grad_buffers()
    opt.step()
