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

For a whole model (mc's layers, ``parallelize``\ d models, plain replicated modules),
:func:`model_sharded_state_dict` gathers these views under the model's parameter names:
one home for "this model's params as full-shape DTensors" (``mc_train.checkpoint`` saves
and loads it). The split itself (which blocks a rank holds) is
:mod:`mc_tp_layers.shards`'.

DCP coordinates its ranks itself (over the default group unless given one), outside
mc_groups' recorder. Megatron's ``sharded_offsets`` are not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import (
    check_group,
    check_int,
    check_optional_group,
    check_str,
    check_tensor,
    type_name,
)
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.gtp import _gtp_group, unsharded_shape
from mc_tp_layers.shards import _group_of, strided_view

if TYPE_CHECKING:  # DTensor is imported where used: importing it costs over a second
    from torch.distributed.tensor import Shard

__all__ = [
    "gtp_sharded_tensor",
    "model_sharded_state_dict",
    "sharded_state_dict_of",
    "tp_sharded_tensor",
]


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
    dim = param_attrs.check_partition_dim(partition_dim, local.dim())
    if local.shape[dim] % check_int("stride", stride):
        raise InputValueError(
            f"stride={stride} does not divide dim {dim} of the tensor's shape "
            f"{tuple(local.shape)}; a strided shard holds stride equal blocks"
        )
    if stride > 1:
        local, dim = strided_view(local, dim, stride), dim + 1
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
    dim = param_attrs.check_partition_dim(partition_dim, len(tp_local_shape))
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


def _module_entries(
    module: torch.nn.Module, own: str, tp_group: dist.ProcessGroup | None, what: str
) -> dict[str, torch.Tensor]:
    """``module``'s own params, split ones as views over its ``tp_group`` (mc's layers,
    ``parallelize``'s) or over ``tp_group`` (required for a tensor-parallel param)."""
    group = _group_of(module, tp_group)
    if group is not None:
        return sharded_state_dict_of(module, group, own)
    for name, param in module.named_parameters(recurse=False):
        if param_attrs.is_tensor_model_parallel(param):
            raise InputValueError(
                f"{what}: {own}{name} is a tensor-parallel shard of a {type_name(module)}, "
                "not one of mc's layers; pass tp_group= (the group it is split over)"
            )
    return {own + n: p.detach() for n, p in module.named_parameters(recurse=False)}


def model_sharded_state_dict(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None = None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``{prefix + param name: DTensor or tensor}``: views of every param of ``module`` for
    DCP, at full shape (module notes). Split params become DTensors over their module's
    ``tp_group`` (mc's layers, ``parallelize``'s), or over ``tp_group`` for a module that
    has none (required when such a module holds a tensor-parallel param); a weight held
    twice is listed once, under its first name (``named_parameters`` order). No
    communication, except where a gtp_remat layer builds its mesh (module notes)."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    check_optional_group("tp_group", tp_group, what="model_sharded_state_dict")
    check_str("prefix", prefix)
    for name, param in module.named_parameters():
        if dtensors.is_dtensor(param):
            raise NotImplementedError(
                f"model_sharded_state_dict: {prefix}{name} is a DTensor (the model is under "
                "FSDP2's fully_shard): mc's DCP views of FSDP2 params are not implemented; "
                "save mc_tp_layers.full_state_dict(model) (whole tensors, one-process names) "
                "and load it with load_full_state_dict at any layout"
            )
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, sub in module.named_modules():
        own = f"{prefix}{name}." if name else prefix
        params = dict(sub.named_parameters(recurse=False))
        for key, value in _module_entries(sub, own, tp_group, "model_sharded_state_dict").items():
            param = params[key[len(own) :]]
            if id(param) not in seen:
                seen.add(id(param))
                out[key] = value
    return out
