"""``build_param_and_grad_buffers``: one :class:`ParamAndGradBuffer` per :class:`BufferKey`,
what Megatron's DDP does in ``_allocate_buffers_for_parameters`` (minus the groups)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from mc_buffers._buffer_args import check_scaling_factor
from mc_buffers._param_checks import Param, as_param_list
from mc_buffers.adopt import as_full_param_layout
from mc_buffers.buffer import ParamAndGradBuffer
from mc_buffers.keys import BufferKey, group_params_for_buffers
from mc_buffers.layout import FullParamLayout, compute_full_param_layout
from mc_groups.argcheck import check_flag, check_int
from mc_groups.errors import InputValueError

__all__ = ["build_param_and_grad_buffers"]


def _layouts_for(
    groups: Mapping[BufferKey, object], full_param_layout: object, default: FullParamLayout
) -> FullParamLayout:
    if full_param_layout is None:
        return default
    adopted = as_full_param_layout(full_param_layout)
    for key in groups:
        if key not in adopted.layouts:
            raise InputValueError(
                f"full_param_layout has no layout for {key}; recompute it with "
                "compute_full_param_layout over the same params and grad_reduce_in_fp32"
            )
    return adopted


def build_param_and_grad_buffers(
    params: Iterable[Param],
    *,
    bucket_size: int | None,
    data_parallel_size: int = 1,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool = False,
    pad_buckets_for_high_nccl_busbw: bool = False,
    expert_data_parallel_size: int | None = None,
    full_param_layout: FullParamLayout | None = None,
    param_to_name: Mapping[Param, str] | None = None,
    param_name_patterns_for_fp32_local_accumulation: Sequence[str] = (),
    gradient_scaling_factor: float = 1.0,
    expert_gradient_scaling_factor: float | None = None,
) -> dict[BufferKey, ParamAndGradBuffer]:
    """Group ``params`` by key, lay each group out and allocate its buffer.

    Layouts come from ``full_param_layout`` when given (every key must be present, each
    is checked against its params), else from :func:`compute_full_param_layout`. Expert
    buffers use ``expert_data_parallel_size`` and ``expert_gradient_scaling_factor``
    (defaulting to ``data_parallel_size`` / ``gradient_scaling_factor`` outside
    distributed-optimizer mode, required inside it). Buffers come in key order (first
    appearance of a key in ``params``).
    """
    plist = as_param_list(params)
    if expert_gradient_scaling_factor is not None:
        check_scaling_factor(expert_gradient_scaling_factor, "expert_gradient_scaling_factor")
    use_dist_opt = check_flag("use_distributed_optimizer", use_distributed_optimizer)
    dp = check_int("data_parallel_size", data_parallel_size)
    groups = group_params_for_buffers(plist, grad_reduce_in_fp32)
    computed = FullParamLayout()
    if full_param_layout is None:
        computed = compute_full_param_layout(
            plist,
            bucket_size,
            dp,
            use_distributed_optimizer=use_dist_opt,
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
            expert_data_parallel_size=expert_data_parallel_size,
        )
    layouts = _layouts_for(groups, full_param_layout, computed)
    buffers = {}
    for key, (members, indices) in groups.items():
        key_dp, key_scale = dp, gradient_scaling_factor
        if key.is_expert_parallel:
            key_dp = _expert_size(expert_data_parallel_size, dp, use_dist_opt)
            if expert_gradient_scaling_factor is not None:
                key_scale = expert_gradient_scaling_factor
        buffers[key] = ParamAndGradBuffer(
            members,
            param_dtype=key.param_dtype,
            grad_dtype=key.grad_dtype,
            bucket_size=bucket_size,
            use_distributed_optimizer=use_dist_opt,
            data_parallel_size=key_dp,
            pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
            param_layout=layouts.layouts[key],
            param_to_name=param_to_name,
            param_name_patterns_for_fp32_local_accumulation=(
                param_name_patterns_for_fp32_local_accumulation
            ),
            param_indices=indices,
            gradient_scaling_factor=key_scale,
        )
    return buffers


def _expert_size(expert_dp: int | None, dp: int, use_dist_opt: bool) -> int:
    if expert_dp is not None:
        return check_int("expert_data_parallel_size", expert_dp)
    if use_dist_opt:
        raise InputValueError(
            "expert_data_parallel_size=None but expert-parallel params (allreduce=False) "
            "need a distributed-optimizer buffer; pass the expert data-parallel group size"
        )
    return dp
