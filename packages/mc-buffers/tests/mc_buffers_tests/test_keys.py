"""Grouping params into buffer keys: dtype pairs, expert flag, layer-wise tag, per-key indices
and order; keys interchangeable with Megatron-Core main's ``BufferKey``.

Pure bookkeeping, compared exactly against hand-listed expectations.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mc_buffers import BufferKey, group_params_for_buffers
from mc_buffers.keys import is_expert_parallel_param
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


@dataclass(frozen=True)
class _MegatronStyleKey:
    """Megatron-Core main's ``BufferKey`` as it is written: another frozen dataclass with the
    same four fields in the same order (so its hash is the hash of the field tuple)."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


def test_fourth_field_defaults_to_megatrons_false() -> None:
    key = BufferKey(BF16, FP32, False)
    assert key.is_managed_by_layer_wise_optimizer is False
    assert key != BufferKey(BF16, FP32, False, True)
    assert len({key, BufferKey(BF16, FP32, False, True)}) == 2


@pytest.mark.parametrize("layer_wise", [False, True])
@pytest.mark.parametrize("expert", [False, True])
def test_keys_are_interchangeable_with_megatrons(expert: bool, layer_wise: bool) -> None:
    ours, theirs = (
        BufferKey(BF16, FP32, expert, layer_wise),
        _MegatronStyleKey(BF16, FP32, expert, layer_wise),
    )
    assert ours == theirs  # mc's __eq__
    assert theirs == ours  # Megatron's returns NotImplemented, Python asks mc's
    assert (ours != theirs, theirs != ours) == (False, False)
    assert hash(ours) == hash(theirs)
    theirs_map: dict[object, str] = {theirs: "megatron"}
    ours_map: dict[object, str] = {ours: "mc"}
    assert theirs_map[ours] == "megatron"  # mc key into Megatron's layouts
    assert ours_map[theirs] == "mc"  # and back
    assert {ours} == {theirs}
    other = _MegatronStyleKey(BF16, FP32, expert, not layer_wise)
    assert ours != other
    assert other != ours
    assert other not in {ours: 1}


def test_a_three_field_object_or_a_tuple_is_not_a_key() -> None:
    key = BufferKey(BF16, FP32, False)
    three = type("Old", (), {"param_dtype": BF16, "grad_dtype": FP32, "is_expert_parallel": False})
    assert key != three()
    assert key != (BF16, FP32, False, False)


def test_layer_wise_tag_gives_its_own_buffer_key() -> None:
    # Megatron's tag_params_for_buffer_routing marks the matrices Muon steps; the rest (here
    # a bias) share the dtypes but get a buffer of their own
    matrix, bias, plain = meta_param(16), meta_param(4), meta_param(8)
    matrix.is_managed_by_layer_wise_optimizer = True  # type: ignore[attr-defined]
    bias.is_managed_by_layer_wise_optimizer = False  # type: ignore[attr-defined]
    groups = group_params_for_buffers([matrix, bias, plain], grad_reduce_in_fp32=True)
    assert list(groups) == [BufferKey(FP32, FP32, False, True), BufferKey(FP32, FP32, False)]
    assert _ids(groups[BufferKey(FP32, FP32, False, True)][0]) == _ids([matrix])
    assert _ids(groups[BufferKey(FP32, FP32, False)][0]) == _ids([bias, plain])
    assert groups[BufferKey(FP32, FP32, False)][1] == [0, 1]


def test_a_non_bool_layer_wise_tag_is_refused() -> None:
    p = meta_param(4)
    p.is_managed_by_layer_wise_optimizer = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="is_managed_by_layer_wise_optimizer=1"):
        group_params_for_buffers([p], grad_reduce_in_fp32=False)
