r"""Pipeline parallelism for any model: ``torch.distributed.pipelining`` runs the schedule,
mc owns the gradients.

::

    rank (tp t, pp p, dp d)
      chunk v of V                any nn.Module: global stage c = v·P + p
        └─ mc DistributedDataParallel (contiguous main_grad buffer, buckets; chunks after
           the first with one bucket, as Megatron's get_model)
             └─ a PipelineStage of stage c: P2P over the pp group, your StageForward

:func:`build_pipeline` wraps this rank's chunks (from :func:`mc_train.split_model`, or built
per stage as Megatron builds them) and builds the schedule; :meth:`Pipeline.forward_backward`
is Megatron's ``forward_backward_func`` with ``finalize_model_grads`` at its end. A step::

    loss = pipe.forward_backward(inputs, target)   # this DP rank's [B, ...] rows
    optimizer.step()                               # ShardedOptimizer over pipe.chunks

1. ``zero_grad_buffer()`` on every chunk.
2. ``schedule.step(inputs, target=target)``: the schedule cuts the rows into ``M``
   micro-batches (along dim 0) and runs 1F1B, GPipe or interleaved 1F1B
   (:mod:`mc_train.schedules`). Every backward of a chunk but its last runs inside the
   chunk's ``no_sync()`` (grads accumulate in ``main_grad``, nothing is reduced); the last
   (pipelining's ``last_backward``, Megatron's last micro-batch) runs with sync on, so with
   ``overlap_grad_reduce`` each bucket's reduce-scatter / all-reduce over DP is issued as
   its grads complete, overlapping the rest of the schedule.
3. The loss: the schedule's ``loss_fn`` on the last stage reduces the per-token losses of
   your :class:`~mc_train.TokenLoss` (mean per micro-batch / M, or the sum with
   ``config.calculate_per_token_loss``: :mod:`mc_train.loss`); the schedules' own
   ``scale_grads`` is off (mc's hooks move every grad into ``main_grad`` before it could
   scale ``param.grad``).
4. ``finalize_model_grads(chunks, num_tokens=...)``: waits for the DP reductions, sums a
   tied embedding's grad between the first and the last stage over ``embd``, sums
   sequence-parallel grads over TP and, with the per-token loss, divides every grad by the
   global count of targets.
5. The step's loss for logging, the same on every rank: ``[Σ loss, targets]`` summed over DP
   on the last stage and broadcast over pp (two small collectives, label
   ``loss for logging``).

Stage shapes: by default ``torch.distributed.pipelining`` infers every stage's input and
output at the first step (one extra forward and backward of the first micro-batch through
every stage, its metadata sent between stages); ``stage_shapes`` gives them statically
instead (meta tensors; the hidden states marked ``requires_grad``, which is what tells a
static stage that a gradient flows back across the boundary).

Checks before anything is built or communicated, with the fix in the message: an unknown
or refused schedule (zero-bubble), micro-batch counts the schedule cannot run, the wrong
number of chunks for the schedule, a chunk without parameters (a split that left a stage
empty), a chunk already wrapped in DDP; the ranks then compare their settings (one
all-gather over the world), so a rank with another schedule or ``M`` is an error on every
rank, not a hang in the schedule's P2P.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import mc_groups as mg
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from mc_finalize import finalize_model_grads
from mc_groups import TransformerConfigLike, param_attrs
from mc_groups.argcheck import check_int, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_train.loss import IGNORE_INDEX, TokenLoss, _type_check
from mc_train.schedules import InFlight, check_schedule
from mc_train.split import tied_parameter_names
from mc_train.stages import StageForward, StageInfo, call_module

if TYPE_CHECKING:  # imported when a pipeline is built (it imports DTensor: seconds)
    import torch.distributed.pipelining
    import torch.distributed.pipelining.schedules

__all__ = ["Pipeline", "StageShapes", "build_pipeline"]

Chunk = DistributedDataParallel[Any]
StageShapes = Callable[[StageInfo], tuple[torch.Tensor, torch.Tensor]]
"""``stage_shapes(stage) -> (input, output)``: meta tensors of one micro-batch's input and
output of ``stage`` (module notes)."""
FinalizeGrads = Callable[..., None]
"""``finalize(chunks, num_tokens=..., pg_collection=...)``: what a step runs after its last
backward, :func:`mc_finalize.finalize_model_grads`'s signature (Megatron's
``config.finalize_model_grads_func``)."""


class Pipeline:
    """This rank's part of a pipeline, built by :func:`build_pipeline`.

    Attributes:
        chunks: this rank's chunks in mc DDP, in global-stage order (what its
            ``ShardedOptimizer`` and checkpointer take).
        stages: their ``PipelineStage`` objects.
        schedule: the torch schedule driving them.
        pg_collection: the groups.
        microbatches: ``M``, micro-batches per step and DP rank.
        in_flight: the count of this rank's chunk-forwards in flight; ``in_flight.peak`` is
            the most alive at once in the last step.
        per_token_loss: the loss is summed per token (``config.calculate_per_token_loss``).
        ignore_index: the target of a position that does not count.
        finalize_model_grads_func: what runs after the last backward
            (:func:`mc_finalize.finalize_model_grads` by default; None: nothing).
        device: where the chunks' params live (inputs are moved there).
    """

    def __init__(
        self,
        chunks: list[Chunk],
        stages: Sequence[torch.distributed.pipelining.PipelineStage],
        schedule: torch.distributed.pipelining.schedules.PipelineScheduleSingle
        | torch.distributed.pipelining.schedules.PipelineScheduleMulti,
        pg_collection: mg.ProcessGroupCollection,
        microbatches: int,
        in_flight: InFlight,
        *,
        per_token_loss: bool,
        ignore_index: int,
        finalize_model_grads_func: FinalizeGrads | None = finalize_model_grads,
    ) -> None:
        self.chunks = chunks
        self.stages = list(stages)
        self.schedule = schedule
        self.pg_collection = pg_collection
        self.microbatches = microbatches
        self.in_flight = in_flight
        self.per_token_loss = per_token_loss
        self.ignore_index = ignore_index
        self.finalize_model_grads_func = finalize_model_grads_func
        self.device = next(chunks[0].parameters()).device
        self._rows: int | None = None

    @property
    def is_first_stage(self) -> bool:
        """This rank holds stage 0 (it reads the inputs)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last stage (it computes the loss)."""
        return any(stage.is_last for stage in self.stages)

    def parameters(self) -> list[nn.Parameter]:
        """Every param of this rank's chunks (what its optimizer steps)."""
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def forward_backward(self, inputs: torch.Tensor | None, target: torch.Tensor | None) -> float:
        """One step's forwards, backwards and ``finalize_model_grads`` on this DP rank's
        ``inputs`` and ``target`` (``[B, ...]`` rows, ``B`` a multiple of the micro-batch
        count; needed on the first and the last stage respectively, ignored elsewhere);
        returns the step's loss over every DP rank (module notes, step 5). The optimizer
        step is yours. Collective over the world."""
        with mg.fail_together(None, "Pipeline.forward_backward"):
            self._check_batch(inputs, target)
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
        losses: list[torch.Tensor] = []
        self.in_flight.reset()
        args = (inputs.to(self.device),) if self.is_first_stage and inputs is not None else ()
        labels = target.to(self.device) if self.is_last_stage and target is not None else None
        self.schedule.step(*args, target=labels, losses=losses, return_outputs=False)
        count = torch.zeros((), dtype=torch.int64, device=self.device)
        if labels is not None:
            count = (labels != self.ignore_index).sum()
        tokens = count if self.per_token_loss else None
        if self.finalize_model_grads_func is not None:
            self.finalize_model_grads_func(
                self.chunks, num_tokens=tokens, pg_collection=self.pg_collection
            )
        return self._step_loss(losses, count)

    def _check_batch(self, inputs: object, target: object) -> None:
        m = self.microbatches
        for name, value, needed in (
            ("inputs", inputs, self.is_first_stage),
            ("target", target, self.is_last_stage),
        ):
            if not needed:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise InputTypeError(
                    f"{name} must be a [batch, ...] tensor on this rank (it holds the "
                    f"{'first' if name == 'inputs' else 'last'} pipeline stage), got "
                    f"{type_name(value)}"
                )
            rows = int(value.shape[0])
            if rows % m:
                raise InputValueError(
                    f"{name} has {rows} rows, not a multiple of the {m} micro-batches: give "
                    f"each micro-batch the same number of rows"
                )
            if self._rows is not None and rows != self._rows:
                raise InputValueError(
                    f"{name} has {rows} rows, but the pipeline's stages were built for "
                    f"{self._rows} ({m} micro-batches of {self._rows // m}): keep the batch "
                    "size of the first step, or build another pipeline"
                )
        sizes = [int(v.shape[0]) for v in (inputs, target) if isinstance(v, torch.Tensor)]
        if self.is_first_stage and self.is_last_stage and len(set(sizes)) > 1:
            raise InputValueError(f"inputs and target have {sizes[0]} and {sizes[1]} rows")
        if sizes and self._rows is None:
            self._rows = sizes[0]

    def _step_loss(self, losses: list[torch.Tensor], count: torch.Tensor) -> float:
        """``[Σ loss, targets]`` summed over DP on the last stage, broadcast over pp."""
        total = torch.zeros(2, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            total[0] = torch.stack([x.detach().float() for x in losses]).sum()
            total[1] = count.float()
        pgc = self.pg_collection
        dp = pgc.require("dp", "Pipeline.forward_backward")
        mg.all_reduce(total, dp, label="loss for logging")
        pp = pgc.require("pp", "Pipeline.forward_backward")
        mg.broadcast(total, pp, group_src=mg.group_size(pp) - 1, label="loss for logging")
        if self.per_token_loss:
            return float(total[0] / total[1].clamp(min=1))
        return float(total[0]) / mg.group_size(dp)


def _schedule_loss(
    loss_fn: TokenLoss, per_token: bool, microbatches: int, ignore_index: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The schedule's ``loss_fn``: per-token losses reduced as :mod:`mc_train.loss` says."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses = loss_fn(output, target)
        if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != tuple(target.shape):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type_name(losses)
            raise InputValueError(
                f"loss_fn returned {shape} for a target of shape {tuple(target.shape)}: it "
                "must return the loss of every target position, shaped like the target"
            )
        total = losses.sum()
        if per_token:
            return total
        count = (target != ignore_index).sum().clamp(min=1)
        return total / count / microbatches

    return loss


def _check_chunks(chunks: object) -> list[nn.Module]:
    if isinstance(chunks, nn.Module) or not isinstance(chunks, Sequence) or not chunks:
        raise InputTypeError(
            f"chunks must be a non-empty list of this rank's model chunks (nn.Module each, "
            f"in global-stage order), got {type_name(chunks)}"
        )
    out: list[nn.Module] = []
    for v, chunk in enumerate(chunks):
        if isinstance(chunk, DistributedDataParallel):
            raise InputTypeError(
                f"chunks[{v}] is already a DistributedDataParallel: build_pipeline wraps each "
                "chunk itself (its ddp_config); pass the chunk's .module"
            )
        if not isinstance(chunk, nn.Module):
            raise InputTypeError(f"chunks[{v}] must be an nn.Module, got {type_name(chunk)}")
        if not any(p.requires_grad for p in chunk.parameters()):
            raise InputValueError(
                f"chunks[{v}] ({type_name(chunk)}) has no trainable parameters: the split left "
                "this pipeline stage empty; give every stage at least one block"
            )
        out.append(chunk)
    return out


def _mark_tied(chunk: nn.Module, v: int) -> None:
    """Re-mark the copies of a tied weight :func:`~mc_train.split_model` found (a
    ``parallelize`` after the split replaces the module that held the mark)."""
    for name in tied_parameter_names(chunk):
        try:
            param = chunk.get_parameter(name)
        except AttributeError as err:
            raise InputValueError(
                f"chunks[{v}] lost its parameter {name!r}, a copy of a weight tied across "
                "stages; keep the name when converting the module (parallelize does)"
            ) from err
        setattr(param, param_attrs.SHARED_EMBEDDING, True)


def build_pipeline(
    chunks: Sequence[nn.Module],
    *,
    config: TransformerConfigLike,
    ddp_config: DistributedDataParallelConfig,
    pg_collection: mg.ProcessGroupCollection,
    microbatches: int,
    loss_fn: TokenLoss,
    schedule: str = "1f1b",
    forward: StageForward = call_module,
    stage_shapes: StageShapes | None = None,
    ignore_index: int = IGNORE_INDEX,
    finalize_model_grads_func: FinalizeGrads | None = finalize_model_grads,
) -> Pipeline:
    """This rank's pipeline (module notes): each of ``chunks`` (global stages ``v·P + p``)
    in mc DDP, a ``PipelineStage`` per chunk and ``schedule`` over ``microbatches``
    micro-batches.

    Args:
        chunks: this rank's model chunks in order (:func:`mc_train.split_model`'s result,
            or your own, e.g. Megatron-style ``GPTModel(pre_process=..., vp_stage=v)``).
        config: the model's parallel config (DDP reads it; ``calculate_per_token_loss``
            picks the loss reduction).
        ddp_config: mc DDP's settings for every chunk; a
            :class:`~mc_ddp.TorchFullyShardedDataParallelConfig` wraps each chunk in
            :class:`~mc_ddp.TorchFullyShardedDataParallel` instead (FSDP2 under PP, as
            torchtitan does it: every backward but a chunk's last inside its ``no_sync``;
            step with any ``torch.optim`` optimizer and :func:`mc_ddp.clip_grad_norm`).
        pg_collection: the groups (``pp`` orders the stages; ``dp``, ``tp``, ``embd`` as
            DDP and ``finalize_model_grads`` read them).
        microbatches: ``M``, micro-batches per step and DP rank.
        loss_fn: per-token losses of the last stage's output (:class:`~mc_train.TokenLoss`).
        schedule: one of :data:`mc_train.SCHEDULES`.
        forward: how a stage calls its chunk (:class:`~mc_train.StageForward`).
        stage_shapes: static stage shapes; None: inferred at the first step (refused with
            ``config.gradient_accumulation_fusion``, whose layers would add the inference
            backward's weight grads to ``main_grad``).
        ignore_index: the target of a position that does not count.
        finalize_model_grads_func: what :meth:`Pipeline.forward_backward` runs after the
            last backward (Megatron's ``config.finalize_model_grads_func``): by default
            :func:`mc_finalize.finalize_model_grads`; your own with its signature (e.g. one
            that also reports); None runs nothing (a loop that finalizes by itself; without
            it DP grads are not waited for, tied embeddings and sequence-parallel grads not
            summed).
    """
    parts = _check_chunks(chunks)
    with mg.fail_together(None, "build_pipeline"):
        if not isinstance(pg_collection, mg.ProcessGroupCollection):
            raise InputTypeError(
                f"pg_collection must be a mc_groups.ProcessGroupCollection, got "
                f"{type_name(pg_collection)}"
            )
        pp = pg_collection.require("pp", "build_pipeline")
        m = check_int("microbatches", microbatches, minimum=1)
        check_schedule(schedule, pp=mg.group_size(pp), chunks=len(parts), microbatches=m)
        loss = _type_check(loss_fn)
        if not callable(forward) or (stage_shapes is not None and not callable(stage_shapes)):
            raise InputTypeError("forward and stage_shapes must be callables (module notes)")
        if finalize_model_grads_func is not None and not callable(finalize_model_grads_func):
            raise InputTypeError(
                "finalize_model_grads_func must be callable as finalize(chunks, num_tokens=, "
                f"pg_collection=) or None, got {type_name(finalize_model_grads_func)}"
            )
        check_int("ignore_index", ignore_index, minimum=-(2**63))
        if stage_shapes is None and getattr(config, "gradient_accumulation_fusion", False):
            raise InputValueError(
                "config.gradient_accumulation_fusion=True needs stage_shapes: inferring the "
                "shapes runs a backward whose weight grads the layers would add to main_grad"
            )
    _agree(pg_collection, (schedule, m, len(parts)))
    for v, chunk in enumerate(parts):
        _mark_tied(chunk, v)
    wrapped: list[Chunk] = [
        TorchFullyShardedDataParallel(config, ddp_config, chunk, pg_collection=pg_collection)  # type: ignore[misc]
        if isinstance(ddp_config, TorchFullyShardedDataParallelConfig)
        else DistributedDataParallel(
            config, ddp_config, chunk, disable_bucketing=v > 0, pg_collection=pg_collection
        )
        for v, chunk in enumerate(parts)
    ]
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    from mc_train import _pipelining  # noqa: PLC0415 (imports DTensor: seconds)

    in_flight = InFlight()
    size, rank = mg.group_size(pp), mg.group_rank(pp)
    stages = []
    for v, chunk in enumerate(wrapped):
        info = StageInfo(v * size + rank, size * len(wrapped), v)
        shapes = stage_shapes(info) if stage_shapes is not None else (None, None)
        stages.append(
            _pipelining.MCStage(
                _pipelining.StageModule(chunk, forward, info),
                in_flight,
                stage_index=info.index,
                num_stages=info.num_stages,
                device=next(chunk.parameters()).device,
                input_args=shapes[0],
                output_args=shapes[1],
                group=pp,
            )
        )
    runner = _pipelining.make_schedule(
        schedule, stages, m, _schedule_loss(loss, per_token, m, ignore_index)
    )
    return Pipeline(
        wrapped,
        stages,
        runner,
        pg_collection,
        m,
        in_flight,
        per_token_loss=per_token,
        ignore_index=ignore_index,
        finalize_model_grads_func=finalize_model_grads_func,
    )


def _agree(pgc: mg.ProcessGroupCollection, settings: tuple[str, int, int]) -> None:
    """Every rank of the world builds the same schedule, micro-batch count and chunk count
    (one all-gather); an error on every rank otherwise."""
    world = pgc.require("world", "build_pipeline")
    seen = mg.all_gather_objects(settings, world, label="pipeline settings")
    if any(s != seen[0] for s in seen):
        listed = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise InputValueError(
            f"the ranks build different pipelines (schedule, microbatches, chunks): {listed}; "
            "every rank must pass the same schedule and microbatches and as many chunks"
        )
