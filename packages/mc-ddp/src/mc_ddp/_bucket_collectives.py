"""What a bucket group's collectives carry: the tensors of each bucket, and the layout
detail that names them (like FSDP2's ``_fsdp_collectives``, over mc_groups).

A bucket group owns one contiguous shard position ``ShardSpec(group, rank, size)``: bucket
``b`` splits into ``size`` equal views, rank ``rank`` owns ``b.grad_shard(rank, size)`` /
``b.param_shard(rank, size)``. One collective per bucket, Megatron's schedule: a group's
buckets go through its :class:`mc_groups.Communicator` as one list, which issues them in
one coalesced batch (a one-bucket group's collective alone; on gloo one batch per dtype)
and keeps the reduce-scatter's temporaries between iterations.

The layout detail (``detail=`` of every collective) is shown in collective errors and
compared by mc_groups' opt-in schedule check, so that ranks whose buckets hold different
params (e.g. params registered in a different order) are told apart even when the buckets
have the same size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import ParamAndGradBucket

Param = torch.nn.Parameter

_SHOWN = 3
"""Params named per bucket; the digest covers all of them."""


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


def _param_data(bucket: ParamAndGradBucket) -> torch.Tensor:
    if bucket.param_data is None:
        raise RuntimeError(
            f"bucket {bucket.bucket_id} has no param_data: params are gathered only with "
            "use_distributed_optimizer=True"
        )
    return bucket.param_data


def reduce_bucket_grads(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    how: GradReduction,
    comm: mg.Communicator,
    *,
    async_op: bool,
    label: str,
    detail: str = "",
) -> mg.CollectiveHandle:
    """Issue the gradient reduction of ``buckets`` over ``comm``'s group.

    ``scatter``: ``grad_shard(rank) ← op_r grad_data`` (this rank's shard only; with
    ``fp32_accumulation`` summed in fp32 and rounded once, see
    :func:`~mc_ddp.reduce_scatter_with_fp32_accumulation`); else ``grad_data ← op_r
    grad_data`` in place.
    """
    if not how.scatter:
        grads = [b.grad_data for b in buckets]
        return comm.all_reduce(grads, op=how.op, async_op=async_op, label=label, detail=detail)
    pairs = [(b.grad_shard(shard.rank, shard.size), b.grad_data) for b in buckets]
    return comm.reduce_scatter(
        pairs,
        op=how.op,
        async_op=async_op,
        label=label,
        detail=detail,
        accumulate_dtype=torch.float32 if how.fp32_accumulation else None,
    )


def all_reduce_across_instances(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    comm: mg.Communicator,
    *,
    op: mg.ReduceOp,
    whole_bucket: bool,
    label: str,
    detail: str = "",
) -> None:
    """``x ← op over comm's group of x`` for this rank's shard of each bucket (or the whole
    bucket with ``whole_bucket``): the second stage of a multi-instance reduction."""
    tensors = [
        b.grad_data if whole_bucket else b.grad_shard(shard.rank, shard.size) for b in buckets
    ]
    comm.all_reduce(tensors, op=op, label=label, detail=detail)


def gather_grad_shards(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    comm: mg.Communicator,
    *,
    label: str,
    detail: str = "",
) -> None:
    """``grad_data ← concat_r grad_shard(r)``: turns reduce-scattered shards into the full
    reduced gradients an all-reduce would have produced (synchronous)."""
    pairs = [(b.grad_data, b.grad_shard(shard.rank, shard.size)) for b in buckets]
    comm.all_gather(pairs, label=label, detail=detail)


def gather_bucket_params(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    comm: mg.Communicator,
    *,
    async_op: bool,
    label: str,
    detail: str = "",
) -> mg.CollectiveHandle:
    """``param_data ← concat_r param_shard(r)`` for each bucket (the distributed optimizer's
    param all-gather, in place: the input is this rank's view of the output)."""
    pairs = [(_param_data(b), b.param_shard(shard.rank, shard.size)) for b in buckets]
    return comm.all_gather(pairs, async_op=async_op, label=label, detail=detail)


def bucket_layout_detail(buckets: Sequence[ParamAndGradBucket], names: Mapping[Param, str]) -> str:
    """``bucket 0: 6 params '4.bias' (4,), '4.weight' (4, 16), '2.bias' (16,) and 3 more;
    layout 1f0c…`` per bucket (``"; "``-joined; ``1 param`` for one).

    The 16-hex-digit layout digest (BLAKE2b) covers every param's name, shape and
    ``(start, end)`` in the bucket and the bucket's size, so two ranks agree on it exactly
    when their buckets map the same elements to the same params. Computed once per bucket
    group (construction), not per collective.
    """
    return "; ".join(_one_bucket(bucket, names) for bucket in buckets)


def _one_bucket(bucket: ParamAndGradBucket, names: Mapping[Param, str]) -> str:
    params = bucket.params_list
    entries = [
        f"{names.get(p, '<unnamed>')}:{tuple(p.shape)}:{bucket.param_to_index[p]}" for p in params
    ]
    text = "|".join([str(bucket.grad_data.numel()), *entries])
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    shown = ", ".join(f"'{names.get(p, '<unnamed>')}' {tuple(p.shape)}" for p in params[:_SHOWN])
    more = f" and {len(params) - _SHOWN} more" if len(params) > _SHOWN else ""
    count = f"{len(params)} param{'' if len(params) == 1 else 's'}"
    return f"bucket {bucket.bucket_id}: {count} {shown}{more}; layout {digest}"
