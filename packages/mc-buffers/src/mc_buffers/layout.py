"""Where each param lives in its buffer: pure layout functions, no tensors allocated.

Params are laid out in **reverse** order (backprop order: bucket 0 holds the end of the
model, whose gradients are ready first). A bucket closes right after the param that brings
it to ``>= bucket_size`` elements, so a bucket may exceed ``bucket_size``; with
``bucket_size=None`` every param goes into one bucket. Worked example (10 ×
``nn.Linear(95, 95, bias=False)``, 9025 elements each, ``bucket_size=9050``)::

    default layout               | p9 0..9025 | p8 9025..18050 | -> bucket 0 = [0, 18050)
    distributed optimizer, dp=2  | p9 0..9025 |pad| p8 9088..18113 |pad| -> [0, 18176)
                                   param starts padded to 64, bucket end to lcm(2, 128)

so five buckets of 18050 elements (default) or five of 18176 with 18113 unpadded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mc_buffers._param_checks import (
    Param,
    as_param_list,
    check_non_empty_numel,
    check_unique,
)
from mc_buffers.keys import BufferKey, group_params_for_buffers
from mc_buffers.padding import pad_bucket_end, pad_param_start
from mc_groups.argcheck import check_flag, check_int, check_optional_int
from mc_groups.errors import InputValueError
from mc_groups.param_attrs import SHARED_EMBEDDING, bool_attr

__all__ = [
    "FullParamLayout",
    "PerBufferParamLayout",
    "compute_default_per_buffer_param_layout",
    "compute_distributed_optimizer_param_layout",
    "compute_full_param_layout",
]


@dataclass
class PerBufferParamLayout:
    """Layout of the params of one buffer (Megatron's field names).

    Attributes:
        param_index_map: param -> ``(start, end, bucket_id)``, element offsets in the buffer;
            ``end - start == param.numel()``.
        bucket_indices: ``(start, end)`` of each bucket, contiguous from 0; ``end`` includes
            the bucket's padding.
        per_bucket_numel_unpadded: per bucket, last param end − bucket start (Megatron's
            distributed-optimizer layout: a bucket closed by a shared embedding counts up to
            the embedding's padded start; the layer-wise layout: the sum of its params).
        param_indices: index of each param among the same-dtype params (checkpoint mapping).
        num_optimizer_shards: number of equal shards every bucket splits into (the
            data-parallel size of a distributed-optimizer layout); None for the default one.
    """

    param_index_map: dict[Param, tuple[int, int, int]] = field(default_factory=dict)
    bucket_indices: list[tuple[int, int]] = field(default_factory=list)
    per_bucket_numel_unpadded: list[int] = field(default_factory=list)
    param_indices: list[int] = field(default_factory=list)
    num_optimizer_shards: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the whole buffer, padding included."""
        return self.bucket_indices[-1][1] if self.bucket_indices else 0

    @property
    def numel_unpadded(self) -> int:
        """Sum of the per-bucket unpadded sizes."""
        return sum(self.per_bucket_numel_unpadded)

    def bucket_params(self, bucket_id: int) -> list[Param]:
        """The params of bucket ``bucket_id`` by increasing start (backprop order)."""
        members = [(v[0], p) for p, v in self.param_index_map.items() if v[2] == bucket_id]
        return [p for _, p in sorted(members, key=lambda item: item[0])]


@dataclass
class FullParamLayout:
    """Layouts of every buffer of a model chunk: ``layouts[key]`` for each :class:`BufferKey`.

    Each per-buffer layout has its own index space (the buffers are separate tensors).
    """

    layouts: dict[BufferKey, PerBufferParamLayout] = field(default_factory=dict)


@dataclass(frozen=True)
class _Padding:
    param_start: Callable[[int], int]
    bucket_end: Callable[[int], int]
    isolate_shared_embedding: bool


_NO_PADDING = _Padding(lambda n: n, lambda n: n, isolate_shared_embedding=False)


class _LayoutWalk:
    """Accumulates params in backprop order and closes buckets by the padding policy."""

    def __init__(self, bucket_size: int | None, padding: _Padding) -> None:
        self.layout = PerBufferParamLayout()
        self._bucket_size = bucket_size
        self._padding = padding
        self._next_start = 0
        self._bucket_start = 0
        self._last_end = 0
        self._open = 0  # params in the open bucket

    def add(self, param: Param) -> None:
        isolate = self._padding.isolate_shared_embedding and bool_attr(
            param, SHARED_EMBEDDING, False
        )
        if isolate and self._open:
            # Megatron pads the shared param's start first, then closes the open bucket
            # there: its unpadded size runs to that padded start (the bucket end is the
            # same either way, as the bucket-end divisor is a multiple of the 64 alignment).
            self._close(self._padding.param_start(self._next_start))
        start = self._padding.param_start(self._next_start)
        end = start + param.numel()
        self.layout.param_index_map[param] = (start, end, len(self.layout.bucket_indices))
        self._open, self._last_end, self._next_start = self._open + 1, end, end
        full = self._bucket_size is not None and end - self._bucket_start >= self._bucket_size
        if full or isolate:
            self._close()

    def _close(self, unpadded_end: int | None = None) -> None:
        last = self._last_end if unpadded_end is None else unpadded_end
        end = self._padding.bucket_end(last)
        self.layout.per_bucket_numel_unpadded.append(last - self._bucket_start)
        self.layout.bucket_indices.append((self._bucket_start, end))
        self._bucket_start = self._next_start = end
        self._open = 0

    def finish(self) -> PerBufferParamLayout:
        if self._open:
            self._close()
        return self.layout


def _walk(params: list[Param], bucket_size: int | None, padding: _Padding) -> PerBufferParamLayout:
    walk = _LayoutWalk(bucket_size, padding)
    for param in reversed(params):
        walk.add(param)
    return walk.finish()


def _checked_params(params: Iterable[Param]) -> list[Param]:
    plist = as_param_list(params)
    if not plist:
        raise InputValueError("params is empty: a buffer layout needs at least one param")
    check_unique(plist)
    check_non_empty_numel(plist)
    return plist


def compute_default_per_buffer_param_layout(
    params: Iterable[Param], bucket_size: int | None
) -> PerBufferParamLayout:
    """Layout without padding (plain data parallelism: each bucket is all-reduced whole).

    Params in reverse order, packed back to back; a bucket closes once it holds
    ``>= bucket_size`` elements (``None``: one bucket). ``numel == numel_unpadded``.
    """
    plist = _checked_params(params)
    size = check_optional_int("bucket_size", bucket_size)
    layout = _walk(plist, size, _NO_PADDING)
    layout.param_indices = list(range(len(plist)))
    return layout


def compute_distributed_optimizer_param_layout(
    params: Iterable[Param],
    bucket_size: int | None,
    data_parallel_size: int,
    pad_buckets_for_high_nccl_busbw: bool = False,
) -> PerBufferParamLayout:
    """Layout for the distributed optimizer (each bucket reduce-scattered into dp shards).

    As the default layout, plus: each param start is padded to a multiple of 64 elements
    (:func:`pad_param_start`); each bucket end to a multiple of ``lcm(dp, 128)`` or
    ``lcm(dp, 128, 2**16)`` (:func:`pad_bucket_end`), so every bucket splits into
    ``data_parallel_size`` equal shards; a param with ``shared_embedding=True`` sits alone
    in its own bucket (the open bucket is closed before it), so the first and last pipeline
    stages shard the tied embedding identically. Unpadded size of a bucket = last param end
    − bucket start, except for a bucket the shared embedding closes: up to the embedding's
    padded start (params [emb(10, shared), w(100)] at dp 1: [128, 10]), as Megatron-Core
    counts it (its distributed-optimizer checkpoints read these sizes).
    """
    plist = _checked_params(params)
    size = check_optional_int("bucket_size", bucket_size)
    dp = check_int("data_parallel_size", data_parallel_size)
    busbw = check_flag("pad_buckets_for_high_nccl_busbw", pad_buckets_for_high_nccl_busbw)
    padding = _Padding(
        pad_param_start,
        lambda n: pad_bucket_end(n, dp, busbw),
        isolate_shared_embedding=True,
    )
    layout = _walk(plist, size, padding)
    layout.param_indices = list(range(len(plist)))
    layout.num_optimizer_shards = dp
    return layout


def _expert_dp(members: list[Param], expert_dp: int | None) -> int:
    if expert_dp is None:
        raise InputValueError(
            f"expert_data_parallel_size=None but {len(members)} expert-parallel param(s) "
            "(allreduce=False) need a distributed-optimizer layout; pass the size of the "
            "expert data-parallel group (pg_collection.expt_dp)"
        )
    return expert_dp


def compute_full_param_layout(
    params: Iterable[Param],
    bucket_size: int | None,
    data_parallel_size: int,
    *,
    use_distributed_optimizer: bool,
    grad_reduce_in_fp32: bool,
    pad_buckets_for_high_nccl_busbw: bool = False,
    expert_data_parallel_size: int | None = None,
) -> FullParamLayout:
    """One layout per :class:`BufferKey` of ``params`` (see :func:`group_params_for_buffers`).

    Each key's params get :func:`compute_distributed_optimizer_param_layout` (with
    ``expert_data_parallel_size`` for expert keys, ``data_parallel_size`` otherwise) when
    ``use_distributed_optimizer``, else :func:`compute_default_per_buffer_param_layout`;
    ``param_indices`` come from the grouping.

    Raises:
        ValueError: expert params in distributed-optimizer mode without
            ``expert_data_parallel_size``; and every error of the functions above.
    """
    check_optional_int("bucket_size", bucket_size)
    dp = check_int("data_parallel_size", data_parallel_size)
    use_dist_opt = check_flag("use_distributed_optimizer", use_distributed_optimizer)
    busbw = check_flag("pad_buckets_for_high_nccl_busbw", pad_buckets_for_high_nccl_busbw)
    expert_dp = None
    if expert_data_parallel_size is not None:
        expert_dp = check_int("expert_data_parallel_size", expert_data_parallel_size)
    full = FullParamLayout()
    for key, (members, indices) in group_params_for_buffers(params, grad_reduce_in_fp32).items():
        if not use_dist_opt:
            layout = compute_default_per_buffer_param_layout(members, bucket_size)
        else:
            key_dp = _expert_dp(members, expert_dp) if key.is_expert_parallel else dp
            layout = compute_distributed_optimizer_param_layout(members, bucket_size, key_dp, busbw)
        layout.param_indices = indices
        full.layouts[key] = layout
    return full
