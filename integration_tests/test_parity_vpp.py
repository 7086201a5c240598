"""A 2-stage pipeline × 2 virtual chunks of a 4-block GPT (2 ranks, PP=2, VPP=2) with tied
embeddings, against the 1-process reference.

Layout (Megatron's interleaved placement, ``ParallelLayout(pp=2, vpp=2)``, chunk
``c = v·pp + p`` holds block c)::

    rank 0 (stage 0): chunk 0 = embedding + block 0 (vp_stage 0),  chunk 2 = block 2 (vp_stage 1)
    rank 1 (stage 1): chunk 1 = block 1 (vp_stage 0),  chunk 3 = block 3 + final LN + LM head
                      (vp_stage 1; its own copy of the tied table, ``output_layer.weight``)

Each chunk is a ``GPT(vp_stage=v)`` whose pre/post-process flags come from
``config.virtual_pipeline_model_parallel_size`` and is wrapped in its own DDP (chunks after
the first with ``disable_bucketing``, as Megatron's ``get_model`` does); one
``ShardedOptimizer`` steps all of a rank's chunks. No schedule: per micro-batch, all
forwards (chunk 0 → 1 → 2 → 3, activations sent with mc_groups' send/recv) then all
backwards (3 → 0); micro-batches other than the last run inside every chunk's ``no_sync``.

Localizes ``finalize_model_grads`` over a list of virtual chunks: the tied-embedding grad is
taken from ``model[0]`` on the first stage (chunk 0, the lookup) and from ``model[-1]`` on
the last stage (chunk 3, the LM head) and summed over ``embd`` (ranks 0 and 1): exactly one
SUM all-reduce per rank and nothing else in finalize (DP = TP = 1). Picking the wrong chunk
on either stage leaves one rank without the all-reduce (a hang or a wrong grad). With
``calculate_per_token_loss`` (uneven loss mask, :mod:`integration_tests._per_token`) the
last stage's token count is broadcast to stage 0 over pp (recorded) and every chunk's grads
are divided by it.

Layouts: plain (all-reduce), distributed optimizer (the tied copies get buckets of their
own), per-token loss. 5 SGD steps each.

Tolerances (fp32, as test_pipeline.py; measured on gloo, printed with ``-s``): step 0's
grads after finalize within 1e-6 of each tensor's largest magnitude (measured ≤ 5.5e-7:
the chunks split the same sums by micro-batch and the head's grad is summed across
stages); the two copies of the table bit-identical; loss per step within 1e-5 relative
(measured ≤ 1.5e-7); final weights within 1e-6 absolute (measured ≤ 1.5e-7) while every
tensor moves by ≥ 7.1e-4 (checked ≥ 100 × the tolerance). The per-token reference is
1.1e-2 away from a run normalising per micro-batch (checked ≥ 100 × the tolerance), so
the test tells the two normalisations apart. NCCL (not run here, no GPUs): 1e-5.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt import (
    GPT,
    WORD_EMBEDDING,
    GPTConfig,
    ParallelLayout,
    ReferenceRun,
    apply_ddp,
    build_model,
    gather_full_weights,
    reference_grads,
)
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
    microbatch_mean_reference,
    per_token_reference,
    plain_reference,
    single_thread,
)
from mc_ddp import DistributedDataParallel, ShardedOptimizer, ensure_params_ready
from mc_finalize import finalize_model_grads
from mc_groups.pipeline_stages import pipeline_rank, pipeline_size
from mc_groups.testing import RankPools

CFG4 = GPTConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, seq_length=16)
LAYOUTS = [
    ParallelLayout(pp=2, vpp=2),
    ParallelLayout(pp=2, vpp=2, distributed_optimizer=True),
    ParallelLayout(pp=2, vpp=2, calculate_per_token_loss=True),
]
_SHARED = {WORD_EMBEDDING, "output_layer.weight"}
Chunks = list[DistributedDataParallel[mg.ModelParallelConfig]]


def _full_name(name: str) -> str:
    return WORD_EMBEDDING if name in _SHARED else name


def _build(layout: ParallelLayout, pgc: mg.ProcessGroupCollection, device: torch.device) -> Chunks:
    assert layout.vpp is not None
    full = full_weights_for(CFG4)
    return [
        apply_ddp(
            build_model(CFG4, layout, pgc, full, device, vp_stage=v),
            layout,
            pgc,
            disable_bucketing=v > 0,
        )
        for v in range(layout.vpp)
    ]


def _microbatch(
    chunks: Chunks,
    pgc: mg.ProcessGroupCollection,
    layout: ParallelLayout,
    mb: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor | None:
    """All forwards, then all backwards, of one micro-batch through the 4 chunks; the loss
    (``Σ mask·CE`` per token, else mean CE / m) on the rank holding the last chunk."""
    pp = pgc.require("pp", "vpp test")
    stage, stages = pipeline_rank(pgc), pipeline_size(pgc)
    prev, nxt = (stage - 1) % stages, (stage + 1) % stages
    tokens, labels = mb[:, :-1], mb[:, 1:]
    last = stages * len(chunks) - 1
    per_token = layout.calculate_per_token_loss
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    for c in range(last + 1):
        if c % stages != stage:
            continue
        hidden = None
        if c > 0:
            shape = (CFG4.seq_length, tokens.shape[0], CFG4.hidden_size)
            hidden = torch.empty(shape, device=mb.device)
            mg.recv(hidden, pp, group_src=prev, label="activation")
            inputs[c] = hidden.requires_grad_()
        out = chunks[c // stages](tokens, labels, hidden_states=hidden, per_token_loss=per_token)
        if c == last:
            out = (out * mask).sum() if per_token else out / layout.microbatches
        else:
            mg.send(out.detach().contiguous(), pp, group_dst=nxt, label="activation")
        outputs[c] = out
    for c in reversed(range(last + 1)):
        if c % stages != stage:
            continue
        if c == last:
            torch.autograd.backward(outputs[c])
        else:
            grad = torch.empty_like(outputs[c])
            mg.recv(grad, pp, group_src=nxt, label="activation grad")
            torch.autograd.backward(outputs[c], grad)
        if c > 0:
            sent = inputs[c].grad
            assert sent is not None
            mg.send(sent.contiguous(), pp, group_dst=prev, label="activation grad")
    return outputs[last].detach() if last in outputs else None


def _main_grads(chunks: Chunks) -> dict[str, torch.Tensor]:
    return {
        name: p.main_grad.detach().float().cpu().clone()  # type: ignore[attr-defined]
        for chunk in chunks
        for name, p in chunk.module.named_parameters()
    }


def _step(
    chunks: Chunks,
    optimizer: ShardedOptimizer,
    pgc: mg.ProcessGroupCollection,
    layout: ParallelLayout,
    step: int,
    out: dict[str, Any],
) -> float | None:
    """One optimizer step; fills ``out`` with grads and records at step 0."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    micro, device = layout.microbatches, next(chunks[0].parameters()).device
    tokens, masks = batch(step).to(device), loss_mask(step).to(device)
    pieces = zip(tokens.chunk(micro), masks.chunk(micro), strict=True)
    losses: list[torch.Tensor] = []
    count = torch.zeros((), dtype=torch.int64, device=device)
    with mg.record_collectives() as p2p:
        for i, (mb, mask) in enumerate(pieces):
            with ExitStack() as stack:
                if i < micro - 1:
                    for chunk in chunks:
                        stack.enter_context(chunk.no_sync())
                loss = _microbatch(chunks, pgc, layout, mb, mask)
            if loss is not None:
                losses.append(loss)
                count += int(mask.sum())
    if step == 0:
        for chunk in chunks:
            chunk.finish_grad_sync()
        out["grads_before"] = _main_grads(chunks)
        out["p2p"] = [(r.op, r.group_ranks, r.label) for r in p2p]
    num_tokens = count.clone() if layout.calculate_per_token_loss else None
    with mg.record_collectives() as log:
        finalize_model_grads(chunks, num_tokens=num_tokens, pg_collection=pgc)
    if step == 0:
        out["grads_after"] = _main_grads(chunks)
        out["finalize"] = [(r.op, r.reduce_op, r.group_ranks, r.label) for r in log]
        out["num_tokens"] = None if num_tokens is None else int(num_tokens)
    optimizer.step()
    if not losses:
        return None
    total = torch.stack(losses).sum()
    return float(total / count) if layout.calculate_per_token_loss else float(total)


