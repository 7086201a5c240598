"""Training the GPT with mc, one small function per concern.

The plan, for a layout declared in :class:`~examples.gpt.config.ParallelLayout`:

1. ``build_model``: the GPT of this rank (its TP slice and pipeline stage, or one virtual
   chunk of it) from mc layers, loaded with this rank's part of the full weights.
2. ``apply_ddp``: wrap it in mc's ``DistributedDataParallel`` (contiguous grad buffers,
   buckets reduced while backward runs; with the distributed optimizer, params kept in
   the buffer and all-gathered bucket by bucket from the next forward's pre-hooks).
3. ``build_optimizer``: AdamW on the fp32 masters of this rank's shard (``ShardedOptimizer``),
   the whole model's grad norm clipped to ``opt.clip_grad`` when set.
4. ``train_step``: this DP rank's rows in equal micro-batches (all but the last inside
   ``no_sync``), ``finalize_model_grads`` (DP reduction, SP grads summed over TP), the
   optimizer step; returns the loss averaged over DP.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

import mc_groups as mg
from examples.gpt.config import GPTConfig, OptimizerConfig, ParallelLayout
from examples.gpt.data import dp_rows
from examples.gpt.model import GPT
from examples.gpt.weights import gather_full_weights, load_full_weights
from mc_ddp import DistributedDataParallel, ShardedOptimizer, StepResult, ensure_params_ready
from mc_finalize import finalize_model_grads
from mc_groups.pipeline_stages import pipeline_rank, pipeline_size

__all__ = [
    "Trainer",
    "apply_ddp",
    "build_model",
    "build_optimizer",
    "final_weights",
    "parallelize",
    "stage_layers",
    "train_step",
]


@dataclass
class Trainer:
    """Everything a training step needs on this rank."""

    cfg: GPTConfig
    layout: ParallelLayout
    pgc: mg.ProcessGroupCollection
    model: DistributedDataParallel[mg.ModelParallelConfig]
    optimizer: ShardedOptimizer
    device: torch.device
    last_step: StepResult | None = None  # what the last optimizer step did (its grad norm)


def stage_layers(
    cfg: GPTConfig,
    pgc: mg.ProcessGroupCollection,
    vp_stage: int | None = None,
    vp_size: int | None = None,
) -> range:
    """Global indices of the blocks of this rank's pipeline stage (equal contiguous runs).

    With virtual chunks (``vp_stage`` of ``vp_size``), Megatron's interleaved placement:
    the model is cut into ``P·V`` equal runs and stage ``p``'s chunk ``v`` holds run
    ``c = v·P + p``, i.e. blocks ``[c·L/(P·V), (c+1)·L/(P·V))``.
    """
    stages, stage = pipeline_size(pgc), pipeline_rank(pgc)
    if vp_stage is None:
        per_stage = cfg.num_layers // stages
        return range(stage * per_stage, (stage + 1) * per_stage)
    if vp_size is None or not 0 <= vp_stage < vp_size:
        raise ValueError(f"vp_stage={vp_stage} needs vp_size (got {vp_size}) > vp_stage >= 0")
    per_chunk = cfg.num_layers // (stages * vp_size)
    chunk = vp_stage * stages + stage
    return range(chunk * per_chunk, (chunk + 1) * per_chunk)


def build_model(
    cfg: GPTConfig,
    layout: ParallelLayout,
    pgc: mg.ProcessGroupCollection,
    full: dict[str, torch.Tensor],
    device: torch.device,
    vp_stage: int | None = None,
) -> GPT:
    """1. This rank's GPT (TP slice, pipeline stage, or with ``vp_stage`` that virtual chunk
    of ``layout.vpp``), holding its part of ``full``."""
    mp = layout.model_parallel_config()
    layers = stage_layers(cfg, pgc, vp_stage, layout.vpp)
    model = GPT(cfg, mp, pgc, device, layers=layers, vp_stage=vp_stage)
    load_full_weights(model, full, pgc.require("tp", "build_model"))
    if layout.compile_blocks:  # each block one graph; DDP's pre-hook on it stays eager
        for block in model.decoder.layers.values():
            block.forward = torch.compile(
                block.forward, fullgraph=True, backend=layout.compile_backend
            )
    return model


def apply_ddp(
    model: GPT,
    layout: ParallelLayout,
    pgc: mg.ProcessGroupCollection,
    *,
    disable_bucketing: bool = False,
) -> DistributedDataParallel[mg.ModelParallelConfig]:
    """2. mc DDP over ``model`` with the layout's bucket, overlap and sharding settings
    (``disable_bucketing``: one bucket, as Megatron does for virtual chunks after the
    first)."""
    return DistributedDataParallel(
        layout.model_parallel_config(),
        layout.ddp_config(),
        model,
        disable_bucketing=disable_bucketing,
        pg_collection=pgc,
    )


def build_optimizer(
    model: DistributedDataParallel,
    opt: OptimizerConfig,
    pgc: mg.ProcessGroupCollection | None = None,
) -> ShardedOptimizer:
    """3. AdamW stepping this rank's shard of fp32 masters (all params without the
    distributed optimizer), clipping the global grad norm to ``opt.clip_grad`` (the
    groups from ``pgc``)."""
    return ShardedOptimizer(
        opt.build(list(model.parameters())),
        model,
        max_grad_norm=opt.clip_grad,
        pg_collection=pgc,
    )


def parallelize(
    cfg: GPTConfig,
    layout: ParallelLayout,
    opt: OptimizerConfig,
    pgc: mg.ProcessGroupCollection,
    full: dict[str, torch.Tensor],
    device: torch.device,
) -> Trainer:
    """Steps 1-3: the model, its DDP wrapper and its optimizer on this rank."""
    model = apply_ddp(build_model(cfg, layout, pgc, full, device), layout, pgc)
    return Trainer(cfg, layout, pgc, model, build_optimizer(model, opt, pgc), device)


def _microbatches(trainer: Trainer, tokens: torch.Tensor) -> list[torch.Tensor]:
    dp = trainer.pgc.require("dp", "train_step")
    rows = dp_rows(tokens, mg.group_rank(dp), mg.group_size(dp)).to(trainer.device)
    return list(rows.chunk(trainer.layout.microbatches))


def train_step(trainer: Trainer, tokens: torch.Tensor) -> float:
    """4. One optimizer step on the global batch ``tokens`` (``[B, s + 1]``, the same on
    every rank); returns the mean loss over the global batch (one all-reduce over DP)."""
    model, micro = trainer.model, _microbatches(trainer, tokens)
    model.zero_grad_buffer()
    total = torch.zeros((), dtype=torch.float32, device=trainer.device)
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        with nullcontext() if last else model.no_sync():
            loss = model(mb[:, :-1], mb[:, 1:]) / len(micro)
            torch.autograd.backward(loss)
        total += loss.detach().float()
    finalize_model_grads([model], pg_collection=trainer.pgc)
    trainer.last_step = trainer.optimizer.step()
    dp = trainer.pgc.require("dp", "train_step")
    mg.all_reduce(total, dp, op=mg.ReduceOp.AVG, label="loss for logging")
    return float(total)


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trained full weights (fp32, CPU): params published (an overlapped param
    all-gather may still be due), then gathered over TP."""
    module = trainer.model.module
    ensure_params_ready(list(module.parameters()))
    return gather_full_weights(module, trainer.pgc.require("tp", "final_weights"))
