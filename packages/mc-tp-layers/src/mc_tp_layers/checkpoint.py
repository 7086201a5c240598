r"""Sharded state dicts for ``torch.distributed.checkpoint`` (DCP).

A layer's ``sharded_state_dict()`` maps each parameter name to a tensor DCP can save from
and load into in place:

- a tensor-parallel shard (``tensor_model_parallel``) becomes a ``DTensor`` on a 1-D
  device mesh over the TP group, sharded along ``partition_dim``; a checkpoint written at
  one TP size loads at any other (DCP reads the overlapping chunks);
- a strided shard (``partition_stride`` k > 1, e.g. a fused QKV weight) is stored as its
  ``[.., k, d/k, ..]`` view sharded along the second of the two: rank r holds blocks
  ``r, r + W, …`` of ``d``, which is exactly column r of that view, so the checkpoint
  layout does not depend on W (it depends on k, which belongs to the model);
- a replicated parameter stays a plain tensor (DCP writes one copy and reads it
  everywhere).

The DTensors are views of the parameters: ``dcp.load`` writes straight into them::

    sd = layer.sharded_state_dict(prefix="fc1.")
    torch.distributed.checkpoint.save(sd, checkpoint_id=path)      # at TP = 2
    ...
    torch.distributed.checkpoint.load(other.sharded_state_dict(prefix="fc1."),
                                      checkpoint_id=path)            # at TP = 1 or 4

A gtp_remat shard (a weight whose TP-local rows are split over the gtp_remat group, see
:mod:`mc_tp_layers.gtp`) becomes a DTensor on a 2-D mesh ``(tp, gtp_remat)`` sharded first
along ``partition_dim`` by TP, then along dim 0 by gtp_remat: each rank contributes its
rows without the alignment padding (``ceil(d0 / G)`` rows per rank, the last ones fewer or
none: DTensor's own uneven split), so the checkpoint holds the plain weight and loads at
any TP and gtp_remat size. Building that mesh all-gathers the gtp_remat ranks over the TP
group, so ``sharded_state_dict`` of such a layer is a collective over its TP group (as
the DCP save/load around it is over every rank). Strided GTP shards are not supported.

DCP coordinates its ranks itself (over the default group unless given one), outside
mc_groups' recorder. Megatron's ``sharded_offsets`` are not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import check_group, check_int, check_str, check_tensor, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers import _validate
from mc_tp_layers.gtp import _gtp_group, unsharded_shape

if TYPE_CHECKING:  # DTensor is imported where used: importing it costs over a second
    from torch.distributed.tensor import Shard

__all__ = ["gtp_sharded_tensor", "sharded_state_dict_of", "tp_sharded_tensor"]


def _strided_view(t: torch.Tensor, dim: int, stride: int) -> torch.Tensor:
    shape = list(t.shape)
    return t.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1 :])


def tp_sharded_tensor(
    tensor: torch.Tensor, tp_group: dist.ProcessGroup, partition_dim: int, stride: int = 1
) -> torch.Tensor:
    """``tensor`` (this rank's TP shard) as a DTensor sharded along ``partition_dim``.

    With ``stride`` k > 1 the DTensor is the ``[.., k, d/k, ..]`` view (see the module
    notes). A group of one rank holds the whole tensor: it is returned as a plain tensor
    (in the same strided view).
    """
    local = check_tensor("tensor", tensor).detach()
    check_group("tp_group", tp_group)
    dim = _validate.partition_dim(partition_dim, local.dim())
    if local.shape[dim] % check_int("stride", stride):
        raise InputValueError(
            f"stride={stride} does not divide dim {dim} of the tensor's shape "
            f"{tuple(local.shape)}; a strided shard holds stride equal blocks"
        )
    if stride > 1:
        local, dim = _strided_view(local, dim, stride), dim + 1
    if tp_group.size() == 1:
        return local
    shape = list(local.shape)
    shape[dim] *= int(tp_group.size())
    global_shape = torch.Size(shape)
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (see the imports)
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    mesh = DeviceMesh.from_group(tp_group, local.device.type)
    return DTensor.from_local(
        local,
        mesh,
        [Shard(dim)],
        run_check=False,
        shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )


def _checked(module: torch.nn.Module, prefix: object, sharded_offsets: Any, metadata: Any) -> None:
    check_str("prefix", prefix)
    if isinstance(sharded_offsets, (str, bytes)) or not isinstance(sharded_offsets, Sequence):
        raise InputTypeError(
            f"sharded_offsets={sharded_offsets!r} must be a tuple of (axis, offset, count) "
            "triples (mc supports only the empty tuple)"
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise InputTypeError(f"metadata={metadata!r} must be a dict or None")
    # Megatron's metadata only selects its own checkpoint formats: accepted, not read.
    if tuple(sharded_offsets):
        raise NotImplementedError(
            f"sharded_offsets={sharded_offsets!r}: mc's DCP state dicts key every tensor by "
            "its name only; prepend no offsets (give stacked layers distinct prefixes)"
        )
    for name, param in module.named_parameters(recurse=False):
        if param_attrs.is_gtp_weight_remat(param) and _stride(param) > 1:
            raise NotImplementedError(
                f"{type_name(module)}.{name} is a gtp_remat shard with partition_stride="
                f"{_stride(param)}; sharded_state_dict supports strided weights without "
                "gtp_remat only"
            )


def _stride(param: torch.Tensor) -> int:
    return param_attrs.partition_stride_of(param)


def gtp_sharded_tensor(
    shard: torch.Tensor, tp_group: dist.ProcessGroup, partition_dim: int
) -> torch.Tensor:
    """A gtp_remat ``shard`` (padded rows of this rank's TP shard) as a DTensor over the
    ``(tp, gtp_remat)`` mesh: Shard(``partition_dim``) by TP, then Shard(0) by gtp_remat
    (see the module notes). The local tensor is a view of the shard's unpadded rows."""
    tp_local_shape = unsharded_shape(shard)  # ValueError unless shard_weight_for_gtp made it
    check_group("tp_group", tp_group)
    dim = _validate.partition_dim(partition_dim, len(tp_local_shape))
    gtp_group = _gtp_group(shard)
    rows, g = int(shard.shape[0]), int(gtp_group.rank())
    local = shard.detach()[: max(0, min(rows, tp_local_shape[0] - g * rows))]
    shape = list(tp_local_shape)
    shape[dim] *= int(tp_group.size())
    global_shape = torch.Size(shape)
    groups, placements = _mesh_axes(tp_group, gtp_group, dim)
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (see the imports)
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if len(groups) == 2:
        mesh = DeviceMesh.from_group(
            groups,
            local.device.type,
            mesh=_rank_grid(tp_group, gtp_group),
            mesh_dim_names=("tp", "gtp_remat"),
        )
    else:
        mesh = DeviceMesh.from_group(groups[0], local.device.type)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )


def _mesh_axes(
    tp_group: dist.ProcessGroup, gtp_group: dist.ProcessGroup, tp_dim: int
) -> tuple[list[dist.ProcessGroup], list[Shard]]:
    """The mesh's groups and placements, outermost first; a one-rank TP group is dropped."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415 (see the imports)

    if tp_group.size() == 1:
        return [gtp_group], [Shard(0)]
    return [tp_group, gtp_group], [Shard(tp_dim), Shard(0)]


def _rank_grid(tp_group: dist.ProcessGroup, gtp_group: dist.ProcessGroup) -> torch.Tensor:
    """Global ranks ``[tp rank][gtp_remat rank]`` of the mesh this rank belongs to: every
    TP peer reports its gtp_remat group's ranks (group-rank order)."""
    rows = mg.all_gather_objects(
        list(mg.group_ranks(gtp_group)), tp_group, label="gtp_remat checkpoint mesh"
    )
    return torch.tensor(rows, dtype=torch.int64)


def sharded_state_dict_of(
    module: torch.nn.Module,
    tp_group: dist.ProcessGroup,
    prefix: str = "",
    sharded_offsets: tuple[tuple[int, int, int], ...] = (),
    metadata: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """``{prefix + name: DTensor or tensor}`` for ``module``'s own parameters (see notes)."""
    _checked(module, prefix, sharded_offsets, metadata)
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(recurse=False):
        if param_attrs.is_gtp_weight_remat(param):
            out[prefix + name] = gtp_sharded_tensor(
                param, tp_group, param_attrs.partition_dim_of(param, 0)
            )
        elif param_attrs.is_tensor_model_parallel(param):
            out[prefix + name] = tp_sharded_tensor(
                param,
                tp_group,
                param_attrs.partition_dim_of(param),
                param_attrs.partition_stride_of(param),
            )
        else:
            out[prefix + name] = param.detach()
    return out
