r"""The GPT on ``torch.distributed.pipelining``'s schedules, with mc's DDP and finalize.

PyTorch owns the pipeline (:class:`~torch.distributed.pipelining.PipelineStage` holds the
send/recv buffers, a schedule the order of forwards and backwards); mc owns the grads. This
module is the adapter between the two, nothing more::

    rank (tp t, pp p, dp d)
      chunk v of V (V = vpp, or 1)  GPT(layers of global stage c = v·P + p)
        └─ mc DistributedDataParallel (contiguous main_grad buffer, buckets)
             └─ _StageModule: pipelining's calling convention (one tensor in, one out)
                  └─ _MCStage(PipelineStage): stage index c of P·V, P2P over the pp group

A step (:func:`pipeline_step`):

1. ``zero_grad_buffer()`` on every chunk.
2. ``schedule.step(tokens, target=labels)``: the schedule cuts this DP rank's rows into
   ``M`` micro-batches and runs 1F1B, GPipe or interleaved 1F1B. Every backward of a chunk
   except its last runs inside the chunk's ``no_sync()`` (grads accumulate in
   ``main_grad``, nothing is reduced); the chunk's last backward (pipelining's
   ``last_backward``, Megatron's "last micro-batch") runs with sync on, so with
   ``overlap_grad_reduce`` each bucket's reduce-scatter / all-reduce over DP is issued as
   its grads complete, overlapping the rest of the schedule (the other chunks' backwards
   and, on earlier stages, the pipeline's drain).
3. ``finalize_model_grads(chunks, num_tokens=...)``: waits for the DP reductions, sums the
   tied embedding's grad between the first stage's lookup (chunk 0) and the last stage's
   LM head (chunk V−1) over the ``embd`` group, sums sequence-parallel grads over TP,
   and with the per-token loss broadcasts the last stage's token count over pp, sums it
   over DP and divides every grad by it.
4. The optimizer step (one ``ShardedOptimizer`` over the rank's chunks).

The loss is computed outside the model, by the schedule's ``loss_fn`` on the last stage:
``vocab_parallel_cross_entropy`` of the logits, ``mean / M`` per micro-batch (so the M
backwards sum to the mean's gradient, as Megatron's forward step divides by the number of
micro-batches; the schedules' own ``scale_grads`` is off because mc's hooks move every
grad into ``main_grad`` before the schedule could scale ``param.grad``), or with the
per-token loss ``Σ mask·CE`` per micro-batch, masked positions carrying the label
``IGNORE_INDEX``.

Zero-bubble schedules (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) split a backward
into input and weight halves computed with ``torch.autograd.grad``, which does not run the
post-accumulate-grad hooks mc's DDP relies on; they are not offered.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase

import mc_groups as mg
import mc_tp_layers as tpl
from examples.gpt.config import GPTConfig, OptimizerConfig, ParallelLayout
from examples.gpt.data import dp_rows
from examples.gpt.model import GPT
from examples.gpt.train import apply_ddp, build_model
from examples.gpt.weights import gather_full_weights
from mc_ddp import DistributedDataParallel, ShardedOptimizer, StepResult, ensure_params_ready
from mc_finalize import finalize_model_grads

__all__ = [
    "IGNORE_INDEX",
    "SCHEDULES",
    "InFlight",
    "PipelineTrainer",
    "build_pipeline",
    "check_schedule",
    "pipeline_final_weights",
    "pipeline_step",
]

IGNORE_INDEX = -100
"""The label of a masked position (per-token loss): no loss, no gradient, not counted."""

SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""The schedules offered: ``torch.distributed.pipelining``'s ``Schedule1F1B``,
``ScheduleGPipe`` (one chunk per rank) and ``ScheduleInterleaved1F1B`` (``vpp`` chunks)."""

Chunk = DistributedDataParallel[mg.ModelParallelConfig]


