"""``BufferKey`` and the grouping of params into one buffer per key."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mc_buffers._checks import Param, as_param_list, check_requires_grad, check_unique
from mc_groups.argcheck import check_flag, check_tensor
from mc_groups.param_attrs import ALLREDUCE, bool_attr

__all__ = ["BufferKey", "group_params_for_buffers", "is_expert_parallel_param"]


@dataclass(frozen=True)
class BufferKey:
    """Identifies one contiguous buffer: params sharing a key share a buffer.

    Attributes:
        param_dtype: dtype of the params (and of ``param_data`` in distributed-optimizer mode).
        grad_dtype: dtype of ``grad_data``, the dtype gradients are reduced in.
        is_expert_parallel: the params are expert-parallel (``param.allreduce is False``) and
            are reduced over the expert data-parallel group, so they need their own buffer.
    """

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool


def is_expert_parallel_param(param: torch.Tensor) -> bool:
    """Megatron's rule: a param is expert-parallel when it carries ``allreduce=False``
    (a non-bool ``allreduce`` is a ``TypeError``)."""
    check_tensor("param", param)
    return not bool_attr(param, ALLREDUCE, True)


def group_params_for_buffers(
    params: Iterable[Param], grad_reduce_in_fp32: bool
) -> dict[BufferKey, tuple[list[Param], list[int]]]:
    """Group ``params`` by :class:`BufferKey`, keeping their order inside each group.

    For each param: ``grad_dtype = float32 if grad_reduce_in_fp32 else param.dtype`` and
    ``is_expert_parallel = not getattr(param, "allreduce", True)``. Keys appear in the
    order their first param appears.

    Returns:
        ``{key: (params, param_indices)}`` where ``param_indices[i]`` is the position of
        ``params[i]`` among the params of the same dtype (counted separately per key, so
        ``param_indices == [0, 1, ..., n-1]`` for each key). Megatron keeps these indices
        to map checkpoints across param storage formats.

    Raises:
        TypeError: ``params`` is unordered or holds a non-tensor; an ``allreduce`` that is
            not a bool.
        ValueError: a param does not require grad, or appears twice.
    """
    check_flag("grad_reduce_in_fp32", grad_reduce_in_fp32)
    plist = as_param_list(params)
    check_unique(plist)
    check_requires_grad(plist)
    groups: dict[BufferKey, tuple[list[Param], list[int]]] = {}
    for p in plist:
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
        key = BufferKey(p.dtype, grad_dtype, is_expert_parallel_param(p))
        members, indices = groups.setdefault(key, ([], []))
        indices.append(len(members))
        members.append(p)
    return groups
