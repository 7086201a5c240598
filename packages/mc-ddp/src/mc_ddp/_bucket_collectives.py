"""Every collective a bucket group issues, in one place (like FSDP2's ``_fsdp_collectives``).

A bucket group owns one contiguous shard position ``ShardSpec(group, rank, size)``: bucket
``b`` splits into ``size`` equal views, rank ``rank`` owns ``b.grad_shard(rank, size)`` /
``b.param_shard(rank, size)``. One collective per bucket, Megatron's schedule: a group's
buckets go in one coalesced batch (a one-bucket group issues its collective alone), native
reduce-scatter / all-gather / all-reduce through mc_groups.

On gloo, mc_groups runs reduce-scatter as an all-to-all through a staging buffer the size
of the bucket (torch 2.13 gloo's own one took 200 ms for 100 MB on 2 ranks, the
all-to-all 53 ms) and all-gather as point-to-point exchanges straight into the bucket (no
staging). The bucket group keeps the reduce-scatter buffers in its :class:`ScratchBuffers`
(one per bucket and dtype): a fresh 33 MB CPU tensor costs ~27 ms of page faults per use
(:func:`mc_groups.needs_staging`).

Two more gloo facts (torch 2.13): one batch must hold one dtype ("allreduce_coalesced:
tensors must all have the same type"), so a group mixing fp32 and bf16 buckets issues one
batch per dtype, in first-appearance order; and a batch of one is not coalesced (gloo's
coalesced all-reduce flattens into a copy, +20 ms per 100 MB).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import ParamAndGradBucket
from mc_ddp._pending import PendingCollective
from mc_ddp._scratch import ScratchBuffers
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


def _param_data(bucket: ParamAndGradBucket) -> torch.Tensor:
    if bucket.param_data is None:
        raise RuntimeError(
            f"bucket {bucket.bucket_id} has no param_data: params are gathered only with "
            "use_distributed_optimizer=True"
        )
    return bucket.param_data


def _param_dtype(bucket: ParamAndGradBucket) -> torch.dtype:
    return _param_data(bucket).dtype


def _issue_all_reduces(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    op: mg.ReduceOp,
    *,
    async_op: bool,
    label: str,
    detail: str,
) -> mg.CollectiveHandle:
    if len(tensors) == 1:
        return mg.all_reduce(
            tensors[0], group, op=op, async_op=async_op, label=label, detail=detail
        )
    with mg.coalesced(group, async_op=async_op, label=label, detail=detail) as batch:
        for tensor in tensors:
            batch.all_reduce(tensor, op=op)
    return batch.handle


_Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(output, input, staging) of one bucket's reduce-scatter."""


def _issue_reduce_scatters(
    triples: Sequence[_Triple],
    group: dist.ProcessGroup,
    op: mg.ReduceOp,
    *,
    async_op: bool,
    label: str,
    detail: str,
) -> mg.CollectiveHandle:
    if len(triples) == 1:
        out, inp, staging = triples[0]
        return mg.reduce_scatter(
            out, inp, group, op=op, async_op=async_op, label=label, staging=staging, detail=detail
        )
    with mg.coalesced(group, async_op=async_op, label=label, detail=detail) as batch:
        for out, inp, staging in triples:
            batch.reduce_scatter(out, inp, op=op, staging=staging)
    return batch.handle


def _gather(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    shard: ShardSpec,
    *,
    async_op: bool,
    label: str,
    detail: str,
) -> PendingCollective:
    """``out ← concat_r shard_r`` over ``shard.group`` for each ``(out, shard)`` pair."""
    group = shard.group
    if len(pairs) == 1:
        out, part = pairs[0]
        return PendingCollective(
            [mg.all_gather(out, part, group, async_op=async_op, label=label, detail=detail)]
        )
    with mg.coalesced(group, async_op=async_op, label=label, detail=detail) as batch:
        for out, part in pairs:
            batch.all_gather(out, part)
    return PendingCollective([batch.handle])


