"""``discard_grad_sync()`` after a backward that raised part-way (2 gloo ranks, the MLP,
overlapped reduction, with and without the distributed optimizer).

Localizes the recovery, in the two states a failed backward can leave:
- a later iteration, 16-element buckets: the failure (a hook on the first layer) comes after
  the hooks issued the reductions of the later layers' buckets, so ``zero_grad_buffer()``
  refuses and names ``discard_grad_sync()``, which drains them without issuing anything;
- the first iteration, one bucket: the hooks are still learning how often each param becomes
  ready and have seen only some params, so ``zero_grad_buffer()`` refuses to learn from the
  partial counts (naming ``discard_grad_sync()``), which forgets them.
The retried step then matches the run that never failed exactly: params compared with
``torch.equal`` after 3 SGD steps (same arithmetic, same order).

Also the misuse of issue 16 refused between two steps (a second optimizer step, a NaN
scale, finalizing twice, ``force_all_reduce`` after the shards were final, every write
while the grads are offloaded, a step on the gradients an offload discarded): each raises
and the run stays bit-identical to the clean one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer, ensure_params_ready
from mc_ddp_tests._harness import (
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools, error_kind

STEPS = 3


class _Boom(RuntimeError):
    pass


def _step(ddp: Any, opt: ShardedOptimizer, step: int) -> None:
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    ddp.zero_grad_buffer()
    ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
    ddp.finish_grad_sync()
    opt.step()


def _fail(ddp: Any, opt: ShardedOptimizer, step: int) -> dict[str, Any]:
    def boom(*_: Any) -> None:
        raise _Boom("injected")

    handle = ddp.module[0].register_full_backward_pre_hook(boom)
    with mg.record_collectives() as log, pytest.raises(_Boom):
        _step(ddp, opt, step)
    handle.remove()
    refusal = ""
    try:
        ddp.zero_grad_buffer()
    except RuntimeError as err:
        refusal = str(err)
    with mg.record_collectives() as discard_log:
        ddp.discard_grad_sync()
    issued = sum(r.label.startswith("grad reduce") for r in log)
    return {"refusal": refusal, "issued": issued, "discard_issued": len(discard_log)}


def _run(distributed_optimizer: bool, bucket_size: int | None, fail_at: int | None) -> Any:
    with model_parallel() as pgc:
        cfg = ddp_config(
            overlap_grad_reduce=True,
            use_distributed_optimizer=distributed_optimizer,
            bucket_size=bucket_size,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, mlp(), pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), ddp)
        failure: dict[str, Any] = {}
        for step in range(STEPS):
            if step == fail_at:
                failure = _fail(ddp, opt, step)
            _step(ddp, opt, step)
        ensure_params_ready(list(ddp.parameters()))
        return {"params": [p.detach().clone() for p in ddp.module.parameters()], **failure}


# (bucket size, failing step): a later iteration with reductions in flight; the first one
CASES = [(16, 1), (None, 0)]


def failed_steps() -> list[tuple[Any, Any]]:
    """Runs on each rank: per sharding and case, the clean run and the failed-and-retried
    one."""
    return [
        (_run(dist_opt, bucket, None), _run(dist_opt, bucket, fail_at))
        for dist_opt in (False, True)
        for bucket, fail_at in CASES
    ]


def test_discard_grad_sync_recovers_a_failed_backward(rank_pools: RankPools) -> None:
    for results in rank_pools.get(2).run(failed_steps):
        for i, (clean, failed) in enumerate(results):
            pairs = zip(failed["params"], clean["params"], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), i
            assert failed["discard_issued"] == 0
            assert "discard_grad_sync()" in failed["refusal"], failed["refusal"]
            if CASES[i % 2][1] == 1:
                assert failed["issued"] >= 1  # reductions were in flight at the failure
                assert failed["refusal"].startswith("zero_grad_buffer(): gradient reductions")
            else:
                assert failed["issued"] == 0  # the first iteration only learns the counts
                assert "got no gradient in the first iteration" in failed["refusal"]


def _misuse(ddp: Any, opt: ShardedOptimizer, step: int) -> list[str]:
    """After a complete step: each misuse of issue 16 §1/§4 must raise and change nothing."""
    x, _ = global_batch(step, dist.get_world_size(), torch.float32)
    rows = local_rows(x, dist.get_rank())
    attempts = [
        opt.step,  # a second step on the same gradients
        lambda: ddp.scale_gradients(float("nan")),
        ddp.mark_grads_finalized,  # twice (the first call below succeeds)
        lambda: ddp.finish_grad_sync(force_all_reduce=True),  # shards already final (dist-opt)
        ddp.offload_grad_buffers,
        lambda: ddp(rows),  # autograd on, grads offloaded
        lambda: ddp.module(rows).sum().backward(),  # the hooks refuse to write
        lambda: ddp.params_with_grad[0].main_grad.add_(1.0),
        opt.step,  # offloaded
        ddp.restore_grad_buffers,
        opt.step,  # the iteration's grads were discarded by the offload
    ]
    ddp.mark_grads_finalized()
    errors = []
    for attempt in attempts:
        try:
            attempt()
        except (RuntimeError, ValueError) as err:
            errors.append(f"{error_kind(err)}: {err}")
    ddp.discard_grad_sync()  # drops the .grad the refused backward may have left
    return errors


def _misused_run(distributed_optimizer: bool, misuse: bool) -> dict[str, Any]:
    with model_parallel() as pgc:
        cfg = ddp_config(
            overlap_grad_reduce=True,
            use_distributed_optimizer=distributed_optimizer,
            bucket_size=16,
        )
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, mlp(), pg_collection=pgc)
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), ddp)
        errors: list[str] = []
        for step in range(STEPS):
            _step(ddp, opt, step)
            if misuse and step == 1:
                errors = _misuse(ddp, opt, step)
        ensure_params_ready(list(ddp.parameters()))
        return {"params": [p.detach().clone() for p in ddp.module.parameters()], "errors": errors}


def misused_runs() -> list[tuple[Any, Any]]:
    """Per sharding: the clean run and the run with every misuse refused after step 1."""
    return [(_misused_run(d, False), _misused_run(d, True)) for d in (False, True)]


def test_refused_misuse_leaves_the_run_bit_identical(rank_pools: RankPools) -> None:
    for results in rank_pools.get(2).run(misused_runs):
        for dist_opt, (clean, misused) in zip((False, True), results, strict=True):
            pairs = zip(misused["params"], clean["params"], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), dist_opt
            expected = [
                "RuntimeError: step(): this optimizer already stepped",
                "ValueError: scaling_factor=nan must be finite",
                "RuntimeError: mark_grads_finalized(): this iteration's gradients were already",
                *(
                    ["RuntimeError: finish_grad_sync(force_all_reduce=True) after"]
                    if dist_opt
                    else []
                ),
                "RuntimeError: forward with autograd on while the grad buffers are offloaded",
                "RuntimeError: backward: the gradient of '4.bias' has no memory to go to",
                "RuntimeError: aten.add_.Tensor: main_grad of '0.weight'",
                "RuntimeError: step(): the grad buffers are offloaded",
                "RuntimeError: step(): offload_grad_buffers() discarded this iteration's gradients",
            ]
            assert len(misused["errors"]) == len(expected), misused["errors"]
            for got, want in zip(misused["errors"], expected, strict=True):
                assert got.startswith(want), (got, want)
