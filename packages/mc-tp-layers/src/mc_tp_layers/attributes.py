"""Tensor-parallel and GTP metadata carried as attributes on parameters.

Every parameter a TP layer creates carries:

- ``tensor_model_parallel`` (bool): this tensor is one shard of a larger one;
- ``partition_dim`` (int): the dimension that is split (-1 when not split);
- ``partition_stride`` (int): the split is strided (see ``_initialize_affine_weight_cpu``);
- ``allreduce`` (bool): its gradient is reduced over the data-parallel group
  (False for expert-parallel weights, reduced over the expert-DP group instead);
- ``expert_tp``, ``is_qkv``, ``qkv_split_shapes``: Megatron's further TP keys, copied with
  the others by :func:`copy_tensor_model_parallel_attributes` when present;
- ``sequence_parallel`` (bool, row-parallel bias only): its gradient is a partial sum
  over the TP ranks and must be all-reduced over TP after backward.

GTP (gtp_remat) weight shards additionally carry ``is_gtp_weight_remat``, ``group`` (the
gtp_remat process group), ``gtp_remat_size``, ``pad_length`` (zero rows appended to
dim 0 before sharding) and ``gtp_unsharded_shape``. Parameters replicated over the
gtp_remat axis carry ``gtp_remat_rank`` (this rank's position on that axis) and
``gtp_replica_group`` (the group holding the identical copies, e.g. for checkpoint
deduplication).

The names, and who else sets and reads each, are :mod:`mc_groups.param_attrs`; this
module holds Megatron's public functions over them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from mc_groups import param_attrs
from mc_groups.argcheck import (
    check_flag,
    check_int,
    check_optional_group,
    check_tensor,
    type_name,
)
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers import _validate
from mc_tp_layers._tp_groups import resolve_tp_group

__all__ = [
    "GTP_ATTRIBUTES",
    "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
    "RankedGroup",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "gtp_local_pad_zero_count",
    "param_is_not_gtp_duplicate",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, object] = {
    param_attrs.EXPERT_TP: False,
    param_attrs.IS_QKV: False,
    param_attrs.QKV_SPLIT_SHAPES: None,
    param_attrs.TENSOR_MODEL_PARALLEL: False,
    param_attrs.PARTITION_DIM: -1,
    param_attrs.PARTITION_STRIDE: 1,
}
"""The TP attributes and the values an unsharded parameter has (Megatron-Core's six keys:
``expert_tp`` marks an expert-TP shard, ``is_qkv`` / ``qkv_split_shapes`` a fused QKV
weight and the sizes of its Q, K and V blocks, which optimizers that orthogonalise per
block need on every copy of the weight)."""

GTP_ATTRIBUTES: tuple[str, ...] = (
    param_attrs.IS_GTP_WEIGHT_REMAT,
    param_attrs.ALLREDUCE,
    param_attrs.GTP_REMAT_RANK,
    param_attrs.GTP_REPLICA_GROUP,
    param_attrs.GTP_REMAT_SIZE,
    param_attrs.GTP_UNSHARDED_SHAPE,
    param_attrs.PAD_LENGTH,
    param_attrs.GTP_GROUP,
)
"""Attributes :func:`copy_gtp_attributes` carries from a parameter to its copies
(``allreduce`` too: the dense/expert tag decides which gtp_remat axis the dedup uses)."""


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Set ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``.

    Setting the same values again is allowed; different values than those already set
    raise ``ValueError`` (a parameter cannot be split two ways). ``dim`` must be a dimension
    of ``tensor`` (``[-ndim, ndim)``; -1 also marks an unsplit 0-D tensor), ``stride`` an
    int >= 1. (:func:`copy_tensor_model_parallel_attributes` copies the tags unchecked: a
    flattened copy keeps its source's dim.)
    """
    check_tensor("tensor", tensor)
    check_flag("is_parallel", is_parallel)
    _validate.partition_dim(dim, tensor.dim() if is_parallel else max(tensor.dim(), 1), "dim")
    check_int("stride", stride)
    wanted = {
        param_attrs.TENSOR_MODEL_PARALLEL: is_parallel,
        param_attrs.PARTITION_DIM: dim,
        param_attrs.PARTITION_STRIDE: stride,
    }
    clashes = {
        name: getattr(tensor, name)
        for name, value in wanted.items()
        if hasattr(tensor, name) and getattr(tensor, name) != value
    }
    if clashes:
        raise InputValueError(
            f"tensor already carries TP attributes {clashes}, which differ from {wanted}; "
            "copy it (tensor.detach().clone()) before re-labelling"
        )
    for name, value in wanted.items():
        setattr(tensor, name, value)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the unsharded defaults for every TP attribute it lacks."""
    check_tensor("tensor", tensor)
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy every TP attribute ``source_tensor`` has onto ``destination_tensor``.

    The keys are those of :data:`_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS` (``is_qkv`` and
    ``qkv_split_shapes`` included); attributes the source lacks are left alone.
    """
    check_tensor("destination_tensor", destination_tensor)
    check_tensor("source_tensor", source_tensor)
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


