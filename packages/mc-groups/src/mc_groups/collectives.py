"""Deprecated alias of :mod:`mc_groups.comm.collectives`, where issue 31 moved it with the
rest of the collective layer (:mod:`mc_groups.comm`). It re-exports that module's public
names for one release and will then be removed: import them from :mod:`mc_groups` or
:mod:`mc_groups.comm.collectives`."""

from __future__ import annotations

from mc_groups.comm.collectives import (
    CoalescedBatch,
    CollectiveError,
    CollectiveHandle,
    CollectiveScheduleError,
    ReduceOp,
    all_gather,
    all_gather_objects,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    coalesced,
    group_rank,
    group_ranks,
    group_size,
    is_group_live,
    record_p2p_ops,
    recv,
    reduce_scatter,
    send,
)

__all__ = [
    "CoalescedBatch",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveScheduleError",
    "ReduceOp",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "coalesced",
    "group_rank",
    "group_ranks",
    "group_size",
    "is_group_live",
    "record_p2p_ops",
    "recv",
    "reduce_scatter",
    "send",
]