def check_schedule(schedule: str, layout: ParallelLayout, cfg: GPTConfig) -> None:
    """ValueError naming the fix when ``schedule`` cannot run ``layout``: an unknown name,
    ``interleaved`` without ``vpp`` (or ``vpp`` with another schedule), 1F1B-style
    schedules with fewer micro-batches than stages (``Schedule1F1B`` raises on it too),
    interleaved with micro-batches not a multiple of the stages (the demo keeps
    pipelining's rounds of ``pp`` micro-batches whole), context parallelism (not wired
    here), or layers that do not split evenly over the stages and chunks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if layout.pp < 2:
        raise ValueError(f"schedule={schedule!r} needs pp >= 2 (got pp={layout.pp})")
    if (schedule == "interleaved") != (layout.vpp is not None):
        raise ValueError(
            f"schedule={schedule!r} with vpp={layout.vpp}: the interleaved schedule runs "
            "vpp virtual chunks per stage and the others one; pass --schedule interleaved "
            "with --vpp, or drop --vpp"
        )
    if layout.cp != 1:
        raise ValueError(f"cp={layout.cp}: the pipeline demo runs without context parallelism")
    m, p = layout.microbatches, layout.pp
    if schedule != "gpipe" and m < p:
        raise ValueError(
            f"microbatches={m} < pp={p}: the {schedule} schedule fills every stage with a "
            f"micro-batch before its first backward (torch.distributed.pipelining refuses "
            f"fewer micro-batches than stages); use at least {p} (or --schedule gpipe)"
        )
    if schedule == "interleaved" and m % p:
        raise ValueError(
            f"microbatches={m} is not a multiple of pp={p}: the interleaved schedule runs "
            f"micro-batches in rounds of pp; use a multiple of {p}"
        )
    layers = cfg.num_layers
    stages = p * (layout.vpp or 1)
    if layers % stages:
        raise ValueError(
            f"num_layers={layers} is not divisible by pp × vpp = {stages}: every stage (and "
            "virtual chunk) holds the same number of layers"
        )


class _StageModule(nn.Module):
    """One chunk with pipelining's calling convention: the first chunk takes the ``[b, s]``
    token ids, the others the previous chunk's hidden states; the last returns the logits
    (``[s, b, V/tp]``), the others their hidden states."""

    def __init__(self, chunk: Chunk) -> None:
        super().__init__()
        self.chunk = chunk
        gpt = chunk.module
        assert isinstance(gpt, GPT)  # built by build_pipeline
        self.pre_process = gpt.pre_process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The chunk's output for this micro-batch (see class)."""
        args = (x, None) if self.pre_process else (None, None, x)
        out: torch.Tensor = self.chunk(*args)
        return out


@dataclass
class InFlight:
    """Chunk-forwards of this rank whose backward has not run yet: now, and the most at
    once since :meth:`reset` (the activations a schedule keeps alive; the dry run's
    ``in_flight_forwards`` predicts it)."""

    now: int = 0
    peak: int = 0

    def reset(self) -> None:
        """Start counting a new step."""
        self.now = self.peak = 0

    def forward(self) -> None:
        """A chunk's forward of one micro-batch ran."""
        self.now += 1
        self.peak = max(self.peak, self.now)

    def backward(self) -> None:
        """A chunk's backward of one micro-batch ran."""
        self.now -= 1