class RankedGroup(Protocol):
    """What :func:`param_is_not_tensor_parallel_duplicate` reads of a group: its ``rank()``
    (a ``ProcessGroup`` has it; so does any stand-in a Megatron user passes)."""

    def rank(self) -> int:
        """This process's rank in the group."""
        ...


def _ranked(name: str, group: object) -> RankedGroup | None:
    """``group`` when it is None, a live ``ProcessGroup``, or another object with a callable
    ``rank()`` (nothing is communicated, so no more is needed)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        check_optional_group(name, group)
        return group
    if callable(getattr(group, "rank", None)):
        return group  # type: ignore[return-value]  # has rank(): the protocol
    raise InputTypeError(
        f"{name}={group!r} ({type_name(group)}) must be a torch.distributed.ProcessGroup, an "
        "object with a rank() method, or None"
    )


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: dist.ProcessGroup | RankedGroup | None = None,
    expert_tp_group: dist.ProcessGroup | RankedGroup | None = None,
) -> bool:
    """True if ``param`` counts once when summing over the tensor-parallel ranks.

    A TP shard (``tensor_model_parallel``) is unique on every rank; a replicated parameter
    counts only on rank 0 of its group. The group, as in Megatron-Core: ``expert_tp_group``
    for a parameter reduced over the expert data-parallel group (``allreduce`` False) when
    it is given, else ``tp_group`` when given. With neither, the registered default
    collection's ``expt_tp`` (expert params) or ``tp`` (the others) — where Megatron falls
    back to its global dense TP rank for both. Only the group's ``rank()`` is read, so any
    object with one will do (:class:`RankedGroup`).
    """
    check_tensor("param", param)
    tp = _ranked("tp_group", tp_group)
    expert_tp = _ranked("expert_tp_group", expert_tp_group)
    if param_attrs.is_tensor_model_parallel(param):
        return True
    is_expert = param_attrs.is_expert_param(param)
    group = expert_tp if is_expert and expert_tp is not None else tp
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return int(group.rank()) == 0
    resolved = resolve_tp_group(
        group, None, is_expert=is_expert, what="param_is_not_tensor_parallel_duplicate"
    )
    return int(resolved.rank()) == 0


def copy_gtp_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the GTP attributes (:data:`GTP_ATTRIBUTES`) ``source`` has onto ``destination``.

    Use it on any view or copy of a parameter (an optimizer's fp32 master or shard): the
    dedup tags keep :func:`param_is_not_gtp_duplicate` right, and ``pad_length`` with
    ``group`` keep :func:`gtp_local_pad_zero_count` right (without both it returns 0).
    """
    check_tensor("destination", destination)
    check_tensor("source", source)
    for name in GTP_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_gtp_duplicate(param: torch.Tensor) -> bool:
    """True if ``param``'s gradient counts once across the gtp_remat axis.

    GTP shards are unique on every rank of the axis (kept). A parameter replicated over
    the axis counts only where ``gtp_remat_rank`` is 0; without GTP the tag is absent and
    reads as 0, so every parameter is kept.
    """
    check_tensor("param", param)
    if param_attrs.is_gtp_weight_remat(param):
        return True
    return param_attrs.gtp_remat_rank_of(param) == 0


def gtp_local_pad_zero_count(gtp_shard: torch.Tensor, range_start: int, range_end: int) -> int:
    """Padding elements inside ``gtp_shard.view(-1)[range_start:range_end]``.

    A GTP weight of ``d0`` rows is padded with ``pad_length`` zero rows at the end of dim 0
    and split evenly over the ``G`` ranks of ``gtp_shard.group``: every shard holds
    ``s = (d0 + pad_length) / G`` rows, and rank r holds rows ``[r·s, (r+1)·s)`` of the
    padded weight. The padding rows ``[G·s - pad_length, G·s)`` usually sit in the last
    shard but spill into earlier ones when ``pad_length > s``; the count uses this rank's
    row offset, so both cases are right. Returns 0 when ``pad_length`` or ``group`` is
    missing.

    Args:
        gtp_shard: this rank's shard (carries ``pad_length`` and ``group``).
        range_start: first flat index of the fragment asked about.
        range_end: one past its last flat index (``0, gtp_shard.numel()`` for all).
    """
    check_tensor("gtp_shard", gtp_shard)
    start_at = check_int("range_start", range_start, minimum=0)
    if check_int("range_end", range_end, minimum=0) < start_at:
        raise InputValueError(
            f"range_end={range_end} < range_start={range_start}; the range is "
            "[range_start, range_end)"
        )
    pad_length = param_attrs.pad_length_of(gtp_shard)
    group = param_attrs.gtp_group_of(gtp_shard)
    if pad_length == 0 or group is None or gtp_shard.dim() == 0:
        return 0
    rows = gtp_shard.shape[0]
    row_numel = gtp_shard.numel() // rows if rows else 0
    pad_first_row = rows * int(group.size()) - pad_length
    local_pad_rows = rows - min(max(pad_first_row - int(group.rank()) * rows, 0), rows)
    pad_start = (rows - local_pad_rows) * row_numel
    start, end = max(range_start, pad_start), min(range_end, gtp_shard.numel())
    return max(end - start, 0)
