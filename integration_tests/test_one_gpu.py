"""The integration tests' GPT trained on one device against the same GPT in plain PyTorch
on one process (CPU, the whole batch): the one-GPU tier end to end.

- One rank (``cpu`` over gloo, ``cuda`` over NCCL): plain DDP, the distributed optimizer
  (params in the buffer, gathered from the forward pre-hooks) and gradient-accumulation
  fusion (weight grads straight into ``main_grad``: on CUDA, apex's kernel or torch's
  mixed-dtype GEMM). The collective layer skips one-rank groups, so this localizes mc's
  layers, buffers, hooks and optimizer on the device.
- Two gloo ranks sharing the GPU (``cuda`` only; the CPU runs of these layouts are in
  ``test_parity.py``): TP = 2 without sequence parallelism and DP = 2 without the
  distributed optimizer, whose collectives are all all-reduces, which gloo runs on CUDA
  tensors. (Gloo's point-to-point, behind mc's gloo all-gather, takes CPU tensors only:
  sequence parallelism, the distributed optimizer's exchanges and gathering TP-split
  weights stay with the multi-GPU NCCL tests, so TP = 2 here compares the losses only.)

Tolerances as in ``test_parity.py``: loss per step within 1e-5 relative; final weights
within 1e-6 absolute on CPU, 1e-5 on CUDA (cuBLAS picks kernels by shape, so the GEMMs sum
in other orders than the reference's CPU ones), both far below the smallest update.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt import ParallelLayout, final_weights, parallelize, train_step
from integration_tests._common import (
    CFG,
    GLOBAL_BATCH,
    SGD,
    STEPS,
    batch,
    full_weights,
    max_rel_loss_diff,
    max_weight_diff,
    model_parallel,
    reference,
    smallest_update,
)
from mc_groups.testing import RankPools, gpu_skip_reason

_REASON = gpu_skip_reason(1)
_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

ONE_RANK = [
    ParallelLayout(tp=1, dp=1),
    ParallelLayout(tp=1, dp=1, distributed_optimizer=True),
    ParallelLayout(tp=1, dp=1, distributed_optimizer=True, gradient_accumulation_fusion=True),
]
SHARED_DEVICE = [ParallelLayout(tp=2, dp=1), ParallelLayout(tp=1, dp=2)]


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _train(layout: ParallelLayout, kind: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG, dist.get_world_size(), GLOBAL_BATCH)
        trainer = parallelize(CFG, layout, SGD, pgc, full_weights(), _device(kind))
        losses = [train_step(trainer, batch(step)) for step in range(STEPS)]
        weights = final_weights(trainer) if layout.tp == 1 else None
        return {
            "losses": losses,
            "weights": weights,
            "device": str(next(trainer.model.parameters()).device),
        }


def train_layouts(layouts: list[ParallelLayout], kind: str) -> list[dict[str, Any]]:
    """Runs on every rank: each layout trained for 5 steps from the same full weights."""
    return [_train(layout, kind) for layout in layouts]


def _check(layouts: list[ParallelLayout], per_rank: list[list[dict[str, Any]]], kind: str) -> None:
    ref = reference()
    tol = 1e-5 if kind == "cuda" else 1e-6
    assert smallest_update(ref) >= 100 * tol  # a lost or mis-scaled update cannot pass
    for i, layout in enumerate(layouts):
        for results in per_rank:
            out = results[i]
            assert out["device"].startswith(kind), (layout.describe(), out["device"])
            rel = max_rel_loss_diff(out["losses"], ref.losses)
            assert rel <= 1e-5, (layout.describe(), rel, out["losses"], ref.losses)
            if out["weights"] is not None:
                diff, name = max_weight_diff(out["weights"], ref.weights)
                assert diff <= tol, (layout.describe(), name, diff)


@pytest.mark.parametrize(
    "kind", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=_ON_GPU)]
)
def test_one_rank_on_the_device_matches_one_process(rank_pools: RankPools, kind: str) -> None:
    backend = "nccl" if kind == "cuda" else "gloo"
    per_rank = rank_pools.get(1, backend).run(train_layouts, ONE_RANK, kind)
    _check(ONE_RANK, per_rank, kind)


@pytest.mark.gpu
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_two_gloo_ranks_sharing_the_gpu_match_one_process(rank_pools: RankPools) -> None:
    per_rank = rank_pools.get(2, "gloo").run(train_layouts, SHARED_DEVICE, "cuda")
    _check(SHARED_DEVICE, per_rank, "cuda")
