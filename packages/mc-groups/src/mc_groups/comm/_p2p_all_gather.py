"""All-gather by point-to-point exchange: the gloo all-gather for large outputs (see
:mod:`mc_groups.comm._gloo`).

Point-to-point messages do not wait in the process group's work queue: on gloo an
exchange progresses while collectives issued earlier on the same group are still
running, where a gloo collective would start only after them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []


def exchange_rows(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, tag: int
) -> list[Any]:
    """Issue ``output = [x_0 | … | x_{W-1}]`` as point-to-point sends and receives on ``tag``.

    Group rank r puts ``x_r`` (``input``) in row r of ``output`` (nothing to copy when
    ``input`` is that row: a shard view of a flat buffer), sends row r to every other rank
    and receives row s from rank s straight into ``output``. Each rank sends and receives
    ``(W-1)/W`` of the output, like a ring all-gather. Returns the ``2 (W-1)`` works.

    Messages between two ranks on one tag arrive in the order they were posted, so several
    exchanges in flight on one group match up as long as every rank issues them in the
    same order (as for any collective); a separate tag keeps them apart from other
    point-to-point traffic on the group.
    """
    size, me = group.size(), group.rank()
    rows = output.view(size, -1)
    own = rows[me]
    source = input.reshape(-1)
    if source.data_ptr() != own.data_ptr():
        if _shares_memory(source, output):
            source = source.clone()  # another row of output: read it before it is received
        own.copy_(source)
    works: list[Any] = []
    for peer in range(size):
        if peer != me:
            works.append(dist.isend(own, group=group, group_dst=peer, tag=tag))
            works.append(dist.irecv(rows[peer], group=group, group_src=peer, tag=tag))
    return works


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The byte ranges of ``a`` and ``b`` (both contiguous) overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
