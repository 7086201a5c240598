"""Layouts from elsewhere, adopted by what they have rather than by their class.

A Megatron-Core user computes a layout with Megatron's own
``DistributedOptimizer.compute_full_param_layout`` (``megatron.core.optimizer.param_layout``)
and passes it to mc's ``DistributedDataParallel``. Its classes are not mc's, but its fields
are the same: a ``layouts`` mapping from a key with ``param_dtype``, ``grad_dtype``,
``is_expert_parallel`` and (Megatron-Core main) ``is_managed_by_layer_wise_optimizer`` to a
per-buffer layout with ``param_index_map``, ``bucket_indices``,
``per_bucket_numel_unpadded``, ``param_indices`` and ``num_optimizer_shards``. Such an object
is copied field by field into mc's :class:`~mc_buffers.FullParamLayout` (the params are the
same objects; nothing is allocated) and then checked like any caller-given layout.

Buffers of Megatron's ``LayerWiseDistributedOptimizer`` (keys with
``is_managed_by_layer_wise_optimizer=True``) are adopted like the others: their layout keeps
each param whole inside one of the ``num_optimizer_shards`` equal shards of its bucket
(shards padded to one size, params placed by the optimizer's bin-packing, not in backprop
order), which is a valid layout for mc's buffers and bucket groups as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from mc_buffers.keys import BufferKey
from mc_buffers.layout import FullParamLayout, PerBufferParamLayout
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError

__all__ = [
    "BufferKeyLike",
    "FullParamLayoutLike",
    "PerBufferParamLayoutLike",
    "as_full_param_layout",
    "as_per_buffer_param_layout",
]

_PER_BUFFER_FIELDS = (
    "param_index_map",
    "bucket_indices",
    "per_bucket_numel_unpadded",
    "param_indices",
    "num_optimizer_shards",
)
_KEY_FIELDS = ("param_dtype", "grad_dtype", "is_expert_parallel")
_LAYER_WISE_FIELD = "is_managed_by_layer_wise_optimizer"


class BufferKeyLike(Protocol):
    """What identifies a buffer: mc's :class:`~mc_buffers.BufferKey` or Megatron's."""

    @property
    def param_dtype(self) -> torch.dtype: ...
    @property
    def grad_dtype(self) -> torch.dtype: ...
    @property
    def is_expert_parallel(self) -> bool: ...


class PerBufferParamLayoutLike(Protocol):
    """The fields of a per-buffer layout (mc's or Megatron's ``PerBufferParamLayout``)."""

    @property
    def param_index_map(self) -> Mapping[Any, tuple[int, int, int]]: ...
    @property
    def bucket_indices(self) -> Sequence[tuple[int, int]]: ...
    @property
    def per_bucket_numel_unpadded(self) -> Sequence[int]: ...
    @property
    def param_indices(self) -> Sequence[int]: ...
    @property
    def num_optimizer_shards(self) -> int | None: ...


class FullParamLayoutLike(Protocol):
    """A ``layouts`` mapping from buffer keys to per-buffer layouts (mc's or Megatron's)."""

    @property
    def layouts(self) -> Mapping[Any, Any]: ...


def _check_fields(value: object, fields: tuple[str, ...], wanted: str) -> None:
    """A TypeError saying what ``value`` should be (``wanted``) and which fields it lacks."""
    missing = [name for name in fields if not hasattr(value, name)]
    if missing:
        raise InputTypeError(f"{wanted}, got {type_name(value)} without {missing}")


def as_per_buffer_param_layout(value: object, name: str = "param_layout") -> PerBufferParamLayout:
    """``value`` as mc's :class:`~mc_buffers.PerBufferParamLayout`: itself when it is one,
    else a field-by-field copy of an object that has the five fields (Megatron's class).

    Raises:
        TypeError: ``value`` lacks a field (the message names the fields and the type with
            its module).
    """
    if isinstance(value, PerBufferParamLayout):
        return value
    _check_fields(
        value,
        _PER_BUFFER_FIELDS,
        f"{name} must be a mc_buffers.PerBufferParamLayout or an object with the fields "
        f"{list(_PER_BUFFER_FIELDS)} (e.g. Megatron-Core's, from compute_full_param_layout)",
    )
    like: PerBufferParamLayoutLike = value  # type: ignore[assignment]  # fields checked above
    shards = like.num_optimizer_shards
    return PerBufferParamLayout(
        param_index_map={
            p: (int(a), int(b), int(c)) for p, (a, b, c) in like.param_index_map.items()
        },
        bucket_indices=[(int(a), int(b)) for a, b in like.bucket_indices],
        per_bucket_numel_unpadded=[int(n) for n in like.per_bucket_numel_unpadded],
        param_indices=[int(i) for i in like.param_indices],
        num_optimizer_shards=None if shards is None else int(shards),
    )


def _as_key(key: object, name: str) -> BufferKey:
    if isinstance(key, BufferKey):
        return key
    _check_fields(
        key,
        _KEY_FIELDS,
        f"{name}'s keys must be mc_buffers.BufferKey or have param_dtype, grad_dtype and "
        f"is_expert_parallel; key {key!r}",
    )
    like: BufferKeyLike = key  # type: ignore[assignment]  # fields checked above
    # Megatron-Core main's fourth field (absent in a three-field key: Megatron's default)
    layer_wise = getattr(key, _LAYER_WISE_FIELD, False)
    return BufferKey(
        like.param_dtype, like.grad_dtype, bool(like.is_expert_parallel), bool(layer_wise)
    )


def as_full_param_layout(value: object, name: str = "full_param_layout") -> FullParamLayout:
    """``value`` as mc's :class:`~mc_buffers.FullParamLayout`: itself when it is one, else
    a copy of an object with a ``layouts`` mapping whose keys and values have the fields of
    :class:`BufferKeyLike` and :class:`PerBufferParamLayoutLike` (Megatron-Core's
    ``FullParamLayout``). Only the container is copied: the params are the caller's.

    Raises:
        TypeError: no ``layouts`` mapping, or a key or per-buffer layout without the fields.
    """
    if isinstance(value, FullParamLayout):
        return value
    layouts = getattr(value, "layouts", None)
    if not isinstance(layouts, Mapping):
        raise InputTypeError(
            f"{name} must be a mc_buffers.FullParamLayout or an object with a `layouts` "
            f"mapping of buffer keys to per-buffer layouts (e.g. Megatron-Core's), got "
            f"{type_name(value)}; compute it with compute_full_param_layout"
        )
    return FullParamLayout(
        layouts={
            _as_key(key, name): as_per_buffer_param_layout(layout, f"{name}.layouts[{key!r}]")
            for key, layout in layouts.items()
        }
    )
