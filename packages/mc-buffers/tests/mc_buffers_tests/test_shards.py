"""Per-shard views of a bucket: hand-derived slices, and a 2-rank gloo check that the
views are what a real reduce-scatter writes and an all-gather reads.

Gradients are ``(rank + 1)·v`` for fp32 values ``v``; the sum over 2 ranks, ``v + 2v``,
and the reference ``3·v`` are both the correctly rounded ``3v``, so comparisons are exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import ParamAndGradBuffer, shard_buffer
from mc_buffers.buffer import ShardParamSlice
from mc_buffers_tests._params import linears, param
from mc_groups.testing import RankPools


def test_shard_param_slices_by_hand() -> None:
    p0, p1 = param(100), param(20)
    buf = ParamAndGradBuffer([p0, p1], use_distributed_optimizer=True, data_parallel_size=2)
    # p1 0..20, p0 p64(20) = 64..164, bucket p128(164) = 256 -> shards [0, 128), [128, 256)
    bucket = buf.buckets[0]
    assert bucket.shard_range(1, 2) == (128, 256)
    assert bucket.shard_param_slices(0, 2) == [
        ShardParamSlice(p1, (0, 20), (0, 20), (0, 20)),
        ShardParamSlice(p0, (0, 64), (64, 128), (64, 128)),
    ]
    assert bucket.shard_param_slices(1, 2) == [ShardParamSlice(p0, (64, 100), (128, 164), (0, 36))]
    # four shards of 64: shard 2 = [128, 192) holds p0's tail, shard 3 only padding
    assert bucket.shard_param_slices(2, 4) == [ShardParamSlice(p0, (64, 100), (128, 164), (0, 36))]
    assert bucket.shard_param_slices(3, 4) == []
    assert bucket.grad_shard(1, 2).data_ptr() == buf.grad_data[128:].data_ptr()


def test_shard_buffer_views() -> None:
    flat = torch.arange(12.0)
    shards = shard_buffer(flat, 3)
    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    shards[2].zero_()
    assert flat[8:].sum().item() == 0


def _sync_through_shard_views() -> dict[str, Any]:
    group, rank = dist.group.WORLD, dist.get_rank()
    assert group is not None
    ps = linears(3, width=10, bias=True, seed=1)
    reference = [p.detach().clone() for p in ps]
    buf = ParamAndGradBuffer(
        ps, bucket_size=150, use_distributed_optimizer=True, data_parallel_size=2
    )
    for p in ps:
        p.main_grad.copy_(p.detach() * (rank + 1))  # type: ignore[attr-defined]
    with mg.record_collectives() as log:
        for bucket in buf.buckets:
            mg.reduce_scatter(bucket.grad_shard(rank, 2), bucket.grad_data, group)
            assert bucket.param_data is not None
            bucket.param_shard(rank, 2).fill_(rank + 1)
            mg.all_gather(bucket.param_data, bucket.param_shard(rank, 2), group)
    grads_ok, owners_ok = True, True
    for bucket in buf.buckets:
        for piece in bucket.shard_param_slices(rank, 2):
            ref = reference[[id(p) for p in ps].index(id(piece.param))].view(-1)
            got = bucket.grad_data[piece.bucket_range[0] : piece.bucket_range[1]]
            grads_ok &= torch.equal(got, 3 * ref[piece.param_range[0] : piece.param_range[1]])
        expected = {id(p): torch.zeros(p.numel()) for p in bucket.params_list}
        for shard in range(2):
            for piece in bucket.shard_param_slices(shard, 2):
                expected[id(piece.param)][piece.param_range[0] : piece.param_range[1]] = shard + 1
        for p in bucket.params_list:
            owners_ok &= torch.equal(p.detach().view(-1), expected[id(p)])
    return {
        "grads_ok": grads_ok,
        "owners_ok": owners_ok,
        "ops": [(r.op, r.numel) for r in log],
        "bucket_numels": [b.numel for b in buf.buckets],
    }


def test_shard_views_match_real_reduce_scatter_and_all_gather(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_sync_through_shard_views):
        assert out["grads_ok"]
        assert out["owners_ok"]
        # reduce-scatter records its full input, all-gather this rank's shard
        expected = []
        for n in out["bucket_numels"]:
            expected += [("reduce_scatter", n), ("all_gather", n // 2)]
        assert out["ops"] == expected
        assert len(out["bucket_numels"]) > 1
