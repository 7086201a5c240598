"""Per-token loss (``calculate_per_token_loss=True`` with ``num_tokens``) on 4 ranks against
the 1-process reference that divides by the global token count.

Every micro-batch's loss is ``Σ mask·CE`` over its unmasked tokens (the GPT returns per-token
losses, ``per_token_loss=True``) and the step counts its tokens; DDP sums the grads over DP
with no 1/dp pre-scale, and ``finalize_model_grads(model, num_tokens=n)`` broadcasts the
last pipeline stage's count (PP = 1 here: nothing to send), SUM-all-reduces it over
``dp_cp`` and divides every grad by the total ``N``. The reference minimises
``Σ mask·CE / N`` over the whole batch (:mod:`integration_tests._per_token`: row ``i``
keeps its first ``s − 2·((3i + t) mod s/2)`` targets, so micro-batches hold different
numbers of tokens and averaging per micro-batch would give other grads).

Layouts (5 SGD steps each):
- TP=2 × DP=2, sequence parallel, distributed optimizer, overlapped reduce and gather
  (per-token losses are gathered from the vocab-parallel cross-entropy; DP groups (0, 2),
  (1, 3));
- TP=1 × DP=4, all-reduce: 8 micro-batches of one sequence, the most uneven counts.

Recorded at step 3: exactly one ``num_tokens`` collective, a SUM all-reduce over the rank's
``dp_cp`` group, and after finalize every rank holds the global count. The pipeline case
(the broadcast from the last stage) is in test_parity_vpp.py.

Tolerances (fp32, measured on gloo, printed with ``-s``): loss per step within 1e-5
relative (measured 1.1e-7 TP=2 × DP=2, 1.4e-7 DP=4); final weights within 1e-6 absolute
(measured 1.2e-7, 1.0e-7) while every tensor moves ≥ 1.25e-3 (checked ≥ 100 × the
tolerance); all ranks bit-identical. The per-token reference is 3.8e-2 (4 micro-batch
groups, TP=2 × DP=2) / 9.0e-2 (8 groups, DP=4) away from the per-micro-batch normalisation
of the same masks (checked ≥ 100 × the tolerance): the test tells the two apart. NCCL
(not run here): 1e-5.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import ParallelLayout, Trainer, final_weights, parallelize
from examples.gpt.data import dp_rows
from integration_tests._common import (
    CFG,
    GLOBAL_BATCH,
    SGD,
    STEPS,
    backends,
    batch,
    device_for,
    full_weights,
    max_rel_loss_diff,
    max_weight_diff,
    model_parallel,
)
from integration_tests._per_token import (
    loss_mask,
    microbatch_mean_reference,
    per_token_reference,
    single_thread,
)
from mc_finalize import finalize_model_grads
from mc_groups.testing import RankPools

RECORDED_STEP = 2
LAYOUTS = [
    ParallelLayout(
        tp=2,
        dp=2,
        sequence_parallel=True,
        distributed_optimizer=True,
        calculate_per_token_loss=True,
    ),
    ParallelLayout(tp=1, dp=4, calculate_per_token_loss=True),
]


def per_token_step(trainer: Trainer, step: int) -> tuple[float, int]:
    """One optimizer step with per-token loss on the global batch and mask of ``step``;
    returns the loss ``Σ mask·CE / N`` and ``N`` (both summed over DP for logging)."""
    model, pgc, device = trainer.model, trainer.pgc, trainer.device
    dp = pgc.require("dp", "per-token test")
    rank, size = mg.group_rank(dp), mg.group_size(dp)
    micro = trainer.layout.microbatches
    tokens = dp_rows(batch(step), rank, size).to(device).chunk(micro)
    masks = dp_rows(loss_mask(step), rank, size).to(device).chunk(micro)
    model.zero_grad_buffer()
    loss_sum = torch.zeros((), device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for i, (mb, mask) in enumerate(zip(tokens, masks, strict=True)):
        with nullcontext() if i == micro - 1 else model.no_sync():
            losses = model(mb[:, :-1], mb[:, 1:], per_token_loss=True)  # [b, s]
            loss = (losses * mask).sum()
            torch.autograd.backward(loss)
        loss_sum += loss.detach()
        count += int(mask.sum())
    num_tokens = count.clone()
    finalize_model_grads([model], num_tokens=num_tokens, pg_collection=pgc)
    trainer.optimizer.step()
    logged = torch.stack([loss_sum, count.float()])
    mg.all_reduce(logged, dp, op=mg.ReduceOp.SUM, label="loss for logging")
    assert int(num_tokens) == int(logged[1])  # finalize left the global count in place
    return float(logged[0] / logged[1]), int(num_tokens)


def _train(layout: ParallelLayout, backend: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG, dist.get_world_size(), GLOBAL_BATCH)
        trainer = parallelize(CFG, layout, SGD, pgc, full_weights(), device_for(backend))
        losses: list[float] = []
        counts: list[int] = []
        records: list[tuple[str, str | None, tuple[int, ...], str]] = []
        for step in range(STEPS):
            with mg.record_collectives() as log:
                loss, count = per_token_step(trainer, step)
            losses.append(loss)
            counts.append(count)
            if step == RECORDED_STEP:
                records = [(r.op, r.reduce_op, r.group_ranks, r.label) for r in log]
        return {
            "losses": losses,
            "counts": counts,
            "records": records,
            "dp_cp": mg.group_ranks(pgc.require("dp_cp", "test")),
            "weights": final_weights(trainer),
        }


def train_per_token(layouts: list[ParallelLayout], backend: str) -> list[dict[str, Any]]:
    """Runs on every rank: each layout trained for 5 steps."""
    return [_train(layout, backend) for layout in layouts]


@pytest.mark.parametrize("backend", backends(4))
def test_per_token_loss_divides_by_global_token_count(rank_pools: RankPools, backend: str) -> None:
    per_rank = rank_pools.get(4, backend).run(train_per_token, LAYOUTS, backend)
    tol = 1e-6 if backend == "gloo" else 1e-5
    with single_thread():
        ref = per_token_reference(CFG)
    start = full_weights()
    assert min(float((w - start[k]).abs().max()) for k, w in ref.weights.items()) >= 100 * tol
    totals = [int(loss_mask(t).sum()) for t in range(STEPS)]
    for i, layout in enumerate(LAYOUTS):
        first = per_rank[0][i]
        # the counts are uneven per micro-batch: per-token normalisation is not the mean of
        # the micro-batches' means
        groups = layout.dp * layout.microbatches
        counts = [int(m.sum()) for m in loss_mask(0).chunk(groups)]
        assert len(set(counts)) > 1, counts
        with single_thread():
            other = microbatch_mean_reference(CFG, groups)
        apart, _ = max_weight_diff(ref.weights, other.weights)
        assert apart >= 100 * tol, (layout.describe(), apart)
        rel = max_rel_loss_diff(first["losses"], ref.losses)
        assert rel <= 1e-5, (layout.describe(), rel, first["losses"], ref.losses)
        diff, name = max_weight_diff(first["weights"], ref.weights)
        assert diff <= tol, (layout.describe(), name, diff)
        for rank, results in enumerate(per_rank):
            out = results[i]
            assert out["counts"] == totals, (rank, out["counts"])
            tokens = [r for r in out["records"] if r[3] == "num_tokens"]
            assert tokens == [("all_reduce", "sum", out["dp_cp"], "num_tokens")], out["records"]
            for key, value in out["weights"].items():
                assert torch.equal(value, first["weights"][key]), (layout.describe(), rank, key)
        print(
            f"{layout.describe()}: loss rel {rel:.2e}, weights {diff:.2e} ({name}), "
            f"per-micro-batch normalisation {apart:.1e} away"
        )
