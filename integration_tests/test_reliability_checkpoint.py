"""A sharded checkpoint saved mid-training (TP=2 × DP=2, distributed optimizer, AdamW) and
loaded into freshly built models continues training: at the same layout with exactly the
losses of the run that never stopped, at other layouts within the rounding of their own
reduction order.

Localizes :func:`mc_train.checkpoint.save_state` / ``load_state`` (one DCP state dict: the mc
layers'
``sharded_state_dict`` for the model, ``ShardedOptimizer.sharded_state_dict`` for the fp32
masters and AdamW's moments and step), and the optimizer-state resharding: each rank's
flat slices stored as pieces of full-parameter tensors and read back by any TP size, DP
size and bucket layout. Loading models start from other weights (seed + 1), so nothing
passes by starting equal.

Checks and tolerances:
- optimizer state after the load, every layout: each slice's master, exp_avg and
  exp_avg_sq equal (``torch.equal``) the same elements of the saved state, reassembled in
  the test from the saving ranks' slices (TP parts concatenated along their split dim), and
  the step count is the saved one. DCP copies bytes: no tolerance.
- same layout: the 3 steps after the load have bit-identical losses and final weights to
  the uninterrupted run (same layout, same reductions in the same order).
- TP=1 × DP=2 (distributed optimizer, other buckets) and TP=2 × DP=1 (replicated
  optimizer): losses within 1e-6 relative and weights within 1e-5 absolute of the
  uninterrupted TP=2 × DP=2 run. The other layout sums the same fp32 terms in another order
  (per TP shard, per DP rank), ~1e-7 relative per sum, and AdamW divides each update by
  √v, which can magnify such a difference where the moments are small. Measured over the
  3 steps: loss ≤ 7e-8 relative, weights ≤ 1.3e-7 (printed with -s). Every tensor moves by
  ≥ 1.7e-2 in those steps (AdamW moves each element by about lr = 1e-2 per step), 1000 ×
  the weight tolerance, so a lost or repeated step fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.gpt import ParallelLayout, final_weights, init_full_weights, parallelize
from integration_tests._common import (
    CFG,
    SEED,
    full_weights,
    max_rel_loss_diff,
    max_weight_diff,
    model_parallel,
)
from integration_tests._reliability import ADAMW, expected_slice, full_states, slice_states, train
from mc_groups.testing import RankPools
from mc_train.checkpoint import load_state, save_state

SAVE_LAYOUT = ParallelLayout(tp=2, dp=2, distributed_optimizer=True)
SAVE_AT, STEPS = 3, 6
OTHER_LAYOUTS = [
    ParallelLayout(tp=1, dp=2, distributed_optimizer=True),
    ParallelLayout(tp=2, dp=1),
]
CPU = torch.device("cpu")


def save_mid_training(path: str) -> dict[str, Any]:
    """4 ranks: the uninterrupted 6-step run, then a run stopped after 3 steps and saved."""
    with model_parallel(SAVE_LAYOUT) as pgc:
        ref = parallelize(CFG, SAVE_LAYOUT, ADAMW, pgc, full_weights(), CPU)
        ref_losses = train(ref, range(STEPS))
        trainer = parallelize(CFG, SAVE_LAYOUT, ADAMW, pgc, full_weights(), CPU)
        losses = train(trainer, range(SAVE_AT))
        saved_weights = final_weights(trainer)
        save_state(path, [trainer.model], trainer.optimizer, pgc)
        return {
            "ref_losses": ref_losses,
            "ref_weights": final_weights(ref),
            "losses": losses,
            "saved_weights": saved_weights,
            "slices": slice_states(trainer),
        }


def load_and_continue(path: str, layouts: list[ParallelLayout]) -> list[dict[str, Any]]:
    """Fresh models (other initial weights) at each layout: load, then steps 3..5."""
    out = []
    for layout in layouts:
        with model_parallel(layout) as pgc:
            layout.check(CFG, dist.get_world_size(), 8)
            trainer = parallelize(CFG, layout, ADAMW, pgc, init_full_weights(CFG, SEED + 1), CPU)
            load_state(path, [trainer.model], trainer.optimizer, pgc)
            loaded_weights = final_weights(trainer)
            slices = slice_states(trainer)
            losses = train(trainer, range(SAVE_AT, STEPS))
            out.append(
                {
                    "losses": losses,
                    "weights": final_weights(trainer),
                    "loaded_weights": loaded_weights,
                    "slices": slices,
                }
            )
    return out


def _check_loaded_state(saved: dict[tuple[str, str], torch.Tensor], per_rank: list[Any]) -> None:
    for slices in per_rank:
        for s in slices:
            assert torch.equal(s.master, expected_slice(saved[s.name, "master"], s)), s.name
            for key, value in s.state.items():
                assert torch.equal(value, expected_slice(saved[s.name, key], s)), (s.name, key)
            assert s.step == SAVE_AT, (s.name, s.step)


def test_checkpoint_continues_at_same_and_other_layouts(
    rank_pools: RankPools, tmp_path: Path
) -> None:
    path = str(tmp_path / "step3")
    saving = rank_pools.get(4).run(save_mid_training, path)
    first = saving[0]
    assert first["losses"] == first["ref_losses"][:SAVE_AT]
    saved = full_states([r["slices"] for r in saving])
    ref_tail, ref_weights = first["ref_losses"][SAVE_AT:], first["ref_weights"]
    moves = {k: float((v - first["saved_weights"][k]).abs().max()) for k, v in ref_weights.items()}
    print(f"smallest per-tensor move over steps 3-5: {min(moves.values()):.2e}")
    assert min(moves.values()) >= 1000 * 1e-5, moves  # far beyond the weight tolerance

    same = rank_pools.get(4).run(load_and_continue, path, [SAVE_LAYOUT])
    _check_loaded_state(saved, [r[0]["slices"] for r in same])
    for rank in same:
        assert rank[0]["losses"] == ref_tail, (rank[0]["losses"], ref_tail)
        for key, value in rank[0]["weights"].items():
            assert torch.equal(value, ref_weights[key]), key

    other = rank_pools.get(2).run(load_and_continue, path, OTHER_LAYOUTS)
    for i, layout in enumerate(OTHER_LAYOUTS):
        _check_loaded_state(saved, [r[i]["slices"] for r in other])
        out = other[0][i]
        for key, value in out["loaded_weights"].items():
            assert torch.equal(value, first["saved_weights"][key]), (layout.describe(), key)
        rel = max_rel_loss_diff(out["losses"], ref_tail)
        diff, name = max_weight_diff(out["weights"], ref_weights)
        print(f"{layout.describe()}: loss rel {rel:.2e}, weights {diff:.2e} ({name})")
        assert rel <= 1e-6, (layout.describe(), rel, out["losses"], ref_tail)
        assert diff <= 1e-5, (layout.describe(), name, diff)
