"""Parity of DDP (2 gloo ranks) with a single-process reference: same init, full batch.

Localizes: bucketing, scaling (1/dp or AVG in the collective), all-reduce vs reduce-scatter
into shards, async dispatch from hooks vs at finish, no_sync accumulation, fp32 grad
buffers, and the sharded optimizer with its param all-gather (overlapped with forward when
overlap is on). Matrix: overlap × distributed optimizer × grad_reduce_in_fp32 × {fp32,
bf16} × average_in_collective × {one bucket, tiny buckets} × {1, 3 microbatches}; without
overlap every bucket size gives one bucket, so "tiny" is run with overlap only. Each of the
four tests runs its sub-cases in one rank_pools call (one world start-up).

Tolerances:
- fp32: |Δ| ≤ 1e-6 for main_grad (each of 3 steps) and params after 3 SGD steps. The only
  difference is the order of fp32 additions (two rank sums added vs one full-batch sum),
  a few ulps of values below 1 (~1e-7).
- bf16: per tensor, relative to the reference's largest magnitude: grads and params
  ≤ 2^-6 (measured: 2^-7.2 and 2^-7.5). The local grads are bf16 (8-bit mantissa, unit
  roundoff 2^-9) computed on half the batch and then reduced, the reference's on the full
  batch: both are within a few roundings of the exact grad, but a sum of cancelling terms
  can lose several bits relative to its largest term; params are rounded to bf16 after
  each step (2^-9 relative) and the next step's grads see those rounded params.
Every case also checks that 3 steps moved the params by far more than the tolerance, so the
test fails if the update were lost or scaled wrongly.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

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
from mc_groups import ModelParallelConfig
from mc_groups.testing import RankPools

LR = 0.3
STEPS = 3
TINY_BUCKET = 16  # elements: 5 buckets for the 6 params of the MLP


class Case(NamedTuple):
    overlap: bool
    grad_reduce_in_fp32: bool
    average_in_collective: bool
    tiny_buckets: bool
    microbatches: int


def _cases() -> list[Case]:
    out = []
    for overlap, fp32, avg, tiny, mb in itertools.product(
        (False, True), (False, True), (False, True), (False, True), (1, 3)
    ):
        if tiny and not overlap:
            continue  # without overlap DDP uses one bucket whatever the size
        out.append(Case(overlap, fp32, avg, tiny, mb))
    return out


def _run_case(pgc: Any, case: Case, dist_opt: bool, dtype: torch.dtype) -> dict[str, Any]:
    model = mlp(dtype)
    initial = [p.detach().float().clone() for p in model.parameters()]
    ref = Reference(model, LR)
    cfg = ddp_config(
        overlap_grad_reduce=case.overlap,
        overlap_param_gather=case.overlap and dist_opt,
        use_distributed_optimizer=dist_opt,
        grad_reduce_in_fp32=case.grad_reduce_in_fp32,
        average_in_collective=case.average_in_collective,
        bucket_size=TINY_BUCKET if case.tiny_buckets else None,
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), cfg, model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9), ddp)
    rank, relative = dist.get_rank(), dtype != torch.float32
    grad_err = 0.0
    for step in range(STEPS):
        x, y = global_batch(step, dist.get_world_size(), dtype)
        ddp.zero_grad_buffer()
        ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), case.microbatches)
        ddp.finish_grad_sync()
        ref_grads = ref.grads(x, y)
        grad_err = max(grad_err, max_grad_error(ddp, ref_grads, relative))
        opt.step()
        ref.step(ref_grads)
    ensure_params_ready(list(model.parameters()))  # overlap: the last gather is still due
    moved = max(
        float((p.detach().float() - p0).abs().max()) / (float(p0.abs().max()) if relative else 1)
        for p, p0 in zip(model.parameters(), initial, strict=True)
    )
    return {
        "case": case,
        "buckets": len(ddp.bucket_groups),
        "grad_err": grad_err,
        "param_err": max_param_error(model, ref.model, relative),
        "moved": moved,
    }


def _parity_cases(dist_opt: bool, dtype: torch.dtype) -> list[dict[str, Any]]:
    with model_parallel() as pgc:
        return [_run_case(pgc, case, dist_opt, dtype) for case in _cases()]


_TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2.0**-6, 2.0**-6)}


@pytest.mark.parametrize("dist_opt", [False, True], ids=["all_reduce", "dist_opt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_matrix(rank_pools: RankPools, dist_opt: bool, dtype: torch.dtype) -> None:
    grad_tol, param_tol = _TOLERANCE[dtype]
    results = rank_pools.get(2).run(_parity_cases, dist_opt, dtype)
    for rank_results in results:
        assert len(rank_results) == len(_cases())
        for r in rank_results:
            case = r["case"]
            assert r["buckets"] == (5 if case.tiny_buckets else 1), case
            assert r["grad_err"] <= grad_tol, (case, r["grad_err"])
            assert r["param_err"] <= param_tol, (case, r["param_err"])
            assert r["moved"] > 50 * param_tol, (case, r["moved"])
