"""The distributed optimizer's two reduction variants end to end on 4 ranks, against the
1-process reference: several optimizer instances, and bf16 params reduce-scattered with
fp32 accumulation.

1. ``num_distributed_optimizer_instances=2`` (``ParallelLayout(dp=4, ...)``; overlap on and
   off). Instances are contiguous halves of dp: ``intra_dp_cp`` = (0, 1), (2, 3);
   ``inter_dist_opt`` = (0, 2), (1, 3). Localizes Megatron's two-stage reduction: each
   bucket is pre-scaled by 1/|dp_cp| = 1/4, SUM-reduce-scattered inside the instance
   (2 shards), then each shard is SUM-all-reduced over the other instance (so
   ``Σ_4 g / 4``, the DP mean); the ``ShardedOptimizer`` steps half of the params on each
   rank (rank r and rank r + 2 the same half) and the params are all-gathered inside the
   instance. Recorded (step 3): every grad reduce-scatter and param all-gather on the
   instance's pair, one all-reduce per bucket on ``inter_dist_opt`` with exactly the
   shard's elements, nothing on the 4-rank group but the loss for logging.

2. ``reduce_scatter_with_fp32_accumulation=True`` with bf16 params and bf16 ``main_grad``
   (no ``grad_reduce_in_fp32``), distributed optimizer, overlap off (so the grads can be
   captured between backward and finalize). Localizes the fp32 accumulation: at step 0
   each rank's reduced shard must equal, bit for bit, ``bf16(Σ_s fp32(g_s / 4))`` computed
   here from the 4 ranks' captured bf16 grads (one rounding); a bf16 running sum differs
   from it in some elements (checked, so a bf16-accumulating reduction would fail). The
   reduction is recorded as one bf16 ``all_to_all`` per bucket over the 4 ranks. Composed
   with TP too: TP=2 × DP=2, sequence parallel, overlapped reduce and gather (the
   all-to-alls dispatched from the backward hooks, on the DP pairs (0, 2), (1, 3)),
   parity only.

Tolerances (measured on gloo, printed with ``-s``):
- (1) fp32: loss per step within 1e-5 relative (measured 1.4e-7, both layouts), final
  weights within 1e-6 absolute (measured 2.4e-7; every tensor moves ≥ 1.06e-3, checked
  ≥ 100 × the tolerance); all 4 ranks bit-identical. NCCL (not run here): 1e-5.
- (2) against the fp32 reference, as test_bf16.py and for the same reason (bf16 has an
  8-bit mantissa, unit roundoff 2^-9 ≈ 2e-3; the forward runs in bf16): loss per step
  within 2e-3 relative (measured 3.8e-4 DP=4, 5.0e-4 TP=2 × DP=2); final weights within
  2^-4 of each tensor's largest magnitude (measured 1.8e-2 in both, the final layer-norm
  bias: it starts at 0 and is built only from grads that are sums of cancelling terms
  over 128 tokens, computed from bf16 logits). Here the grads are bf16 too (each
  micro-batch's grad rounded to 2^-9 when added into ``main_grad``, the reduced shard
  rounded once more), then the fp32 masters step with them and are rounded back to bf16.
  All 4 ranks bit-identical. The bit-exact shard check has no tolerance; 8109 shard
  elements of step 0 differ from a bf16 running sum.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import ParallelLayout, Trainer, final_weights, parallelize, train_step
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
    reference,
    smallest_update,
)
from integration_tests._per_token import single_thread
from mc_finalize import finalize_model_grads
from mc_groups.testing import RankPools

RECORDED_STEP = 2
INSTANCES = [
    ParallelLayout(dp=4, distributed_optimizer=True, num_distributed_optimizer_instances=2),
    ParallelLayout(
        dp=4, distributed_optimizer=True, num_distributed_optimizer_instances=2, overlap=False
    ),
]
FP32_RS = [
    ParallelLayout(
        dp=4,
        distributed_optimizer=True,
        reduce_scatter_with_fp32_accumulation=True,
        params_dtype=torch.bfloat16,
        overlap=False,
    ),
    ParallelLayout(
        tp=2,
        dp=2,
        sequence_parallel=True,
        distributed_optimizer=True,
        reduce_scatter_with_fp32_accumulation=True,
        params_dtype=torch.bfloat16,
    ),
]
Rec = tuple[str, str | None, tuple[int, ...], str, int, str]


def _summary(log: list[mg.CollectiveRecord]) -> list[Rec]:
    return [
        (r.op, r.reduce_op, r.group_ranks, r.label, r.numel, str(r.dtype).removeprefix("torch."))
        for r in log
    ]


def _buckets(trainer: Trainer) -> list[Any]:
    return [b for group in trainer.model.bucket_groups for b in group.buckets]


def _train_instances(layout: ParallelLayout, backend: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG, dist.get_world_size(), GLOBAL_BATCH)
        trainer = parallelize(CFG, layout, SGD, pgc, full_weights(), device_for(backend))
        losses: list[float] = []
        records: list[Rec] = []
        for step in range(STEPS):
            with mg.record_collectives() if step == RECORDED_STEP else nullcontext() as log:
                losses.append(train_step(trainer, batch(step)))
            if log is not None:
                records = _summary(log)
        return {
            "losses": losses,
            "weights": final_weights(trainer),
            "records": records,
            "intra": mg.group_ranks(pgc.require("intra_dp_cp", "test")),
            "inter": mg.group_ranks(pgc.require("inter_dist_opt", "test")),
            "bucket_numels": [b.grad_data.numel() for b in _buckets(trainer)],
            "owned": sum(m.numel() for m in trainer.optimizer.master_params),
        }


def train_instances(layouts: list[ParallelLayout], backend: str) -> list[dict[str, Any]]:
    """Runs on every rank: each layout trained for 5 steps."""
    return [_train_instances(layout, backend) for layout in layouts]


def _captured_step(trainer: Trainer, tokens: torch.Tensor) -> dict[str, Any]:
    """``train_step`` with the bf16 grads captured before finalize (overlap is off, so
    nothing is reduced before ``finish_grad_sync``) and the reduced shards after it."""
    model, pgc = trainer.model, trainer.pgc
    dp = pgc.require("dp", "test")
    rank, size = mg.group_rank(dp), mg.group_size(dp)
    rows = dp_rows(tokens, rank, size).to(trainer.device)
    micro = list(rows.chunk(trainer.layout.microbatches))
    model.zero_grad_buffer()
    total = torch.zeros((), device=trainer.device)
    for i, mb in enumerate(micro):
        with nullcontext() if i == len(micro) - 1 else model.no_sync():
            loss = model(mb[:, :-1], mb[:, 1:]) / len(micro)
            torch.autograd.backward(loss)
        total += loss.detach().float()
    before = [b.grad_data.detach().cpu().clone() for b in _buckets(trainer)]
    with mg.record_collectives() as log:
        finalize_model_grads([model], pg_collection=pgc)
    shards = [b.grad_shard(rank, size).detach().cpu().clone() for b in _buckets(trainer)]
    trainer.optimizer.step()
    mg.all_reduce(total, dp, op=mg.ReduceOp.AVG, label="loss for logging")
    return {"loss": float(total), "before": before, "shards": shards, "records": _summary(log)}


def _train_fp32_reduce_scatter(layout: ParallelLayout, backend: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG, dist.get_world_size(), GLOBAL_BATCH)
        trainer = parallelize(CFG, layout, SGD, pgc, full_weights(), device_for(backend))
        first: dict[str, Any] = {"dp": mg.group_ranks(pgc.require("dp", "test"))}
        losses: list[float] = []
        for step in range(STEPS):
            if step == 0 and not layout.overlap:
                first |= _captured_step(trainer, batch(0))
                losses.append(first.pop("loss"))
            elif step == RECORDED_STEP and layout.overlap:
                with mg.record_collectives() as log:
                    losses.append(train_step(trainer, batch(step)))
                first["records"] = _summary(log)
            else:
                losses.append(train_step(trainer, batch(step)))
        params = list(trainer.model.module.parameters())
        first["dtypes"] = {
            "params": {str(p.dtype) for p in params},
            "main_grad": {str(p.main_grad.dtype) for p in params},  # type: ignore[attr-defined]
            "masters": {str(m.dtype) for m in trainer.optimizer.master_params},
        }
        return {"losses": losses, "weights": final_weights(trainer), **first}


def train_fp32_reduce_scatter(layouts: list[ParallelLayout], backend: str) -> list[dict[str, Any]]:
    """Runs on every rank: each layout trained for 5 steps; without overlap step 0's grads
    are captured, with it step 3's collectives recorded."""
    return [_train_fp32_reduce_scatter(layout, backend) for layout in layouts]


