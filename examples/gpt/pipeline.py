r"""The GPT on :mod:`mc_train`'s pipeline: what the demo adds is the model.

``mc_train.build_pipeline`` runs the schedule over mc DDP chunks (docs/pipeline.md); this
module gives it the GPT's pieces, Megatron's way: each rank builds its own chunks,
``GPT(layers=..., vp_stage=v)`` (only chunk 0 of the first stage embeds, only the last
chunk of the last stage has the LM head and its copy of the tied table), and tells the
pipeline how to call one and what its loss is::

    chunk v of rank p (global stage c = v·P + p)
      first stage:  GPT(tokens [b, s])            → hidden [s(/tp), b, h]
      other stages: GPT(hidden_states=[s(/tp), b, h])
      last stage:   ... → logits [s, b, V/tp]  → vocab-parallel cross-entropy per token

Stage shapes are static (the GPT's sizes are known: no inference step), the loss per
token (``mc_train.token_cross_entropy`` over the TP group, sequence first): ``mean / M``
per micro-batch, or ``Σ mask·CE`` with the per-token loss, masked targets carrying
``IGNORE_INDEX``. :func:`pipeline_step` takes the demo's global batch (``[B, s + 1]`` ids,
the same on every rank), keeps this DP rank's rows and runs one optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import mc_groups as mg
import mc_train
from examples.gpt.config import GPTConfig, OptimizerConfig, ParallelLayout
from examples.gpt.data import dp_rows
from examples.gpt.model import GPT
from examples.gpt.train import build_model
from examples.gpt.weights import gather_full_weights
from mc_ddp import DistributedDataParallel, ShardedOptimizer, StepResult, ensure_params_ready
from mc_train import IGNORE_INDEX, SCHEDULES, InFlight, StageInfo

__all__ = [
    "IGNORE_INDEX",
    "SCHEDULES",
    "PipelineTrainer",
    "build_pipeline",
    "check_schedule",
    "pipeline_final_weights",
    "pipeline_step",
]

Chunk = DistributedDataParallel[mg.ModelParallelConfig]


def check_schedule(schedule: str, layout: ParallelLayout, cfg: GPTConfig) -> None:
    """ValueError naming the fix when ``schedule`` cannot run ``layout``: what
    :func:`mc_train.check_schedule` refuses, ``interleaved`` without ``vpp`` (or ``vpp``
    with another schedule), context parallelism (not wired here), or layers that do not
    split evenly over the stages and chunks."""
    if schedule in SCHEDULES and (schedule == "interleaved") != (layout.vpp is not None):
        raise ValueError(
            f"schedule={schedule!r} with vpp={layout.vpp}: the interleaved schedule runs "
            "vpp virtual chunks per stage and the others one; pass --schedule interleaved "
            "with --vpp, or drop --vpp"
        )
    mc_train.check_schedule(
        schedule, pp=layout.pp, chunks=layout.vpp or 1, microbatches=layout.microbatches
    )
    if layout.cp != 1:
        raise ValueError(f"cp={layout.cp}: the pipeline demo runs without context parallelism")
    stages = layout.pp * (layout.vpp or 1)
    if cfg.num_layers % stages:
        raise ValueError(
            f"num_layers={cfg.num_layers} is not divisible by pp × vpp = {stages}: every "
            "stage (and virtual chunk) holds the same number of layers"
        )


@dataclass
class PipelineTrainer:
    """Everything a pipeline step needs on this rank: the :class:`mc_train.Pipeline` over
    its GPT chunks, their optimizer, and the batch the stages were built for."""

    cfg: GPTConfig
    layout: ParallelLayout
    pgc: mg.ProcessGroupCollection
    pipeline: mc_train.Pipeline
    optimizer: ShardedOptimizer
    device: torch.device
    micro_batch_size: int
    last_step: StepResult | None = None  # what the last optimizer step did (its grad norm)

    @property
    def chunks(self) -> list[Chunk]:
        """This rank's chunks in mc DDP, in ``vp_stage`` order."""
        return self.pipeline.chunks

    @property
    def in_flight(self) -> InFlight:
        """The pipeline's count of chunk-forwards alive (``in_flight.peak``)."""
        return self.pipeline.in_flight

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the LM head (and computes the loss)."""
        return self.pipeline.is_last_stage


def _gpt_forward(module: torch.nn.Module, x: torch.Tensor, stage: StageInfo) -> torch.Tensor:
    """The GPT's calling convention: token ids into the first stage, hidden states into
    the others; the last returns its logits (``labels=None``)."""
    out: torch.Tensor = module(x, None) if stage.is_first else module(None, None, x)
    return out


def _stage_shapes(
    cfg: GPTConfig, layout: ParallelLayout, micro_batch_size: int
) -> mc_train.StageShapes:
    """Meta tensors of each chunk's input and output (static shapes; the hidden states
    ``requires_grad``, which tells a static stage that a gradient flows back)."""
    b, s, h, dtype = micro_batch_size, cfg.seq_length, cfg.hidden_size, layout.params_dtype
    rows = s // layout.tp if layout.sequence_parallel else s
    hidden = torch.empty(rows, b, h, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(b, s, dtype=torch.int64, device="meta")
    logits = torch.empty(s, b, cfg.vocab_size // layout.tp, dtype=dtype, device="meta")

    def shapes(stage: StageInfo) -> tuple[torch.Tensor, torch.Tensor]:
        return (tokens if stage.is_first else hidden), (logits if stage.is_last else hidden)

    return shapes


def build_pipeline(
    cfg: GPTConfig,
    layout: ParallelLayout,
    opt: OptimizerConfig,
    pgc: mg.ProcessGroupCollection,
    full: dict[str, torch.Tensor],
    device: torch.device,
    *,
    schedule: str,
    micro_batch_size: int,
) -> PipelineTrainer:
    """This rank's GPT chunks (``layout.vpp`` of them, or one) on ``mc_train``'s pipeline
    (``schedule`` of :data:`SCHEDULES`, ``layout.microbatches`` micro-batches of
    ``micro_batch_size`` sequences) and one optimizer over all of them."""
    check_schedule(schedule, layout, cfg)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    vpp = layout.vpp
    chunks: list[torch.nn.Module] = [
        build_model(cfg, layout, pgc, full, device, v if vpp else None) for v in range(vpp or 1)
    ]
    pipeline = mc_train.build_pipeline(
        chunks,
        config=layout.model_parallel_config(),
        ddp_config=layout.ddp_config(),
        pg_collection=pgc,
        microbatches=layout.microbatches,
        loss_fn=mc_train.token_cross_entropy(
            tp_group=pgc.require("tp", "build_pipeline"), sequence_first=True
        ),
        schedule=schedule,
        forward=_gpt_forward,
        stage_shapes=_stage_shapes(cfg, layout, micro_batch_size),
    )
    optimizer = ShardedOptimizer(
        opt.build(pipeline.parameters()),
        pipeline.chunks,
        max_grad_norm=opt.clip_grad,
        pg_collection=pgc,
    )
    return PipelineTrainer(cfg, layout, pgc, pipeline, optimizer, device, micro_batch_size)


def pipeline_step(
    trainer: PipelineTrainer, tokens: torch.Tensor, mask: torch.Tensor | None = None
) -> float:
    """One optimizer step on the global batch ``tokens`` (``[B, s + 1]``, the same on every
    rank; ``mask`` ``[B, s]``: 1 for the targets that count, with the per-token loss);
    returns the step's loss over the global batch on every rank (the mean over DP of the
    last stage's ``Σ mean/M``, or ``Σ mask·CE / Σ mask``)."""
    layout, pgc = trainer.layout, trainer.pgc
    if (mask is not None) != layout.calculate_per_token_loss:
        raise ValueError(
            "mask is given exactly when the layout has calculate_per_token_loss=True "
            f"(got mask={'a tensor' if mask is not None else None}, "
            f"calculate_per_token_loss={layout.calculate_per_token_loss})"
        )
    _check_batch(trainer, tokens, mask)
    dp = pgc.require("dp", "pipeline_step")
    dp_rank, dp_size = mg.group_rank(dp), mg.group_size(dp)
    rows = dp_rows(tokens, dp_rank, dp_size)
    labels = rows[:, 1:]
    if mask is not None:
        keep = dp_rows(mask, dp_rank, dp_size)
        labels = labels.masked_fill(keep == 0, IGNORE_INDEX)
    loss = trainer.pipeline.forward_backward(rows[:, :-1].contiguous(), labels.contiguous())
    trainer.last_step = trainer.optimizer.step()
    return loss


