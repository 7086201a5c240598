"""The gloo algorithms of the collective layer: reduce-scatter built from
``all_to_all_single`` plus a local reduction, with its caller-kept staging buffer, and
all-gather built from point-to-point exchanges straight into the output (torch 2.13 gloo's
own reduce-scatter and all-gather are 2-4× slower on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mc_groups._core import ReduceOp, check_group, dtype_name
from mc_groups._p2p import exchange_rows

__all__ = ["needs_staging"]


def is_gloo(group: dist.ProcessGroup) -> bool:
    """The group runs on gloo."""
    return bool(dist.get_backend(group) == "gloo")


def needs_staging(group: dist.ProcessGroup) -> bool:
    """True when :func:`~mc_groups.reduce_scatter` on ``group`` uses a staging tensor the
    size of the full (unsharded) buffer: gloo groups of more than one rank.
    (:func:`~mc_groups.all_gather` needs none: on gloo it exchanges the shards directly.)

    Callers that repeat a collective on the same buffer pass a kept ``staging`` tensor:
    on CPU a fresh 33 MB tensor costs about 27 ms of page faults per use, a reused one
    1.5 ms to fill (measured on this project's 2-core machines).
    """
    return check_group(group).size() > 1 and is_gloo(group)


def staging_for(full: torch.Tensor, staging: torch.Tensor | None) -> torch.Tensor:
    """``staging`` checked against ``full`` (numel, dtype, device), or a fresh buffer."""
    if staging is None:
        return torch.empty(full.numel(), dtype=full.dtype, device=full.device)
    return _checked(full, staging)


def check_staging(full: torch.Tensor, staging: object) -> None:
    """``staging`` is None or a contiguous tensor of ``full``'s numel, dtype and device;
    checked on every group (a one-rank group uses none, but the same call must be judged
    the same at any group size)."""
    if staging is not None:
        _checked(full, staging)


def _checked(full: torch.Tensor, staging: object) -> torch.Tensor:
    if not isinstance(staging, torch.Tensor):
        raise TypeError(
            f"staging={staging!r} must be None or a torch.Tensor of {full.numel()} × "
            f"{dtype_name(full.dtype)} on {full.device} (the full buffer's size)"
        )
    if (
        staging.numel() != full.numel()
        or staging.dtype != full.dtype
        or staging.device != full.device
        or not staging.is_contiguous()
    ):
        shown = f"{staging.numel()} × {dtype_name(staging.dtype)} on {staging.device}"
        raise ValueError(
            f"staging={shown} must be a contiguous tensor of {full.numel()} × "
            f"{dtype_name(full.dtype)} on {full.device} (the full buffer's size)"
        )
    return staging.view(-1)


def reduce_rows(rows: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> None:
    """``out ← op over dim 0 of rows`` (one row per rank, in group-rank order).

    Sums are taken in fp32 and rounded once into ``out``'s dtype.
    """
    if op is ReduceOp.MAX:
        torch.amax(rows, dim=0, out=out)
        return
    if op is ReduceOp.MIN:
        torch.amin(rows, dim=0, out=out)
        return
    if out.dtype in (torch.float32, torch.float64):
        torch.sum(rows, dim=0, out=out)
        if op is ReduceOp.AVG:
            out.div_(rows.shape[0])
        return
    total = rows.sum(dim=0, dtype=torch.float32)
    if op is ReduceOp.AVG:
        total.div_(rows.shape[0])
    out.copy_(total)


def reduce_scatter_by_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: ReduceOp,
    async_op: bool,
    received: torch.Tensor,
) -> tuple[Any, Callable[[], None]]:
    """Gloo's reduce-scatter, built from an all-to-all and a local reduction.

    Rank r receives slice r of every rank's ``input`` into ``staging`` (row j = rank j's
    copy), then reduces the rows into ``output``. torch 2.13 gloo's own reduce-scatter
    reduces everything and then slices: about twice an all-reduce; this one moves the same
    bytes as a ring reduce-scatter (100 MB on 2 ranks: 200 → 53 ms, measured). ``output``
    may alias ``input``: it is written only after the all-to-all completed. ``received``
    is a flat buffer of ``input``'s numel and dtype.
    """
    work = dist.all_to_all_single(received, input.view(-1), group=group, async_op=async_op)

    def finish() -> None:
        reduce_rows(received.view(group.size(), -1), op, output.view(-1))

    return work, finish


EXCHANGE_TAG = 0x6D63
"""The point-to-point tag of the all-gather exchange: apart from user ``send``/``recv``
(tag 0) on the same group, so neither can take the other's message."""

EXCHANGE_MIN_BYTES = 4 * 2**20
"""Outputs from this size on are all-gathered by point-to-point exchange, smaller ones by
an all-to-all of the repeated shard (see :func:`all_gather_works`)."""


def all_gather_works(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> list[Any]:
    """Gloo's all-gather, issued asynchronously; returns its works.

    Large outputs (≥ :data:`EXCHANGE_MIN_BYTES`): point-to-point exchanges straight into
    ``output`` (:func:`_exchange`), no staging. Smaller ones: one all-to-all of the repeated
    shard through a fresh buffer (cheap at that size: no page faults from the heap).
    Measured on 2 ranks (torch 2.13, 1 thread per rank), alone: 25 MiB output 8.3 ms by
    exchange against 11.4 ms by all-to-all (gloo's ``all_gather_into_tensor`` 13.2 ms),
    4 MiB 1.5 against 2.2 ms, 1 MiB and below equal within 0.1 ms; but inside a
    sequence-parallel step of 256 KiB gathers, with both cores computing, the exchange
    (two works, each needing the peer's progress) cost ~1 ms more per gather.
    """
    if output.numel() * output.element_size() >= EXCHANGE_MIN_BYTES:
        return _exchange(output, input, group)
    size = group.size()
    repeated = input.reshape(1, -1).expand(size, -1).contiguous()  # read before any write
    return [dist.all_to_all_single(output.view(-1), repeated.view(-1), group=group, async_op=True)]


def _exchange(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> list[Any]:
    """All-gather by point-to-point exchange on :data:`EXCHANGE_TAG` (see
    :func:`mc_groups._p2p.exchange_rows`)."""
    return exchange_rows(output, input, group, tag=EXCHANGE_TAG)
