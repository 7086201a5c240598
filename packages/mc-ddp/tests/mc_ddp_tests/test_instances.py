"""Four gloo ranks: several distributed-optimizer instances, expert-parallel params (ep = 2),
and reduce_scatter_with_fp32_accumulation on its own.

Localizes the two-stage reduction (reduce-scatter inside an instance, all-reduce of the
shard across instances) and its groups, expert grads reduced over expt_dp only with Megatron's
scaling (Σ over expt_dp / |dp_cp|), expert broadcasts over expt_dp, and the fp32 local sum
of the all-to-all reduce-scatter.

Tolerances: fp32 grads and params vs the single-process reference |Δ| ≤ 1e-6 (summation
order only); the fp32-accumulation case uses powers of two and is exact (==).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer, reduce_scatter_with_fp32_accumulation
from mc_ddp_tests._harness import (
    SCATTER_OP,
    Reference,
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    loss_fn,
    max_grad_error,
    max_param_error,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools

MP = mg.ModelParallelConfig()
LR = 0.3


def _two_instances(overlap: bool) -> dict[str, Any]:
    with model_parallel(num_distributed_optimizer_instances=2) as pgc:
        model = mlp()
        ref = Reference(model, LR)
        cfg = ddp_config(
            use_distributed_optimizer=True,
            num_distributed_optimizer_instances=2,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
            bucket_size=16,
        )
        ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9), ddp)
        grad_err, rank = 0.0, dist.get_rank()
        for step in range(2):
            x, y = global_batch(step, dist.get_world_size(), torch.float32)
            ddp.zero_grad_buffer()
            with mg.record_collectives() as log:
                ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
                ddp.finish_grad_sync()
            ref_grads = ref.grads(x, y)
            grad_err = max(grad_err, max_grad_error(ddp, ref_grads))
            opt.step()
            ref.step(ref_grads)
        ddp.start_param_sync(force_sync=True)  # overlap: publish the last step's params
        return {
            # the forward param all-gathers (overlap) are checked in test_schedules
            "schedule": [
                (r.op, r.group_ranks, r.async_op)
                for r in log
                if not r.label.startswith("param gather")
            ],
            "grad_err": grad_err,
            "param_err": max_param_error(model, ref.model),
            "shard_count": ddp.bucket_groups[0].shard.size,
        }


def test_two_optimizer_instances(rank_pools: RankPools) -> None:
    pool = rank_pools.get(4)
    for overlap in (False, True):
        for rank, out in enumerate(pool.run(_two_instances, overlap)):
            intra = (0, 1) if rank < 2 else (2, 3)  # instances are contiguous blocks of dp
            inter = (rank % 2, rank % 2 + 2)  # same shard position in each instance
            groups = 5 if overlap else 1  # without overlap: one bucket
            rs = [(SCATTER_OP, intra, overlap)] * groups
            ar = [("all_reduce", inter, False)] * groups
            # with overlap the hooks issue every reduce-scatter; the cross-instance all-reduce
            # of each group follows its wait in finish_grad_sync
            interleaved = [x for pair in zip(rs, ar, strict=True) for x in pair]
            assert out["schedule"] == (rs + ar if overlap else interleaved)
            assert out["shard_count"] == 2
            assert out["grad_err"] <= 1e-6, overlap
            assert out["param_err"] <= 1e-6, overlap


def _expert_model(ep_rank: int) -> nn.Sequential:
    model = mlp()
    torch.manual_seed(10 + ep_rank)  # each expert-parallel rank holds a different expert
    expert = nn.Linear(16, 16)
    layer: Any = model[2]
    with torch.no_grad():
        layer.weight.copy_(expert.weight)
        layer.bias.copy_(expert.bias)
    for param in layer.parameters():
        param.allreduce = False
    return model


def _local_grads(
    ep_rank: int, world_rank: int, x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    model = _expert_model(ep_rank)
    torch.autograd.backward(loss_fn(model(local_rows(x, world_rank)), local_rows(y, world_rank)))
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _experts(average: bool, dist_opt: bool) -> dict[str, Any]:
    with model_parallel(expert_model_parallel_size=2) as pgc:
        assert pgc.ep is not None
        assert pgc.expt_dp is not None
        ep_rank, world = mg.group_rank(pgc.ep), dist.get_world_size()
        model = _expert_model(ep_rank)
        cfg = ddp_config(average_in_collective=average, use_distributed_optimizer=dist_opt)
        ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc)
        x, y = global_batch(0, world, torch.float32)
        with mg.record_collectives() as log:
            ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
            ddp.finish_grad_sync()
        # dense: mean of every rank's grads; expert: sum over my expt_dp group / |dp_cp| = 4
        expt_ranks = mg.group_ranks(pgc.expt_dp)
        # ranks of my expt_dp group hold my expert; the others (ep = 2) the other one
        grads = {
            s: _local_grads(ep_rank if s in expt_ranks else 1 - ep_rank, s, x, y)
            for s in range(world)
        }
        expected: list[torch.Tensor] = []
        for i, p in enumerate(model.parameters()):
            ranks = expt_ranks if not getattr(p, "allreduce", True) else range(world)
            expected.append(torch.stack([grads[s][i] for s in ranks]).sum(0) / world)
        groups = {(r.label.split(" ")[2], r.group_ranks) for r in log}
        with mg.record_collectives() as log:
            ddp.broadcast_params()
        return {
            "err": max_grad_error(ddp, expected),
            "groups": sorted(groups),
            "expt_dp": expt_ranks,
            "broadcast_groups": [r.group_ranks for r in log],
        }


def test_expert_params_reduce_over_expert_data_parallel(rank_pools: RankPools) -> None:
    pool = rank_pools.get(4)
    for average in (False, True):
        for dist_opt in (False, True):
            for rank, out in enumerate(pool.run(_experts, average, dist_opt)):
                expt_dp = out["expt_dp"]
                assert len(expt_dp) == 2
                assert rank in expt_dp
                assert out["groups"] == [("dense", (0, 1, 2, 3)), ("expert", tuple(expt_dp))]
                assert out["err"] <= 1e-6, (average, dist_opt)
                # per param, in registration order: 0.w 0.b dense, 2.w 2.b expert, 4.w 4.b
                dense, expert = (0, 1, 2, 3), tuple(expt_dp)
                assert out["broadcast_groups"] == [dense, dense, expert, expert, dense, dense]


def _experts_with_instances(ep: int, overlap: bool) -> dict[str, Any]:
    with model_parallel(
        expert_model_parallel_size=ep, num_distributed_optimizer_instances=2
    ) as pgc:
        assert pgc.ep is not None
        assert pgc.expt_dp is not None
        assert pgc.intra_expt_dp is not None
        assert pgc.inter_expt_dp is not None
        ep_rank, world, rank = mg.group_rank(pgc.ep), dist.get_world_size(), dist.get_rank()
        model = _expert_model(ep_rank)
        before = [p.detach().clone() for p in model.parameters()]
        cfg = ddp_config(
            use_distributed_optimizer=True,
            num_distributed_optimizer_instances=2,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        )
        ddp = DistributedDataParallel(MP, cfg, model, pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), ddp)
        x, y = global_batch(0, world, torch.float32)
        ddp.zero_grad_buffer()
        with mg.record_collectives() as log:
            ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
            ddp.finish_grad_sync()
        expt_ranks = mg.group_ranks(pgc.expt_dp)
        grads = {
            s: _local_grads(ep_rank if s in expt_ranks else ep - 1 - ep_rank, s, x, y)
            for s in range(world)
        }
        expected: list[torch.Tensor] = []
        for i, p in enumerate(model.parameters()):
            ranks = expt_ranks if not getattr(p, "allreduce", True) else range(world)
            expected.append(torch.stack([grads[s][i] for s in ranks]).sum(0) / world)
        opt.step()
        ddp.start_param_sync(force_sync=True)  # overlap: publish the step's params now
        stepped = [b - LR * g for b, g in zip(before, expected, strict=True)]
        return {
            "grad_err": max_grad_error(ddp, expected),
            "param_err": max(
                float((p.detach() - q).abs().max())
                for p, q in zip(model.parameters(), stepped, strict=True)
            ),
            "expert_ops": [  # the gradient reduction of the expert bucket group
                (r.op, r.group_ranks)
                for r in log
                if r.label.startswith("grad") and "expert bucket group" in r.label
            ],
            "intra_expt_dp": mg.group_ranks(pgc.intra_expt_dp),
            "inter_expt_dp": mg.group_ranks(pgc.inter_expt_dp),
        }


def test_expert_params_with_two_optimizer_instances(rank_pools: RankPools) -> None:
    """Expert grads are reduce-scattered inside their instance's chunk of expt_dp
    (intra_expt_dp), then the shard is all-reduced with the same position in the other
    instance (inter_expt_dp): Σ over expt_dp / |dp_cp|, as with one instance; one SGD step
    matches the hand-computed update. ep = 1 (expt_dp = dp_cp: both stages have 2 ranks)
    and ep = 2 (expt_dp of 2 ranks, one per instance: a 1-rank reduce-scatter, then the
    all-reduce carries the whole reduction)."""
    pool = rank_pools.get(4)
    for ep in (1, 2):
        for overlap in (False, True):
            for out in pool.run(_experts_with_instances, ep, overlap):
                intra, inter = out["intra_expt_dp"], out["inter_expt_dp"]
                assert len(intra) * len(inter) == 4 // ep
                assert out["grad_err"] <= 1e-6, (ep, overlap)
                assert out["param_err"] <= 1e-6, (ep, overlap)
                stages = [] if len(intra) == 1 else [(SCATTER_OP, intra)]
                assert out["expert_ops"] == [*stages, ("all_reduce", inter)], (ep, overlap)


def _fp32_accumulation(op: str) -> list[float]:
    rank = dist.get_rank()
    world = dist.group.WORLD
    assert world is not None
    value = {0: 1.0, 1: 2.0**-8, 2: 2.0**-8, 3: 0.0}[rank]
    flat = torch.full((8,), value, dtype=torch.bfloat16)
    shard = flat[rank * 2 : (rank + 1) * 2]
    with mg.record_collectives() as log:
        reduce_scatter_with_fp32_accumulation(
            shard, flat, world, op=mg.ReduceOp[op], async_op=True
        ).wait()
    assert [(r.op, r.dtype, r.numel) for r in log] == [("all_to_all", torch.bfloat16, 8)]
    return [float(v) for v in shard]


def test_reduce_scatter_with_fp32_accumulation(rank_pools: RankPools) -> None:
    # exact sum 1 + 2^-8 + 2^-8 = 1 + 2^-7, a bf16 number; a bf16 running sum could stop at 1
    pool = rank_pools.get(4)
    assert pool.run(_fp32_accumulation, "SUM") == [[1.0 + 2.0**-7] * 2] * 4
    assert pool.run(_fp32_accumulation, "AVG") == [[(1.0 + 2.0**-7) / 4] * 2] * 4
