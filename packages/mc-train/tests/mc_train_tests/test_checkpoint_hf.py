"""``Checkpointer`` on a ``transformers`` Llama with tied embeddings (2 ranks, AdamW), saved
by a 2-stage pipeline and resumed by a pipeline and by plain data parallelism.

Runs, all on the 2-rank pool, each step on the same global batch:

- A: PP=2 (1F1B, distributed-optimizer DDP layout), 4 steps, saving every 2 steps and
  keeping 1: the uninterrupted reference; its folder keeps only ``step-00000004``.
- B: the same run stopped after step 2 (folder B: ``step-00000002``), and A's ``step-4``
  copied beside it, then truncated (one rank's shard): a damaged newest checkpoint.
- C: PP=2 resuming ``"auto"`` from folder B: passes over the damaged step 4 (named, with
  the file and the rank that wrote it), resumes step 2 and trains steps 3-4.
- D: DP=2 (no pipeline: the whole model in one mc DDP, ``transformers``' own loss) resuming
  step 2 of folder B by path, steps 3-4.

Localizes :mod:`mc_train.checkpoint` on a model that is not the demo's: full-shape keys under
the model's own names whatever the split, the tied table written once (the last stage's
copy ``lm_head.weight`` is not a key of the checkpoint; it is loaded from
``model.embed_tokens.weight``, optimizer state included), retention, and the fallback.

Checks: C's losses equal A's exactly (same layout, same bytes: ``==`` on floats); D's within
1e-5 relative of A's (another layout sums in another order; measured, printed with -s); a
control run that resumes without the optimizer state moves the losses by far more.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer
from mc_finalize import finalize_model_grads
from mc_groups.testing import RankPools
from mc_train import (
    build_pipeline,
    decoder_stages,
    hf_causal_lm_forward,
    split_model,
    token_cross_entropy,
)
from mc_train.checkpoint import Checkpointer
from mc_train_tests import _hf

pytest.importorskip("transformers", reason="the library tests train a transformers Llama")

STEPS = 4
RUN = {"model": "llama-4x32-tied", "optimizer": "adamw 3e-2"}
DDP = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=2048)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-2)


def pipeline_run(folder: str, resume: str, steps: int, interval: int, keep: int | None) -> Any:
    """Runs on both ranks: PP=2, resuming ``resume``, training up to ``steps``."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(1, 2)
    try:
        model = _hf.build(tie=True)
        chunks = split_model(model, decoder_stages(model, 2), pgc)
        pipe = build_pipeline(
            chunks,
            config=mg.ModelParallelConfig(pipeline_model_parallel_size=2),
            ddp_config=DDP,
            pg_collection=pgc,
            microbatches=2,
            loss_fn=token_cross_entropy(),
            forward=hf_causal_lm_forward,
        )
        opt = ShardedOptimizer(_adamw(pipe.parameters()), pipe.chunks)
        ckpt = Checkpointer(
            folder, pipe.chunks, opt, pg_collection=pgc, interval=interval, keep=keep, run=RUN
        )
        resumed = ckpt.load(resume)
        losses = list(resumed.state.get("losses", []))
        for step in range(resumed.step, steps):
            ids = _hf.batch(step)
            losses.append(pipe.forward_backward(ids, _hf.targets(ids)))
            opt.step()
            ckpt.save(step + 1, state={"losses": losses}, last=step + 1 == steps)
        return {"losses": losses, "step": resumed.step, "damaged": resumed.damaged}
    finally:
        mg.destroy_model_parallel(pgc)


def data_parallel_run(path: str, with_optimizer: bool) -> list[float]:
    """Runs on both ranks: DP=2, the whole model, resuming ``path`` (model only without
    ``with_optimizer``), steps 3-4 with ``transformers``' loss on this rank's rows."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(1, 1)
    try:
        ddp = DistributedDataParallel(
            mg.ModelParallelConfig(), DDP, _hf.build(tie=True, seed=1), pg_collection=pgc
        )
        opt = ShardedOptimizer(_adamw(ddp.parameters()), ddp)
        ckpt = Checkpointer(None, ddp, opt if with_optimizer else None, pg_collection=pgc, run=RUN)
        resumed = ckpt.load(path)
        if not with_optimizer:
            opt.reload_model_params()  # the masters from the loaded weights
        dp = pgc.require("dp", "test")
        rows = slice(dp.rank() * 4, dp.rank() * 4 + 4)
        losses = list(resumed.state["losses"])
        for step in range(resumed.step, STEPS):
            ids = _hf.batch(step)[rows]
            ddp.zero_grad_buffer()
            loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            finalize_model_grads([ddp], pg_collection=pgc)
            opt.step()
            mean = loss.detach().clone()
            mg.all_reduce(mean, dp, op=mg.ReduceOp.AVG, label="loss for logging")
            losses.append(float(mean))
        return losses
    finally:
        mg.destroy_model_parallel(pgc)


def _keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_resume_across_layouts_and_past_a_damaged_checkpoint(
    rank_pools: RankPools, tmp_path: Path
) -> None:
    pool = rank_pools.get(2)
    a, b = tmp_path / "a", tmp_path / "b"
    full = pool.run(pipeline_run, str(a), "auto", STEPS, 2, 1)[0]["losses"]
    assert sorted(p.name for p in a.iterdir()) == ["step-00000004"]  # keep=1
    keys = _keys(a / "step-00000004")
    assert "model.model.embed_tokens.weight" in keys
    assert not any("lm_head.weight" in k for k in keys), sorted(keys)
    assert "optimizer.model.model.embed_tokens.weight.exp_avg" in keys

    stopped = pool.run(pipeline_run, str(b), "auto", 2, 2, None)[0]["losses"]
    assert stopped == full[:2]
    shutil.copytree(a / "step-00000004", b / "step-00000004")
    shard = b / "step-00000004" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])

    resumed = pool.run(pipeline_run, str(b), "auto", STEPS, 2, None)
    assert resumed[0]["step"] == 2
    (damage,) = resumed[0]["damaged"]
    assert damage.startswith("step-00000004: __1_0.distcp differs from what was written: 100")
    assert "(written by rank 1;" in damage
    assert all(r["losses"] == full for r in resumed)  # same layout: bit for bit

    step2 = str(b / "step-00000002")
    flat = pool.run(data_parallel_run, step2, True)[0]
    assert flat[:2] == full[:2]
    rel = max(abs(x - y) / abs(y) for x, y in zip(flat[2:], full[2:], strict=True))
    print(f"PP=2 -> DP=2: steps 3-4 max relative loss difference {rel:.1e}")
    assert rel <= 1e-5, (flat, full)
    forgot = pool.run(data_parallel_run, step2, False)[0]
    moved = max(abs(x - y) / abs(y) for x, y in zip(forgot[2:], full[2:], strict=True))
    print(f"resumed without the optimizer state: {moved:.1e}")
    assert moved > 100 * 1e-5  # the control moves them far past the bound
