"""DDP on CUDA devices with NCCL: the native collective path (coalesced reduce-scatter /
all-gather instead of gloo's all-to-alls), CUDA buffers and offload.

Skipped with the reason when the CUDA devices are missing. Tolerance: |Δ| ≤ 1e-5 against
the single-process reference on the same device; cuBLAS may pick different fp32 kernels for
the local batch (6 rows) and the full one (12 rows), so sums differ in order by a few ulps
more than on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer, ensure_params_ready
from mc_ddp_tests._harness import (
    Reference,
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    max_grad_error,
    max_param_error,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools, gpu_skip_reason

_ONE, _TWO = gpu_skip_reason(1), gpu_skip_reason(2)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _parity(overlap: bool, dist_opt: bool) -> dict[str, Any]:
    device = _device()
    with model_parallel() as pgc:
        model = mlp().to(device)
        ref = Reference(model, 0.3)
        cfg = ddp_config(
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap and dist_opt,
            use_distributed_optimizer=dist_opt,
            bucket_size=16,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.3, momentum=0.9), ddp)
        grad_err, rank, ops = 0.0, dist.get_rank(), set()
        for step in range(3):
            x, y = (t.to(device) for t in global_batch(step, dist.get_world_size(), torch.float32))
            ddp.zero_grad_buffer()
            with mg.record_collectives() as log:
                ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 1)
                ddp.finish_grad_sync()
                opt.step()
            ops |= {r.op for r in log}
            ref_grads = ref.grads(x, y)
            grad_err = max(grad_err, max_grad_error(ddp, ref_grads))
            ref.step(ref_grads)
        ensure_params_ready(list(model.parameters()))
        torch.cuda.synchronize()
        return {
            "grad_err": grad_err,
            "param_err": max_param_error(model, ref.model),
            "ops": sorted(ops),
        }


@pytest.mark.gpu
@pytest.mark.skipif(_TWO is not None, reason=_TWO or "")
def test_nccl_parity_and_native_collectives(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2, "nccl")
    for overlap in (False, True):
        for dist_opt in (False, True):
            for out in pool.run(_parity, overlap, dist_opt):
                assert out["grad_err"] <= 1e-5, (overlap, dist_opt)
                assert out["param_err"] <= 1e-5, (overlap, dist_opt)
                expected = ["all_gather", "reduce_scatter"] if dist_opt else ["all_reduce"]
                assert out["ops"] == expected


def _single_device() -> dict[str, Any]:
    device = _device()
    with model_parallel() as pgc:
        cfg = ddp_config(use_distributed_optimizer=True)
        ddp = DistributedDataParallel(
            mg.ModelParallelConfig(), cfg, mlp().to(device), pg_collection=pgc
        )
        grad = ddp.buffers[0].grad_data
        on_device = grad.device == device and ddp.buffers[0].param_data is not None
        before = torch.cuda.memory_allocated()
        ddp.offload_grad_buffers()
        freed = before - torch.cuda.memory_allocated()
        ddp.restore_grad_buffers()
        return {
            "on_device": on_device,
            "freed": freed,
            "nbytes": grad.nbytes,
            "zeroed": int(torch.count_nonzero(grad)),
        }


@pytest.mark.gpu
@pytest.mark.skipif(_ONE is not None, reason=_ONE or "")
def test_cuda_buffers_offload_and_restore(rank_pools: RankPools) -> None:
    (out,) = rank_pools.get(1, "nccl").run(_single_device)
    assert out["on_device"]
    assert out["freed"] >= out["nbytes"]
    assert out["zeroed"] == 0
