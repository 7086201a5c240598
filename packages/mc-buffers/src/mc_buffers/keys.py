"""``BufferKey`` and the grouping of params into one buffer per key."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mc_buffers._param_checks import Param, as_param_list, check_requires_grad, check_unique
from mc_groups.argcheck import check_flag, check_tensor
from mc_groups.param_attrs import ALLREDUCE, bool_attr, is_layer_wise_managed

__all__ = ["BufferKey", "group_params_for_buffers", "is_expert_parallel_param"]


_KEY_FIELDS = (
    "param_dtype",
    "grad_dtype",
    "is_expert_parallel",
    "is_managed_by_layer_wise_optimizer",
)


@dataclass(frozen=True, eq=False)
class BufferKey:
    """Identifies one contiguous buffer: params sharing a key share a buffer.

    Attributes:
        param_dtype: dtype of the params (and of ``param_data`` in distributed-optimizer mode).
        grad_dtype: dtype of ``grad_data``, the dtype gradients are reduced in.
        is_expert_parallel: the params are expert-parallel (``param.allreduce is False``) and
            are reduced over the expert data-parallel group, so they need their own buffer.
        is_managed_by_layer_wise_optimizer: the params are stepped by Megatron-Core's
            ``LayerWiseDistributedOptimizer`` (``param.is_managed_by_layer_wise_optimizer``,
            which Megatron's ``tag_params_for_buffer_routing`` sets), whose layout keeps
            every param whole inside one shard; the other params get a byte-level layout
            in a buffer of their own. Default False, as Megatron's.

    Interchangeable with Megatron-Core's ``megatron.core.optimizer.param_layout.BufferKey``:
    a key equals any object with the same four fields at equal values (either side of
    ``==``), and hashes as Megatron's frozen dataclass does (the hash of the tuple of the
    four fields), so a key of either library finds the other's entry in a dict or set.
    """

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False

    def _fields(self) -> tuple[torch.dtype, torch.dtype, bool, bool]:
        return (
            self.param_dtype,
            self.grad_dtype,
            self.is_expert_parallel,
            self.is_managed_by_layer_wise_optimizer,
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BufferKey):
            return self._fields() == other._fields()
        try:
            theirs = tuple(getattr(other, name) for name in _KEY_FIELDS)
        except AttributeError:
            return NotImplemented
        return self._fields() == theirs

    def __hash__(self) -> int:
        return hash(self._fields())


def is_expert_parallel_param(param: torch.Tensor) -> bool:
    """Megatron's rule: a param is expert-parallel when it carries ``allreduce=False``
    (a non-bool ``allreduce`` is a ``TypeError``)."""
    check_tensor("param", param)
    return not bool_attr(param, ALLREDUCE, True)


def group_params_for_buffers(
    params: Iterable[Param], grad_reduce_in_fp32: bool
) -> dict[BufferKey, tuple[list[Param], list[int]]]:
    """Group ``params`` by :class:`BufferKey`, keeping their order inside each group.

    For each param: ``grad_dtype = float32 if grad_reduce_in_fp32 else param.dtype``,
    ``is_expert_parallel = not getattr(param, "allreduce", True)`` and
    ``is_managed_by_layer_wise_optimizer = getattr(param, "is_managed_by_layer_wise_optimizer",
    False)`` (Megatron-Core's rule). Keys appear in the order their first param appears.

    Returns:
        ``{key: (params, param_indices)}`` where ``param_indices[i]`` is the position of
        ``params[i]`` among the params of the same dtype (counted separately per key, so
        ``param_indices == [0, 1, ..., n-1]`` for each key). Megatron keeps these indices
        to map checkpoints across param storage formats.

    Raises:
        TypeError: ``params`` is unordered or holds a non-tensor; an ``allreduce`` or
            ``is_managed_by_layer_wise_optimizer`` that is not a bool.
        ValueError: a param does not require grad, or appears twice.
    """
    check_flag("grad_reduce_in_fp32", grad_reduce_in_fp32)
    plist = as_param_list(params)
    check_unique(plist)
    check_requires_grad(plist)
    groups: dict[BufferKey, tuple[list[Param], list[int]]] = {}
    for p in plist:
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
        key = BufferKey(p.dtype, grad_dtype, is_expert_parallel_param(p), is_layer_wise_managed(p))
        members, indices = groups.setdefault(key, ([], []))
        indices.append(len(members))
        members.append(p)
    return groups