def _check_instance_records(out: dict[str, Any]) -> None:
    records: list[Rec] = out["records"]
    intra, inter = out["intra"], out["inter"]
    scatter = [r for r in records if r[3].startswith("grad reduce ") and "across" not in r[3]]
    across = [r for r in records if r[3].startswith("grad reduce across instances")]
    gather = [r for r in records if r[3].startswith("param gather")]
    assert scatter, records
    assert {(r[0], r[1], r[2]) for r in scatter} == {("reduce_scatter", "sum", intra)}
    assert {(r[0], r[1], r[2]) for r in across} == {("all_reduce", "sum", inter)}
    # one inter-instance all-reduce per bucket, of this rank's shard (bucket / |intra|)
    assert sorted(r[4] for r in across) == sorted(n // len(intra) for n in out["bucket_numels"])
    assert gather, records
    assert {(r[0], r[2]) for r in gather} == {("all_gather", intra)}
    on_world = {r[3] for r in records if r[2] == (0, 1, 2, 3)}
    assert on_world == {"loss for logging"}, on_world


@pytest.mark.parametrize("backend", backends(4))
def test_two_optimizer_instances_match_one_process(rank_pools: RankPools, backend: str) -> None:
    per_rank = rank_pools.get(4, backend).run(train_instances, INSTANCES, backend)
    with single_thread():
        ref = reference()
    tol = 1e-6 if backend == "gloo" else 1e-5
    assert smallest_update(ref) >= 100 * tol
    for i, layout in enumerate(INSTANCES):
        first = per_rank[0][i]
        assert [r[i]["intra"] for r in per_rank] == [(0, 1), (0, 1), (2, 3), (2, 3)]
        assert [r[i]["inter"] for r in per_rank] == [(0, 2), (1, 3), (0, 2), (1, 3)]
        owned = [r[i]["owned"] for r in per_rank]
        assert owned[2:] == owned[:2], owned  # rank r and r + 2 step the same half
        assert owned[0] + owned[1] == sum(w.numel() for w in full_weights().values())
        rel = max_rel_loss_diff(first["losses"], ref.losses)
        assert rel <= 1e-5, (layout.describe(), rel)
        diff, name = max_weight_diff(first["weights"], ref.weights)
        assert diff <= tol, (layout.describe(), name, diff)
        for rank, results in enumerate(per_rank):
            _check_instance_records(results[i])
            for key, value in results[i]["weights"].items():
                assert torch.equal(value, first["weights"][key]), (layout.describe(), rank, key)
        print(f"{layout.describe()}: loss rel {rel:.2e}, weights {diff:.2e} ({name})")


Shards = list[list[torch.Tensor]]


def _expected_shards(per_rank: list[dict[str, Any]]) -> tuple[Shards, Shards]:
    """``bf16(Σ_s fp32(g_s / 4))`` per bucket and rank, and the bf16 running sum."""
    size = len(per_rank)
    exact: Shards = []
    running: Shards = []
    for b in range(len(per_rank[0]["before"])):
        scaled = torch.stack([out["before"][b] for out in per_rank]) * (1.0 / size)  # exact
        parts = scaled.view(size, size, -1)  # [source rank, shard, elements]
        exact.append(list(parts.sum(dim=0, dtype=torch.float32).to(torch.bfloat16).unbind(0)))
        acc = parts[0].clone()
        for s in range(1, size):
            acc += parts[s]  # bf16 + bf16, rounded after every addition
        running.append(list(acc.unbind(0)))
    return exact, running


def _check_exact_shards(per_rank: list[dict[str, Any]]) -> int:
    """Each rank's reduced shards equal ``bf16(Σ_s fp32(g_s / 4))``; returns how many
    elements a bf16 running sum would have got wrong."""
    with single_thread():
        exact, running = _expected_shards(per_rank)
    differs = 0
    for rank, result in enumerate(per_rank):
        for b, shards in enumerate(exact):
            assert torch.equal(result["shards"][b], shards[rank]), (rank, b)
            differs += int((running[b][rank] != shards[rank]).sum())
        grad = [r for r in result["records"] if r[3].startswith("grad reduce")]
        assert len(grad) == len(exact), result["records"]  # one all-to-all per bucket
        assert {(r[0], r[2], r[5]) for r in grad} == {("all_to_all", (0, 1, 2, 3), "bfloat16")}
    return differs


@pytest.mark.parametrize("backend", backends(4))
def test_bf16_fp32_accumulating_reduce_scatter_tracks_reference(
    rank_pools: RankPools, backend: str
) -> None:
    per_rank = rank_pools.get(4, backend).run(train_fp32_reduce_scatter, FP32_RS, backend)
    with single_thread():
        ref = reference()
    for i, layout in enumerate(FP32_RS):
        out = per_rank[0][i]
        assert out["dtypes"] == {
            "params": {"torch.bfloat16"},
            "main_grad": {"torch.bfloat16"},
            "masters": {"torch.float32"},
        }
        differs = None
        if not layout.overlap:
            differs = _check_exact_shards([r[i] for r in per_rank])
            assert differs > 0  # one rounding differs from a bf16 running sum: it can tell
        else:
            for results in per_rank:
                grad = [r for r in results[i]["records"] if r[3].startswith("grad reduce")]
                assert grad, results[i]["records"]
                kinds = {(r[0], r[2], r[5]) for r in grad}
                assert kinds == {("all_to_all", results[i]["dp"], "bfloat16")}, kinds
        rel = max_rel_loss_diff(out["losses"], ref.losses)
        assert rel <= 2e-3, (layout.describe(), rel)
        diff, name = max_weight_diff(out["weights"], ref.weights, relative_to_tensor=True)
        assert diff <= 2.0**-4, (layout.describe(), name, diff)
        for rank, results in enumerate(per_rank):
            for key, value in results[i]["weights"].items():
                assert torch.equal(value, out["weights"][key]), (layout.describe(), rank, key)
        print(f"{layout.describe()}: loss {rel:.1e}, weights {diff:.1e} ({name}), {differs=}")
