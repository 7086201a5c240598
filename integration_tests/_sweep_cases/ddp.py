"""mc-ddp: the DDP config and the wrapper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from integration_tests._sweep_cases.base import (
    HUGE,
    Ctx,
    D,
    Opaque,
    Ref,
    arg,
    ddp,
    md,
    mf,
    mg,
    misuse,
    mlp,
    mp_config,
    step,
)

_DDP_BOOLS = (
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "align_param_gather",
    "use_distributed_optimizer",
    "check_for_nan_in_grad",
    "check_for_large_grads",
    "pad_buckets_for_high_nccl_busbw",
    "reduce_scatter_with_fp32_accumulation",
    "average_in_collective",
    "delay_wgrad_compute",
    "disable_symmetric_registration",
    "fp8_param_gather",
    "nccl_ub",
)


def _ddp_config_slots() -> None:
    cfg = md.DistributedDataParallelConfig
    for name in _DDP_BOOLS:
        arg(
            D, f"DistributedDataParallelConfig({name}=)", "flag", lambda c, v, n=name: cfg(**{n: v})
        )
    arg(
        D,
        "DistributedDataParallelConfig(num_distributed_optimizer_instances=)",
        "size",
        lambda c, v: cfg(num_distributed_optimizer_instances=v),
    )
    for name in ("bucket_size", "num_buckets"):
        arg(
            D,
            f"DistributedDataParallelConfig({name}=)",
            "size",
            lambda c, v, n=name: cfg(**{n: v}),
            values=(HUGE + 0.5,),
        )
    arg(
        D,
        "DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=)",
        "misuse",
        lambda c, v: cfg(param_name_patterns_for_fp32_local_accumulation=v),
        ("param_name_patterns_for_fp32_local_accumulation",),
        values=("all", [3], None),
        only=True,
        good=(),
    )
    arg(
        D,
        "DistributedDataParallelConfig(data_parallel_sharding_strategy=)",
        "misuse",
        lambda c, v: cfg(data_parallel_sharding_strategy=v),
        ("data_parallel_sharding_strategy",),
        values=("optim", 3),
        only=True,
        good="no_shard",
    )


def _ddp_slots() -> None:
    d = md.DistributedDataParallel
    arg(
        D,
        "DistributedDataParallel(config=)",
        "misuse",
        lambda c, v: d(v, md.DistributedDataParallelConfig(), mlp(), pg_collection=c.pgc),
        ("config",),
        values=(None, "x", Opaque()),
        only=True,
        good=mp_config(),
    )
    arg(
        D,
        "DistributedDataParallel(ddp_config=)",
        "misuse",
        lambda c, v: d(mp_config(), v, mlp(), pg_collection=c.pgc),
        ("ddp_config",),
        values=(None, {"bucket_size": 4}),
        only=True,
        good=md.DistributedDataParallelConfig(),
    )
    arg(
        D,
        "DistributedDataParallel(module=)",
        "misuse",
        lambda c, v: d(mp_config(), md.DistributedDataParallelConfig(), v, pg_collection=c.pgc),
        ("module",),
        values=(None, "x", [Ref("module")], Ref("meta_module")),
        only=True,
        good=Ref("module"),
    )
    arg(
        D,
        "DistributedDataParallel(disable_bucketing=)",
        "flag",
        lambda c, v: d(mp_config(), md.DistributedDataParallelConfig(), mlp(), v, c.pgc),
    )
    arg(
        D,
        "DistributedDataParallel(pg_collection=)",
        "collection",
        lambda c, v: ddp(c, pgc=v),
        ("pg_collection",),
    )
    arg(
        D,
        "DistributedDataParallel(full_param_layout=)",
        "misuse",
        lambda c, v: d(mp_config(), md.DistributedDataParallelConfig(), mlp(), False, c.pgc, v),
        ("full_param_layout",),
        values=("x", {}),
        only=True,
        good=None,
    )
    arg(
        D,
        "DistributedDataParallel.finish_grad_sync(force_all_reduce=)",
        "flag",
        lambda c, v: _step_then(c, lambda m: m.finish_grad_sync(force_all_reduce=v)),
    )
    arg(
        D,
        "DistributedDataParallel.scale_gradients(scaling_factor=)",
        "real",
        lambda c, v: ddp(c).scale_gradients(v),
        ("scaling_factor",),
        values=(None,),
    )
    arg(
        D,
        "DistributedDataParallel.offload_grad_buffers(synchronize=)",
        "flag",
        lambda c, v: ddp(c).offload_grad_buffers(synchronize=v),
    )
    arg(
        D,
        "DistributedDataParallel.offload_grad_buffers(empty_cache=)",
        "flag",
        lambda c, v: ddp(c).offload_grad_buffers(empty_cache=v),
    )
    arg(
        D,
        "DistributedDataParallel.restore_grad_buffers(synchronize=)",
        "flag",
        lambda c, v: ddp(c).restore_grad_buffers(synchronize=v),
    )
    arg(
        D,
        "DistributedDataParallel.start_param_sync(force_sync=)",
        "flag",
        lambda c, v: ddp(c, use_distributed_optimizer=True).start_param_sync(force_sync=v),
    )
    arg(
        D,
        "DistributedDataParallel.disable_forward_pre_hook(param_sync=)",
        "flag",
        lambda c, v: ddp(
            c, use_distributed_optimizer=True, overlap_param_gather=True
        ).disable_forward_pre_hook(param_sync=v),
    )
    misuse(D, "offload_grad_buffers then backward", lambda c: _offloaded(c, step), ("offload",))
    misuse(
        D,
        "offload_grad_buffers then finish_grad_sync",
        lambda c: _offloaded(c, lambda m: m.finish_grad_sync()),
        ("offload",),
    )
    misuse(
        D,
        "offload_grad_buffers then scale_gradients",
        lambda c: _offloaded(c, lambda m: m.scale_gradients(0.5)),
        ("offload",),
    )
    misuse(
        D,
        "offload_grad_buffers then write main_grad",
        lambda c: _offloaded(c, lambda m: m.params_with_grad[0].main_grad.add_(1)),
        ("offload",),
    )
    misuse(
        D,
        "offload_grad_buffers then finalize_model_grads",
        lambda c: _offloaded(c, lambda m: mf.finalize_model_grads([m], pg_collection=c.pgc)),
        ("offload",),
    )
    misuse(D, "backward after destroy_model_parallel", _ddp_after_destroy, ("destroy",))
    misuse(
        D,
        "start_param_sync without the distributed optimizer",
        lambda c: ddp(c).start_param_sync(),
        ("use_distributed_optimizer",),
    )


def _step_then(ctx: Ctx, then: Callable[[Any], object]) -> None:
    model = ddp(ctx)
    model.zero_grad_buffer()
    step(model)
    then(model)


def _offloaded(ctx: Ctx, then: Callable[[Any], object]) -> None:
    model = ddp(ctx)
    model.zero_grad_buffer()
    model.offload_grad_buffers()
    then(model)


def _ddp_after_destroy(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    model = ddp(ctx, pgc=pgc)
    mg.destroy_model_parallel(pgc)
    model.zero_grad_buffer()
    step(model)
    model.finish_grad_sync()