class _MCStage(PipelineStage):
    """A ``PipelineStage`` whose backwards accumulate without reduction until the chunk's
    last one, whose P2P ops are recorded (``mg.record_p2p_ops``, labels ``activation`` /
    ``activation grad``) for the tests' collective logs, and whose forwards and backwards
    are counted in the rank's :class:`InFlight`."""

    def __init__(self, module: _StageModule, in_flight: InFlight, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._chunk = module.chunk
        self._in_flight = in_flight

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        """Pipelining's forward of one micro-batch, counted."""
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._in_flight.forward()
        return out

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        """Pipelining's backward of one micro-batch, inside ``no_sync()`` unless it is this
        chunk's last (then DDP's hooks start the bucket reductions)."""
        with nullcontext() if last_backward else self._chunk.no_sync():
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
        self._in_flight.backward()

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """Pipelining's ops, recorded."""
        return _recorded(super().get_fwd_send_ops(fwd_chunk_id), "activation")

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """Pipelining's ops, recorded."""
        return _recorded(super().get_fwd_recv_ops(fwd_chunk_id), "activation")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """Pipelining's ops, recorded."""
        return _recorded(super().get_bwd_send_ops(bwd_chunk_id), "activation grad")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """Pipelining's ops, recorded."""
        return _recorded(super().get_bwd_recv_ops(bwd_chunk_id), "activation grad")


def _recorded(ops: list[dist.P2POp], label: str) -> list[dist.P2POp]:
    mg.record_p2p_ops(ops, label=label)
    return ops


@dataclass
class PipelineTrainer:
    """Everything a pipeline step needs on this rank: its chunks (in ``vp_stage`` order),
    their optimizer, the schedule driving them and the count of its forwards in flight
    (``in_flight.peak``: the most chunk-forwards alive at once in the last step)."""

    cfg: GPTConfig
    layout: ParallelLayout
    pgc: mg.ProcessGroupCollection
    chunks: list[Chunk]
    optimizer: ShardedOptimizer
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    device: torch.device
    in_flight: InFlight
    micro_batch_size: int
    last_step: StepResult | None = None  # what the last optimizer step did (its grad norm)

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the LM head (and computes the loss)."""
        return mg.pipeline_rank(self.pgc) == self.layout.pp - 1


def _loss_fn(
    layout: ParallelLayout, tp: dist.ProcessGroup
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The schedule's ``loss_fn(logits [s, b, V/tp], labels [b, s])`` (module notes)."""
    per_token, m = layout.calculate_per_token_loss, layout.microbatches

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = tpl.vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1), tp_group=tp, ignore_index=IGNORE_INDEX
        )
        return losses.sum() if per_token else losses.mean() / m

    return loss


