"""Resolving the process groups a layer or mapping talks over.

Groups are passed explicitly. A ``group=None`` / ``tp_group=None`` argument falls back to
``pg_collection`` and then to the collection registered with
:func:`mc_groups.set_default_collection` (:func:`mc_groups.collection_or_default`); when
none is registered the error says how to pass one. Nothing here communicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_groups import collection_or_default
from mc_groups.argcheck import check_group
from mc_groups.errors import InputValueError

__all__: list[str] = []

_EXPLICIT = "tp_group=<ProcessGroup> or pg_collection=<ProcessGroupCollection>"


def resolve_tp_group(
    tp_group: object,
    pg_collection: object = None,
    *,
    is_expert: bool = False,
    what: str = "this layer",
) -> dist.ProcessGroup:
    """``tp_group`` if given, else the collection's ``tp`` (``expt_tp`` for experts)."""
    if tp_group is not None:
        return check_group("tp_group", tp_group)
    field = "expt_tp" if is_expert else "tp"
    return collection_or_default(pg_collection, what, explicit=_EXPLICIT).require(field, what)


def resolve_gtp_group(
    gtp_remat_size: int,
    pg_collection: object,
    *,
    is_expert: bool = False,
    what: str = "this layer",
) -> dist.ProcessGroup | None:
    """The gtp_remat group when ``gtp_remat_size > 1`` (checked against its size), else None."""
    if gtp_remat_size == 1:
        return None
    field = "expt_gtp_remat" if is_expert else "gtp_remat"
    group = collection_or_default(pg_collection, what, explicit=_EXPLICIT).require(field, what)
    if group.size() != gtp_remat_size:
        raise InputValueError(
            f"config.gtp_remat_size={gtp_remat_size} but pg_collection.{field} has "
            f"{group.size()} ranks; build the groups with the same gtp_remat_size"
        )
    return group


def group_rank_and_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """``(rank in group, group size)``."""
    return int(group.rank()), int(group.size())


def default_device(use_cpu_initialization: bool, group: dist.ProcessGroup) -> torch.device:
    """Where a layer allocates its parameters when the caller names no device.

    CPU initialisation keeps weights on CPU (as Megatron does); otherwise the current CUDA
    device when the group communicates through NCCL, else CPU (gloo worlds).
    """
    if use_cpu_initialization:
        return torch.device("cpu")
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
