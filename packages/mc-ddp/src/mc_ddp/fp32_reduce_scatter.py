"""``reduce_scatter_with_fp32_accumulation``: a reduce-scatter whose sum is taken in fp32.

A bf16 ring reduce-scatter rounds after every addition, so with many data-parallel ranks
the shard loses precision. This one moves the same bytes (an all-to-all sends each rank
``(W − 1)/W`` of the input, like a ring reduce-scatter) but keeps the wire in the grad
dtype and sums locally in fp32::

    rank r, input x_r = [x_r^0 | x_r^1 | … | x_r^{W-1}]     (W equal chunks)
    all-to-all:  rank r receives [x_0^r | x_1^r | … | x_{W-1}^r]
    local:       output_r = dtype( Σ_s fp32(x_s^r) )          (÷ W for AVG)

so the result is rounded once, from the exact fp32 sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp._pending import PendingCollective
from mc_groups.argcheck import check_flag, check_tensor

__all__ = ["reduce_scatter_with_fp32_accumulation"]


def _check(output: torch.Tensor, input: torch.Tensor, size: int, op: mg.ReduceOp) -> None:
    check_tensor("output", output)
    check_tensor("input", input)
    if not isinstance(op, mg.ReduceOp):
        raise TypeError(f"op={op!r} must be a mc_groups.ReduceOp (SUM or AVG)")
    if op not in (mg.ReduceOp.SUM, mg.ReduceOp.AVG):
        raise ValueError(f"op={op} is not supported: use ReduceOp.SUM or ReduceOp.AVG")
    if input.numel() != output.numel() * size:
        raise ValueError(
            f"input.numel()={input.numel()} must equal output.numel()={output.numel()} × "
            f"group size {size}"
        )
    if output.dtype != input.dtype:
        raise ValueError(f"output dtype {output.dtype} differs from input dtype {input.dtype}")


def _check_scratch(t: torch.Tensor, numel: int, dtype: torch.dtype, name: str) -> None:
    check_tensor(name, t)
    if t.numel() != numel or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements, got "
            f"{t.numel()} × {t.dtype}"
        )


def reduce_scatter_with_fp32_accumulation(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: mg.ReduceOp = mg.ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
    received: torch.Tensor | None = None,
    fp32_sum: torch.Tensor | None = None,
    detail: str = "",
) -> PendingCollective:
    """Reduce the flat ``input`` over ``group``; group rank r gets chunk r in ``output``.

    One ``all_to_all`` in ``input.dtype`` (recorded as such), then a local fp32 sum over the
    W received chunks, rounded once into ``output``. ``output`` may be a view of ``input``
    (this rank's shard of a bucket). With ``async_op`` the returned object's ``wait()``
    finishes the collective and the sum.

    Temporaries, allocated when not given (pass reused ones to avoid the allocation):
    ``received`` (``input``'s numel and dtype, the all-to-all output) and, unless ``output``
    is fp32, ``fp32_sum`` (``output``'s numel, fp32). ``label`` and ``detail`` go to the
    all-to-all (records, errors and mc_groups' schedule check).
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} must be a torch.distributed.ProcessGroup")
    size = mg.group_size(group)
    _check(output, input, size, op)
    check_flag("async_op", async_op)
    if fp32_sum is not None and output.dtype != torch.float32:
        _check_scratch(fp32_sum, output.numel(), torch.float32, "fp32_sum")
    received = torch.empty_like(input) if received is None else received
    _check_scratch(received, input.numel(), input.dtype, "received")
    handle = mg.all_to_all(
        received.view(-1), input, group, async_op=async_op, label=label, detail=detail
    )

    def finish() -> None:
        chunks = received.view(size, -1)
        if output.dtype == torch.float32:
            torch.sum(chunks, dim=0, out=output.view(-1))
            total = output.view(-1)
        else:
            total = (
                torch.empty(output.numel(), device=output.device) if fp32_sum is None else fp32_sum
            )
            _check_scratch(total, output.numel(), torch.float32, "fp32_sum")
            torch.sum(chunks, dim=0, dtype=torch.float32, out=total)
        if op is mg.ReduceOp.AVG:
            total.div_(size)
        if total.data_ptr() != output.data_ptr():
            output.view(-1).copy_(total)

    pending = PendingCollective([handle], [finish])
    if not async_op:
        pending.wait()
    return pending
