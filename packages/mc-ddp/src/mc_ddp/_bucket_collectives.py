"""Every collective a bucket group issues, in one place (like FSDP2's ``_fsdp_collectives``).

A bucket group owns one contiguous shard position ``ShardSpec(group, rank, size)``: bucket
``b`` splits into ``size`` equal views, rank ``rank`` owns ``b.grad_shard(rank, size)`` /
``b.param_shard(rank, size)``. Each function issues one coalesced batch per dtype over the
group (one collective per bucket, same kind and reduce op), except the fp32-accumulating
reduce-scatter, which is an all-to-all per bucket.

Two gloo facts shape this (torch 2.13): batches are opened without a device, so torch takes
its fast path (``allreduce_coalesced`` and friends; the per-device path raises "gloo does
not implement startCoalescing"); and a gloo batch must hold one dtype ("allreduce_coalesced:
tensors must all have the same type"), so a group mixing fp32 and bf16 buckets issues one
batch per dtype, in first-appearance order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import ParamAndGradBucket
from mc_ddp._pending import PendingCollective
from mc_ddp.fp32_reduce_scatter import reduce_scatter_with_fp32_accumulation


class ShardSpec(NamedTuple):
    """Where this rank's shards are: ``group``, its rank there and the shard count."""

    group: dist.ProcessGroup
    rank: int
    size: int


class GradReduction(NamedTuple):
    """How one bucket group reduces: reduce-scatter or all-reduce, op, fp32 accumulation."""

    scatter: bool
    op: mg.ReduceOp
    fp32_accumulation: bool


def _by_dtype(
    buckets: Sequence[ParamAndGradBucket], dtype_of: Callable[[ParamAndGradBucket], torch.dtype]
) -> list[list[ParamAndGradBucket]]:
    batches: dict[torch.dtype, list[ParamAndGradBucket]] = {}
    for bucket in buckets:
        batches.setdefault(dtype_of(bucket), []).append(bucket)
    return list(batches.values())


def _grad_dtype(bucket: ParamAndGradBucket) -> torch.dtype:
    return bucket.grad_data.dtype


def _param_dtype(bucket: ParamAndGradBucket) -> torch.dtype:
    assert bucket.param_data is not None  # distributed-optimizer buffers only
    return bucket.param_data.dtype


def reduce_bucket_grads(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    how: GradReduction,
    *,
    async_op: bool,
    label: str,
) -> PendingCollective:
    """Issue the gradient reduction of ``buckets`` over ``shard.group``.

    ``scatter``: ``grad_shard(rank) ← op_r grad_data`` in place (this rank's shard only);
    else ``grad_data ← op_r grad_data``. With ``fp32_accumulation`` the reduce-scatter is
    :func:`~mc_ddp.reduce_scatter_with_fp32_accumulation` per bucket.
    """
    if how.scatter and how.fp32_accumulation:
        return _fp32_reduce_scatter(buckets, shard, how.op, async_op=async_op, label=label)
    handles = []
    for same_dtype in _by_dtype(buckets, _grad_dtype):
        with mg.coalesced(shard.group, async_op=async_op, label=label) as b:
            for bucket in same_dtype:
                if how.scatter:
                    out = bucket.grad_shard(shard.rank, shard.size)
                    b.reduce_scatter(out, bucket.grad_data, op=how.op)
                else:
                    b.all_reduce(bucket.grad_data, op=how.op)
        handles.append(b.handle)
    return PendingCollective(handles)


def _fp32_reduce_scatter(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    op: mg.ReduceOp,
    *,
    async_op: bool,
    label: str,
) -> PendingCollective:
    parts = [
        reduce_scatter_with_fp32_accumulation(
            b.grad_shard(shard.rank, shard.size),
            b.grad_data,
            shard.group,
            op=op,
            async_op=async_op,
            label=label,
        )
        for b in buckets
    ]
    return PendingCollective([], [p.wait for p in parts])


def all_reduce_across_instances(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    inter_group: dist.ProcessGroup,
    *,
    op: mg.ReduceOp,
    whole_bucket: bool,
    label: str,
) -> None:
    """``x ← op over inter_group of x`` for this rank's shard of each bucket (or the whole
    bucket with ``whole_bucket``): the second stage of a multi-instance reduction."""
    for same_dtype in _by_dtype(buckets, _grad_dtype):
        with mg.coalesced(inter_group, label=label) as batch:
            for bucket in same_dtype:
                whole = bucket.grad_data
                batch.all_reduce(
                    whole if whole_bucket else bucket.grad_shard(shard.rank, shard.size), op=op
                )


def gather_grad_shards(
    buckets: Sequence[ParamAndGradBucket], shard: ShardSpec, *, label: str
) -> None:
    """``grad_data ← concat_r grad_shard(r)``: turns reduce-scattered shards into the full
    reduced gradients an all-reduce would have produced (synchronous)."""
    for same_dtype in _by_dtype(buckets, _grad_dtype):
        with mg.coalesced(shard.group, label=label) as batch:
            for bucket in same_dtype:
                batch.all_gather(bucket.grad_data, bucket.grad_shard(shard.rank, shard.size))


def gather_bucket_params(
    buckets: Sequence[ParamAndGradBucket], shard: ShardSpec, *, async_op: bool, label: str
) -> PendingCollective:
    """``param_data ← concat_r param_shard(r)`` for each bucket (the distributed optimizer's
    param all-gather, in place: the input is this rank's view of the output)."""
    handles = []
    for same_dtype in _by_dtype(buckets, _param_dtype):
        with mg.coalesced(shard.group, async_op=async_op, label=label) as b:
            for bucket in same_dtype:
                param_data = bucket.param_data
                assert param_data is not None  # checked by _param_dtype
                b.all_gather(param_data, bucket.param_shard(shard.rank, shard.size))
        handles.append(b.handle)
    return PendingCollective(handles)
