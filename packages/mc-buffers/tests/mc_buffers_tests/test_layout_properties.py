"""Layout invariants over random param lists (hypothesis).

Each property is checked independently of the layout code: membership, disjointness,
reverse order, alignment and divisibility follow from the rules in the issue, restated
here as plain arithmetic. Integers only, so comparisons are exact.
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mc_buffers import (
    PerBufferParamLayout,
    compute_default_per_buffer_param_layout,
    pad_param_start,
)
from mc_buffers.layout import compute_distributed_optimizer_param_layout, compute_full_param_layout

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_SETTINGS = settings(max_examples=120, deadline=None)


def _make(
    sizes: list[int], shared: list[bool], expert: list[bool] | None = None
) -> list[torch.nn.Parameter]:
    out = []
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.empty(n, device="meta"))
        if shared[i]:
            p.shared_embedding = True  # type: ignore[attr-defined]
        if expert is not None and expert[i]:
            p.allreduce = False  # type: ignore[attr-defined]
        out.append(p)
    return out


_sizes = st.lists(st.integers(1, 700), min_size=1, max_size=12)
_bucket = st.one_of(st.none(), st.integers(1, 3000))
_dp = st.integers(1, 16)


def closed_by_shared_embedding(
    layout: PerBufferParamLayout, bucket: int, bucket_size: int | None
) -> bool:
    """The distributed-optimizer layout closed ``bucket`` because the next param is a shared
    embedding (not because the bucket reached ``bucket_size``)."""
    if layout.num_optimizer_shards is None or bucket + 1 >= len(layout.bucket_indices):
        return False
    b_start = layout.bucket_indices[bucket][0]
    last_end = max(layout.param_index_map[p][1] for p in layout.bucket_params(bucket))
    full = bucket_size is not None and last_end - b_start >= bucket_size
    own = layout.bucket_params(bucket)
    nxt = layout.bucket_params(bucket + 1)[0]
    shared = [bool(getattr(p, "shared_embedding", False)) for p in [*own, nxt]]
    return not full and not any(shared[:-1]) and shared[-1]  # a shared bucket closes itself


def _check_common(
    layout: PerBufferParamLayout, params: list[torch.nn.Parameter], bucket_size: int | None
) -> None:
    # every param exactly once, with its numel
    assert len(layout.param_index_map) == len(params)
    for p in params:
        start, end, _ = layout.param_index_map[p]
        assert end - start == p.numel()
    # reverse registration order: strictly increasing starts, non-decreasing bucket ids
    placed = [layout.param_index_map[p] for p in reversed(params)]
    for (_s0, e0, b0), (s1, _, b1) in itertools.pairwise(placed):
        assert e0 <= s1  # no overlap, in order
        assert b1 in (b0, b0 + 1)  # buckets in order, none empty
    # buckets contiguous from 0, each param inside its bucket, bucket partition
    assert layout.bucket_indices[0][0] == 0
    for (_, e), (s, _) in zip(layout.bucket_indices, layout.bucket_indices[1:], strict=False):
        assert e == s
    for start, end, b in placed:
        b_start, b_end = layout.bucket_indices[b]
        assert b_start <= start
        assert end <= b_end
    members = [len(layout.bucket_params(b)) for b in range(len(layout.bucket_indices))]
    assert sum(members) == len(params)
    assert min(members) >= 1
    # unpadded = last param end − bucket start <= padded; a bucket that the next bucket's
    # shared embedding closed counts up to the embedding's padded start (Megatron's rule)
    for b, (b_start, b_end) in enumerate(layout.bucket_indices):
        last_end = max(layout.param_index_map[p][1] for p in layout.bucket_params(b))
        if closed_by_shared_embedding(layout, b, bucket_size):
            last_end = pad_param_start(last_end)
        assert layout.per_bucket_numel_unpadded[b] == last_end - b_start <= b_end - b_start


def _check_bucket_closing(
    layout: PerBufferParamLayout, bucket_size: int | None, isolate_shared: bool
) -> None:
    # a bucket closes right after the param that brings it to >= bucket_size elements
    for b, (b_start, _) in enumerate(layout.bucket_indices):
        members = layout.bucket_params(b)
        shared = [bool(getattr(p, "shared_embedding", False)) for p in members]
        if isolate_shared and any(shared):
            assert len(members) == 1
            continue
        for p in members[:-1]:
            assert bucket_size is None or layout.param_index_map[p][1] - b_start < bucket_size
        last_full = bucket_size is not None and layout.per_bucket_numel_unpadded[b] >= bucket_size
        closed_by_next_shared = False
        if b + 1 < len(layout.bucket_indices):
            nxt = layout.bucket_params(b + 1)[0]
            closed_by_next_shared = isolate_shared and bool(getattr(nxt, "shared_embedding", False))
        assert last_full or closed_by_next_shared or b == len(layout.bucket_indices) - 1


@_SETTINGS
@given(sizes=_sizes, bucket_size=_bucket, data=st.data())
def test_default_layout_properties(
    sizes: list[int], bucket_size: int | None, data: st.DataObject
) -> None:
    shared = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    params = _make(sizes, shared)
    layout = compute_default_per_buffer_param_layout(params, bucket_size)
    _check_common(layout, params, bucket_size)
    _check_bucket_closing(layout, bucket_size, isolate_shared=False)
    # no padding: params back to back, total = sum of sizes
    placed = [layout.param_index_map[p] for p in reversed(params)]
    assert [s for s, _, _ in placed] == [0] + [e for _, e, _ in placed[:-1]]
    assert layout.numel == layout.numel_unpadded == sum(sizes)
    if bucket_size is None:
        assert len(layout.bucket_indices) == 1


@_SETTINGS
@given(sizes=_sizes, bucket_size=_bucket, dp=_dp, busbw=st.booleans(), data=st.data())
def test_distributed_optimizer_layout_properties(
    sizes: list[int], bucket_size: int | None, dp: int, busbw: bool, data: st.DataObject
) -> None:
    shared = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    params = _make(sizes, shared)
    layout = compute_distributed_optimizer_param_layout(params, bucket_size, dp, busbw)
    _check_common(layout, params, bucket_size)
    _check_bucket_closing(layout, bucket_size, isolate_shared=True)
    divisor = math.lcm(dp, 128, 2**16) if busbw else math.lcm(dp, 128)
    assert all(layout.param_index_map[p][0] % 64 == 0 for p in params)
    assert all(end % divisor == 0 for _, end in layout.bucket_indices)
    assert all((end - start) % dp == 0 for start, end in layout.bucket_indices)
    assert layout.numel % dp == 0
    assert layout.numel_unpadded <= layout.numel
    # padding is bounded: < 64 before each param, < divisor after each bucket
    slack = 63 * len(params) + (divisor - 1) * len(layout.bucket_indices)
    assert layout.numel - sum(sizes) <= slack


@_SETTINGS
@given(units=st.lists(st.integers(1, 8), min_size=1, max_size=10), bucket_size=_bucket)
def test_dp1_with_128_multiples_equals_default_layout(
    units: list[int], bucket_size: int | None
) -> None:
    # every size and thus every param/bucket end is already a multiple of 128: no padding
    params = _make([128 * u for u in units], [False] * len(units))
    default = compute_default_per_buffer_param_layout(params, bucket_size)
    dist = compute_distributed_optimizer_param_layout(params, bucket_size, 1)
    assert dist.param_index_map == default.param_index_map
    assert dist.bucket_indices == default.bucket_indices
    assert dist.per_bucket_numel_unpadded == default.per_bucket_numel_unpadded


@_SETTINGS
@given(units=st.lists(st.integers(1, 8), min_size=1, max_size=10), bucket_size=_bucket)
def test_dp1_with_64_multiples_keeps_buckets_and_local_offsets(
    units: list[int], bucket_size: int | None
) -> None:
    # param starts need no padding; only a bucket ending on an odd multiple of 64 gains 64
    params = _make([64 * u for u in units], [False] * len(units))
    default = compute_default_per_buffer_param_layout(params, bucket_size)
    dist = compute_distributed_optimizer_param_layout(params, bucket_size, 1)
    assert dist.per_bucket_numel_unpadded == default.per_bucket_numel_unpadded
    for p in params:
        d_start, _, d_bucket = default.param_index_map[p]
        o_start, _, o_bucket = dist.param_index_map[p]
        assert d_bucket == o_bucket
        assert (
            d_start - default.bucket_indices[d_bucket][0]
            == o_start - dist.bucket_indices[o_bucket][0]
        )
    for (s, e), unpadded in zip(dist.bucket_indices, dist.per_bucket_numel_unpadded, strict=True):
        assert e - s - unpadded in (0, 64)


@_SETTINGS
@given(
    sizes=_sizes,
    bucket_size=_bucket,
    dp=_dp,
    edp=_dp,
    dist_opt=st.booleans(),
    data=st.data(),
)
def test_full_layout_covers_every_param_once_per_key(
    sizes: list[int],
    bucket_size: int | None,
    dp: int,
    edp: int,
    dist_opt: bool,
    data: st.DataObject,
) -> None:
    n = len(sizes)
    expert = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    dtypes = data.draw(st.lists(st.sampled_from(_DTYPES), min_size=n, max_size=n))
    params = [
        torch.nn.Parameter(torch.empty(size, device="meta", dtype=dtype))
        for size, dtype in zip(sizes, dtypes, strict=True)
    ]
    for p, e in zip(params, expert, strict=True):
        if e:
            p.allreduce = False  # type: ignore[attr-defined]
    full = compute_full_param_layout(
        params,
        bucket_size,
        dp,
        use_distributed_optimizer=dist_opt,
        grad_reduce_in_fp32=False,
        expert_data_parallel_size=edp,
    )
    seen = [p for layout in full.layouts.values() for p in layout.param_index_map]
    assert sorted(id(p) for p in seen) == sorted(id(p) for p in params)
    for key, layout in full.layouts.items():
        members = [p for p in params if p in layout.param_index_map]
        assert all(p.dtype == key.param_dtype for p in members)
        assert all((not getattr(p, "allreduce", True)) == key.is_expert_parallel for p in members)
        key_dp = edp if key.is_expert_parallel else dp
        if dist_opt:
            assert layout.numel % key_dp == 0
        assert layout.param_indices == list(range(len(members)))
