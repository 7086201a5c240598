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

Under FSDP2 (``fully_shard``) a param is a DTensor over the data-parallel mesh whose
"global" tensor is this rank's TP shard, split along dim 0 (``Shard(0)``; the rows
``torch.chunk`` gives each rank). Its view is one DTensor of the one-process shape on the
2-D mesh ``(tp, dp)``, placed ``[Shard(partition_dim), Shard(0)]``: split by TP first, then
FSDP2's rows by dp, so the local tensor is FSDP2's own (the view writes into the param) and
DCP reads and writes the same chunks a TP-only or whole run does. A param that is not
split by TP is FSDP2's DTensor itself; a strided one uses the ``[.., k, d/k, ..]`` view
(``Shard(0)`` over the k packed parts when ``partition_dim`` is 0: the data-parallel size
must divide k, else FSDP2's rows cut a part and the view is refused). The rank grid of
the ``(tp, dp)`` mesh takes one exchange over dp per TP group (HSDP: one over the shard
group, one over the replicate group), so under FSDP2 :func:`model_sharded_state_dict` is
a collective over the data-parallel group. FSDP2's default layouts are taken: a 1-D mesh,
``Shard(0)``; HSDP's 2-D ``(replicate, shard)`` mesh, ``(Replicate(), Shard(0))``, viewed on
the 3-D ``(tp, replicate, shard)`` mesh as ``[Shard(partition_dim), Replicate(),
Shard(0)]``. No ``shard_placement_fn``, and no gtp_remat shard under FSDP2.

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
from typing import TYPE_CHECKING, Any, cast

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
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

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
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (see the imports)
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    mesh = DeviceMesh.from_group(tp_group, local.device.type)
    return dtensors.from_local(local, mesh, [Shard(dim)], shape)


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
    groups, placements = _mesh_axes(tp_group, gtp_group, dim)
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (see the imports)

    if len(groups) == 2:
        mesh = DeviceMesh.from_group(
            groups,
            local.device.type,
            mesh=_rank_grid(tp_group, gtp_group),
            mesh_dim_names=("tp", "gtp_remat"),
        )
    else:
        mesh = DeviceMesh.from_group(groups[0], local.device.type)
    return dtensors.from_local(local, mesh, placements, shape)


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
    """``{prefix + name: DTensor or tensor}`` for ``module``'s own parameters (see notes;
    under FSDP2, a collective over the data-parallel group: the views' mesh)."""
    _checked(module, prefix, sharded_offsets, metadata)
    return _own_entries(module, tp_group, prefix, {})


# the (tp, dp) meshes built during one call, by the ids of the tp group and the dp mesh's groups
_Meshes = dict[tuple[int, ...], "DeviceMesh"]


def _own_entries(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None, prefix: str, meshes: _Meshes
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(recurse=False):
        if dtensors.is_dtensor(param):
            out[prefix + name] = _fsdp2_view(param, tp_group, prefix + name, meshes)
        elif param_attrs.is_gtp_weight_remat(param):
            assert tp_group is not None  # a gtp_remat layer has its tp_group
            out[prefix + name] = gtp_sharded_tensor(
                param, tp_group, param_attrs.partition_dim_of(param, 0)
            )
        elif param_attrs.is_tensor_model_parallel(param):
            assert tp_group is not None  # checked by the callers
            out[prefix + name] = tp_sharded_tensor(
                param,
                tp_group,
                param_attrs.partition_dim_of(param),
                param_attrs.partition_stride_of(param),
            )
        else:
            out[prefix + name] = param.detach()
    return out


def _fsdp2_view(
    param: torch.Tensor, tp_group: dist.ProcessGroup | None, name: str, meshes: _Meshes
) -> torch.Tensor:
    """An FSDP2 param (module notes) as one DTensor of the one-process shape."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 (a DTensor exists)

    sharded = cast("DTensor", param)
    dp_mesh, placements = sharded.device_mesh, tuple(sharded.placements)
    dp_places = [Shard(0)] if dp_mesh.ndim == 1 else [Replicate(), Shard(0)]
    if placements != tuple(dp_places):
        raise NotImplementedError(
            f"{name} is a DTensor placed {placements} on a {dp_mesh.ndim}-D mesh: mc's DCP "
            "views take FSDP2's default layouts (fully_shard over a 1-D data-parallel mesh, "
            "Shard(0); HSDP's (Replicate(), Shard(0)); no shard_placement_fn); save "
            "full_state_dict(model) instead"
        )
    if param_attrs.is_gtp_weight_remat(param):
        raise NotImplementedError(
            f"{name} is a gtp_remat shard under FSDP2: its DCP view is not implemented; save "
            "full_state_dict(model) instead"
        )
    local, dim = sharded.to_local().detach(), 0
    shape = list(sharded.shape)  # the TP-local shape FSDP2 splits
    size = dp_mesh.size(dp_mesh.ndim - 1)  # the ranks FSDP2 splits dim 0 over
    split = param_attrs.is_tensor_model_parallel(param)
    if split:
        dim = param_attrs.check_partition_dim(param_attrs.partition_dim_of(param), len(shape))
        stride = param_attrs.partition_stride_of(param)
        if stride > 1:
            if dim == 0 and stride % size:
                raise NotImplementedError(
                    f"{name} packs partition_stride={stride} blocks along dim 0 and FSDP2 "
                    f"splits dim 0 over {size} data-parallel ranks, which cut a block ({size} "
                    f"does not divide {stride}): no one-chunk DCP view; save "
                    "full_state_dict(model) instead"
                )
            block = shape[dim] // stride  # this rank's rows of one packed part
            local = local.view(*local.shape[:dim], -1, block, *local.shape[dim + 1 :])
            shape[dim : dim + 1] = [stride, block]
            dim += 1
    tp_size = 1 if tp_group is None else mg.group_size(tp_group)
    if not split or tp_size == 1:
        mesh, places = dp_mesh, dp_places
    else:
        assert tp_group is not None
        shape[dim] *= tp_size
        mesh = _tp_dp_mesh(tp_group, dp_mesh, local.device.type, meshes)
        places = [Shard(dim), *dp_places]  # split by tp first, then FSDP2's rows by dp
    return dtensors.from_local(local, mesh, places, shape)


def _tp_dp_mesh(
    tp_group: dist.ProcessGroup, dp_mesh: DeviceMesh, device_type: str, meshes: _Meshes
) -> DeviceMesh:
    """The ``(tp, dp)`` mesh of this rank's TP group and FSDP2's data-parallel mesh (under
    HSDP ``(tp, replicate, shard)``), built once per call (:func:`mc_groups.dtensors.
    mesh_before`: one exchange per data-parallel mesh dim)."""
    names = ("tp", "dp") if dp_mesh.ndim == 1 else ("tp", "replicate", "shard")
    label = "FSDP2 checkpoint mesh"
    return dtensors.mesh_before(tp_group, dp_mesh, device_type, names, label, cache=meshes)


def _module_entries(
    module: torch.nn.Module,
    own: str,
    tp_group: dist.ProcessGroup | None,
    what: str,
    meshes: _Meshes,
) -> dict[str, torch.Tensor]:
    """``module``'s own params, split ones as views over its ``tp_group`` (mc's layers,
    ``parallelize``'s) or over ``tp_group`` (required for a tensor-parallel param)."""
    group = _group_of(module, tp_group)
    if group is None:
        for name, param in module.named_parameters(recurse=False):
            if param_attrs.is_tensor_model_parallel(param):
                raise InputValueError(
                    f"{what}: {own}{name} is a tensor-parallel shard of a "
                    f"{type_name(module)}, not one of mc's layers; pass tp_group= (the group "
                    "it is split over)"
                )
    else:
        _checked(module, own, (), None)
    return _own_entries(module, group, own, meshes)


def model_sharded_state_dict(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None = None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``{prefix + param name: DTensor or tensor}``: views of every param of ``module`` for
    DCP, at full shape (module notes). Split params become DTensors over their module's
    ``tp_group`` (mc's layers, ``parallelize``'s), or over ``tp_group`` for a module that
    has none (required when such a module holds a tensor-parallel param); a weight held
    twice is listed once, under its first name (``named_parameters`` order). Under FSDP2
    (``fully_shard``) each param is one DTensor of the one-process shape over the
    ``(tp, dp)`` mesh (module notes), the marks ``fully_shard`` dropped put back from the
    record (:func:`mc_groups.param_attrs.restore_marks`). No communication, except where a
    gtp_remat layer builds its mesh and, under FSDP2, one exchange over the data-parallel
    group per TP group (the mesh's rank grid): every rank calls it then."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    check_optional_group("tp_group", tp_group, what="model_sharded_state_dict")
    check_str("prefix", prefix)
    dtensors.reshard_fsdp(module)  # views of FSDP2's sharded params (after an eval forward)
    param_attrs.restore_marks(module)  # after FSDP2's fully_shard replaced the params
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    meshes: _Meshes = {}
    for name, sub in module.named_modules():
        own = f"{prefix}{name}." if name else prefix
        params = dict(sub.named_parameters(recurse=False))
        entries = _module_entries(sub, own, tp_group, "model_sharded_state_dict", meshes)
        for key, value in entries.items():
            param = params[key[len(own) :]]
            if id(param) not in seen:
                seen.add(id(param))
                out[key] = value
    return out
