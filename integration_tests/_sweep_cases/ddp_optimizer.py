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
    mp_config,
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


def _fsdp2(ctx: Ctx, *args: Any, **kw: Any) -> Any:
    """``TorchFullyShardedDataParallel`` of a fresh model over the one-rank world."""
    config = kw.pop("ddp_config", md.TorchFullyShardedDataParallelConfig())
    module = kw.pop("module", mlp())
    return md.TorchFullyShardedDataParallel(
        mp_config(), config, module, *args, pg_collection=ctx.pgc, **kw
    )


def _stepped(ctx: Ctx) -> Any:
    """A plain model after one backward (grads in ``param.grad``)."""
    model = mlp()
    step(model)
    return model


def _torch_state(ctx: Ctx, **kw: Any) -> Any:
    """``optimizer_sharded_state_dict`` of an SGD over a plain model (a build for loading)."""
    from mc_tp_layers import model_sharded_state_dict

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    views = kw.pop("views", model_sharded_state_dict(model))
    kw.setdefault("is_loading", True)
    return md.optimizer_sharded_state_dict(kw.pop("optimizer", opt), views, **kw)


def _fsdp2_slots() -> None:
    """The FSDP2 entry points: the wrapper and its config, ``clip_grad_norm``, the torch
    optimizer's sharded state."""
    bad: tuple[object, ...]
    for name, bad in (
        ("module", (None, "x", Opaque())),
        ("ddp_config", (None, {}, "x")),
        ("mp_policy", ("bf16", 1)),
    ):
        arg(
            D,
            f"TorchFullyShardedDataParallel({name}=)",
            "misuse",
            lambda c, v, n=name: _fsdp2(c, **{n: v}),
            (name,),
            values=bad,
            only=True,
        )
    arg(
        D,
        "TorchFullyShardedDataParallel(sub_modules_to_wrap=)",
        "misuse",
        _fsdp2,
        ("sub_modules_to_wrap",),
        values=("Linear", 3, [Opaque()], [torch.nn.Linear(2, 2)]),
        only=True,
    )
    arg(
        D,
        "TorchFullyShardedDataParallel(disable_bucketing=)",
        "flag",
        lambda c, v: _fsdp2(c, None, v),
    )
    arg(
        D,
        "TorchFullyShardedDataParallel(process_group=)",
        "misuse",
        lambda c, v: _fsdp2(c, None, False, v),
        ("process_group",),
        values=("tp", 0, Ref("pgc")),
        only=True,
    )
    for name, bad in (
        ("reshard_after_forward", (1, 0, -2, "yes", 2.5)),
        ("gradient_accumulation_mode", ("sum", 1, None)),
        ("clone_output_views", (True,)),
    ):
        arg(
            D,
            f"TorchFullyShardedDataParallelConfig({name}=)",
            "misuse",
            lambda c, v, n=name: md.TorchFullyShardedDataParallelConfig(**{n: v}),
            (name,),
            values=bad,
            only=True,
        )
    arg(
        D,
        "TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=)",
        "flag",
        lambda c, v: md.TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=v),
    )
    arg(
        D,
        "clip_grad_norm(model=)",
        "misuse",
        lambda c, v: md.clip_grad_norm(v, 1.0, pg_collection=c.pgc),
        ("model",),
        values=(None, [], "x", [Opaque()], Ref("ddp")),
        only=True,
    )
    arg(
        D,
        "clip_grad_norm(max_norm=)",
        "real",
        lambda c, v: md.clip_grad_norm(_stepped(c), v, pg_collection=c.pgc),
        values=(0.0, -1.0),
    )
    arg(
        D,
        "clip_grad_norm(norm_type=)",
        "misuse",
        lambda c, v: md.clip_grad_norm(_stepped(c), 1.0, v, pg_collection=c.pgc),
        ("norm_type",),
        values=("fro", 0.5, 0, NAN, True, None),
        only=True,
    )
    arg(
        D,
        "clip_grad_norm(grad_scaler=)",
        "misuse",
        lambda c, v: md.clip_grad_norm(_stepped(c), 1.0, grad_scaler=v, pg_collection=c.pgc),
        ("grad_scaler",),
        values=("x", 1.0),
        only=True,
    )
    arg(
        D,
        "clip_grad_norm(error_if_nonfinite=)",
        "flag",
        lambda c, v: md.clip_grad_norm(_stepped(c), 1.0, error_if_nonfinite=v, pg_collection=c.pgc),
    )
    arg(
        D,
        "optimizer_sharded_state_dict(optimizer=)",
        "misuse",
        lambda c, v: _torch_state(c, optimizer=v),
        ("optimizer",),
        values=(None, "sgd", Opaque()),
        only=True,
    )
    arg(
        D,
        "optimizer_sharded_state_dict(model_sharded_state_dict=)",
        "misuse",
        lambda c, v: _torch_state(c, views=v),
        ("model_sharded_state_dict",),
        values=(None, [1], "x"),
        only=True,
    )
    arg(
        D,
        "optimizer_sharded_state_dict(is_loading=)",
        "flag",
        lambda c, v: _torch_state(c, is_loading=v),
        good=True,
    )
    arg(D, "optimizer_sharded_state_dict(prefix=)", "text", lambda c, v: _torch_state(c, prefix=v))
    arg(
        D,
        "load_optimizer_sharded_state_dict(state_dict=)",
        "misuse",
        lambda c, v: md.load_optimizer_sharded_state_dict(
            torch.optim.SGD(mlp().parameters(), lr=0.1), v, {}
        ),
        ("state_dict",),
        values=(None, 3, "x"),
        only=True,
    )
