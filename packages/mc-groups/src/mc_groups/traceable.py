"""Deprecated alias of :mod:`mc_groups.comm.traceable`, where issue 31 moved it with the
rest of the collective layer (:mod:`mc_groups.comm`). It re-exports that module's public
names for one release and will then be removed: import them from :mod:`mc_groups` or
:mod:`mc_groups.comm.traceable`."""

from __future__ import annotations

from mc_groups.comm.traceable import (
    PendingTensor,
    all_gather_tensor,
    all_reduce_tensor,
    all_to_all_tensor,
    reduce_scatter_tensor,
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
)

__all__ = [
    "PendingTensor",
    "all_gather_tensor",
    "all_reduce_tensor",
    "all_to_all_tensor",
    "reduce_scatter_tensor",
    "start_all_gather",
    "start_all_reduce",
    "start_reduce_scatter",
]
