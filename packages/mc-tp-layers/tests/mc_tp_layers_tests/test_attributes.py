"""TP/GTP attribute helpers, without processes (pure functions on tensors).

``gtp_local_pad_zero_count`` is checked on hand-derived layouts: a weight of ``d0`` rows
padded with ``p`` rows and split over G ranks of ``s`` rows puts the padding in rows
``[G·s - p, G·s)`` of the padded weight.
"""

from __future__ import annotations

import pytest
import torch

import mc_tp_layers as tpl
from mc_tp_layers.layers import (
    _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    gtp_local_pad_zero_count,
    param_is_not_gtp_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)


class _Group:
    """Only what gtp_local_pad_zero_count reads from a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _shard(rows: int, cols: int, pad: int, group: _Group | None) -> torch.Tensor:
    shard = torch.zeros(rows, cols)
    shard.pad_length = pad  # type: ignore[attr-defined]
    if group is not None:
        shard.group = group  # type: ignore[attr-defined]
    return shard


def test_pad_count_spills_into_earlier_shards() -> None:
    # 16-row shards over 4 ranks, 63 padding rows: rows 1..63 of 64 are padding, so rank 0
    # holds 15 padding rows and ranks 1-3 hold 16 each.
    counts = [
        gtp_local_pad_zero_count(_shard(16, 8, 63, _Group(4, r)), 0, 16 * 8) for r in range(4)
    ]
    assert counts == [15 * 8, 16 * 8, 16 * 8, 16 * 8]


@pytest.mark.parametrize(
    ("start", "end", "expected"), [(0, 32, 12), (0, 20, 0), (18, 32, 12), (21, 31, 10)]
)
def test_pad_count_of_a_fragment(start: int, end: int, expected: int) -> None:
    # last of 4 ranks, 8x4 shard, 3 padding rows: flat elements 20..31 are padding
    assert gtp_local_pad_zero_count(_shard(8, 4, 3, _Group(4, 3)), start, end) == expected


def test_pad_count_needs_pad_length_and_group() -> None:
    assert gtp_local_pad_zero_count(_shard(8, 4, 3, _Group(4, 0)), 0, 32) == 0  # not in rank 0
    assert gtp_local_pad_zero_count(_shard(8, 4, 3, None), 0, 32) == 0
    source = _shard(8, 4, 3, _Group(4, 3))
    copy = torch.zeros(8, 4)
    copy_gtp_attributes(copy, source)
    assert gtp_local_pad_zero_count(copy, 0, 32) == 12


def test_gtp_duplicate_tags() -> None:
    shard, replica0, replica1, plain = (torch.zeros(1) for _ in range(4))
    shard.is_gtp_weight_remat = True  # type: ignore[attr-defined]
    replica0.gtp_remat_rank = 0  # type: ignore[attr-defined]
    replica1.gtp_remat_rank = 1  # type: ignore[attr-defined]
    assert [param_is_not_gtp_duplicate(p) for p in (shard, replica0, replica1, plain)] == [
        True,
        True,
        False,
        True,
    ]


def test_tp_attribute_helpers() -> None:
    t = torch.zeros(2)
    set_defaults_if_not_set_tensor_model_parallel_attributes(t)
    # Megatron-Core's six keys and defaults (megatron/core/tensor_parallel/layers.py).
    assert {k: getattr(t, k) for k in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS} == {
        "expert_tp": False,
        "is_qkv": False,
        "qkv_split_shapes": None,
        "tensor_model_parallel": False,
        "partition_dim": -1,
        "partition_stride": 1,
    }
    u = torch.zeros(2, 2)  # split along dim 1: a 2-D tensor (dim 1 of a 1-D one is refused)
    set_tensor_model_parallel_attributes(u, True, 1, 2)
    set_tensor_model_parallel_attributes(u, True, 1, 2)  # same values again: fine
    v = torch.zeros(2)
    copy_tensor_model_parallel_attributes(v, u)
    assert (v.tensor_model_parallel, v.partition_dim, v.partition_stride) == (True, 1, 2)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="differ"):
        set_tensor_model_parallel_attributes(u, True, 0, 1)


def test_copies_keep_qkv_and_expert_tags() -> None:
    """A fused-QKV weight's ``is_qkv`` / ``qkv_split_shapes`` survive
    ``copy_tensor_model_parallel_attributes`` (Megatron copies every key of its six), and
    ``copy_gtp_attributes`` keeps ``allreduce``: an optimizer's copy of an expert shard must
    still dedup over the expert gtp_remat axis (Megatron copies is_gtp_weight_remat,
    allreduce, gtp_replica_group, pad_length)."""
    qkv = torch.zeros(6, 2)
    set_tensor_model_parallel_attributes(qkv, True, 0, 1)
    qkv.is_qkv = True  # type: ignore[attr-defined]
    qkv.qkv_split_shapes = [2, 2, 2]  # type: ignore[attr-defined]
    copy = torch.zeros(6, 2)
    copy_tensor_model_parallel_attributes(copy, qkv)
    assert (copy.is_qkv, copy.qkv_split_shapes) == (True, [2, 2, 2])  # type: ignore[attr-defined]
    assert not hasattr(copy, "expert_tp")  # absent on the source: not invented
    expert = torch.zeros(2)
    expert.allreduce = False  # type: ignore[attr-defined]
    expert.is_gtp_weight_remat = True  # type: ignore[attr-defined]
    master = torch.zeros(2)
    copy_gtp_attributes(master, expert)
    assert (master.allreduce, master.is_gtp_weight_remat) == (False, True)  # type: ignore[attr-defined]


SPEC_LAYERS_NAMES = (
    "VocabParallelEmbedding",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "param_is_not_tensor_parallel_duplicate",
    "copy_gtp_attributes",
    "param_is_not_gtp_duplicate",
    "gtp_local_pad_zero_count",
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "_initialize_affine_weight_gpu",
    "_initialize_affine_weight_cpu",
    "_linear_forward",
    "linear_with_frozen_weight",
    "_wgrad_gemm",
    "linear_with_grad_accumulation_and_async_allreduce",
    "_grad_accum_fusion_available",
    "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
)


def test_layers_module_has_every_spec_name() -> None:
    # The names listed in spec/tensor_parallel_layers.txt (core.tensor_parallel.layers).
    from mc_tp_layers import layers

    missing = [name for name in SPEC_LAYERS_NAMES if not hasattr(layers, name)]
    assert missing == []
    # Megatron's underscore helpers import from the module but stay out of __all__
    assert sorted(layers.__all__) == sorted(n for n in SPEC_LAYERS_NAMES if n[0] != "_")
    for cls in (tpl.ColumnParallelLinear, tpl.RowParallelLinear):
        for method in (
            "_forward_impl",
            "forward",
            "backward_dw",
            "sharded_state_dict",
            "set_extra_state",
            "get_extra_state",
            "extra_repr",
        ):
            assert callable(getattr(cls, method)), (cls, method)
    assert callable(tpl.VocabParallelEmbedding.sharded_state_dict)