def _stage_meta(
    cfg: GPTConfig, layout: ParallelLayout, gpt: GPT, micro_batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of the chunk's input and output: static shapes, so pipelining infers
    nothing at run time. ``requires_grad`` on the hidden states is what tells a static
    stage that a gradient flows back across the boundary (without it the stage before
    never receives its output's grad and its backward fails: "grad can be implicitly
    created only for scalar outputs")."""
    b, s, h, dtype = micro_batch_size, cfg.seq_length, cfg.hidden_size, layout.params_dtype
    rows = s // layout.tp if layout.sequence_parallel else s
    hidden = torch.empty(rows, b, h, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(b, s, dtype=torch.int64, device="meta")
    logits = torch.empty(s, b, cfg.vocab_size // layout.tp, dtype=dtype, device="meta")
    return (tokens if gpt.pre_process else hidden), (logits if gpt.post_process else hidden)


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
    """This rank's chunks (``layout.vpp`` of them, or one), each in mc DDP (chunks after the
    first with one bucket, as Megatron's ``get_model``), one optimizer over all, and the
    pipelining schedule (``schedule`` of :data:`SCHEDULES`) over ``layout.microbatches``
    micro-batches of ``micro_batch_size`` sequences."""
    check_schedule(schedule, layout, cfg)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    vpp = layout.vpp or 1
    chunks = [
        apply_ddp(
            build_model(cfg, layout, pgc, full, device, v if layout.vpp else None),
            layout,
            pgc,
            disable_bucketing=v > 0,
        )
        for v in range(vpp)
    ]
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = ShardedOptimizer(
        opt.build(params), chunks, max_grad_norm=opt.clip_grad, pg_collection=pgc
    )
    p, stages = mg.pipeline_rank(pgc), layout.pp * vpp
    pipeline_stages: list[_PipelineStageBase] = []
    in_flight = InFlight()
    for v, chunk in enumerate(chunks):
        gpt = chunk.module
        assert isinstance(gpt, GPT)  # build_model returns a GPT
        inputs, outputs = _stage_meta(cfg, layout, gpt, micro_batch_size)
        pipeline_stages.append(
            _MCStage(
                _StageModule(chunk),
                in_flight,
                stage_index=v * layout.pp + p,
                num_stages=stages,
                device=device,
                input_args=inputs,
                output_args=outputs,
                group=pgc.require("pp", "build_pipeline"),
            )
        )
    loss = _loss_fn(layout, pgc.require("tp", "build_pipeline"))
    m = layout.microbatches
    runner: PipelineScheduleSingle | PipelineScheduleMulti
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(pipeline_stages, m, loss_fn=loss, scale_grads=False)
    else:
        single = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        runner = single(pipeline_stages[0], m, loss_fn=loss, scale_grads=False)
    return PipelineTrainer(
        cfg, layout, pgc, chunks, optimizer, runner, device, in_flight, micro_batch_size
    )


def pipeline_step(
    trainer: PipelineTrainer, tokens: torch.Tensor, mask: torch.Tensor | None = None
) -> float:
    """One optimizer step on the global batch ``tokens`` (``[B, s + 1]``, the same on every
    rank; ``mask`` ``[B, s]``: 1 for the targets that count, with the per-token loss);
    returns the step's loss over the global batch on every rank (the mean over DP of the
    last stage's ``Σ mean/M``, or ``Σ mask·CE / Σ mask``), broadcast over pp."""
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
    rows = dp_rows(tokens, dp_rank, dp_size).to(trainer.device)
    labels = rows[:, 1:]
    if mask is not None:
        keep = dp_rows(mask, dp_rank, dp_size).to(trainer.device)
        labels = labels.masked_fill(keep == 0, IGNORE_INDEX)
    for chunk in trainer.chunks:
        chunk.zero_grad_buffer()
    losses: list[torch.Tensor] = []
    trainer.in_flight.reset()
    trainer.schedule.step(rows[:, :-1].contiguous(), target=labels.contiguous(), losses=losses)
    count = (labels != IGNORE_INDEX).sum()
    finalize_model_grads(
        trainer.chunks, num_tokens=count if mask is not None else None, pg_collection=pgc
    )
    trainer.last_step = trainer.optimizer.step()
    return _step_loss(trainer, losses, count)


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


def _step_loss(trainer: PipelineTrainer, losses: list[torch.Tensor], count: torch.Tensor) -> float:
    """``[Σ loss, tokens]`` summed over DP on the last stage, broadcast over pp."""
    total = torch.zeros(2, dtype=torch.float32, device=trainer.device)
    if trainer.is_last_stage:
        total[0] = torch.stack([x.detach().float() for x in losses]).sum()
        total[1] = count.float()
    pgc = trainer.pgc
    mg.all_reduce(total, pgc.require("dp", "pipeline_step"), label="loss for logging")
    pp = pgc.require("pp", "pipeline_step")
    mg.broadcast(total, pp, group_src=trainer.layout.pp - 1, label="loss for logging")
    if trainer.layout.calculate_per_token_loss:
        return float(total[0] / total[1])
    return float(total[0]) / trainer.layout.dp


def pipeline_final_weights(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    """This rank's chunks' trained weights, gathered over TP (fp32, CPU; full names, the
    last stage's copy of the tied table under the embedding's name)."""
    weights: dict[str, torch.Tensor] = {}
    tp = trainer.pgc.require("tp", "pipeline_final_weights")
    for chunk in trainer.chunks:
        ensure_params_ready(list(chunk.module.parameters()))
        weights |= gather_full_weights(chunk.module, tp)
    return weights
