"""Layouts against hand-derived offsets: the issue's worked example and variations.

Exact integer arithmetic, no tolerance. Notation in the comments: ``p64(x)`` is the next
multiple of 64 at or after x, ``p128(x)`` of 128. A Linear(95, 95) weight has 9025 =
141·64 + 1 elements, so a param after it starts 9088 = 142·64 later.
"""

from __future__ import annotations

import pytest
import torch

from mc_buffers import BufferKey, compute_default_per_buffer_param_layout
from mc_buffers.layout import compute_distributed_optimizer_param_layout, compute_full_param_layout
from mc_buffers_tests._params import linears, meta_param

W = 9025  # elements of one Linear(95, 95) weight


def test_worked_example_default_layout() -> None:
    ps = linears(10)
    layout = compute_default_per_buffer_param_layout(ps, bucket_size=9050)
    # one weight (9025) is < 9050, two (18050) close the bucket: 5 buckets of 2 weights
    assert layout.bucket_indices == [(k * 18050, (k + 1) * 18050) for k in range(5)]
    assert layout.per_bucket_numel_unpadded == [18050] * 5
    # reverse order: the last param sits at 0 in bucket 0
    assert layout.param_index_map[ps[9]] == (0, W, 0)
    assert layout.param_index_map[ps[8]] == (W, 2 * W, 0)
    assert layout.param_index_map[ps[0]] == (9 * W, 10 * W, 4)
    assert layout.numel == layout.numel_unpadded == 10 * W
    assert layout.num_optimizer_shards is None


def test_worked_example_distributed_optimizer_layout_dp2() -> None:
    ps = linears(10)
    layout = compute_distributed_optimizer_param_layout(ps, 9050, data_parallel_size=2)
    # bucket k: [18176k, +W) then p64 -> +9088 .. +9088+W = 18113; end p128(18113) = 18176
    assert layout.bucket_indices == [(k * 18176, (k + 1) * 18176) for k in range(5)]
    assert layout.per_bucket_numel_unpadded == [18113] * 5
    assert layout.param_index_map[ps[9]] == (0, W, 0)
    assert layout.param_index_map[ps[8]] == (9088, 9088 + W, 0)
    assert layout.param_index_map[ps[7]] == (18176, 18176 + W, 1)
    assert layout.param_index_map[ps[0]] == (4 * 18176 + 9088, 4 * 18176 + 9088 + W, 4)
    assert layout.num_optimizer_shards == 2


@pytest.mark.parametrize(
    ("dp", "bucket"),
    [
        (1, 18176),
        (2, 18176),
        (4, 18176),
        (8, 18176),  # lcm(dp, 128) = 128 for dp | 128: p128(18113) = 142·128
        (3, 18432),  # lcm = 384: 18113 = 47·384 + 65 -> 48·384
        (512, 18432),  # lcm = 512: 18113 = 35·512 + 193 -> 36·512
    ],
)
def test_worked_example_bucket_padding_per_dp(dp: int, bucket: int) -> None:
    layout = compute_distributed_optimizer_param_layout(linears(10), 9050, dp)
    assert layout.bucket_indices == [(k * bucket, (k + 1) * bucket) for k in range(5)]
    assert layout.per_bucket_numel_unpadded == [18113] * 5
    assert layout.numel % dp == 0


def test_worked_example_high_busbw_padding() -> None:
    ps = linears(10)
    layout = compute_distributed_optimizer_param_layout(ps, 9050, 2, True)
    # divisor lcm(2, 128, 2**16) = 65536; each bucket still holds 18113 elements
    assert layout.bucket_indices == [(k * 65536, (k + 1) * 65536) for k in range(5)]
    assert layout.per_bucket_numel_unpadded == [18113] * 5
    assert layout.param_index_map[ps[7]] == (65536, 65536 + W, 1)
    assert layout.param_index_map[ps[6]] == (65536 + 9088, 65536 + 9088 + W, 1)


def test_bucket_size_none_is_one_bucket() -> None:
    ps = linears(10)
    default = compute_default_per_buffer_param_layout(ps, None)
    assert default.bucket_indices == [(0, 10 * W)]
    dist = compute_distributed_optimizer_param_layout(ps, None, 2)
    # starts at 9088·k; last end 9·9088 + 9025 = 90817; p128 -> 710·128 = 90880
    assert [dist.param_index_map[p][0] for p in reversed(ps)] == [9088 * k for k in range(10)]
    assert dist.bucket_indices == [(0, 90880)]
    assert dist.per_bucket_numel_unpadded == [90817]


def test_bucket_size_one_gives_each_param_a_bucket() -> None:
    ps = linears(3)
    assert compute_default_per_buffer_param_layout(ps, 1).bucket_indices == [
        (0, W),
        (W, 2 * W),
        (2 * W, 3 * W),
    ]
    # each bucket p128(9025) = 71·128 = 9088
    dist = compute_distributed_optimizer_param_layout(ps, 1, 2)
    assert dist.bucket_indices == [(0, 9088), (9088, 18176), (18176, 27264)]
    assert dist.per_bucket_numel_unpadded == [W] * 3


