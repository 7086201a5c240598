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
``Shard(partition_dim)`` over expt_tp (a ``[gate; up]`` shard as its ``[.., 2, I, ..]`` view,
as ``mc_tp_layers`` stores strided shards), else ``Replicate()``: a checkpoint written at one
EP × expert-TP layout loads at any other. Under FSDP2 (expert TP 1) an expert param is a
DTensor over ``expt_dp`` holding its rows of this EP rank's experts; its view is on the
``(ep, expt_dp)`` mesh, ``[Shard(0), Shard(0)]``: the same global tensor, so FSDP2 and mc
DDP checkpoints hold the same tensors (under HSDP: ``(ep, replicate, shard)``,
``[Shard(0), Replicate(), Shard(0)]``). The routers' expert biases (buffers that
``finalize_model_grads`` updates: DeepSeek-V3's ``e_score_correction_bias``) are model state
too and are included, whole (every rank holds the same values).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError
from mc_moe.dispatcher import TokenDispatcher
from mc_moe.experts import DISPATCHER_ATTR, is_converted
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
    state = full_tp_state_dict(module)
    with torch.no_grad():
        for key, _, experts in expert_params(module):
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
    for key, _, experts in expert_params(module):
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
    (those of :func:`mc_tp_layers.model_sharded_state_dict`, and one exchange over the
    expert params' FSDP2 group per expert param to build its mesh)."""
    out = tp_sharded_state_dict(module, tp_group, prefix)
    for key, param, experts in expert_params(module):
        if prefix + key not in out:
            continue
        dispatcher = getattr(experts, DISPATCHER_ATTR)
        if dtensors.is_dtensor(param):
            out[prefix + key] = _fsdp2_expert_view(param, dispatcher, prefix + key)
        else:
            out[prefix + key] = _expert_view(param, dispatcher)
    for name, router in routers_with_bias(module):
        out[f"{prefix}{name}.{BIAS}" if name else f"{prefix}{BIAS}"] = getattr(router, BIAS)
    return out


def _fsdp2_expert_view(param: torch.Tensor, dispatcher: TokenDispatcher, name: str) -> torch.Tensor:
    """An expert param under FSDP2 (``mc_ddp.TorchFullyShardedDataParallel``: a DTensor over
    ``expt_dp``, ``Shard(0)``: each rank its rows of this EP rank's experts; under HSDP
    ``(Replicate(), Shard(0))`` on the ``(replicate, shard)`` mesh) as one DTensor of the
    unsplit shape on the ``(ep, expt_dp)`` mesh, ``[Shard(0), Shard(0)]`` (HSDP: ``(ep,
    replicate, shard)``, ``[Shard(0), Replicate(), Shard(0)]``): split into the EP ranks'
    experts, then FSDP2's rows of those (expert TP 1 only)."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    sharded: Any = param
    dp_mesh = sharded.device_mesh
    dp_places = [Shard(0)] if dp_mesh.ndim == 1 else [Replicate(), Shard(0)]
    if dispatcher.tp_size > 1 or tuple(sharded.placements) != tuple(dp_places):
        raise NotImplementedError(
            f"model_sharded_state_dict: the expert param {name} is a DTensor placed "
            f"{tuple(sharded.placements)} on a {dp_mesh.ndim}-D mesh with expert TP "
            f"{dispatcher.tp_size}: DCP views of expert params under FSDP2 take expert TP 1 "
            "and FSDP2's Shard(0) (HSDP: Replicate(), Shard(0)); save mc_moe.full_state_dict "
            "instead"
        )
    local = sharded.to_local().detach()
    shape = [sharded.shape[0] * dispatcher.ep_size, *sharded.shape[1:]]
    if dispatcher.ep_size == 1:
        return dtensors.from_local(local, dp_mesh, dp_places, shape)
    names = ("ep", "expt_dp") if dp_mesh.ndim == 1 else ("ep", "replicate", "shard")
    mesh = dtensors.mesh_before(dispatcher.ep, dp_mesh, local.device.type, names, "expert mesh")
    return dtensors.from_local(local, mesh, [Shard(0), *dp_places], shape)


def _expert_view(param: torch.Tensor, dispatcher: TokenDispatcher) -> torch.Tensor:
    local = param.detach()
    dim = None
    if param_attrs.is_tensor_model_parallel(param):
        dim, stride = param_attrs.partition_dim_of(param), param_attrs.partition_stride_of(param)
        if stride > 1:
            local, dim = strided_view(local, dim, stride), dim + 1
    p, q = dispatcher.ep_size, dispatcher.tp_size
    if p * q == 1:
        return local
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (slow import)
    from torch.distributed.tensor import Placement, Replicate, Shard  # noqa: PLC0415

    shape = list(local.shape)
    shape[0] *= p
    groups = [dispatcher.ep, dispatcher.expt_tp]
    axes: list[Placement] = [Shard(0), Replicate() if dim is None else Shard(dim)]
    if dim is not None:
        shape[dim] *= q
    grid = torch.tensor(mg.group_ranks(dispatcher.tp_ep)).view(p, q)  # expt_tp fastest
    keep = [i for i, size in enumerate((p, q)) if size > 1]
    mesh = DeviceMesh.from_group(
        groups[keep[0]] if len(keep) == 1 else groups,
        local.device.type,
        mesh=grid.squeeze() if len(keep) == 1 else grid,
    )
    return dtensors.from_local(local, mesh, [axes[i] for i in keep], shape)