def _placement(chunk: DistributedDataParallel[mg.ModelParallelConfig]) -> tuple[Any, ...]:
    """(vpp read from the chunk's config, vp_stage, blocks, pre_process, post_process,
    bucket groups)."""
    gpt = chunk.module
    assert isinstance(gpt, GPT)
    return (
        chunk.config.virtual_pipeline_model_parallel_size,
        gpt.vp_stage,
        sorted(int(i) for i in gpt.decoder.layers),
        gpt.pre_process,
        gpt.post_process,
        len(chunk.bucket_groups),
    )


def _train(layout: ParallelLayout, backend: str) -> dict[str, Any]:
    with model_parallel(layout) as pgc:
        layout.check(CFG4, dist.get_world_size(), GLOBAL_BATCH)
        chunks = _build(layout, pgc, device_for(backend))
        params = [p for chunk in chunks for p in chunk.parameters()]
        optimizer = ShardedOptimizer(SGD.build(params), chunks)
        out: dict[str, Any] = {
            "stage": pipeline_rank(pgc),
            "placement": [_placement(chunk) for chunk in chunks],
        }
        out["losses"] = [_step(chunks, optimizer, pgc, layout, t, out) for t in range(STEPS)]
        weights: dict[str, torch.Tensor] = {}
        tp = pgc.require("tp", "vpp test")
        for chunk in chunks:
            ensure_params_ready(list(chunk.module.parameters()))
            weights |= gather_full_weights(chunk.module, tp)
        out["weights"] = weights
        return out


