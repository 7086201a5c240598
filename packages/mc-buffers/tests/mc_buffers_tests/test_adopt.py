"""Layouts that another library computed (Megatron-Core's classes, same fields) are adopted.

The stand-ins below are written from Megatron-Core's documented fields
(``megatron.core.optimizer.param_layout``: a frozen ``BufferKey`` with a fourth field
``is_managed_by_layer_wise_optimizer``, and ``PerBufferParamLayout`` / ``FullParamLayout``
dataclasses); they are other classes than mc's, which is what a Megatron user passes. The
reference is mc's own layout for the same params: buffers built from the adopted copy must
place every param exactly where mc's own layout does. A layout of Megatron's layer-wise
optimizer is derived by hand from its rules (``LayerWiseDistributedOptimizer``'s docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mc_buffers import BufferKey, FullParamLayout, ParamAndGradBuffer
from mc_buffers.adopt import as_full_param_layout, as_per_buffer_param_layout
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers.layout import compute_full_param_layout
from mc_buffers_tests._params import linears, param


@dataclass(frozen=True)
class ForeignKey:
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


@dataclass
class ForeignPerBuffer:
    param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] = field(default_factory=dict)
    bucket_indices: list[tuple[int, int]] = field(default_factory=list)
    per_bucket_numel_unpadded: list[int] = field(default_factory=list)
    param_indices: list[int] = field(default_factory=list)
    num_optimizer_shards: int | None = None


@dataclass
class ForeignFull:
    layouts: dict[ForeignKey, ForeignPerBuffer] = field(default_factory=dict)


def _foreign_copy(full: FullParamLayout) -> ForeignFull:
    out = ForeignFull()
    for key, layout in full.layouts.items():
        out.layouts[ForeignKey(key.param_dtype, key.grad_dtype, key.is_expert_parallel)] = (
            ForeignPerBuffer(
                dict(layout.param_index_map),
                list(layout.bucket_indices),
                list(layout.per_bucket_numel_unpadded),
                list(layout.param_indices),
                layout.num_optimizer_shards,
            )
        )
    return out


def test_foreign_full_layout_builds_the_same_buffers() -> None:
    params = linears(3, 33)
    ours = compute_full_param_layout(
        params, 2000, 4, use_distributed_optimizer=True, grad_reduce_in_fp32=False
    )
    adopted = as_full_param_layout(_foreign_copy(ours))
    assert isinstance(adopted, FullParamLayout)
    assert adopted == ours  # same keys (as mc's BufferKey), same fields
    buffers = build_param_and_grad_buffers(
        params,
        bucket_size=2000,
        data_parallel_size=4,
        use_distributed_optimizer=True,
        full_param_layout=_foreign_copy(ours),  # type: ignore[arg-type]
    )
    key = BufferKey(torch.float32, torch.float32, False)
    assert buffers[key].param_layout == ours.layouts[key]
    assert as_full_param_layout(ours) is ours  # mc's own: not copied


def test_foreign_per_buffer_layout_is_accepted_by_the_buffer() -> None:
    params = [param(5), param(7)]
    ours = compute_full_param_layout(
        params, None, 1, use_distributed_optimizer=False, grad_reduce_in_fp32=False
    )
    (layout,) = ours.layouts.values()
    foreign = _foreign_copy(ours).layouts.popitem()[1]
    buffer = ParamAndGradBuffer(params, param_layout=foreign)
    assert buffer.param_layout == layout
    assert as_per_buffer_param_layout(layout) is layout


def _layer_wise_layout() -> tuple[list[torch.nn.Parameter], ForeignFull]:
    """Four tagged params (100, 60, 100, 60 elements) laid out as Megatron main's
    ``LayerWiseDistributedOptimizer`` lays them out at dp = 2, derived by hand from its rules:
    backprop order p3, p2, p1, p0; placed by cost (numel for 1-D params), largest first, on
    the least-loaded shard whose 64-aligned cursor stays within 1.3 × 320 / 2 = 208: p2 → 0,
    p0 → 1 (shard 0 would reach 228), p3 → 0 (loads tie), p1 → 1. Shards padded to
    p64(188) = 192, so the bucket is [0, 384); unpadded = 320, the params' sum."""
    params = [param(n, is_managed_by_layer_wise_optimizer=True) for n in (100, 60, 100, 60)]
    p0, p1, p2, p3 = params
    key = ForeignKey(torch.float32, torch.float32, False, is_managed_by_layer_wise_optimizer=True)
    layout = ForeignPerBuffer(
        {p2: (0, 100, 0), p3: (128, 188, 0), p0: (192, 292, 0), p1: (320, 380, 0)},
        [(0, 384)],
        [320],
        [0, 1, 2, 3],
        2,
    )
    return params, ForeignFull({key: layout})


def test_layer_wise_buffers_keep_every_param_whole_in_one_shard() -> None:
    params, foreign = _layer_wise_layout()
    adopted = as_full_param_layout(foreign)
    ((key, layout),) = adopted.layouts.items()
    assert key == BufferKey(torch.float32, torch.float32, False, True)
    assert layout.per_bucket_numel_unpadded == [320]
    buffers = build_param_and_grad_buffers(
        params,
        bucket_size=None,
        data_parallel_size=2,
        use_distributed_optimizer=True,
        full_param_layout=foreign,  # type: ignore[arg-type]
    )
    (buffer,) = buffers.values()
    assert (buffer.numel, buffer.numel_unpadded) == (384, 320)
    (bucket,) = buffer.buckets
    p0, p1, p2, p3 = params
    assert bucket.params_list == [p2, p3, p0, p1]  # by start, not backprop order
    for rank, owned in ((0, [p2, p3]), (1, [p0, p1])):
        slices = bucket.shard_param_slices(rank, 2)
        assert [s.param for s in slices] == owned
        assert all(s.param_range == (0, s.param.numel()) for s in slices)  # whole params
    # each param's values moved into its place in param_data
    assert torch.equal(bucket.param_shard(1, 2)[0:100], torch.arange(100.0))
    assert torch.equal(buffer.param_data[320:380], torch.arange(60.0))  # type: ignore[index]


def test_a_type_without_the_fields_is_named_with_its_module() -> None:
    with pytest.raises(TypeError, match=r"got mc_buffers_tests\.test_adopt\.ForeignKey") as info:
        as_full_param_layout(ForeignKey(torch.float32, torch.float32, False))
    assert isinstance(info.value, AssertionError)  # as Megatron's assert isinstance
    with pytest.raises(TypeError, match=r"without \['bucket_indices'"):
        as_per_buffer_param_layout(type("Partial", (), {"param_index_map": {}})())


def test_layer_wise_legacy_param_lists_name_the_layout_path() -> None:
    """Megatron's layer-wise optimizer without a layout hands each bucket per-rank param
    lists; mc refuses that path and names the one it implements."""
    params, foreign = _layer_wise_layout()
    buffers = build_param_and_grad_buffers(
        params,
        bucket_size=None,
        data_parallel_size=2,
        use_distributed_optimizer=True,
        full_param_layout=foreign,  # type: ignore[arg-type]
    )
    (bucket,) = next(iter(buffers.values())).buckets
    with pytest.raises(NotImplementedError, match=r"full_param_layout=\.\.\.\) with"):
        bucket.set_layerwise_params_list([params[:2], params[2:]])
