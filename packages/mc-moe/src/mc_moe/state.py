r"""One piece and back for a model :func:`mc_moe.parallelize` split: the unsplit model's
names and shapes.

``full_state_dict`` = :func:`mc_tp_layers.full_state_dict` (every tensor-parallel shard
gathered over its module's group: dense layers over ``tp``, expert-TP shards over
``expt_tp``), then every expert parameter gathered over ``ep`` along dim 0 (rank p holds
experts ``p·L … p·L + L − 1``). ``load_full_state_dict`` cuts the other way (no
communication): this rank's experts, then :func:`mc_tp_layers.load_full_state_dict` cuts
the TP shards.

``model_sharded_state_dict`` gives ``torch.distributed.checkpoint`` (and
``mc_train.Checkpointer``) full-shape views: :func:`mc_tp_layers.model_sharded_state_dict`
with every expert parameter a DTensor on the ``(ep, expt_tp)`` mesh of this rank's
``tp_ep`` group, ``Shard(0)`` over ep (whole experts) and, for an expert-TP shard,
``Shard(d)`` over expt_tp along the dim it splits, else ``Replicate()``. A packed
``[gate; up]`` is viewed as ``[E, 2, I, H]`` at every expert TP (as ``mc_tp_layers`` stores
strided shards; the dims come from the experts' layout, not from marks, which expert TP 1
leaves off): a checkpoint written at one EP × expert-TP layout loads at any other. Under
FSDP2 an expert param is a DTensor over ``expt_dp`` holding its rows of this EP and
expert-TP rank's experts; its view is on the ``(ep, expt_tp, expt_dp)`` mesh, ``[Shard(0),
Shard(d), Shard(0)]``: the same global tensor, so FSDP2 and mc DDP checkpoints hold the same
tensors (under HSDP: ``(ep, expt_tp, replicate, shard)``, ``[Shard(0), Shard(d),
Replicate(), Shard(0)]``). The routers' expert biases (buffers that
``finalize_model_grads`` updates: DeepSeek-V3's ``e_score_correction_bias``) are model state
too and are included, whole (every rank holds the same values).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import dtensors
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError
from mc_moe.dispatcher import TokenDispatcher
from mc_moe.experts import DISPATCHER_ATTR, is_converted, read_experts
from mc_moe.router import BIAS, routers_with_bias
from mc_tp_layers import full_state_dict as full_tp_state_dict
from mc_tp_layers import load_full_state_dict as load_tp_state_dict
from mc_tp_layers.sharded_state import model_sharded_state_dict as tp_sharded_state_dict
from mc_tp_layers.shards import strided_view

__all__ = [
    "expert_params",
    "full_state_dict",
    "load_full_state_dict",
    "model_sharded_state_dict",
]


def expert_params(
    module: torch.nn.Module,
) -> Iterator[tuple[str, torch.nn.Parameter, torch.nn.Module]]:
    """``(state-dict key, param, experts module)`` of every expert parameter of every
    converted experts module of ``module``, in module order."""
    for name, sub in module.named_modules():
        if is_converted(sub):
            prefix = f"{name}." if name else ""
            for pname, param in sub.named_parameters(recurse=False):
                yield prefix + pname, param, sub


def _state_keys(module: torch.nn.Module) -> dict[int, str]:
    """``id(param)`` → the key ``module.state_dict()`` gives it. A wrapper's own hook may
    rename keys (torch's ``checkpoint_wrapper`` drops ``_checkpoint_wrapped_module.``, as
    torchtitan's activation checkpointing leaves it), so a module path is not the key.
    FSDP2's sharded params are registered first (:func:`mc_groups.dtensors.reshard_fsdp`),
    the ones its state-dict hooks give."""
    dtensors.reshard_fsdp(module)
    return {id(value): key for key, value in module.state_dict(keep_vars=True).items()}


def _check(module: object, pg_collection: object) -> None:
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    if not isinstance(pg_collection, mg.ProcessGroupCollection):
        raise InputTypeError(
            f"pg_collection must be a mc_groups.ProcessGroupCollection, got "
            f"{type_name(pg_collection)}"
        )


def full_state_dict(
    module: torch.nn.Module, pg_collection: mg.ProcessGroupCollection
) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every split parameter gathered whole, on every rank
    (module notes). Collectives: those of :func:`mc_tp_layers.full_state_dict`, then one
    all-gather over ``ep`` per expert parameter (none on a one-rank group). Every rank calls
    it."""
    _check(module, pg_collection)
    keys = _state_keys(module)
    state = full_tp_state_dict(module)
    with torch.no_grad():
        for _, param, experts in expert_params(module):
            key = keys[id(param)]
            ep = getattr(experts, DISPATCHER_ATTR).ep
            size = mg.group_size(ep)
            if size == 1:
                continue
            local = state[key].contiguous()
            out = local.new_empty((size * local.numel(),))
            mg.all_gather(out, local.view(-1), ep, label="full_state_dict experts")
            state[key] = out.view(size * local.shape[0], *local.shape[1:])
    return state


def load_full_state_dict(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    pg_collection: mg.ProcessGroupCollection,
    strict: bool = True,
) -> None:
    """Load an unsplit model's state dict into ``module``: each rank keeps its experts and
    its TP shards (no communication); ``strict`` as ``torch.nn.Module.load_state_dict``."""
    _check(module, pg_collection)
    if not isinstance(state_dict, Mapping):
        raise InputTypeError(f"state_dict must be a mapping, got {type_name(state_dict)}")
    local = dict(state_dict)
    keys = _state_keys(module)
    for _, param, experts in expert_params(module):
        key = keys[id(param)]
        if key in local:
            dispatcher = getattr(experts, DISPATCHER_ATTR)
            first, count = dispatcher.first_local_expert, dispatcher.num_local_experts
            local[key] = local[key].narrow(0, first, count)
    load_tp_state_dict(module, local, strict=strict)


def model_sharded_state_dict(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None = None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``{prefix + param name: DTensor or tensor}``: views of every param of ``module`` at
    full shape for DCP (module notes); ``tp_group`` as
    :func:`mc_tp_layers.model_sharded_state_dict`. No communication, except under FSDP2
    (those of :func:`mc_tp_layers.model_sharded_state_dict`, and the exchanges that build
    each expert view mesh, once per call for each set of groups)."""
    out = tp_sharded_state_dict(module, tp_group, prefix)
    meshes: dict[tuple[int, ...], Any] = {}  # FSDP2 expert view meshes, one per group set
    for key, param, experts in expert_params(module):
        if prefix + key not in out:
            continue
        dispatcher = getattr(experts, DISPATCHER_ATTR)
        path, _, pname = key.rpartition(".")
        layout = read_experts(experts, path)
        dim, stride = layout.split_dim(pname), layout.stride(pname)
        if dtensors.is_dtensor(param):
            view = _fsdp2_expert_view(param, dispatcher, dim, stride, prefix + key, meshes)
            out[prefix + key] = view
        else:
            out[prefix + key] = _expert_view(param, dispatcher, dim, stride)
    for name, router in routers_with_bias(module):
        out[f"{prefix}{name}.{BIAS}" if name else f"{prefix}{BIAS}"] = getattr(router, BIAS)
    return out


def _global(
    local: torch.Tensor, shape: list[int], dim: int | None, stride: int, dispatcher: TokenDispatcher
) -> tuple[torch.Tensor, int | None, list[int]]:
    """An expert param's ``local`` tensor (a packed ``[gate; up]``, ``stride`` 2, viewed as
    ``[.., 2, I, ..]`` at every expert TP, as ``mc_tp_layers`` stores strided shards, so that
    one checkpoint serves every layout), the dim expert TP splits in that view (None: whole)
    and the one-process shape: ``shape`` (this EP and expert-TP rank's) with dim 0 × ep and
    the split dim × expert TP."""
    if stride > 1:
        assert dim is not None
        local = strided_view(local, dim, stride)
        shape[dim : dim + 1] = [stride, shape[dim] // stride]
        dim += 1
    shape[0] *= dispatcher.ep_size
    if dim is not None:
        shape[dim] *= dispatcher.tp_size
    return local, dim, shape


def _fsdp2_expert_view(
    param: torch.Tensor,
    dispatcher: TokenDispatcher,
    dim: int | None,
    stride: int,
    name: str,
    meshes: dict[tuple[int, ...], Any],
) -> torch.Tensor:
    """An expert param under FSDP2 (``mc_ddp.TorchFullyShardedDataParallel``: a DTensor over
    ``expt_dp``, ``Shard(0)``: each rank its rows of this EP rank's experts; under HSDP
    ``(Replicate(), Shard(0))`` on the ``(replicate, shard)`` mesh) as one DTensor of the
    one-process shape (:func:`_global`) on the ``(ep, expt_tp, expt_dp)`` mesh (HSDP: ``(ep,
    expt_tp, replicate, shard)``; an axis of one rank left out), ``[Shard(0), Shard(d),
    Shard(0)]``: split into the EP ranks' experts, each expert by expert TP along ``d``
    (``Replicate()`` for a param expert TP keeps whole), then into FSDP2's rows. Building a
    mesh gathers the groups' ranks over the mesh's groups (one ``all_gather_objects`` per
    mesh dim), once per call of :func:`model_sharded_state_dict` for each set of groups
    (``meshes``; every rank meets the same sets in the same order)."""
    from torch.distributed.tensor import Placement, Replicate, Shard  # noqa: PLC0415

    sharded: Any = param
    dp_mesh = sharded.device_mesh
    places: list[Placement] = [Shard(0)] if dp_mesh.ndim == 1 else [Replicate(), Shard(0)]
    if tuple(sharded.placements) != tuple(places):
        raise NotImplementedError(
            f"model_sharded_state_dict: the expert param {name} is a DTensor placed "
            f"{tuple(sharded.placements)} on a {dp_mesh.ndim}-D mesh: DCP views of expert "
            "params under FSDP2 take FSDP2's Shard(0) (HSDP: Replicate(), Shard(0)); save "
            "mc_moe.full_state_dict instead"
        )
    local, dim, shape = _global(
        sharded.to_local().detach(), list(sharded.shape), dim, stride, dispatcher
    )
    names = ["expt_dp"] if dp_mesh.ndim == 1 else ["replicate", "shard"]
    mesh, device = dp_mesh, local.device.type
    tp_place: Placement = Replicate() if dim is None else Shard(dim)
    for group, size, place, axis in (
        (dispatcher.expt_tp, dispatcher.tp_size, tp_place, "expt_tp"),
        (dispatcher.ep, dispatcher.ep_size, Shard(0), "ep"),
    ):
        if size > 1:
            names.insert(0, axis)
            mesh = dtensors.mesh_before(group, mesh, device, names, "expert mesh", meshes)
            places.insert(0, place)
    return dtensors.from_local(local, mesh, places, shape)


def _expert_view(
    param: torch.Tensor, dispatcher: TokenDispatcher, dim: int | None, stride: int
) -> torch.Tensor:
    """An expert param (not under FSDP2) as one DTensor of the one-process shape
    (:func:`_global`) on the ``(ep, expt_tp)`` mesh of this rank's ``tp_ep`` group (an axis
    of one rank left out): ``Shard(0)`` over ep, ``Shard(d)`` over expt_tp (``Replicate()``
    for a param expert TP keeps whole); at EP 1 × expert TP 1 the local tensor itself."""
    p, q = dispatcher.ep_size, dispatcher.tp_size
    local, dim, shape = _global(param.detach(), list(param.shape), dim, stride, dispatcher)
    if p * q == 1:
        return local
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (slow import)
    from torch.distributed.tensor import Placement, Replicate, Shard  # noqa: PLC0415

    groups = [dispatcher.ep, dispatcher.expt_tp]
    axes: list[Placement] = [Shard(0), Replicate() if dim is None else Shard(dim)]
    grid = torch.tensor(mg.group_ranks(dispatcher.tp_ep)).view(p, q)  # expt_tp fastest
    keep = [i for i, size in enumerate((p, q)) if size > 1]
    mesh = DeviceMesh.from_group(
        groups[keep[0]] if len(keep) == 1 else groups,
        local.device.type,
        mesh=grid.squeeze() if len(keep) == 1 else grid,
        mesh_dim_names=tuple(("ep", "expt_tp")[i] for i in keep),
    )
    return dtensors.from_local(local, mesh, [axes[i] for i in keep], shape)
