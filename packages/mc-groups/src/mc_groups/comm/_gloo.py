"""The gloo side of the collective layer: which groups run on gloo, and all-gather built from
point-to-point exchanges straight into the output (torch 2.13 gloo's own all-gather is
slower on CPU). gloo's reduce-scatter, an all-to-all plus a local reduction, lives with the
other reduce-scatter algorithms in :mod:`mc_groups.comm._reduce_scatter`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mc_groups.comm._p2p_all_gather import exchange_rows

__all__: list[str] = []


def is_gloo(group: dist.ProcessGroup) -> bool:
    """The group runs on gloo."""
    return bool(dist.get_backend(group) == "gloo")


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
    shard through a fresh buffer (cheap at that size: no page faults from the heap). Why
    the threshold: alone, the exchange is faster from a few MiB on and equal below; inside
    a busy sequence-parallel step of small gathers, its two works per peer (each needing
    the peer's progress) cost more (the measurements are in mc-groups' README).
    """
    if output.numel() * output.element_size() >= EXCHANGE_MIN_BYTES:
        return _exchange(output, input, group)
    size = group.size()
    repeated = input.reshape(1, -1).expand(size, -1).contiguous()  # read before any write
    return [dist.all_to_all_single(output.view(-1), repeated.view(-1), group=group, async_op=True)]


def _exchange(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> list[Any]:
    """All-gather by point-to-point exchange on :data:`EXCHANGE_TAG` (see
    :func:`mc_groups.comm._p2p_all_gather.exchange_rows`)."""
    return exchange_rows(output, input, group, tag=EXCHANGE_TAG)
