r"""One piece and back for a model :func:`mc_moe.parallelize` split: the unsplit model's
names and shapes.

``full_state_dict`` = :func:`mc_tp_layers.full_state_dict` (every tensor-parallel shard
gathered over its module's group: dense layers over ``tp``, expert-TP shards over
``expt_tp``), then every expert parameter gathered over ``ep`` along dim 0 (rank p holds
experts ``p·L … p·L + L − 1``). ``load_full_state_dict`` cuts the other way (no
communication): this rank's experts, then :func:`mc_tp_layers.load_full_state_dict` cuts
the TP shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

import mc_groups as mg
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError
from mc_moe.experts import DISPATCHER_ATTR, is_converted
from mc_tp_layers import full_state_dict as full_tp_state_dict
from mc_tp_layers import load_full_state_dict as load_tp_state_dict

__all__ = ["expert_params", "full_state_dict", "load_full_state_dict"]


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
