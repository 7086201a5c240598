"""bf16 params with fp32 grads (``grad_reduce_in_fp32``, fp32 masters in the sharded
optimizer) on 4 ranks (TP=2 × DP=2), against the fp32 1-process reference.

Localizes the mixed-precision path end to end: bf16 weights and activations in the TP
layers, fp32 ``main_grad`` buffers reduced in fp32, fp32 masters stepped and cast back to
bf16 (with and without the distributed optimizer; sequence parallelism on with it).

Tolerances, against the fp32 run (bf16 has an 8-bit mantissa: unit roundoff 2^-9 ≈ 2e-3):
- loss per step within 2e-3 relative: the loss is a mean of 128 fp32 cross-entropies of
  bf16 logits, each within a few bf16 roundings, and the rounding errors mostly average
  out (measured ≤ 6.8e-4 over the 5 steps).
- final weights within 2^-4 ≈ 6.3e-2 of each tensor's largest magnitude. Measured: matrices
  and embeddings ≤ 1.2e-2, layer norms and biases ≤ 1e-2, except the final layer-norm bias
  (2.0e-2 with SP, 3.5e-2 without): it starts at 0, so its whole magnitude is accumulated
  from grads that are sums over all 128 tokens of cancelling terms (through the tied head:
  Eᵀ(softmax − one-hot)) computed from bf16 logits. The params are re-rounded to bf16 after
  every step (2^-9 relative) and each step's grads see those rounded params. Matrices move
  by 18-100 % of their magnitude in 5 steps, far beyond the tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt import ParallelLayout, final_weights, parallelize, train_step
from integration_tests._common import (
    CFG,
    SGD,
    STEPS,
    backends,
    batch,
    device_for,
    full_weights,
    max_rel_loss_diff,
    max_weight_diff,
    model_parallel,
    reference,
)
from mc_groups.testing import RankPools

LAYOUTS = [
    ParallelLayout(
        tp=2,
        dp=2,
        sequence_parallel=True,
        distributed_optimizer=True,
        params_dtype=torch.bfloat16,
        grad_reduce_in_fp32=True,
    ),
    ParallelLayout(tp=2, dp=2, params_dtype=torch.bfloat16, grad_reduce_in_fp32=True),
]


def _train(layout: ParallelLayout, backend: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG, dist.get_world_size(), 8)
        trainer = parallelize(CFG, layout, SGD, pgc, full_weights(), device_for(backend))
        params = list(trainer.model.module.parameters())
        dtypes = {
            "params": {str(p.dtype) for p in params},
            "main_grad": {str(p.main_grad.dtype) for p in params},  # type: ignore[attr-defined]
            "masters": {str(m.dtype) for m in trainer.optimizer.master_params},
        }
        losses = [train_step(trainer, batch(step)) for step in range(STEPS)]
        return {"losses": losses, "weights": final_weights(trainer), "dtypes": dtypes}


def train_bf16(layouts: list[ParallelLayout], backend: str) -> list[dict[str, Any]]:
    """Runs on every rank: each bf16 layout trained for 5 steps."""
    return [_train(layout, backend) for layout in layouts]


@pytest.mark.parametrize("backend", backends(4))
def test_bf16_params_fp32_grads_track_fp32_reference(rank_pools: RankPools, backend: str) -> None:
    per_rank = rank_pools.get(4, backend).run(train_bf16, LAYOUTS, backend)
    ref = reference()
    for i, layout in enumerate(LAYOUTS):
        out = per_rank[0][i]
        assert out["dtypes"] == {
            "params": {"torch.bfloat16"},
            "main_grad": {"torch.float32"},
            "masters": {"torch.float32"},
        }
        rel = max_rel_loss_diff(out["losses"], ref.losses)
        assert rel <= 2e-3, (layout.describe(), rel)
        diff, name = max_weight_diff(out["weights"], ref.weights, relative_to_tensor=True)
        assert diff <= 2.0**-4, (layout.describe(), name, diff)
        for rank, results in enumerate(per_rank):
            for key, value in results[i]["weights"].items():
                assert torch.equal(value, out["weights"][key]), (layout.describe(), rank, key)
