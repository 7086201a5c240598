"""mc-buffers: layouts, buffers, buckets, offloading."""

from __future__ import annotations

from torch import nn

from integration_tests._sweep_cases.base import (
    B,
    Ctx,
    Ref,
    arg,
    buffer,
    mb,
    misuse,
    mlp,
    z,
)
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers.keys import is_expert_parallel_param
from mc_buffers.layout import compute_distributed_optimizer_param_layout, compute_full_param_layout


def _params() -> list[nn.Parameter]:
    return list(mlp().parameters())


def _buffer_slots() -> None:
    arg(B, "pad_to_divisor(n=)", "count", lambda c, v: mb.pad_to_divisor(v, 4))
    arg(B, "pad_to_divisor(d=)", "size", lambda c, v: mb.pad_to_divisor(4, v))
    arg(B, "pad_param_start(n=)", "count", lambda c, v: mb.pad_param_start(v))
    arg(
        B,
        "bucket_end_divisor(data_parallel_size=)",
        "size",
        lambda c, v: mb.bucket_end_divisor(v, False),
    )
    arg(
        B,
        "bucket_end_divisor(pad_for_high_nccl_busbw=)",
        "flag",
        lambda c, v: mb.bucket_end_divisor(2, v),
    )
    arg(B, "pad_bucket_end(n=)", "count", lambda c, v: mb.pad_bucket_end(v, 2, False))
    arg(
        B,
        "is_expert_parallel_param(param=)",
        "tensor",
        lambda c, v: is_expert_parallel_param(v),
        ("param",),
        good=z(),
    )
    arg(
        B,
        "group_params_for_buffers(params=)",
        "misuse",
        lambda c, v: mb.group_params_for_buffers(v, False),
        ("params",),
        values=(None, "x", [None], 3),
        only=True,
        good=[],
    )
    arg(
        B,
        "group_params_for_buffers(grad_reduce_in_fp32=)",
        "flag",
        lambda c, v: mb.group_params_for_buffers(_params(), v),
    )
    arg(
        B,
        "compute_default_per_buffer_param_layout(bucket_size=)",
        "size",
        lambda c, v: mb.compute_default_per_buffer_param_layout(_params(), v),
    )
    arg(
        B,
        "compute_distributed_optimizer_param_layout(data_parallel_size=)",
        "size",
        lambda c, v: compute_distributed_optimizer_param_layout(_params(), None, v),
    )
    arg(
        B,
        "compute_distributed_optimizer_param_layout(pad_buckets_for_high_nccl_busbw=)",
        "flag",
        lambda c, v: compute_distributed_optimizer_param_layout(_params(), None, 2, v),
    )
    arg(
        B,
        "compute_full_param_layout(use_distributed_optimizer=)",
        "flag",
        lambda c, v: compute_full_param_layout(
            _params(), None, 1, use_distributed_optimizer=v, grad_reduce_in_fp32=False
        ),
    )
    arg(
        B,
        "compute_full_param_layout(grad_reduce_in_fp32=)",
        "flag",
        lambda c, v: compute_full_param_layout(
            _params(), None, 1, use_distributed_optimizer=False, grad_reduce_in_fp32=v
        ),
    )
    arg(
        B,
        "ParamAndGradBuffer(params=)",
        "misuse",
        lambda c, v: mb.ParamAndGradBuffer(v),
        ("params",),
        values=(None, "x", [None], [z()], Ref("non_leaf_params")),
        only=True,
        good=Ref("params"),
    )
    for name, kind in (
        ("param_dtype", "opt_dtype"),
        ("grad_dtype", "opt_dtype"),
        ("bucket_size", "size"),
        ("use_distributed_optimizer", "flag"),
        ("data_parallel_size", "size"),
        ("pad_buckets_for_high_nccl_busbw", "flag"),
        ("gradient_scaling_factor", "real"),
    ):
        arg(B, f"ParamAndGradBuffer({name}=)", kind, lambda c, v, n=name: buffer(**{n: v}))
    arg(
        B,
        "ParamAndGradBuffer(param_layout=)",
        "misuse",
        lambda c, v: buffer(param_layout=v),
        ("param_layout",),
        values=("x", {}),
        only=True,
        good=None,
    )
    arg(
        B,
        "ParamAndGradBuffer(param_to_name=)",
        "misuse",
        lambda c, v: buffer(param_to_name=v),
        ("param_to_name",),
        values=("x", [1]),
        only=True,
        good=None,
    )
    arg(
        B,
        "ParamAndGradBuffer(param_name_patterns_for_fp32_local_accumulation=)",
        "misuse",
        lambda c, v: buffer(param_name_patterns_for_fp32_local_accumulation=v),
        ("param_name_patterns_for_fp32_local_accumulation",),
        values=("all", [3]),
        only=True,
        good=(),
    )
    arg(
        B,
        "ParamAndGradBuffer(param_indices=)",
        "misuse",
        lambda c, v: buffer(param_indices=v),
        ("param_indices",),
        values=("x", [0]),
        only=True,
        good=None,
    )
    arg(
        B,
        "ParamAndGradBuffer.scale_gradients(scaling_factor=)",
        "real",
        lambda c, v: buffer().scale_gradients(v),
        ("scaling_factor",),
        values=(None,),
    )
    arg(
        B,
        "ParamAndGradBuffer.offload_to_cpu(move_params=)",
        "flag",
        lambda c, v: buffer().offload_to_cpu(move_params=v),
    )
    arg(
        B,
        "ParamAndGradBuffer.reload_from_cpu(move_grads=)",
        "flag",
        lambda c, v: buffer().reload_from_cpu(move_grads=v),
    )
    misuse(B, "write main_grad of an offloaded buffer", _write_offloaded, ("offload",))
    misuse(B, "read bucket grads of an offloaded buffer", _read_offloaded, ("offload",))
    arg(
        B,
        "ParamAndGradBucket.shard_range(shard_index=)",
        "misuse",
        lambda c, v: buffer().buckets[0].shard_range(v, 1),
        ("shard_index",),
        values=(-1, 1, True, "0"),
        only=True,
        good=0,
    )
    arg(
        B,
        "ParamAndGradBucket.shard_range(num_shards=)",
        "size",
        lambda c, v: buffer().buckets[0].shard_range(0, v),
        ("num_shards",),
    )
    arg(B, "shard_buffer(data_parallel_world_size=)", "size", lambda c, v: mb.shard_buffer(z(), v))
    arg(B, "shard_buffer(buffer=)", "tensor", lambda c, v: mb.shard_buffer(v, 1), good=z())
    arg(
        B,
        "build_param_and_grad_buffers(bucket_size=)",
        "size",
        lambda c, v: build_param_and_grad_buffers(_params(), bucket_size=v),
    )
    arg(
        B,
        "build_param_and_grad_buffers(data_parallel_size=)",
        "size",
        lambda c, v: build_param_and_grad_buffers(
            _params(), bucket_size=None, data_parallel_size=v
        ),
    )
    arg(
        B,
        "build_param_and_grad_buffers(gradient_scaling_factor=)",
        "real",
        lambda c, v: build_param_and_grad_buffers(
            _params(), bucket_size=None, gradient_scaling_factor=v
        ),
    )
    arg(
        B,
        "build_param_and_grad_buffers(expert_gradient_scaling_factor=)",
        "real",
        lambda c, v: build_param_and_grad_buffers(
            _params(), bucket_size=None, expert_gradient_scaling_factor=v
        ),
    )
    arg(
        B,
        "build_param_and_grad_buffers(grad_reduce_in_fp32=)",
        "flag",
        lambda c, v: build_param_and_grad_buffers(
            _params(), bucket_size=None, grad_reduce_in_fp32=v
        ),
    )


def _write_offloaded(ctx: Ctx) -> None:
    params = _params()
    buf = mb.ParamAndGradBuffer(params)
    buf.offload_to_cpu()
    params[0].main_grad.add_(1.0)  # type: ignore[attr-defined]


def _read_offloaded(ctx: Ctx) -> None:
    buf = buffer()
    buf.offload_to_cpu()
    float(buf.buckets[0].grad_data.sum())
