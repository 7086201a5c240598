"""The one-GPU tier of mc-ddp: DDP on a single CUDA device, each case run on CPU too (same
function, same single-process reference), so only the ``cuda`` variants need the GPU.

NCCL refuses two ranks on one device, so the device is used two ways:
- dp = 1 over NCCL (a world of one): the buffers, hooks and state machines on CUDA. The
  collective layer skips a one-rank group (nothing to reduce), so what runs is mc's own
  schedule: bucket groups dispatched from the backward hooks (overlap, from the second
  iteration on), the distributed optimizer's param gather dispatched and waited for by the
  forward pre-hooks, offload/restore (grads freed, params to pinned host memory) and
  ``ensure_params_ready`` as a no-op under CUDA-graph capture;
- dp = 2 as two gloo ranks sharing ``cuda:0``: the real bucketed all-reduce on CUDA grad
  buffers, dispatched from the hooks. The distributed optimizer's reduce-scatter and
  all-gather run on gloo as all-to-all and point-to-point exchanges, which gloo does not do
  on CUDA tensors: they stay with the two-GPU NCCL tests (``test_nccl.py``).

Tolerance: |Δ| ≤ 1e-5 against the single-process reference on the same device (the local
batch is summed per micro-batch, the reference over the full batch: another summation
order; cuBLAS may pick other fp32 kernels for the two shapes).
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

_REASON = gpu_skip_reason(1)
_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
TOLERANCE = 1e-5
LR = 0.3


def devices() -> list[Any]:
    """``cpu`` always; ``cuda`` marked ``gpu`` and skipped with the reason without one."""
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=_ON_GPU)]


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend(kind: str) -> str:
    """One rank per device: NCCL on CUDA, gloo on CPU."""
    return "nccl" if kind == "cuda" else "gloo"


def _wrap(
    kind: str, pgc: mg.ProcessGroupCollection, *, overlap: bool, dist_opt: bool
) -> tuple[DistributedDataParallel, ShardedOptimizer, Reference]:
    model = mlp().to(_device(kind))
    ref = Reference(model, LR)
    cfg = ddp_config(
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and dist_opt,
        use_distributed_optimizer=dist_opt,
        bucket_size=16,  # one bucket group per param or two: several to dispatch
    )
    ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
    opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9), ddp)
    return ddp, opt, ref


def _step(
    ddp: DistributedDataParallel, opt: ShardedOptimizer, ref: Reference, step: int, kind: str
) -> dict[str, Any]:
    """One iteration (2 micro-batches) with what the schedule looked like at each point."""
    device, rank, world = _device(kind), dist.get_rank(), dist.get_world_size()
    x, y = (t.to(device) for t in global_batch(step, world, torch.float32))
    groups = ddp.bucket_groups
    ddp.zero_grad_buffer()
    gathered_before = [g.param_gather_dispatched for g in groups]
    with mg.record_collectives() as log:
        ddp_backward(ddp, local_rows(x, rank), local_rows(y, rank), 2)  # forwards run here
        gathered_after = [g.param_gather_dispatched for g in groups]
        from_hooks = [g.grad_reduce_handle is not None for g in groups]
        ddp.finish_grad_sync()
        ref_grads = ref.grads(x, y)
        grad_err = max_grad_error(ddp, ref_grads)
        opt.step()
    ref.step(ref_grads)
    return {
        "grad_err": grad_err,
        "gathered_before_forward": gathered_before,
        "gathered_after_forward": gathered_after,
        "dispatched_from_hooks": from_hooks,
        "ops": sorted({r.op for r in log}),
    }


def _train(kind: str, overlap: bool, dist_opt: bool, steps: int = 3) -> dict[str, Any]:
    """Runs on every rank: ``steps`` iterations against the single-process reference."""
    with model_parallel() as pgc:
        ddp, opt, ref = _wrap(kind, pgc, overlap=overlap, dist_opt=dist_opt)
        per_step = [_step(ddp, opt, ref, s, kind) for s in range(steps)]
        ensure_params_ready(list(ddp.module.parameters()))
        mg.device.synchronize(_device(kind))
        return {
            "steps": per_step,
            "param_err": max_param_error(ddp.module, ref.model),
            "groups": len(ddp.bucket_groups),
            "buffer_device": str(ddp.buffers[0].grad_data.device),
            "pre_hooks": len(ddp.remove_forward_pre_hook_handles),
        }


def _check_training(out: dict[str, Any], kind: str, world: int, overlap: bool, dp: bool) -> None:
    assert out["buffer_device"].startswith(kind)
    # Without overlap DDP makes one bucket (nothing to overlap); with it, one per param or two.
    assert out["groups"] >= 3 if overlap else out["groups"] == 1
    assert out["param_err"] <= TOLERANCE
    for step, s in enumerate(out["steps"]):
        assert s["grad_err"] <= TOLERANCE, (step, s["grad_err"])
        # The first iteration learns how often each param becomes ready; from the second on
        # the hook completing a bucket group dispatches its reduction during backward.
        assert s["dispatched_from_hooks"] == [overlap and step > 0] * out["groups"], step
        if dp and overlap:
            # finish_grad_sync marks the params stale; the optimizer step leaves the gather
            # to the next forward, whose pre-hooks dispatch and wait for every group.
            assert not any(s["gathered_before_forward"]), step
            assert all(s["gathered_after_forward"]), step
        expected_ops = [] if world == 1 else ["all_reduce"]  # one rank: nothing to reduce
        assert s["ops"] == expected_ops, step
    assert out["pre_hooks"] > 0 if dp and overlap else out["pre_hooks"] == 0


@pytest.mark.parametrize("kind", devices())
@pytest.mark.parametrize(
    ("overlap", "dist_opt"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "overlap", "dist-opt", "dist-opt-overlap"],
)
def test_dp1_schedule_and_parity(
    rank_pools: RankPools, kind: str, overlap: bool, dist_opt: bool
) -> None:
    (out,) = rank_pools.get(1, _backend(kind)).run(_train, kind, overlap, dist_opt)
    _check_training(out, kind, 1, overlap, dist_opt)


@pytest.mark.parametrize("kind", devices())
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_dp2_all_reduce_on_one_device(rank_pools: RankPools, kind: str, overlap: bool) -> None:
    """Two gloo ranks, grad buffers on the same device: the bucket all-reduces are real."""
    for out in rank_pools.get(2, "gloo").run(_train, kind, overlap, False):
        _check_training(out, kind, 2, overlap, False)


# -- offload and restore ------------------------------------------------------------------------


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _offload_restore(kind: str) -> dict[str, Any]:
    """Train a step, offload grads (freed) and params (to pinned host memory), restore,
    train two more steps: the run must equal the reference as if nothing happened."""
    device = _device(kind)
    with model_parallel() as pgc:
        ddp, opt, ref = _wrap(kind, pgc, overlap=True, dist_opt=True)
        errors = [_step(ddp, opt, ref, 0, kind)["grad_err"]]
        params = [p.detach().clone() for p in ddp.module.parameters()]
        buffer = ddp.buffers[0]
        assert buffer.param_data is not None
        nbytes = buffer.grad_data.nbytes + buffer.param_data.nbytes
        before = _allocated(device)
        ddp.offload_grad_buffers()
        buffer.offload_to_cpu(move_params=True, move_grads=False)
        freed = before - _allocated(device)
        assert buffer.param_data_cpu is not None
        pinned = buffer.param_data_cpu.is_pinned()
        buffer.reload_from_cpu(move_params=True, move_grads=False)
        ddp.restore_grad_buffers()
        mg.device.synchronize(device)
        same = all(torch.equal(p, q) for p, q in zip(ddp.module.parameters(), params, strict=True))
        zeroed = int(torch.count_nonzero(buffer.grad_data))
        errors += [_step(ddp, opt, ref, s, kind)["grad_err"] for s in (1, 2)]
        return {
            "freed": freed,
            "nbytes": nbytes,
            "pinned": pinned,
            "params_restored": same,
            "grads_zeroed": zeroed == 0,
            "grad_errs": errors,
            "param_err": max_param_error(ddp.module, ref.model),
        }


@pytest.mark.parametrize("kind", devices())
def test_offload_restore_mid_training(rank_pools: RankPools, kind: str) -> None:
    (out,) = rank_pools.get(1, _backend(kind)).run(_offload_restore, kind)
    assert out["params_restored"]
    assert out["grads_zeroed"]
    assert max(out["grad_errs"]) <= TOLERANCE
    assert out["param_err"] <= TOLERANCE
    if kind == "cuda":
        assert out["pinned"]  # a non-blocking copy back needs page-locked memory
        assert out["freed"] >= out["nbytes"]
    else:
        assert not out["pinned"]


# -- ensure_params_ready under CUDA-graph capture -------------------------------------------


def _ready_under_capture() -> dict[str, Any]:
    device = _device("cuda")
    with model_parallel() as pgc:
        ddp, opt, ref = _wrap("cuda", pgc, overlap=True, dist_opt=True)
        _step(ddp, opt, ref, 0, "cuda")  # leaves every group's gather undispatched
        groups = ddp.bucket_groups
        params = list(ddp.module.parameters())
        before = [g.param_gather_dispatched for g in groups]
        static_in = torch.arange(4.0, device=device)
        static_out = torch.zeros(4, device=device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls are checked (the NCCL watchdog thread runs on).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            ensure_params_ready(params)  # a gather or a wait here would break the capture
            static_out.copy_(static_in * 2)
        during = [g.param_gather_dispatched for g in groups]
        graph.replay()
        torch.cuda.synchronize(device)
        ensure_params_ready(params)
        after = [g.param_gather_dispatched and g.param_gather_handle is None for g in groups]
        return {
            "before": before,
            "during": during,
            "after": after,
            "replayed": static_out.cpu().tolist(),
        }


@pytest.mark.gpu
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_ensure_params_ready_is_a_no_op_under_graph_capture(rank_pools: RankPools) -> None:
    (out,) = rank_pools.get(1, "nccl").run(_ready_under_capture)
    assert not any(out["before"])
    assert out["during"] == out["before"]  # nothing dispatched while capturing
    assert out["replayed"] == [0.0, 2.0, 4.0, 6.0]  # the capture itself worked
    assert all(out["after"])  # outside the capture the same call publishes every group
