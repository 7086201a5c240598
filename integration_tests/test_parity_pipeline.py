"""The 4-block GPT trained by ``torch.distributed.pipelining``'s schedules through the glue
of :mod:`mc_train.pipeline` (mc DDP per chunk, ``finalize_model_grads`` per step) with the
GPT's adapter :mod:`examples.gpt.pipeline`,
against the 1-process reference on the same global batch (8 sequences, 5 SGD steps).

Layouts, one rank pool per world size:

- 2 ranks: PP=2 with 1F1B (tied embedding across the two stages), PP=2 with GPipe and the
  per-token loss (uneven masks, :mod:`integration_tests._per_token`), PP=2 × VPP=2 with
  interleaved 1F1B (4 micro-batches);
- 4 ranks: TP=2 × PP=2 with sequence parallelism, PP=2 × DP=2 with the distributed
  optimizer (overlapped grad reduce and param gather);
- 8 ranks: TP=2 × PP=2 × DP=2 with the distributed optimizer.

Localizes the adapter between a schedule and mc: grads accumulate over micro-batches and
are reduced once per step, started by each chunk's last backward (an adapter that kept
every backward inside ``no_sync`` would leave all reductions to finalize: the overlap
check below fails; one without ``no_sync`` still reduces once, since mc's bucket groups
dispatch when the first iteration's per-param grad count is reached, as Megatron's), the
tied table's two copies get the summed grad (a missing or doubled embedding all-reduce
moves the weights), the loss scaling (mean / M, or Σ mask·CE / N) matches the reference.

Collectives, recorded per step (the schedule's P2P through
``mc_groups.comm.collectives.record_p2p_ops``):
each chunk ``c`` of the ``P·V`` global stages sends M activations forward unless it is
last and M activation grads back unless it is first, and receives as many; every rank
issues exactly one ``embedding grads`` all-reduce (every rank here is on the first or the
last stage); with DP and ``overlap_grad_reduce``, step 1 onward issues each bucket
group's DP reduction exactly once, from the chunk's last backward, so on the last stage
all of them precede the schedule's final activation-grad send (overlap with the pipeline).

The most chunk-forwards alive at once on each rank (counted by the adapter) equal the dry
run's ``in_flight_forwards`` for the schedule: 1F1B ``P − p``, GPipe ``M``, interleaved
``2(P − p − 1) + (V − 1)P + 1`` (capped at ``M·V``).

Tolerances (fp32, gloo): loss per step within 1e-5 relative, weights within 1e-6 absolute
(measured with ``-s``: printed per layout); every tensor moves by at least 100× that.
NCCL (one GPU per rank; not run here, no GPUs): weights within 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import WORD_EMBEDDING, GPTConfig, ParallelLayout, ReferenceRun
from examples.gpt.pipeline import build_pipeline, pipeline_final_weights, pipeline_step
from integration_tests._common import (
    GLOBAL_BATCH,
    SGD,
    STEPS,
    backends,
    batch,
    device_for,
    max_rel_loss_diff,
    max_weight_diff,
    model_parallel,
)
from integration_tests._per_token import (
    full_weights_for,
    loss_mask,
    per_token_reference,
    plain_reference,
)
from mc_groups.pipeline_stages import pipeline_rank
from mc_groups.testing import RankPools
from mc_train import in_flight_forwards

CFG4 = GPTConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, seq_length=16)
CASES: dict[int, list[tuple[ParallelLayout, str]]] = {
    2: [
        (ParallelLayout(pp=2), "1f1b"),
        (ParallelLayout(pp=2, calculate_per_token_loss=True), "gpipe"),
        (ParallelLayout(pp=2, vpp=2, microbatches=4), "interleaved"),
    ],
    4: [
        (ParallelLayout(tp=2, pp=2, sequence_parallel=True), "1f1b"),
        (ParallelLayout(pp=2, dp=2, distributed_optimizer=True), "1f1b"),
    ],
    8: [(ParallelLayout(tp=2, pp=2, dp=2, distributed_optimizer=True), "1f1b")],
}


def _summary(log: list[mg.CollectiveRecord]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(r.op, r.group_ranks, r.label) for r in log]


def _train(layout: ParallelLayout, schedule: str, device: torch.device) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG4, dist.get_world_size(), GLOBAL_BATCH)
        rows = GLOBAL_BATCH // (layout.dp * layout.microbatches)
        trainer = build_pipeline(
            CFG4,
            layout,
            SGD,
            pgc,
            full_weights_for(CFG4),
            device,
            schedule=schedule,
            micro_batch_size=rows,
        )
        losses, logs, peaks = [], [], []
        for step in range(STEPS):
            mask = loss_mask(step) if layout.calculate_per_token_loss else None
            with mg.record_collectives() as log:
                losses.append(pipeline_step(trainer, batch(step), mask))
            logs.append(_summary(log))
            peaks.append(trainer.in_flight.peak)
        buckets = sum(len(chunk.bucket_groups) for chunk in trainer.chunks)
        with pytest.raises(ValueError, match="the pipeline's stages were built for") as bad:
            pipeline_step(trainer, batch(0)[:4], loss_mask(0) if mask is not None else None)
        return {
            "stage": pipeline_rank(pgc),
            "tp_rank": mg.group_rank(pgc.require("tp", "test")),
            "dp_rank": mg.group_rank(pgc.require("dp", "test")),
            "pp_ranks": tuple(mg.group_ranks(pgc.require("pp", "test"))),
            "dp_ranks": tuple(mg.group_ranks(pgc.require("dp", "test"))),
            "buckets": buckets,
            "losses": losses,
            "logs": logs,
            "in_flight": peaks,
            "bad_batch": str(bad.value),
            "weights": pipeline_final_weights(trainer),
        }


def train_cases(cases: list[tuple[ParallelLayout, str]], backend: str) -> list[dict[str, Any]]:
    """Runs on every rank: each case trained for 5 steps."""
    torch.set_num_threads(1)
    return [_train(layout, schedule, device_for(backend)) for layout, schedule in cases]


def _reference(layout: ParallelLayout) -> ReferenceRun:
    if layout.calculate_per_token_loss:
        return per_token_reference(CFG4)
    return plain_reference(CFG4)


def _expected_p2p(layout: ParallelLayout, stage: int) -> tuple[int, int]:
    """(sends, recvs) per step of pipeline stage ``stage``: M each way across every
    boundary next to one of its chunks (global stages ``v·P + stage``)."""
    vpp, m = layout.vpp or 1, layout.microbatches
    last = layout.pp * vpp - 1
    sends = recvs = 0
    for v in range(vpp):
        c = v * layout.pp + stage
        sends += m * ((c < last) + (c > 0))  # activation forward, its grad back
        recvs += m * ((c > 0) + (c < last))
    return sends, recvs


def _check_collectives(layout: ParallelLayout, out: dict[str, Any]) -> None:
    sends, recvs = _expected_p2p(layout, out["stage"])
    embd = ("all_reduce", out["pp_ranks"], "embedding grads")
    for log in out["logs"]:
        p2p = [r for r in log if r[2] in ("activation", "activation grad")]
        assert [r[0] for r in p2p].count("send") == sends, log
        assert [r[0] for r in p2p].count("recv") == recvs, log
        assert {r[1] for r in p2p} == {out["pp_ranks"]}
        assert log.count(embd) == 1, log
    if layout.dp == 1:
        return
    # Step 1 onward (overlap dispatches from the hooks after the first iteration): one DP
    # reduction per bucket group per step, all before finalize's embedding all-reduce, and
    # on the last stage before its final activation-grad send.
    log = out["logs"][-1]
    reductions = [
        i for i, r in enumerate(log) if r[1] == out["dp_ranks"] and r[2].startswith("grad")
    ]
    assert len(reductions) == out["buckets"], log
    assert max(reductions) < log.index(embd), log
    if out["stage"] == layout.pp - 1:
        last_send = max(i for i, r in enumerate(log) if r[:1] == ("send",))
        assert max(reductions) < last_send, log


def _check_case(
    index: int, layout: ParallelLayout, schedule: str, per_rank: list[Any], tol: float
) -> None:
    outs = [rank[index] for rank in per_rank]
    ref = _reference(layout)
    start = full_weights_for(CFG4)
    assert min(float((w - start[k]).abs().max()) for k, w in ref.weights.items()) >= 100 * tol
    rel = max(max_rel_loss_diff(out["losses"], ref.losses) for out in outs)
    assert rel <= 1e-5, (schedule, layout.describe(), rel)
    firsts = [o for o in outs if o["tp_rank"] == o["dp_rank"] == 0]
    by_stage = {o["stage"]: o["weights"] for o in firsts}
    assert sorted(by_stage) == list(range(layout.pp))
    table0 = by_stage[0].pop(WORD_EMBEDDING)
    table1 = by_stage[layout.pp - 1].pop(WORD_EMBEDDING)
    assert torch.equal(table0, table1)
    merged = {k: v for weights in by_stage.values() for k, v in weights.items()}
    diff, name = max_weight_diff({**merged, WORD_EMBEDDING: table0}, ref.weights)
    assert diff <= tol, (schedule, layout.describe(), name, diff)
    rows = GLOBAL_BATCH // (layout.dp * layout.microbatches)
    for out in outs:
        assert out["bad_batch"] == (
            f"tokens of shape (4, 17): the pipeline's stages were built for (8, 17) (dp "
            f"{layout.dp} × {layout.microbatches} micro-batches × micro_batch_size {rows} "
            "rows of seq_length + 1 ids); rebuild it with build_pipeline(micro_batch_size=...) "
            "for another batch"
        )
        _check_collectives(layout, out)
        # torch's schedule keeps as many chunk-forwards alive as the dry run counts
        flight = in_flight_forwards(
            schedule, out["stage"], layout.pp, layout.microbatches, layout.vpp or 1
        )
        assert out["in_flight"] == [flight] * STEPS, (schedule, out["stage"], out["in_flight"])
    print(f"{schedule} {layout.describe()}: loss {rel:.1e}, weights {diff:.1e}")


WORLDS = [
    pytest.param(world, *backend.values, marks=backend.marks, id=f"{world}-{backend.id}")
    for world in sorted(CASES)
    for backend in backends(world)
]


@pytest.mark.parametrize(("world", "backend"), WORLDS)
def test_pipeline_schedules_match_one_process(
    rank_pools: RankPools, world: int, backend: str
) -> None:
    cases = CASES[world]
    per_rank = rank_pools.get(world, backend).run(train_cases, cases, backend)
    tol = 1e-6 if backend == "gloo" else 1e-5
    for i, (layout, schedule) in enumerate(cases):
        _check_case(i, layout, schedule, per_rank, tol)
