r"""The one place mc_train leans on ``torch.distributed.pipelining`` beyond its documented API.

``PipelineStage`` and the schedules are public, but a stage has no documented hook for "the
backward of a micro-batch is about to run" or "these P2P ops are about to be issued", and
mc needs both: mc DDP must stay in ``no_sync`` until a chunk's last backward (then its
hooks start the bucket reductions), and the tests record the schedule's sends and receives
(``mc_groups.comm.collectives.record_p2p_ops``). :class:`MCStage` overrides these methods
of ``PipelineStage``,
which every schedule offered calls (torch 2.13):

- ``forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)``;
- ``backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)``, with
  ``last_backward=True`` exactly once per stage and step (the stage's last micro-batch);
- ``get_fwd_send_ops`` / ``get_fwd_recv_ops`` / ``get_bwd_send_ops`` /
  ``get_bwd_recv_ops(chunk_id)`` returning the ``dist.P2POp`` lists the schedule batches.

``mc_train_tests/test_pipelining_contract.py`` checks these signatures and that every
offered schedule calls ``backward_one_chunk(..., last_backward=True)`` once per stage and
step, so a torch upgrade that renames or stops calling them fails there, not in a silent
wrong gradient. Imported only when a pipeline is built (``torch.distributed.pipelining``
imports DTensor, over a second).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
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

from mc_ddp import DistributedDataParallel
from mc_groups.comm.collectives import record_p2p_ops
from mc_train.schedules import InFlight
from mc_train.stages import StageForward, StageInfo

__all__ = ["MCStage", "StageModule", "make_schedule"]

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class StageModule(nn.Module):
    """A chunk with pipelining's calling convention: one tensor in, one tensor out, through
    the user's :class:`~mc_train.StageForward`."""

    def __init__(
        self, chunk: DistributedDataParallel[Any], forward: StageForward, info: StageInfo
    ) -> None:
        super().__init__()
        self.chunk = chunk
        self._forward = forward
        self.info = info

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The chunk's output for one micro-batch. Output and input grad are made
        contiguous: the schedule sends them and receives them into buffers of their
        strides, which gloo needs contiguous (a sequence-parallel block's reduce-scatter
        along ``[b, s, h]``'s dim 1, and its backward, are not)."""
        if x.requires_grad:
            x = _ContiguousGrad.apply(x)  # type: ignore[no-untyped-call]
        return self._forward(self.chunk, x, self.info).contiguous()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class MCStage(PipelineStage):
    """A ``PipelineStage`` whose backwards accumulate without reduction until the chunk's
    last one, whose P2P ops are recorded (labels ``activation`` / ``activation grad``), and
    whose forwards and backwards are counted in the rank's :class:`~mc_train.InFlight`."""

    def __init__(self, module: StageModule, in_flight: InFlight, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._chunk = module.chunk
        self._in_flight = in_flight

    def _forward_metadata_inference(
        self,
        args: Any,
        kwargs: dict[str, Any] | None = None,
        has_backward: bool = False,
    ) -> Any:
        """Pipelining's shape inference, leaving no trace: it runs the stage's forward once,
        before the first micro-batch, on stand-ins (a later stage's are uninitialised) in
        training mode with grad enabled, so a stateful forward would count it as a step's
        (a router's ``local_tokens_per_expert``: the expert bias then moved on garbage
        routing; a norm's running statistics; the RNG a dropout draws from). The stage's
        buffers and the RNG state are put back after it: only the buffers it changed, so
        a buffer autograd saved (a rotary cache) keeps its version for the backward shape
        inference that follows on this forward's graph."""
        saved = [(buffer, buffer.detach().clone()) for buffer in self.submod.buffers()]
        cuda = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda):
                return super()._forward_metadata_inference(args, kwargs, has_backward)
        finally:
            with torch.no_grad():
                for buffer, value in saved:  # meta buffers hold no values to put back
                    if not buffer.is_meta and not torch.equal(buffer, value):
                        buffer.copy_(value)

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
    record_p2p_ops(ops, label=label)
    return ops


def make_schedule(
    schedule: str,
    stages: Sequence[PipelineStage],
    microbatches: int,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Schedule:
    """The torch schedule object; ``scale_grads=False``: mc's hooks move every grad into
    ``main_grad`` before the schedule could scale ``param.grad`` (the loss carries 1/M)."""
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(list(stages), microbatches, loss_fn=loss, scale_grads=False)
    single = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return single(stages[0], microbatches, loss_fn=loss, scale_grads=False)
