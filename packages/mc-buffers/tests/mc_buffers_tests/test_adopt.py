"""Layouts that another library computed (Megatron-Core's classes, same fields) are adopted.

The stand-ins below are written from Megatron-Core's documented fields
(``megatron.core.optimizer.param_layout``: a frozen ``BufferKey`` with a fourth field
``is_managed_by_layer_wise_optimizer``, and ``PerBufferParamLayout`` / ``FullParamLayout``
dataclasses); they are other classes than mc's, which is what a Megatron user passes. The
reference is mc's own layout for the same params: buffers built from the adopted copy must
place every param exactly where mc's own layout does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mc_buffers import (
    BufferKey,
    FullParamLayout,
    ParamAndGradBuffer,
    as_full_param_layout,
    as_per_buffer_param_layout,
    build_param_and_grad_buffers,
    compute_full_param_layout,
)
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


def test_layer_wise_buffers_are_refused_by_name() -> None:
    params = [param(4)]
    ours = _foreign_copy(
        compute_full_param_layout(
            params, None, 1, use_distributed_optimizer=False, grad_reduce_in_fp32=False
        )
    )
    ((key, value),) = ours.layouts.items()
    ours.layouts = {
        ForeignKey(
            key.param_dtype, key.grad_dtype, False, is_managed_by_layer_wise_optimizer=True
        ): value
    }
    with pytest.raises(NotImplementedError, match="LayerWiseDistributedOptimizer"):
        as_full_param_layout(ours)


def test_a_type_without_the_fields_is_named_with_its_module() -> None:
    with pytest.raises(TypeError, match=r"got mc_buffers_tests\.test_adopt\.ForeignKey") as info:
        as_full_param_layout(ForeignKey(torch.float32, torch.float32, False))
    assert isinstance(info.value, AssertionError)  # as Megatron's assert isinstance
    with pytest.raises(TypeError, match=r"without \['bucket_indices'"):
        as_per_buffer_param_layout(type("Partial", (), {"param_index_map": {}})())
