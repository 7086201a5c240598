"""A ``transformers`` Llama (4 blocks, from a config) cut by ``split_model`` into pipeline
stages and trained by ``build_pipeline`` (mc DDP per chunk, ``torch.distributed.pipelining``
schedules, stage shapes inferred), against the same model trained by one process on the
whole global batch with ``transformers``' own loss (8 sequences of 16 tokens, 3 SGD steps).

Cases, on 2 ranks (PP=2): 1F1B (untied); interleaved 1F1B with 2 chunks per rank (4
stages) and tied input/output embeddings (stage 0's ``embed_tokens`` and stage 3's
``lm_head`` hold copies, summed over ``embd``); GPipe with the per-token loss on labels
padded unevenly (``calculate_per_token_loss``: every counted target weighs the same, as
``transformers``' mean over the non-ignored labels). PP × DP is held by the demo's GPT
(``integration_tests/test_parity_pipeline.py``).

Localizes the library on a model that is not the demo's: the split (global names, the
stages composing to the model's forward, the tied copies marked), the stage calling
convention (``hf_causal_lm_forward``), the loss reduction, and the grad sync.

Collectives, recorded per step (steps 2 and 3; the first step also infers the stage
shapes): each chunk sends and receives ``M`` activations or their grads across every
boundary next to it; with tied embeddings every rank issues exactly one ``embedding
grads`` all-reduce, without them none. The most chunk-forwards alive at once equal
``mc_train.in_flight_forwards``.

Tolerances (fp32, gloo): loss per step within 1e-5 relative, weights within 1e-6 absolute
(measured, printed with -s); every tensor of the reference moves by at least 100× that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
from mc_ddp import DistributedDataParallelConfig, ShardedOptimizer
from mc_groups.pipeline_stages import pipeline_rank
from mc_groups.testing import RankPools
from mc_train import (
    build_pipeline,
    decoder_stages,
    hf_causal_lm_forward,
    in_flight_forwards,
    split_model,
    token_cross_entropy,
)
from mc_train_tests import _hf

pytest.importorskip("transformers", reason="the library tests train a transformers Llama")

M, STEPS = 4, 3
Case = tuple[str, int, bool, bool]  # schedule, chunks per rank, tied, per-token loss (padded)
CASES: list[Case] = [
    ("1f1b", 1, False, False),
    ("interleaved", 2, True, False),
    ("gpipe", 1, False, True),
]


def _train(case: Case) -> dict[str, Any]:
    schedule, vpp, tie, per_token = case
    pgc = mg.initialize_model_parallel(
        1, 2, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
    )
    try:
        config = mg.ModelParallelConfig(
            pipeline_model_parallel_size=2, calculate_per_token_loss=per_token
        )
        model = _hf.build(tie=tie)
        chunks = split_model(model, decoder_stages(model, 2 * vpp), pgc)
        pipe = build_pipeline(
            chunks,
            config=config,
            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2048),
            pg_collection=pgc,
            microbatches=M,
            loss_fn=token_cross_entropy(),
            schedule=schedule,
            forward=hf_causal_lm_forward,
        )
        opt = ShardedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.5), pipe.chunks)
        losses, logs, peaks = [], [], []
        for step in range(STEPS):
            target = _hf.targets(_hf.labels(step, padded=per_token))
            with mg.record_collectives() as log:
                losses.append(pipe.forward_backward(_hf.batch(step), target))
            opt.step()
            logs.append([(r.op, r.group_ranks, r.label) for r in log])
            peaks.append(pipe.in_flight.peak)
        return {
            "stage": pipeline_rank(pgc),
            "pp_ranks": tuple(mg.group_ranks(pgc.require("pp", "test"))),
            "tied": [
                n
                for chunk in pipe.chunks
                for n, p in chunk.module.named_parameters()
                if getattr(p, "shared_embedding", False)
            ],
            "losses": losses,
            "logs": logs,
            "in_flight": peaks,
            "weights": {
                k: v.detach().clone()
                for chunk in pipe.chunks
                for k, v in chunk.module.state_dict().items()
            },
        }
    finally:
        mg.destroy_model_parallel(pgc)


def train_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Runs on both ranks: each case trained for 3 steps."""
    torch.set_num_threads(1)
    return [_train(case) for case in cases]


