"""How DDP lays out its buffers and bucket groups: bucket size, scaling factors, buffers,
groups and the param all-gather chain. Pure construction; nothing communicates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import BufferKey, FullParamLayout, ParamAndGradBuffer
from mc_buffers.adopt import as_full_param_layout
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers.layout import compute_full_param_layout
from mc_ddp import _agreement as agreement
from mc_ddp._ddp_groups import DDPGroups
from mc_ddp.bucket_group import ParamAndGradBucketGroup, partition_buckets
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_groups import param_attrs
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputValueError

Param = torch.nn.Parameter

DEFAULT_MIN_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_DP_RANK = 1_000_000


def resolve_bucket_size(
    ddp_config: DistributedDataParallelConfig,
    total_numel: int,
    dp_size: int,
    pipeline_rank: int,
    disable_bucketing: bool,
) -> int | None:
    """Elements per bucket, or None for one bucket per buffer.

    ``num_buckets`` → ``max(1, total_numel // num_buckets)``; ``bucket_size=None`` →
    ``max(40M, 1M · dp)`` (large dp needs large buckets so ring chunks stay bandwidth-bound);
    one bucket without overlap_grad_reduce (nothing to overlap), on pipeline stages after
    the first (their reduction is off the critical path) or with ``disable_bucketing``.
    """
    if not ddp_config.overlap_grad_reduce or pipeline_rank > 0 or disable_bucketing:
        return None
    if ddp_config.num_buckets is not None:
        return max(1, total_numel // ddp_config.num_buckets)
    if ddp_config.bucket_size is not None:
        return int(ddp_config.bucket_size)
    return max(DEFAULT_MIN_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * dp_size)


class LayoutPlan(NamedTuple):
    """The resolved bucket size and the layout of every buffer (computed, not allocated)."""

    bucket_size: int | None
    layout: FullParamLayout


def plan_layout(
    params: Sequence[Param],
    ddp_config: DistributedDataParallelConfig,
    groups: DDPGroups,
    disable_bucketing: bool,
    full_param_layout: object,
) -> LayoutPlan:
    """Bucket size (:func:`resolve_bucket_size`) and the buffers' layouts: the caller's
    ``full_param_layout`` or mc_buffers' ``compute_full_param_layout`` for the reduction
    group sizes (intra_dp_cp / intra_expt_dp). Pure: nothing allocated or communicated."""
    total = sum(p.numel() for p in params)
    dp_cp = mg.group_size(groups.dp_cp)
    bucket_size = resolve_bucket_size(
        ddp_config, total, dp_cp, groups.pipeline_rank, disable_bucketing
    )
    if full_param_layout is not None:
        return LayoutPlan(bucket_size, as_full_param_layout(full_param_layout))
    expert_dp = None if groups.intra_expt_dp is None else mg.group_size(groups.intra_expt_dp)
    layout = compute_full_param_layout(
        params,
        bucket_size,
        mg.group_size(groups.intra_dp_cp),
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32,
        pad_buckets_for_high_nccl_busbw=ddp_config.pad_buckets_for_high_nccl_busbw,
        expert_data_parallel_size=expert_dp,
    )
    return LayoutPlan(bucket_size, layout)


class Scaling(NamedTuple):
    """Factors applied to the dense and expert grads before the collective."""

    dense: float
    expert: float


def gradient_scaling(
    config: TransformerConfigLike, ddp_config: DistributedDataParallelConfig, groups: DDPGroups
) -> Scaling:
    """Pre-collective scaling so that reduced grads are averaged over dp·cp.

    - ``calculate_per_token_loss``: 1 and 1 (finalize divides by the token count);
    - ``average_in_collective``: dense 1 (the AVG collective divides by |dp_cp|), expert
      |expt_dp| / |dp_cp| (AVG over expt_dp then gives 1/|dp_cp|);
    - otherwise 1/|dp_cp| for both, then a SUM collective.

    Refused (ValueError, nothing built): ``average_in_collective`` with
    ``calculate_per_token_loss`` (per-token losses are summed), and ``average_in_collective``
    with an active gtp_remat group, as Megatron-Core's DDP refuses it: gtp_remat shards
    are pre-scaled by 1/gtp_remat before their SUM reduce-scatter and the replicate-group
    collective must then SUM after DDP's own 1/|dp_cp|; an AVG there would leave the
    gtp_remat factor out of the composition.
    """
    dp_cp = mg.group_size(groups.dp_cp)
    if groups.gtp_remat_active and ddp_config.average_in_collective:
        raise InputValueError(
            "ddp_config.average_in_collective=True with an active gtp_remat group "
            "(pg_collection.gtp_remat or expt_gtp_remat spans > 1 rank): gtp_remat needs "
            "SUM collectives after a 1/dp_cp pre-scale (Megatron-Core refuses this too); "
            "set average_in_collective=False"
        )
    if config.calculate_per_token_loss:
        if ddp_config.average_in_collective:
            raise InputValueError(
                "config.calculate_per_token_loss=True with ddp_config.average_in_collective="
                "True: per-token losses must be summed, not averaged; set "
                "average_in_collective=False"
            )
        return Scaling(1.0, 1.0)
    if ddp_config.average_in_collective:
        expt = mg.group_size(groups.expt_dp) if groups.expt_dp is not None else dp_cp
        return Scaling(1.0, expt / dp_cp)
    return Scaling(1.0 / dp_cp, 1.0 / dp_cp)


class Buffers(NamedTuple):
    """The dense and the expert-parallel buffers (each in key order)."""

    dense: list[ParamAndGradBuffer]
    expert: list[ParamAndGradBuffer]


def build_buffers(
    params: Sequence[Param],
    names: Mapping[Param, str],
    ddp_config: DistributedDataParallelConfig,
    groups: DDPGroups,
    plan: LayoutPlan,
    scaling: Scaling,
) -> Buffers:
    """One buffer per (param dtype, grad dtype, expert) key, laid out by ``plan`` (for the
    reduction group sizes intra_dp_cp / intra_expt_dp)."""
    expert_dp = None if groups.intra_expt_dp is None else mg.group_size(groups.intra_expt_dp)
    built: dict[BufferKey, ParamAndGradBuffer] = build_param_and_grad_buffers(
        params,
        bucket_size=plan.bucket_size,
        data_parallel_size=mg.group_size(groups.intra_dp_cp),
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32,
        pad_buckets_for_high_nccl_busbw=ddp_config.pad_buckets_for_high_nccl_busbw,
        expert_data_parallel_size=expert_dp,
        full_param_layout=plan.layout,
        param_to_name=names,
        param_name_patterns_for_fp32_local_accumulation=list(
            ddp_config.param_name_patterns_for_fp32_local_accumulation
        ),
        gradient_scaling_factor=scaling.dense,
        expert_gradient_scaling_factor=scaling.expert,
    )
    for key, buffer in built.items():  # Megatron's fields: the reduction group, the config
        buffer.data_parallel_group = (
            groups.intra_expt_dp if key.is_expert_parallel else groups.intra_dp_cp
        )
        buffer.ddp_config = ddp_config
    return Buffers(
        [b for k, b in built.items() if not k.is_expert_parallel],
        [b for k, b in built.items() if k.is_expert_parallel],
    )


def build_bucket_groups(
    buffers: Sequence[ParamAndGradBuffer],
    ddp_config: DistributedDataParallelConfig,
    group: dist.ProcessGroup | None,
    inter_group: dist.ProcessGroup | None,
    names: Mapping[Param, str],
    kind: str,
    single_group: bool,
) -> list[ParamAndGradBucketGroup]:
    """Bucket groups over ``buffers`` (see :func:`~mc_ddp.partition_buckets`), chained for
    the param all-gather so that the last group (the start of the model) goes first."""
    if not buffers:
        return []
    assert group is not None  # resolve_groups requires it when such params exist
    groups = [
        ParamAndGradBucketGroup(
            buckets,
            ddp_config,
            group,
            inter_instance_group=inter_group,
            param_to_name=names,
            name=f"{kind} bucket group {i}",
        )
        for i, buckets in enumerate(partition_buckets(buffers, single_group))
    ]
    for later, earlier in zip(groups[1:], groups[:-1], strict=True):
        later.next_param_gather_bucket_group = earlier
    return groups


def agree_across_ranks(
    config: TransformerConfigLike,
    ddp_config: DistributedDataParallelConfig,
    groups: DDPGroups,
    disable_bucketing: bool,
    plan: LayoutPlan,
    named: Sequence[tuple[str, Param]],
    experts: int,
    check_param_values: bool = True,
) -> None:
    """The construction-time agreement (:mod:`mc_ddp._agreement`): dense over ``dp_cp``,
    then, with expert params, expert over ``expt_dp``; the params' values are compared in
    the same exchanges unless ``check_param_values=False``."""
    params = [p for _, p in named]
    compared = mg.group_size(groups.dp_cp) > 1 or (
        experts > 0 and groups.expt_dp is not None and mg.group_size(groups.expt_dp) > 1
    )
    checksums = (
        dict(zip(params, agreement.value_checksums(params), strict=True))
        if check_param_values and compared
        else None
    )

    def record(expert: bool) -> agreement.Record:
        return agreement.build_record(
            calculate_per_token_loss=config.calculate_per_token_loss,
            ddp_config=ddp_config,
            disable_bucketing=disable_bucketing,
            bucket_size=plan.bucket_size,
            named=named,
            layout=plan.layout,
            expert=expert,
            expert_count=experts,
            checksums=checksums,
        )

    dense = [(n, p) for n, p in named if not param_attrs.is_expert_param(p)]
    expert = [(n, p) for n, p in named if param_attrs.is_expert_param(p)]
    telling = agreement.telling_fields
    agreement.agree(groups.dp_cp, "dp_cp", record(expert=False), telling(dense, checksums))
    if experts and groups.expt_dp is not None:
        agreement.agree(groups.expt_dp, "expt_dp", record(expert=True), telling(expert, checksums))
