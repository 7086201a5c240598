"""``reduce_scatter_with_fp32_accumulation``: Megatron-Core's name for mc_groups'
reduce-scatter with ``accumulate_dtype=torch.float32``.

A bf16 ring reduce-scatter rounds after every addition, so with many data-parallel ranks
the shard loses precision. This one moves the same bytes (an all-to-all sends each rank
``(W − 1)/W`` of the input, like a ring reduce-scatter) but keeps the wire in the grad
dtype and sums locally in fp32::

    rank r, input x_r = [x_r^0 | x_r^1 | … | x_r^{W-1}]     (W equal chunks)
    all-to-all:  rank r receives [x_0^r | x_1^r | … | x_{W-1}^r]
    local:       output_r = dtype( Σ_s fp32(x_s^r) )          (÷ W for AVG)

so the result is rounded once, from the exact fp32 sum. The mechanism is
:func:`mc_groups.reduce_scatter` (``accumulate_dtype``); DDP's bucket groups reach it
through their :class:`mc_groups.comm.communicator.Communicator`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["reduce_scatter_with_fp32_accumulation"]


def reduce_scatter_with_fp32_accumulation(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    op: mg.ReduceOp = mg.ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
    received: torch.Tensor | None = None,
    detail: str = "",
    all_to_all_output_tensor: torch.Tensor | None = None,
) -> mg.CollectiveHandle:
    """Reduce the flat ``input`` over ``group``; group rank r gets chunk r in ``output``.

    One ``all_to_all`` in ``input.dtype`` (recorded as such), then a local fp32 sum over the
    W received chunks, rounded once into ``output`` (``op``: SUM or AVG). ``output`` may be
    a view of ``input`` (this rank's shard of a bucket). With ``async_op`` the returned
    handle's ``wait()`` finishes the collective and the sum.

    ``all_to_all_output_tensor`` (Megatron-Core main's keyword; ``received`` is mc's older
    name for the same buffer, give one of them): the all-to-all's receive buffer, of
    ``input``'s shape and dtype (contiguous, on its device), for callers that keep their own
    buffer pool; allocated per call when not given. It must stay alive until the handle's
    ``wait()`` returns. A buffer of another shape or dtype is an ``InputValueError`` (an
    ``AssertionError``, as Megatron asserts) before the all-to-all starts, so no rank is left
    waiting in it. ``label`` and ``detail`` go to the all-to-all (records, errors and
    mc_groups' schedule check). ``group=None`` is torch's default (world) group, as in
    Megatron and torch.distributed.
    """
    scratch = _scratch(input, received, all_to_all_output_tensor)
    if group is None:
        if not dist.is_initialized() or dist.group.WORLD is None:
            raise InputValueError(
                "group=None means torch's default group, but torch.distributed is not "
                "initialised: call torch.distributed.init_process_group() or pass a group"
            )
        group = dist.group.WORLD
    summing = (mg.ReduceOp.SUM, mg.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    if isinstance(op, mg.ReduceOp | dist.ReduceOp.RedOpType) and op not in summing:
        raise InputValueError(f"op={op} is not supported: use ReduceOp.SUM or ReduceOp.AVG")
    return mg.reduce_scatter(
        output,
        input,
        group,
        op=op,
        async_op=async_op,
        label=label,
        detail=detail,
        accumulate_dtype=torch.float32,
        received=scratch,
    )


def _scratch(
    input: object, received: torch.Tensor | None, all_to_all_output_tensor: torch.Tensor | None
) -> torch.Tensor | None:
    """The caller's receive buffer under either name; Megatron's shape and dtype rule for
    ``all_to_all_output_tensor`` (mc_groups checks numel, dtype, device and contiguity)."""
    if all_to_all_output_tensor is None:
        return received
    if received is not None:
        raise InputValueError(
            "received= and all_to_all_output_tensor= name the same receive buffer: pass one"
        )
    given = all_to_all_output_tensor
    if not isinstance(given, torch.Tensor):
        raise InputTypeError(
            f"all_to_all_output_tensor={type_name(given)} must be None or a torch.Tensor "
            "shaped like input_tensor"
        )
    if isinstance(input, torch.Tensor) and (
        given.shape != input.shape or given.dtype != input.dtype
    ):
        raise InputValueError(
            f"all_to_all_output_tensor of shape {tuple(given.shape)} and dtype "
            f"{given.dtype} must match input_tensor's shape {tuple(input.shape)} and "
            f"dtype {input.dtype}; pass torch.empty_like(input) or None"
        )
    return given