def _check_collectives(case: Case, out: dict[str, Any]) -> None:
    schedule, vpp, tie, _ = case
    stages = 2 * vpp
    chunks = [v * 2 + out["stage"] for v in range(vpp)]
    boundaries = sum((c > 0) + (c < stages - 1) for c in chunks)
    embd = ("all_reduce", out["pp_ranks"], "embedding grads")
    for log in out["logs"][1:]:
        p2p = [r for r in log if r[2] in ("activation", "activation grad")]
        assert [r[0] for r in p2p].count("send") == M * boundaries, log
        assert [r[0] for r in p2p].count("recv") == M * boundaries, log
        assert log.count(embd) == (1 if tie else 0), log
    flight = in_flight_forwards(schedule, out["stage"], 2, M, vpp)
    assert out["in_flight"] == [flight] * STEPS, (schedule, out["stage"], out["in_flight"])


def _check(case: Case, outs: list[dict[str, Any]]) -> None:
    schedule, _, tie, per_token = case
    ref = _hf.reference(tie=tie, steps=STEPS, padded=per_token)
    start = _hf.build(tie=tie).state_dict()
    assert min(float((w - start[k]).abs().max()) for k, w in ref.weights.items()) >= 1e-4
    rel = max(
        abs(a - b) / abs(b) for out in outs for a, b in zip(out["losses"], ref.losses, strict=True)
    )
    assert rel <= 1e-5, (case, rel)
    merged: dict[str, torch.Tensor] = {}
    for out in outs:
        merged |= out["weights"]
        _check_collectives(case, out)
    names = set(merged)
    if tie:  # the last stage's copy under lm_head.weight equals the table it is tied to
        assert torch.equal(merged["lm_head.weight"], merged["model.embed_tokens.weight"])
        assert {n for out in outs for n in out["tied"]} == {
            "lm_head.weight",
            "model.embed_tokens.weight",
        }
    assert names == set(ref.weights), names ^ set(ref.weights)
    diff = max(float((merged[k] - w).abs().max()) for k, w in ref.weights.items())
    assert diff <= 1e-6, (case, diff)
    print(f"{schedule} tied={tie} per_token={per_token}: loss {rel:.1e}, weights {diff:.1e}")


def test_transformers_llama_pipeline_matches_one_process(rank_pools: RankPools) -> None:
    per_rank = rank_pools.get(2).run(train_cases, CASES)
    for i, case in enumerate(CASES):
        _check(case, [rank[i] for rank in per_rank])


def train_one_stage() -> dict[str, Any]:
    """Runs on both ranks: PP=1 × DP=2, the whole model one stage (1F1B on one stage)."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel()
    try:
        model = _hf.build(tie=True)
        pipe = build_pipeline(
            split_model(model, decoder_stages(model, 1), pgc),
            config=mg.ModelParallelConfig(),
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
            pg_collection=pgc,
            microbatches=2,
            loss_fn=token_cross_entropy(),
            forward=hf_causal_lm_forward,
        )
        opt = ShardedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.5), pipe.chunks)
        dp = mg.group_rank(pgc.require("dp", "test"))
        losses, logs = [], []
        for step in range(STEPS):
            ids = _hf.batch(step)[dp * 4 : dp * 4 + 4]
            with mg.record_collectives() as log:
                losses.append(pipe.forward_backward(ids, _hf.targets(ids)))
            opt.step()
            logs.append([r.label for r in log])
        weights = {k: v.detach().clone() for k, v in pipe.chunks[0].module.state_dict().items()}
        return {"losses": losses, "logs": logs, "peak": pipe.in_flight.peak, "weights": weights}
    finally:
        mg.destroy_model_parallel(pgc)


def test_one_stage_runs_the_micro_batches_in_turn(rank_pools: RankPools) -> None:
    """PP=1 (Megatron's ``forward_backward_no_pipelining``): ``schedule="1f1b"`` on one stage
    runs the micro-batches one after another (one forward in flight), accumulates their
    grads and reduces them once over DP; no P2P; the same losses and weights as one
    process on the whole batch (tied embeddings in one module)."""
    ref = _hf.reference(tie=True, steps=STEPS)
    outs = rank_pools.get(2).run(train_one_stage)
    for out in outs:
        rel = max(abs(a - b) / b for a, b in zip(out["losses"], ref.losses, strict=True))
        assert rel <= 1e-5, rel
        diff = max(float((out["weights"][k] - w).abs().max()) for k, w in ref.weights.items())
        assert diff <= 1e-6, diff
        assert out["peak"] == in_flight_forwards("1f1b", 0, 1, 2, 1) == 1
        for labels in out["logs"][1:]:
            assert not {"activation", "activation grad", "embedding grads"} & set(labels), labels
            assert sum(label.startswith("grad reduce") for label in labels) == 1, labels
    print(f"PP=1 x DP=2: loss {rel:.1e}, weights {diff:.1e}")
