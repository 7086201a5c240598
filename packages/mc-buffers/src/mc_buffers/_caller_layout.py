"""Check a caller-given :class:`PerBufferParamLayout` against the params it must place."""

from __future__ import annotations

from collections.abc import Mapping

from mc_buffers._param_checks import Param, describe
from mc_buffers.adopt import as_per_buffer_param_layout
from mc_buffers.layout import PerBufferParamLayout
from mc_groups.errors import InputValueError

_FIX = "recompute it with compute_full_param_layout over these params"


def check_layout(
    layout: object,
    params: list[Param],
    names: Mapping[Param, str] | None,
    shard_count: int | None,
) -> PerBufferParamLayout:
    """``layout`` if it places exactly ``params`` without overlap inside contiguous buckets
    (each divisible by ``shard_count`` when given); else a ValueError naming the culprit."""
    layout = as_per_buffer_param_layout(layout)
    _check_membership(layout, params, names)
    _check_buckets(layout, shard_count)
    _check_param_ranges(layout, params, names)
    return layout


def _check_membership(
    layout: PerBufferParamLayout, params: list[Param], names: Mapping[Param, str] | None
) -> None:
    for p in params:
        if p not in layout.param_index_map:
            raise InputValueError(f"param_layout misses {describe(p, names)}; {_FIX}")
    if len(layout.param_index_map) != len(params):
        extra = next(p for p in layout.param_index_map if not any(p is q for q in params))
        raise InputValueError(
            f"param_layout places {describe(extra)}, which is not among this buffer's params; "
            f"{_FIX}"
        )


def _check_buckets(layout: PerBufferParamLayout, shard_count: int | None) -> None:
    buckets = layout.bucket_indices
    if not buckets:
        raise InputValueError(f"param_layout has no buckets; {_FIX}")
    if len(layout.per_bucket_numel_unpadded) != len(buckets):
        raise InputValueError(
            f"param_layout has {len(buckets)} buckets but "
            f"{len(layout.per_bucket_numel_unpadded)} per_bucket_numel_unpadded entries; {_FIX}"
        )
    previous_end = 0
    for i, (start, end) in enumerate(buckets):
        if start != previous_end or end < start:
            raise InputValueError(
                f"param_layout bucket {i} spans [{start}, {end}) but must start at "
                f"{previous_end} (buckets are contiguous from 0); {_FIX}"
            )
        if not 0 <= layout.per_bucket_numel_unpadded[i] <= end - start:
            raise InputValueError(
                f"param_layout bucket {i}: numel_unpadded "
                f"{layout.per_bucket_numel_unpadded[i]} is outside [0, {end - start}]; {_FIX}"
            )
        if shard_count is not None and (start % shard_count or end % shard_count):
            raise InputValueError(
                f"param_layout bucket {i} spans [{start}, {end}), not divisible by the "
                f"data-parallel size {shard_count}; use "
                "compute_distributed_optimizer_param_layout at that size"
            )
        previous_end = end


def _check_param_ranges(
    layout: PerBufferParamLayout, params: list[Param], names: Mapping[Param, str] | None
) -> None:
    buckets = layout.bucket_indices
    used = set()
    placed = sorted((layout.param_index_map[p], i) for i, p in enumerate(params))
    previous_end = 0
    for (start, end, bucket_id), i in placed:
        p = params[i]
        if end - start != p.numel():
            raise InputValueError(
                f"param_layout gives {describe(p, names)} [{start}, {end}) = {end - start} "
                f"elements but it has {p.numel()}; {_FIX}"
            )
        if not 0 <= bucket_id < len(buckets):
            raise InputValueError(
                f"param_layout puts {describe(p, names)} in bucket {bucket_id}, but there are "
                f"{len(buckets)} buckets; {_FIX}"
            )
        b_start, b_end = buckets[bucket_id]
        if start < b_start or end > b_end:
            raise InputValueError(
                f"param_layout puts {describe(p, names)} at [{start}, {end}), outside its "
                f"bucket {bucket_id} [{b_start}, {b_end}); {_FIX}"
            )
        if start < previous_end:
            raise InputValueError(
                f"param_layout puts {describe(p, names)} at [{start}, {end}), overlapping the "
                f"param before it (which ends at {previous_end}); {_FIX}"
            )
        previous_end = end
        used.add(bucket_id)
    empty = sorted(set(range(len(buckets))) - used)
    if empty:
        raise InputValueError(f"param_layout bucket {empty[0]} holds no param; {_FIX}")
