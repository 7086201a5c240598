"""Offload → restore round trips between training steps lose nothing: params come back bit
for bit, and training continues with exactly the losses and weights of a run that never
offloaded.

Localizes DDP's ``offload_grad_buffers`` / ``restore_grad_buffers`` (grad storages freed,
back zeroed) and mc-buffers' ``offload_to_cpu(move_params=True)`` / ``reload_from_cpu``
(the distributed optimizer's ``param_data``: copied out, storage freed, copied back), on the
GPT at TP=2 × DP=2 with AdamW, after every one of 5 steps (RL-style: free the training
memory between steps). With the distributed optimizer the offload happens while the
params are half-published (each rank updated its shard; the others' arrive with the next
forward's all-gather), so the whole buffer, stale shards included, must survive. Three
layouts: fp32 params (the fp32 masters are views of ``param_data``, offloaded with it),
bf16 params with fp32 grads (separate fp32 masters), and no distributed optimizer (grads
only; ``param_data`` does not exist).

While offloaded, freed memory is refilled with NaN-filled tensors of the same sizes, so a
restore that reused stale memory instead of copying would show. No tolerances: every
comparison is exact (same arithmetic, same order). The round trip issues no collective.
"""

from __future__ import annotations

from typing import Any

import torch

import mc_groups as mg
from examples.gpt import ParallelLayout, Trainer, final_weights, parallelize
from integration_tests._common import CFG, full_weights, model_parallel
from integration_tests._reliability import ADAMW, train
from mc_buffers import ParamAndGradBuffer
from mc_groups.testing import RankPools

LAYOUTS = [
    ParallelLayout(tp=2, dp=2, distributed_optimizer=True),
    ParallelLayout(
        tp=2,
        dp=2,
        distributed_optimizer=True,
        params_dtype=torch.bfloat16,
        grad_reduce_in_fp32=True,
    ),
    ParallelLayout(tp=2, dp=2),
]
STEPS = 5
CPU = torch.device("cpu")


def _buffers(trainer: Trainer) -> list[ParamAndGradBuffer]:
    return trainer.model.buffers + trainer.model.expert_parallel_buffers


def _snapshot(trainer: Trainer) -> list[torch.Tensor]:
    out = [b.param_data.clone() for b in _buffers(trainer) if b.param_data is not None]
    return out + [p.detach().clone() for p in trainer.model.module.parameters()]


def _offloaded_bytes(trainer: Trainer) -> list[int]:
    out = []
    for buffer in _buffers(trainer):
        out.append(buffer.grad_data.untyped_storage().nbytes())
        if buffer.param_data is not None:
            out.append(buffer.param_data.untyped_storage().nbytes())
    return out


def _scribble(nbytes: list[int]) -> None:
    """Fill memory of the freed sizes with NaN and free it again."""
    junk = [torch.full((n // 4,), float("nan")) for n in nbytes]
    del junk


def _round_trip(trainer: Trainer) -> dict[str, Any]:
    before, sizes = _snapshot(trainer), _offloaded_bytes(trainer)
    with mg.record_collectives() as log:
        trainer.model.offload_grad_buffers()
        for buffer in _buffers(trainer):
            buffer.offload_to_cpu(move_params=True, move_grads=False)
        freed = _offloaded_bytes(trainer)
        _scribble(sizes)
        for buffer in _buffers(trainer):
            buffer.reload_from_cpu(move_params=True, move_grads=False)
        trainer.model.restore_grad_buffers()
    after = _snapshot(trainer)
    return {
        "freed": freed,
        "restored_sizes": _offloaded_bytes(trainer) == sizes,
        "identical": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "grads_zero": all(not b.grad_data.any() for b in _buffers(trainer)),
        "collectives": len(log),
    }


def _layout_runs(layout: ParallelLayout) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        ref = parallelize(CFG, layout, ADAMW, pgc, full_weights(), CPU)
        ref_losses = train(ref, range(STEPS))
        trainer = parallelize(CFG, layout, ADAMW, pgc, full_weights(), CPU)
        losses, trips = [], []
        for step in range(STEPS):
            losses += train(trainer, [step])
            trips.append(_round_trip(trainer))
        ref_weights, weights = final_weights(ref), final_weights(trainer)
        return {
            "ref_losses": ref_losses,
            "losses": losses,
            "same_weights": all(torch.equal(weights[k], v) for k, v in ref_weights.items()),
            "trips": trips,
            "param_buffers": sum(b.param_data is not None for b in _buffers(trainer)),
        }


def offload_every_step(layouts: list[ParallelLayout]) -> list[dict[str, Any]]:
    """Runs on every rank: per layout, an uninterrupted run and one offloaded after every
    step, from the same weights."""
    return [_layout_runs(layout) for layout in layouts]


def test_offload_round_trips_change_nothing(rank_pools: RankPools) -> None:
    per_rank = rank_pools.get(4).run(offload_every_step, LAYOUTS)
    for results in per_rank:
        for layout, out in zip(LAYOUTS, results, strict=True):
            name = layout.describe()
            assert out["losses"] == out["ref_losses"], (name, out["losses"], out["ref_losses"])
            assert out["same_weights"], name
            assert out["param_buffers"] == (1 if layout.distributed_optimizer else 0), name
            for trip in out["trips"]:
                assert trip["freed"] == [0] * len(trip["freed"]), (name, trip["freed"])
                assert trip["restored_sizes"], name
                assert trip["identical"], name
                assert trip["grads_zero"], name
                assert trip["collectives"] == 0, name
