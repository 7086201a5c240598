"""Reduce-scatter, the one home of its algorithms (used by :func:`~mc_groups.reduce_scatter`,
coalesced batches and :class:`~mc_groups.Communicator`).

A reduce-scatter of the flat ``input`` over W ranks leaves ``op_s x_s^r`` in ``output`` on
group rank r, where ``x_s = [x_s^0 | … | x_s^{W-1}]`` is rank s's input. It runs as

- the backend's own reduce-scatter (NCCL and the others, without an accumulation dtype);
- an all-to-all plus a local reduction::

      all-to-all:  rank r receives [x_0^r | x_1^r | … | x_{W-1}^r]   (W rows, input's dtype)
      local:       output = dtype( op_s acc(x_s^r) )                  (÷ W for AVG)

  on gloo (torch 2.13 gloo's own reduce-scatter reduces the whole tensor and then slices,
  about twice an all-reduce; the all-to-all moves the bytes of a ring reduce-scatter), and
  on every backend when the caller names an accumulation dtype (``acc``: the wire keeps the
  input's dtype, the sum is taken in ``acc`` and rounded once; Megatron's
  ``reduce_scatter_with_fp32_accumulation``).

The all-to-all needs a receive buffer of the input's size and, when ``output`` is narrower
than ``acc``, a sum buffer of the output's size. They come from an :data:`Allocate`
function: a fresh tensor per call, the caller's ``received``, or the buffers a
:class:`~mc_groups.Communicator` keeps between calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_float_dtype
from mc_groups.comm._common import (
    DONE,
    TORCH_OPS,
    CollectiveHandle,
    Planned,
    ReduceOp,
    check_schedule,
    describe_later,
    dtype_name,
    failed,
    record,
)
from mc_groups.comm._gloo import is_gloo
from mc_groups.comm._shims import reduce_scatter_flat
from mc_groups.comm.cross_rank import schedule_check_enabled
from mc_groups.comm.recorder import _recording
from mc_groups.errors import InputTypeError, InputValueError

__all__: list[str] = []

Allocate = Callable[[str, int, torch.dtype, torch.device], torch.Tensor]
"""``allocate(role, numel, dtype, device)``: a flat temporary for ``role`` (``"received"``:
the all-to-all's receive buffer; ``"sum"``: the accumulation buffer). Its contents are
overwritten before they are read."""


def fresh(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new temporary per request (an :data:`Allocate`)."""
    del role
    return torch.empty(numel, dtype=dtype, device=device)


def given(received: torch.Tensor | None) -> Allocate:
    """The caller's ``received`` as the receive buffer (when given), fresh otherwise."""
    if received is None:
        return fresh

    def allocate(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return received.view(-1) if role == "received" else fresh(role, numel, dtype, device)

    return allocate


def check_accumulate_dtype(value: object) -> torch.dtype | None:
    """None or a floating-point dtype."""
    return check_float_dtype("accumulate_dtype", value, allow_none=True)


def check_received(input: torch.Tensor, received: object) -> None:
    """``received`` is None or a contiguous tensor of ``input``'s numel, dtype and device;
    checked on every group (a one-rank group uses none, but the same call must be judged
    the same at any group size)."""
    if received is None:
        return
    if not isinstance(received, torch.Tensor):
        raise InputTypeError(
            f"received={received!r} must be None or a torch.Tensor of {input.numel()} × "
            f"{dtype_name(input.dtype)} on {input.device} (the input's size)"
        )
    if (
        received.numel() != input.numel()
        or received.dtype != input.dtype
        or received.device != input.device
        or not received.is_contiguous()
    ):
        shown = f"{received.numel()} × {dtype_name(received.dtype)} on {received.device}"
        raise InputValueError(
            f"received={shown} must be a contiguous tensor of {input.numel()} × "
            f"{dtype_name(input.dtype)} on {input.device} (the input's size)"
        )


def accumulation_dtype(output: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    """The dtype of the local reduction: ``requested``, else the output's for fp32/fp64 and
    fp32 for narrower dtypes."""
    if requested is not None:
        return requested
    return output.dtype if output.dtype in (torch.float32, torch.float64) else torch.float32


def reduce_rows(
    rows: torch.Tensor, op: ReduceOp, out: torch.Tensor, sum_buffer: torch.Tensor | None
) -> None:
    """``out ← op over dim 0 of rows`` (one row per rank, in group-rank order).

    SUM/AVG accumulate in ``sum_buffer``'s dtype and round once into ``out`` (straight into
    ``out`` when ``sum_buffer`` is None); MAX/MIN are exact in any dtype.
    """
    if op is ReduceOp.MAX:
        torch.amax(rows, dim=0, out=out)
        return
    if op is ReduceOp.MIN:
        torch.amin(rows, dim=0, out=out)
        return
    total = out if sum_buffer is None else sum_buffer
    torch.sum(rows, dim=0, dtype=total.dtype, out=total)
    if op is ReduceOp.AVG:
        total.div_(rows.shape[0])
    if sum_buffer is not None:
        out.copy_(total)


def by_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    accumulate: torch.dtype,
    allocate: Allocate,
) -> tuple[Any, Callable[[], None]]:
    """Issue the all-to-all; return its work and the local reduction that completes it.

    ``output`` may alias ``input`` (this rank's shard of a flat buffer): it is written only
    by the reduction, after the all-to-all completed.
    """
    received = allocate("received", input.numel(), input.dtype, input.device)
    needs_sum = op in (ReduceOp.SUM, ReduceOp.AVG) and output.dtype != accumulate
    sum_buffer = allocate("sum", output.numel(), accumulate, output.device) if needs_sum else None
    work = dist.all_to_all_single(received, input.view(-1), group=group, async_op=async_op)

    def finish() -> None:
        reduce_rows(received.view(group.size(), -1), op, output.view(-1), sum_buffer)

    return work, finish


def issue_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    label: str,
    detail: str,
    accumulate_dtype: torch.dtype | None,
    allocate: Allocate,
) -> CollectiveHandle:
    """Issue a checked reduce-scatter on a group of more than one rank (the arguments of
    :func:`~mc_groups.reduce_scatter`, with ``allocate`` for the temporaries).

    With ``accumulate_dtype`` it is recorded (and schedule-checked, and named in errors) as
    the all-to-all it communicates with, on every backend; on gloo without it, as a
    ``reduce_scatter``.
    """
    if accumulate_dtype is None and not is_gloo(group):
        # the common case written out (as mc_groups.comm.collectives._issue_all_reduce):
        # sequence-parallel layers run it per call
        if schedule_check_enabled():
            check_schedule("reduce_scatter", group, input, reduce_op=op, label=label, detail=detail)
        if _recording():
            record("reduce_scatter", group, input, reduce_op=op, async_op=async_op, label=label)
        about: Planned = ("reduce_scatter", group, input, label, detail)
        try:
            work = reduce_scatter_flat(
                output, input, op=TORCH_OPS[op], group=group, async_op=async_op
            )
        except RuntimeError as err:
            raise failed(about, err) from err
        if not async_op or work is None:
            return DONE
        return CollectiveHandle.of_work(work, about)
    if accumulate_dtype is None:
        kind, reduce_op = "reduce_scatter", op
    else:
        kind, reduce_op = "all_to_all", None
    description = describe_later(kind, group, input, label, detail)
    check_schedule(kind, group, input, reduce_op=reduce_op, label=label, detail=detail)
    record(kind, group, input, reduce_op=reduce_op, async_op=async_op, label=label)
    accumulate = accumulation_dtype(output, accumulate_dtype)
    try:
        work, finish = by_all_to_all(output, input, group, op, async_op, accumulate, allocate)
    except RuntimeError as err:
        raise failed(description, err) from err
    if not async_op:
        finish()
        return DONE
    return CollectiveHandle([work], description, [finish])