def train_vpp(layouts: list[ParallelLayout], backend: str) -> list[dict[str, Any]]:
    """Runs on both ranks: each layout trained for 5 steps."""
    return [_train(layout, backend) for layout in layouts]


def _reference(layout: ParallelLayout) -> ReferenceRun:
    return per_token_reference(CFG4) if layout.calculate_per_token_loss else plain_reference(CFG4)


def _smallest_update(ref: ReferenceRun) -> float:
    start = full_weights_for(CFG4)
    return min(float((w - start[k]).abs().max()) for k, w in ref.weights.items())


def _check_grads(layout: ParallelLayout, stage0: dict[str, Any], stage1: dict[str, Any]) -> float:
    """Checks step 0's grads before and after finalize; returns the largest error after."""
    per_token = layout.calculate_per_token_loss
    mask = loss_mask(0) if per_token else None
    with single_thread():
        _, ref = reference_grads(full_weights_for(CFG4), CFG4, batch(0), mask)
    # Before finalize: per-token grads are sums over tokens, not yet divided by N.
    scale = 1.0 / float(loss_mask(0).sum()) if per_token else 1.0
    lookup = stage0["grads_before"][WORD_EMBEDDING] * scale
    head = stage1["grads_before"]["output_layer.weight"] * scale
    table = ref[WORD_EMBEDDING]
    top = float(table.abs().max())
    assert float((lookup - table).abs().max()) > 1e-2 * top  # one use each
    assert float((head - table).abs().max()) > 1e-2 * top
    assert float((lookup + head - table).abs().max()) <= 1e-6 * top
    worst = 0.0
    for stage in (stage0, stage1):
        for name, grad in stage["grads_after"].items():
            expected = ref[_full_name(name)]
            err = float((grad - expected).abs().max()) / float(expected.abs().max())
            assert err <= 1e-6, (layout.describe(), name, err)
            worst = max(worst, err)
    assert torch.equal(
        stage0["grads_after"][WORD_EMBEDDING], stage1["grads_after"]["output_layer.weight"]
    )
    return worst


