"""All-reduce many small grads as few flat buffers (Megatron's flatten / unflatten)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize.grad_access import _GradView
from mc_groups.argcheck import check_str, type_name
from mc_groups.errors import InputTypeError


def _allreduce_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, op: mg.ReduceOp, label: str
) -> None:
    """``t ← op over group of t`` for every tensor, one collective per (dtype, device).

    Tensors of one dtype are concatenated into one flat buffer, reduced, and copied back:
    gloo refuses to coalesce tensors of different dtypes, so each dtype gets its own
    all-reduce (in model order, the same on every rank). A lone contiguous tensor is reduced
    in place. Nothing runs on a group of one rank (the arguments are checked all the same).
    """
    _check_tensors(tensors)
    size = mg.group_size(group)  # a live process group, or a TypeError / RuntimeError
    if not isinstance(op, mg.ReduceOp):
        raise InputTypeError(f"op={op!r} must be a mc_groups.ReduceOp (SUM, AVG, MAX or MIN)")
    check_str("label", label)
    if not tensors or size <= 1:
        return
    for bucket in _by_dtype_and_device(tensors):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            mg.all_reduce(bucket[0], group, op=op, label=label)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        mg.all_reduce(flat, group, op=op, label=label)
        for tensor, piece in zip(
            bucket, torch.split(flat, [t.numel() for t in bucket]), strict=True
        ):
            tensor.copy_(piece.view_as(tensor))


def _check_tensors(tensors: object) -> None:
    if not isinstance(tensors, list | tuple):
        raise InputTypeError(
            f"tensors must be a list of tensors (the grads to reduce), got {type_name(tensors)}"
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"tensors[{index}] is a {type_name(tensor)}, not a torch.Tensor")


def _allreduce_views(
    views: Sequence[_GradView], group: dist.ProcessGroup, op: mg.ReduceOp, label: str
) -> None:
    """Reduce the grads behind ``views`` and write them back to their params."""
    _allreduce_tensors([v.full for v in views], group, op, label)
    for view in views:
        view.commit()


def _by_dtype_and_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(buckets.values())