def _check_batch(trainer: PipelineTrainer, tokens: object, mask: object) -> None:
    """ValueError/TypeError before anything is communicated: the stages were built for
    ``[dp · M · micro_batch_size, s + 1]`` token ids (and a ``[.., s]`` mask)."""
    lay, cfg = trainer.layout, trainer.cfg
    rows = lay.dp * lay.microbatches * trainer.micro_batch_size
    want = (rows, cfg.seq_length + 1)
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64:
        raise TypeError(f"tokens must be an int64 tensor of token ids, got {tokens!r:.60}")
    if tuple(tokens.shape) != want:
        raise ValueError(
            f"tokens of shape {tuple(tokens.shape)}: the pipeline's stages were built for "
            f"{want} (dp {lay.dp} × {lay.microbatches} micro-batches × micro_batch_size "
            f"{trainer.micro_batch_size} rows of seq_length + 1 ids); rebuild it with "
            "build_pipeline(micro_batch_size=...) for another batch"
        )
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) != (rows, cfg.seq_length):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} must be {(rows, cfg.seq_length)}: one flag "
            "per target token"
        )


def pipeline_final_weights(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    """This rank's chunks' trained weights, gathered over TP (fp32, CPU; full names, the
    last stage's copy of the tied table under the embedding's name)."""
    weights: dict[str, torch.Tensor] = {}
    tp = trainer.pgc.require("tp", "pipeline_final_weights")
    for chunk in trainer.chunks:
        gpt = chunk.module
        assert isinstance(gpt, GPT)  # build_pipeline built it
        ensure_params_ready(list(gpt.parameters()))
        weights |= gather_full_weights(gpt, tp)
    return weights