def _check_collectives(
    layout: ParallelLayout, stage0: dict[str, Any], stage1: dict[str, Any]
) -> None:
    expected: list[tuple[str, str | None, tuple[int, ...], str]] = [
        ("all_reduce", "sum", (0, 1), "embedding grads")
    ]
    if layout.calculate_per_token_loss:
        # from the last pp rank; the SUM over dp_cp has one rank here and is skipped
        expected.append(("broadcast", None, (0, 1), "num_tokens"))
        total = int(loss_mask(0).sum())
        assert stage0["num_tokens"] == stage1["num_tokens"] == total
    for stage in (stage0, stage1):
        assert stage["finalize"] == expected, (layout.describe(), stage["finalize"])
        # per micro-batch: 3 activations forward and 3 grads back cross the two ranks
        sends = [r for r in stage["p2p"] if r[0] == "send"]
        assert len(sends) == 3 * layout.microbatches, stage["p2p"]
        assert {r[1] for r in stage["p2p"]} == {(0, 1)}


@pytest.mark.parametrize("backend", backends(2))
def test_virtual_pipeline_chunks_share_embedding_grads(rank_pools: RankPools, backend: str) -> None:
    per_rank = rank_pools.get(2, backend).run(train_vpp, LAYOUTS, backend)
    tol = 1e-6 if backend == "gloo" else 1e-5
    for i, layout in enumerate(LAYOUTS):
        stage0, stage1 = per_rank[0][i], per_rank[1][i]
        assert (stage0["stage"], stage1["stage"]) == (0, 1)
        # (vpp from config, vp_stage, blocks, pre_process, post_process, bucket groups)
        assert [p[:5] for p in stage0["placement"]] == [
            (2, 0, [0], True, False),
            (2, 1, [2], False, False),
        ]
        assert [p[:5] for p in stage1["placement"]] == [
            (2, 0, [1], False, False),
            (2, 1, [3], False, True),
        ]
        # bucket groups: only stage 0's first chunk is bucketed (disable_bucketing after it,
        # one bucket on later pipeline stages)
        buckets = [p[5] for p in stage0["placement"] + stage1["placement"]]
        assert buckets[0] >= 2, buckets
        assert buckets[1:] == [1, 1, 1], buckets
        grad_err = _check_grads(layout, stage0, stage1)
        _check_collectives(layout, stage0, stage1)
        ref = _reference(layout)
        assert _smallest_update(ref) >= 100 * tol
        assert stage0["losses"] == [None] * STEPS
        rel = max_rel_loss_diff(stage1["losses"], ref.losses)
        assert rel <= 1e-5, (layout.describe(), rel)
        table0 = stage0["weights"].pop(WORD_EMBEDDING)
        table1 = stage1["weights"].pop(WORD_EMBEDDING)
        assert torch.equal(table0, table1)
        merged = {**stage0["weights"], **stage1["weights"], WORD_EMBEDDING: table0}
        diff, name = max_weight_diff(merged, ref.weights)
        assert diff <= tol, (layout.describe(), name, diff)
        print(f"{layout.describe()}: grads {grad_err:.1e}, loss {rel:.1e}, weights {diff:.1e}")
    # The per-token case is far from a per-micro-batch normalisation of the same masks.
    apart, _ = max_weight_diff(
        per_token_reference(CFG4).weights, microbatch_mean_reference(CFG4, 2).weights
    )
    assert apart >= 100 * tol, apart
