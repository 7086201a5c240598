"""Where a param's grad lives, and DTensor grads as plain tensors around a collective.

A grad is ``param.main_grad`` when the param has that attribute (the DDP buffer view,
possibly fp32) and ``param.grad`` otherwise.

A DTensor grad (torch FSDP2) is unsharded before a finalize collective and resharded after:

    _unshard_if_dtensor:  local shards ──all_gather per Shard mesh dim──▶ full tensor
    _reshard_if_dtensor:  full tensor ──keep this rank's torch.chunk slice──▶ DTensor

The unshard gathers through mc-groups' collective layer (one ``all_gather`` per mesh
dimension that shards, innermost mesh dimension first, uneven ``torch.chunk`` shards padded
to the largest shard and trimmed after), so the recorder sees it; the reshard communicates
nothing: every rank already holds the reduced full tensor and keeps its own slice.
``Replicate`` placements need no gather; ``Partial`` placements are rejected (a grad with
pending reductions is not a finished grad).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard, cast

import torch

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import check_tensor, type_name
from mc_groups.errors import InputTypeError, InputValueError

if TYPE_CHECKING:  # DTensor is imported where used: importing it costs over a second
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement, Shard

_GATHER_LABEL = "unshard DTensor grad"


def _get_main_grad_attr(param: torch.nn.Parameter) -> str:
    """``"main_grad"`` when ``param`` has that attribute, else ``"grad"``."""
    check_tensor("param", param)
    return param_attrs.MAIN_GRAD if param_attrs.has_main_grad(param) else "grad"


def _is_dtensor(tensor: object) -> bool:
    """No DTensor exists before ``torch.distributed.tensor`` is imported, so only then can
    a grad be one (a dict lookup per grad; torch builds without DTensor never load it)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def _is_shard(placement: object) -> TypeGuard[Shard]:
    from torch.distributed.tensor import Shard  # noqa: PLC0415 (loaded: a DTensor exists)

    return isinstance(placement, Shard)


def _unshard_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (gathered over its mesh); any other tensor unchanged.

    Attributes set on the DTensor object (``vars(tensor)``) are copied to the result.
    Raises ``TypeError`` for a ``Partial`` placement, before any collective.
    """
    check_tensor("tensor", tensor)
    if not _is_dtensor(tensor):
        return tensor
    dtensor = cast("DTensor", tensor)
    placements = tuple(dtensor.placements)
    _check_placements(placements)
    with torch.no_grad():
        full = _gather_full(dtensor, placements)
    _copy_attributes(dtensor, full)
    return full


def _reshard_if_dtensor(
    tensor_to_shard: torch.Tensor, reference_tensor: torch.Tensor
) -> torch.Tensor:
    """``tensor_to_shard`` split like ``reference_tensor`` when that is a DTensor.

    Otherwise returns ``reference_tensor`` itself (a plain grad was reduced in place). The
    new DTensor has the reference's mesh, placements, global shape and stride, and its
    attributes; this rank keeps its ``torch.chunk`` slice (no communication).
    """
    check_tensor("tensor_to_shard", tensor_to_shard)
    check_tensor("reference_tensor", reference_tensor)
    if not _is_dtensor(reference_tensor):
        return reference_tensor
    reference = cast("DTensor", reference_tensor)
    mesh, placements = reference.device_mesh, tuple(reference.placements)
    _check_placements(placements)
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (loaded: a DTensor exists)

    with torch.no_grad():
        local = _local_slice(tensor_to_shard, mesh, placements)
        sharded = DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=reference.shape,
            stride=reference.stride(),
        )
    _copy_attributes(reference, sharded)
    return sharded


def _check_placements(placements: tuple[Placement, ...]) -> None:
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 (loaded)

    for placement in placements:
        if not isinstance(placement, Shard | Replicate):
            raise InputTypeError(
                f"DTensor grad placement {placement!r} is not supported: finalize reduces "
                "finished grads; redistribute Partial grads to Shard or Replicate first"
            )


def _copy_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    for key, value in vars(source).items():
        setattr(target, key, value)


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


def _gather_full(tensor: DTensor, placements: tuple[Placement, ...]) -> torch.Tensor:
    mesh = tensor.device_mesh
    sizes = _sizes_before_split(tensor.shape, mesh, placements)
    full = tensor.to_local()
    # Mesh dim 0 split first, so the innermost split is undone first.
    for mesh_dim in reversed(range(len(placements))):
        placement = placements[mesh_dim]
        if _is_shard(placement):
            dim = placement.dim % tensor.ndim
            full = _gather_dim(full, dim, sizes[mesh_dim], mesh.get_group(mesh_dim))
    return full


def _gather_dim(
    local: torch.Tensor, dim: int, length: int, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    parts = mg.group_size(group)
    piece = -(-length // parts)
    rows = local.movedim(dim, 0)
    send = torch.zeros((piece, *rows.shape[1:]), dtype=local.dtype, device=local.device)
    send[: rows.shape[0]].copy_(rows)
    out = torch.empty((parts * piece, *rows.shape[1:]), dtype=local.dtype, device=local.device)
    mg.all_gather(out, send, group, label=_GATHER_LABEL)
    kept = [out[i * piece : i * piece + _chunk_len(length, parts, i)] for i in range(parts)]
    return torch.cat(kept).movedim(0, dim).contiguous()


def _local_slice(
    full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> torch.Tensor:
    local, coords = full, _coordinates(mesh)
    for mesh_dim, placement in enumerate(placements):
        if _is_shard(placement):
            dim = placement.dim % full.ndim
            length, parts = local.shape[dim], mesh.size(mesh_dim)
            start = coords[mesh_dim] * -(-length // parts)
            local = local.narrow(
                dim, min(start, length), _chunk_len(length, parts, coords[mesh_dim])
            )
    # A copy, so the full tensor is not kept alive by a view.
    return local.clone(memory_format=torch.contiguous_format)


@dataclass
class _GradView:
    """A param's grad as a plain full tensor to reduce, and how to put it back.

    For a plain grad ``full`` is the grad itself (reduced in place); for a DTensor grad it is
    the unsharded copy, and :meth:`commit` stores the resharded result on the param.
    """

    param: torch.nn.Parameter
    attr: str
    original: torch.Tensor
    full: torch.Tensor

    def commit(self) -> None:
        """Write the reduced grad back to ``param.<attr>`` (resharded when it was a DTensor)."""
        if self.full is not self.original:
            setattr(self.param, self.attr, _reshard_if_dtensor(self.full, self.original))


def _grad_view(param: torch.nn.Parameter) -> _GradView | None:
    """The param's grad (``main_grad`` or ``grad``), unsharded; ``None`` when it has none."""
    attr = _get_main_grad_attr(param)
    original = getattr(param, attr)
    if original is None:
        return None
    if not isinstance(original, torch.Tensor):
        raise InputTypeError(
            f"param.{attr} is {type_name(original)}, expected a torch.Tensor or None"
        )
    return _GradView(param, attr, original, _unshard_if_dtensor(original))