def test_bias_params_are_padded_between() -> None:
    ps = linears(2, bias=True)  # w0, b0, w1, b1 -> laid out b1, w1, b0, w0
    w0, b0, w1, b1 = ps
    default = compute_default_per_buffer_param_layout(ps, None)
    assert [default.param_index_map[p][:2] for p in (b1, w1, b0, w0)] == [
        (0, 95),
        (95, 9120),
        (9120, 9215),
        (9215, 18240),
    ]
    dist = compute_distributed_optimizer_param_layout(ps, None, 5)
    # b1 0..95; w1 p64(95)=128..9153; b0 p64(9153)=9216..9311; w0 p64(9311)=9344..18369
    assert [dist.param_index_map[p][:2] for p in (b1, w1, b0, w0)] == [
        (0, 95),
        (128, 9153),
        (9216, 9311),
        (9344, 18369),
    ]
    # lcm(5, 128) = 640: 18369 = 28·640 + 449 -> 29·640 = 18560
    assert dist.bucket_indices == [(0, 18560)]
    assert dist.per_bucket_numel_unpadded == [18369]


def _tied_model() -> list[torch.nn.Parameter]:
    # embedding (shared), two small weights, output layer tied to the embedding (shared)
    return [
        meta_param(800, shared_embedding=True),
        meta_param(64),
        meta_param(30),
        meta_param(800, shared_embedding=True),
    ]


def test_shared_embedding_gets_its_own_bucket() -> None:
    emb, w1, w2, out = _tied_model()
    dist = compute_distributed_optimizer_param_layout([emb, w1, w2, out], None, 2)
    # out 0..800 alone -> p128(800) = 896; w2 896..926; w1 p64(926)=960..1024;
    # emb closes the open bucket at p128(1024) = 1024, then 1024..1824 -> p128 = 1920
    assert dist.param_index_map[out] == (0, 800, 0)
    assert dist.param_index_map[w2] == (896, 926, 1)
    assert dist.param_index_map[w1] == (960, 1024, 1)
    assert dist.param_index_map[emb] == (1024, 1824, 2)
    assert dist.bucket_indices == [(0, 896), (896, 1024), (1024, 1920)]
    assert dist.per_bucket_numel_unpadded == [800, 128, 800]


def test_shared_embedding_is_not_isolated_in_default_layout() -> None:
    emb, w1, w2, out = _tied_model()
    default = compute_default_per_buffer_param_layout([emb, w1, w2, out], None)
    assert default.bucket_indices == [(0, 1694)]  # 800 + 30 + 64 + 800
    assert default.param_index_map[emb] == (894, 1694, 0)


def test_bucket_closed_by_shared_embedding_counts_to_its_padded_start() -> None:
    # w (100) then a shared embedding: Megatron-Core pads the embedding's start to
    # p64(100) = 128 and closes the open bucket there, so its unpadded size is 128 (its
    # distributed-optimizer checkpoints read these sizes); the embedding's own bucket ends
    # at its last element (10).
    emb, w = meta_param(10, shared_embedding=True), meta_param(100)
    dist = compute_distributed_optimizer_param_layout([emb, w], None, 1)
    assert dist.per_bucket_numel_unpadded == [128, 10]
    assert dist.bucket_indices == [(0, 128), (128, 256)]
    assert dist.param_index_map[w] == (0, 100, 0)
    assert dist.param_index_map[emb] == (128, 138, 1)


def test_full_layout_splits_keys_and_uses_expert_dp() -> None:
    dense = [meta_param(100), meta_param(100)]
    experts = [meta_param(100, allreduce=False), meta_param(100, allreduce=False)]
    params = [dense[0], experts[0], dense[1], experts[1]]
    full = compute_full_param_layout(
        params,
        None,
        2,
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        expert_data_parallel_size=3,
    )
    dense_key = BufferKey(torch.float32, torch.float32, False)
    expert_key = BufferKey(torch.float32, torch.float32, True)
    assert list(full.layouts) == [dense_key, expert_key]
    # 0..100, p64 -> 128..228; dense p128(228) = 256, expert lcm(3, 128) = 384
    assert full.layouts[dense_key].bucket_indices == [(0, 256)]
    assert full.layouts[expert_key].bucket_indices == [(0, 384)]
    assert full.layouts[expert_key].num_optimizer_shards == 3
    assert full.layouts[expert_key].param_index_map[experts[1]] == (0, 100, 0)
    assert full.layouts[dense_key].param_indices == [0, 1]


def test_full_layout_default_mode_needs_no_expert_dp() -> None:
    params = [meta_param(100), meta_param(7, allreduce=False)]
    full = compute_full_param_layout(
        params, 50, 4, use_distributed_optimizer=False, grad_reduce_in_fp32=False
    )
    assert [lay.bucket_indices for lay in full.layouts.values()] == [[(0, 100)], [(0, 7)]]


def test_full_layout_bf16_params_with_fp32_grads_group_by_param_dtype() -> None:
    bf16 = torch.nn.Parameter(torch.empty(10, device="meta", dtype=torch.bfloat16))
    fp32 = meta_param(10)
    full = compute_full_param_layout(
        [bf16, fp32], None, 1, use_distributed_optimizer=False, grad_reduce_in_fp32=True
    )
    assert list(full.layouts) == [
        BufferKey(torch.bfloat16, torch.float32, False),
        BufferKey(torch.float32, torch.float32, False),
    ]


def test_bucket_params_lists_members_in_backprop_order() -> None:
    ps = linears(4)
    layout = compute_default_per_buffer_param_layout(ps, 9050)
    assert [id(p) for p in layout.bucket_params(0)] == [id(ps[3]), id(ps[2])]
    assert [id(p) for p in layout.bucket_params(1)] == [id(ps[1]), id(ps[0])]
