"""Grouping params into buffer keys: dtype pairs, expert flag, per-key indices and order.

Pure bookkeeping, compared exactly against hand-listed expectations.
"""

from __future__ import annotations

import pytest
import torch

from mc_buffers import BufferKey, group_params_for_buffers, is_expert_parallel_param
from mc_buffers_tests._params import meta_param

BF16, FP32 = torch.bfloat16, torch.float32


def _ids(params: list[torch.nn.Parameter]) -> list[int]:
    return [id(p) for p in params]


def _params(specs: list[tuple[torch.dtype, bool]]) -> list[torch.nn.Parameter]:
    out = []
    for dtype, expert in specs:
        p = torch.nn.Parameter(torch.empty(4, device="meta", dtype=dtype))
        if expert:
            p.allreduce = False  # type: ignore[attr-defined]
        out.append(p)
    return out


def test_keys_without_fp32_reduction_follow_param_dtype() -> None:
    ps = _params([(BF16, False), (FP32, False), (BF16, True), (BF16, False), (BF16, True)])
    groups = group_params_for_buffers(ps, grad_reduce_in_fp32=False)
    assert list(groups) == [
        BufferKey(BF16, BF16, False),
        BufferKey(FP32, FP32, False),
        BufferKey(BF16, BF16, True),
    ]
    assert _ids(groups[BufferKey(BF16, BF16, False)][0]) == _ids([ps[0], ps[3]])
    assert groups[BufferKey(BF16, BF16, False)][1] == [0, 1]
    assert _ids(groups[BufferKey(FP32, FP32, False)][0]) == _ids([ps[1]])
    assert groups[BufferKey(FP32, FP32, False)][1] == [0]
    assert _ids(groups[BufferKey(BF16, BF16, True)][0]) == _ids([ps[2], ps[4]])
    assert groups[BufferKey(BF16, BF16, True)][1] == [0, 1]


def test_fp32_reduction_makes_every_grad_dtype_fp32() -> None:
    ps = _params([(BF16, False), (FP32, False), (BF16, True), (BF16, False)])
    groups = group_params_for_buffers(iter(ps), grad_reduce_in_fp32=True)
    assert list(groups) == [
        BufferKey(BF16, FP32, False),
        BufferKey(FP32, FP32, False),
        BufferKey(BF16, FP32, True),
    ]
    assert _ids(groups[BufferKey(BF16, FP32, False)][0]) == _ids([ps[0], ps[3]])


def test_expert_flag_reads_allreduce_attribute() -> None:
    dense, expert, explicit = meta_param(1), meta_param(1, allreduce=False), meta_param(1)
    explicit.allreduce = True  # type: ignore[attr-defined]
    assert [is_expert_parallel_param(p) for p in (dense, expert, explicit)] == [
        False,
        True,
        False,
    ]


def test_keys_are_frozen_and_hashable() -> None:
    key = BufferKey(BF16, FP32, False)
    assert {key: 1}[BufferKey(BF16, FP32, False)] == 1
    with pytest.raises(AttributeError):
        key.is_expert_parallel = True  # type: ignore[misc]
