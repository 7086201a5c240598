"""A DTensor (FSDP2's sharded parameters and grads) as a whole tensor and back, through mc's
collective layer, so :func:`mc_groups.record_collectives` sees the gathers.

::

    full_tensor:  local shards ──all_gather per Shard mesh dim──▶ full tensor
    local_piece:  full tensor ──keep this rank's torch.chunk slice──▶ local tensor

:func:`full_tensor` issues one ``all_gather`` per mesh dimension that shards, innermost mesh
dimension first (the split order undone), with uneven ``torch.chunk`` shards padded to the
largest shard and trimmed after; ``Replicate`` needs no gather; ``Partial`` (pending
reductions) is refused. :func:`local_piece` communicates nothing: every rank holds the full
tensor and keeps its own slice. ``torch.distributed.tensor`` is imported only once a DTensor
exists (importing it costs over a second).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard, cast

import torch

from mc_groups.argcheck import check_tensor
from mc_groups.comm.collectives import all_gather, all_gather_objects, group_ranks, group_size
from mc_groups.errors import InputTypeError, InputValueError

if TYPE_CHECKING:
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.distributed.tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement, Shard

__all__ = [
    "check_placements",
    "distribute_like",
    "first_replica_local",
    "from_local",
    "full_tensor",
    "is_dtensor",
    "is_fsdp_module",
    "local_piece",
    "mesh_before",
    "reshard_fsdp",
]


def is_dtensor(tensor: object) -> bool:
    """``tensor`` is a DTensor (False, without importing DTensor, when none can exist)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def is_fsdp_module(module: object) -> TypeGuard[torch.distributed.fsdp.FSDPModule]:
    """``module`` is under FSDP2's ``fully_shard`` (False, without importing FSDP2, when no
    module can be): FSDP2 reduce-scatters its grads in backward and replaced its params."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return fsdp is not None and isinstance(module, fsdp)


def reshard_fsdp(module: torch.nn.Module) -> int:
    """Register the sharded params of every FSDP2 module in ``module`` (``fully_shard``'s
    ``FSDPModule.reshard()``: frees its unsharded params where they are allocated). Returns
    the number of FSDP2 modules. No communication; nothing to do without FSDP2.

    After a forward with no backward (evaluation), the root FSDP2 module keeps its
    unsharded params registered (torch's default ``reshard_after_forward`` for the root),
    and FSDP2's own state-dict pre-hooks swap in the sharded ones, freeing the unsharded
    storage: a reader that takes the params before ``state_dict()`` / ``load_state_dict()``
    would read freed storage or load into params about to be dropped. mc's readers call
    this first, so they always see FSDP2's sharded DTensor params."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    wrapped = [m for m in module.modules() if is_fsdp_module(m)]
    for sub in wrapped:
        sub.reshard()
    return len(wrapped)


def _is_shard(placement: object) -> TypeGuard[Shard]:
    from torch.distributed.tensor import Shard  # noqa: PLC0415 (loaded: a DTensor exists)

    return isinstance(placement, Shard)


def check_placements(placements: tuple[Placement, ...], what: str = "DTensor") -> None:
    """``Shard`` and ``Replicate`` only (a ``TypeError`` for ``Partial``)."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 (loaded)

    for placement in placements:
        if not isinstance(placement, Shard | Replicate):
            raise InputTypeError(
                f"{what} placement {placement!r} is not supported: a Partial tensor has pending "
                "reductions; redistribute it to Shard or Replicate first"
            )


def full_tensor(tensor: torch.Tensor, label: str = "full DTensor") -> torch.Tensor:
    """The whole tensor of a DTensor (gathered over its mesh, module notes); any other tensor
    unchanged. Collective over the mesh's groups: every rank of the mesh calls it."""
    check_tensor("tensor", tensor)
    if not is_dtensor(tensor):
        return tensor
    dtensor = cast("DTensor", tensor)
    placements = tuple(dtensor.placements)
    check_placements(placements)
    mesh = dtensor.device_mesh
    sizes = _sizes_before_split(dtensor.shape, mesh, placements)
    with torch.no_grad():
        full = dtensor.to_local()
        for mesh_dim in reversed(range(len(placements))):  # mesh dim 0 split first
            placement = placements[mesh_dim]
            if _is_shard(placement):
                dim = placement.dim % dtensor.ndim
                full = _gather_dim(full, dim, sizes[mesh_dim], mesh.get_group(mesh_dim), label)
    return full


def local_piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``full`` split as the DTensor ``like`` is (a contiguous
    copy; no communication); ``full`` itself when ``like`` is no DTensor."""
    check_tensor("full", full)
    check_tensor("like", like)
    if not is_dtensor(like):
        return full
    reference = cast("DTensor", like)
    mesh, placements = reference.device_mesh, tuple(reference.placements)
    check_placements(placements)
    local, coords = full, _coordinates(mesh)
    for mesh_dim, placement in enumerate(placements):
        if _is_shard(placement):
            dim = placement.dim % full.ndim
            length, parts = local.shape[dim], mesh.size(mesh_dim)
            start = coords[mesh_dim] * -(-length // parts)
            local = local.narrow(
                dim, min(start, length), _chunk_len(length, parts, coords[mesh_dim])
            )
    return local.clone(memory_format=torch.contiguous_format)


def distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` as a DTensor placed as ``like`` is (same mesh, placements, global shape and
    stride), holding this rank's :func:`local_piece` (no communication); ``full`` itself
    when ``like`` is no DTensor."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (loaded: a DTensor exists)

    reference = cast("DTensor", like)
    return DTensor.from_local(
        local_piece(full, like),
        reference.device_mesh,
        tuple(reference.placements),
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )


def mesh_before(
    group: torch.distributed.ProcessGroup,
    mesh: torch.distributed.device_mesh.DeviceMesh,
    device_type: str,
    names: Sequence[str],
    label: str = "mesh rank grid",
    cache: dict[tuple[int, ...], torch.distributed.device_mesh.DeviceMesh] | None = None,
) -> torch.distributed.device_mesh.DeviceMesh:
    """The mesh ``(group, *mesh's dims)`` named ``names``: a view's mesh that splits by
    ``group`` (tp, ep) first, then as FSDP2's ``mesh`` (1-D, or HSDP's ``(replicate,
    shard)``). The rank grid comes from ``group``'s ranks gathered over ``mesh``'s groups,
    innermost first: one ``all_gather_objects`` per mesh dim, so a collective over
    ``mesh``'s ranks. ``cache``: a caller's dict (one state dict's views, say) keyed by the
    groups; a mesh found there is returned without communicating, so every rank must meet
    the same groups in the same order."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (see the module notes)

    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    key = (id(group), *(id(g) for g in groups))
    if cache is not None and key in cache:
        return cache[key]
    grid: object = list(group_ranks(group))
    for dim_group in reversed(groups):
        grid = all_gather_objects(grid, dim_group, label=label)
    ranks = torch.tensor(grid, dtype=torch.int64)  # [mesh dims...][group]
    built = DeviceMesh.from_group(
        [group, *groups],
        device_type,
        mesh=ranks.permute(ranks.dim() - 1, *range(ranks.dim() - 1)).contiguous(),
        mesh_dim_names=tuple(names),
    )
    if cache is not None:
        cache[key] = built
    return built


def from_local(
    local: torch.Tensor,
    mesh: torch.distributed.device_mesh.DeviceMesh,
    placements: Sequence[torch.distributed.tensor.Placement],
    global_shape: Sequence[int],
) -> torch.Tensor:
    """``local`` as this rank's part of a DTensor of ``global_shape`` (contiguous strides)
    placed by ``placements`` on ``mesh``; no communication and no cross-rank check: the
    caller computed the shape every rank agrees on."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (see the module notes)

    shape = torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, tuple(placements), run_check=False, shape=shape, stride=stride
    )


def first_replica_local(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A DTensor's local tensor, and whether this rank holds the first copy of it: at
    coordinate 0 of every mesh dim the DTensor is ``Replicate`` over (its ``Shard`` dims hold
    disjoint pieces). Counting only first copies counts every element once (a global norm).
    No communication."""
    check_tensor("tensor", tensor)
    dtensor = cast("DTensor", tensor)
    placements = tuple(dtensor.placements)
    check_placements(placements)
    coords = _coordinates(dtensor.device_mesh)
    first = all(_is_shard(p) or coords[dim] == 0 for dim, p in enumerate(placements))
    return dtensor.to_local(), first


def _chunk_len(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` splits ``n`` rows into ``parts``."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def _coordinates(mesh: DeviceMesh) -> list[int]:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise InputValueError(f"this rank is not in the DTensor's device mesh {mesh!r}")
    return list(coordinate)


def _sizes_before_split(
    shape: torch.Size, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> list[int]:
    """For each mesh dim, the length of its sharded tensor dim just before it splits."""
    current, coords, sizes = list(shape), _coordinates(mesh), []
    for mesh_dim, placement in enumerate(placements):
        if not _is_shard(placement):
            sizes.append(0)
            continue
        dim = placement.dim % len(current)
        sizes.append(current[dim])
        current[dim] = _chunk_len(current[dim], mesh.size(mesh_dim), coords[mesh_dim])
    return sizes


def _gather_dim(
    local: torch.Tensor, dim: int, length: int, group: torch.distributed.ProcessGroup, label: str
) -> torch.Tensor:
    parts = group_size(group)
    piece = -(-length // parts)
    rows = local.movedim(dim, 0)
    send = torch.zeros((piece, *rows.shape[1:]), dtype=local.dtype, device=local.device)
    send[: rows.shape[0]].copy_(rows)
    out = torch.empty((parts * piece, *rows.shape[1:]), dtype=local.dtype, device=local.device)
    all_gather(out, send, group, label=label)
    kept = [out[i * piece : i * piece + _chunk_len(length, parts, i)] for i in range(parts)]
    return torch.cat(kept).movedim(0, dim).contiguous()