def _a2a_scratch(
    scratch: ScratchBuffers, index: int, like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return scratch.get(f"all-to-all {index}", like, dtype)


def _staging(
    scratch: ScratchBuffers, group: dist.ProcessGroup, index: int, full: torch.Tensor
) -> torch.Tensor | None:
    """The kept staging buffer of bucket ``index`` when ``group`` needs one (gloo)."""
    return _a2a_scratch(scratch, index, full) if mg.needs_staging(group) else None


def reduce_bucket_grads(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    how: GradReduction,
    *,
    async_op: bool,
    label: str,
    scratch: ScratchBuffers,
    detail: str = "",
) -> PendingCollective:
    """Issue the gradient reduction of ``buckets`` over ``shard.group``.

    ``scatter``: ``grad_shard(rank) ← op_r grad_data`` (this rank's shard only; with
    ``fp32_accumulation`` via :func:`~mc_ddp.reduce_scatter_with_fp32_accumulation`);
    else ``grad_data ← op_r grad_data`` in place.
    """
    group = shard.group
    if how.scatter and how.fp32_accumulation:
        parts = []
        for i, b in enumerate(buckets):
            out = b.grad_shard(shard.rank, shard.size)
            fp32_sum = (
                None if out.dtype == torch.float32 else _a2a_scratch(scratch, i, out, torch.float32)
            )
            parts.append(
                reduce_scatter_with_fp32_accumulation(
                    out,
                    b.grad_data,
                    group,
                    op=how.op,
                    async_op=async_op,
                    label=label,
                    received=_a2a_scratch(scratch, i, b.grad_data),
                    fp32_sum=fp32_sum,
                    detail=detail,
                )
            )
        return PendingCollective([], [p.wait for p in parts])
    index = {id(b): i for i, b in enumerate(buckets)}
    handles = []
    for batch in _by_dtype(buckets, _grad_dtype):
        if how.scatter:
            triples = [
                (
                    b.grad_shard(shard.rank, shard.size),
                    b.grad_data,
                    _staging(scratch, group, index[id(b)], b.grad_data),
                )
                for b in batch
            ]
            handles.append(
                _issue_reduce_scatters(
                    triples, group, how.op, async_op=async_op, label=label, detail=detail
                )
            )
        else:
            tensors = [b.grad_data for b in batch]
            handles.append(
                _issue_all_reduces(
                    tensors, group, how.op, async_op=async_op, label=label, detail=detail
                )
            )
    return PendingCollective(handles)


def all_reduce_across_instances(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    inter_group: dist.ProcessGroup,
    *,
    op: mg.ReduceOp,
    whole_bucket: bool,
    label: str,
    detail: str = "",
) -> None:
    """``x ← op over inter_group of x`` for this rank's shard of each bucket (or the whole
    bucket with ``whole_bucket``): the second stage of a multi-instance reduction."""
    for batch in _by_dtype(buckets, _grad_dtype):
        tensors = [
            b.grad_data if whole_bucket else b.grad_shard(shard.rank, shard.size) for b in batch
        ]
        _issue_all_reduces(tensors, inter_group, op, async_op=False, label=label, detail=detail)


def gather_grad_shards(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    *,
    label: str,
    detail: str = "",
) -> None:
    """``grad_data ← concat_r grad_shard(r)``: turns reduce-scattered shards into the full
    reduced gradients an all-reduce would have produced (synchronous)."""
    for batch in _by_dtype(buckets, _grad_dtype):
        pairs = [(b.grad_data, b.grad_shard(shard.rank, shard.size)) for b in batch]
        _gather(pairs, shard, async_op=False, label=label, detail=detail).wait()


def gather_bucket_params(
    buckets: Sequence[ParamAndGradBucket],
    shard: ShardSpec,
    *,
    async_op: bool,
    label: str,
    detail: str = "",
) -> PendingCollective:
    """``param_data ← concat_r param_shard(r)`` for each bucket (the distributed optimizer's
    param all-gather, in place: the input is this rank's view of the output)."""
    parts = []
    for batch in _by_dtype(buckets, _param_dtype):
        pairs = [(_param_data(b), b.param_shard(shard.rank, shard.size)) for b in batch]
        parts.append(_gather(pairs, shard, async_op=async_op, label=label, detail=detail))
    return PendingCollective([], [p.wait for p in parts])
