"""A 2-stage pipeline of the small GPT (2 ranks, PP=2), run without a schedule: stage 0
holds the embedding and block 0, stage 1 block 1, the final layer norm and its own copy of
the tied table (``output_layer.weight``). Activations go forward and their grads back with
mc_groups' send/recv, one micro-batch at a time.

Localizes the tied-embedding step of ``finalize_model_grads``: before it, stage 0's table
grad holds only the lookup's contribution and stage 1's only the LM head's; after it (one
SUM all-reduce over the ``embd`` group, ranks 0 and 1) both hold their sum, which is the
1-process grad of the single tied table. Then 5 SGD steps keep the two copies identical and
match the reference.

Tolerances: grads within 1e-6 of each tensor's largest magnitude (fp32; the stages split the
same sums by micro-batch, a few ulps); the two copies of the table bit-identical (they
start equal and get the same reduced grad and the same update); loss per step within 1e-5
relative and weights within 1e-6 absolute as in the TP/DP parity tests (NCCL: 1e-5).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import (
    WORD_EMBEDDING,
    ParallelLayout,
    Trainer,
    final_weights,
    parallelize,
    reference_grads,
)
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
    smallest_update,
)
from mc_finalize import ModelChunk, finalize_model_grads
from mc_groups.pipeline_stages import pipeline_rank
from mc_groups.testing import RankPools

LAYOUTS = [
    ParallelLayout(pp=2),
    ParallelLayout(pp=2, distributed_optimizer=True),
]
_SHARED = {"embedding.word_embeddings.weight", "output_layer.weight"}


def _forward_backward(trainer: Trainer, mb: torch.Tensor, last: bool) -> float | None:
    """One micro-batch through both stages; the loss on stage 1, None on stage 0."""
    pp, model = trainer.pgc.require("pp", "pipeline test"), trainer.model
    tokens, labels = mb[:, :-1], mb[:, 1:]
    micro = trainer.layout.microbatches
    with nullcontext() if last else model.no_sync():
        if mg.is_pipeline_first_stage(trainer.pgc):
            hidden = model(tokens, labels)
            mg.send(hidden.detach().contiguous(), pp, group_dst=1, label="activation")
            grad = torch.empty_like(hidden)
            mg.recv(grad, pp, group_src=1, label="activation grad")
            torch.autograd.backward(hidden, grad)
            return None
        shape = (CFG.seq_length, tokens.shape[0], CFG.hidden_size)
        received = torch.empty(shape, device=trainer.device)
        mg.recv(received, pp, group_src=0, label="activation")
        received.requires_grad_()
        loss = model(tokens, labels, hidden_states=received) / micro
        torch.autograd.backward(loss)
        assert received.grad is not None
        mg.send(received.grad.contiguous(), pp, group_dst=0, label="activation grad")
        return float(loss.detach())


def _step_grads(trainer: Trainer, step: int) -> tuple[float | None, dict[str, torch.Tensor]]:
    """Forward/backward of every micro-batch; returns the loss and the grads before finalize."""
    trainer.model.zero_grad_buffer()
    micro = batch(step).to(trainer.device).chunk(trainer.layout.microbatches)
    losses = [_forward_backward(trainer, mb, i == len(micro) - 1) for i, mb in enumerate(micro)]
    trainer.model.finish_grad_sync()
    before = _main_grads(trainer)
    loss = None if losses[0] is None else sum(x for x in losses if x is not None)
    return loss, before


def _main_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: p.main_grad.detach().float().cpu().clone()  # type: ignore[attr-defined]
        for name, p in trainer.model.module.named_parameters()
    }


def _train(layout: ParallelLayout, backend: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG, dist.get_world_size(), 8)
        trainer = parallelize(CFG, layout, SGD, pgc, full_weights(), device_for(backend))
        chunk: ModelChunk = trainer.model
        losses: list[float | None] = []
        first: dict[str, Any] = {}
        for step in range(STEPS):
            loss, before = _step_grads(trainer, step)
            with mg.record_collectives() as log:
                finalize_model_grads([chunk], pg_collection=pgc)
            if step == 0:
                first = {"before": before, "after": _main_grads(trainer), "log": list(log)}
            trainer.optimizer.step()
            losses.append(loss)
        embd = [
            (r.op, r.reduce_op, r.group_ranks) for r in first["log"] if r.label == "embedding grads"
        ]
        return {
            "stage": pipeline_rank(pgc),
            "losses": losses,
            "grads_before": first["before"],
            "grads_after": first["after"],
            "embedding_collectives": embd,
            "weights": final_weights(trainer),
        }


def train_pipeline(layouts: list[ParallelLayout], backend: str) -> list[dict[str, Any]]:
    """Runs on both stages: each layout trained for 5 steps."""
    return [_train(layout, backend) for layout in layouts]


def _full_name(name: str) -> str:
    return WORD_EMBEDDING if name in _SHARED else name


def _check_grads(stage0: dict[str, Any], stage1: dict[str, Any]) -> None:
    _, ref = reference_grads(full_weights(), CFG, batch(0))
    lookup = stage0["grads_before"]["embedding.word_embeddings.weight"]
    head = stage1["grads_before"]["output_layer.weight"]
    table = ref[WORD_EMBEDDING]
    scale = float(table.abs().max())
    # Before finalize each copy holds one use; the two uses add up to the tied grad.
    assert float((lookup - table).abs().max()) > 1e-2 * scale
    assert float((head - table).abs().max()) > 1e-2 * scale
    assert float((lookup + head - table).abs().max()) <= 1e-6 * scale
    for stage in (stage0, stage1):
        assert stage["embedding_collectives"] == [("all_reduce", "sum", (0, 1))]
        for name, grad in stage["grads_after"].items():
            expected = ref[_full_name(name)]
            err = float((grad - expected).abs().max()) / float(expected.abs().max())
            assert err <= 1e-6, (name, err)
    assert torch.equal(
        stage0["grads_after"]["embedding.word_embeddings.weight"],
        stage1["grads_after"]["output_layer.weight"],
    )


@pytest.mark.parametrize("backend", backends(2))
def test_two_stage_pipeline_shares_embedding_grads(rank_pools: RankPools, backend: str) -> None:
    per_rank = rank_pools.get(2, backend).run(train_pipeline, LAYOUTS, backend)
    ref, tol = reference(), 1e-6 if backend == "gloo" else 1e-5
    assert smallest_update(ref) >= 100 * tol  # a lost or mis-scaled update cannot pass
    for i, layout in enumerate(LAYOUTS):
        stage0, stage1 = per_rank[0][i], per_rank[1][i]
        assert (stage0["stage"], stage1["stage"]) == (0, 1)
        _check_grads(stage0, stage1)
        assert stage0["losses"] == [None] * 5
        assert max_rel_loss_diff(stage1["losses"], ref.losses) <= 1e-5, layout.describe()
        # Each stage gathers its own params; the shared table appears on both.
        table0 = stage0["weights"].pop(WORD_EMBEDDING)
        table1 = stage1["weights"].pop(WORD_EMBEDDING)
        assert torch.equal(table0, table1)
        merged = {**stage0["weights"], **stage1["weights"], WORD_EMBEDDING: table0}
        diff, name = max_weight_diff(merged, ref.weights)
        assert diff <= tol, (layout.describe(), name, diff)
