r"""A plain ``torch.optim`` optimizer's state for ``torch.distributed.checkpoint`` (DCP) in
:class:`~mc_ddp.ShardedOptimizer`'s keys, so one checkpoint moves between an optimizer that
steps FSDP2's sharded params in place and mc's distributed optimizer at any layout.

Under FSDP2 (``fully_shard``, :class:`~mc_ddp.TorchFullyShardedDataParallel`) the user's own
optimizer steps the sharded params: each param, and each of its elementwise states (Adam's
``exp_avg``, ``exp_avg_sq``), is a DTensor holding this rank's rows of its tensor-parallel
shard. The model's DCP state dict (``mc_tp_layers.model_sharded_state_dict``) views each
param at its one-process shape (a DTensor over the ``(tp, dp)`` mesh); this module places
the states exactly where their param sits::

    model_sharded_state_dict[K]          the param's view: local rows, offsets, global shape
    {prefix}{K}.fp32_param               the param itself (the optimizer steps it: fp32)
    {prefix}{K}.{state}                  each elementwise state, at the param's offsets
    {prefix}{K}.step  (scalars, others)  as themselves (every rank holding rows writes it;
                                         DCP keeps one)
    {prefix}param_groups.{i}.{name}      each param group's hyperparameters

These are :meth:`ShardedOptimizer.sharded_state_dict <mc_ddp.ShardedOptimizer.sharded_state_dict>`'s
keys and layout (its master is the fp32 param; its slices are pieces of the same global
tensors), so DCP reshards between the two in either direction: FSDP2 at TP=2 × DP=2 saves,
mc DDP with the distributed optimizer at TP=1 × DP=4 loads, and back. The optimizer's
param groups must be the same on both sides (same order, same hyperparameter names: the
same optimizer class built over the model's params in ``named_parameters`` order).

A param is found in ``model_sharded_state_dict`` by its memory (the view's local tensor is
the param's local tensor), as ShardedOptimizer finds its params. A rank whose FSDP2 rows of
a param are empty (fewer rows than data-parallel ranks) writes and reads nothing for it.
Nothing here communicates except the one status exchange after the checks
(:func:`mc_groups.fail_together`): a check failing on one rank is an error on every rank,
before DCP starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

import mc_groups as mg
from mc_ddp import _optimizer_checks as checks
from mc_ddp import _optimizer_state as state_keys
from mc_ddp._optimizer_state import CheckpointKeys, OwnedSlice, Placement
from mc_groups import dtensors
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError

__all__ = ["load_optimizer_sharded_state_dict", "optimizer_sharded_state_dict"]

Param = torch.nn.Parameter


def _check_optimizer(optimizer: object, what: str) -> torch.optim.Optimizer:
    from mc_ddp.sharded_optimizer import ShardedOptimizer  # noqa: PLC0415 (one name)

    if isinstance(optimizer, ShardedOptimizer):
        raise InputTypeError(
            f"{what}: optimizer is a ShardedOptimizer; call its own sharded_state_dict() / "
            "load_sharded_state_dict() (this function takes a torch.optim optimizer that "
            "steps the params in place, e.g. over FSDP2's sharded params)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(
            f"{what}: optimizer must be a torch.optim.Optimizer, got {type_name(optimizer)}"
        )
    return optimizer


def _slots(optimizer: torch.optim.Optimizer) -> tuple[list[OwnedSlice], dict[Param, str]]:
    """One slot per distinct param: the whole local tensor, stepped in place (aliased),
    named by its position for the errors; empty local tensors are left out."""
    slots: list[OwnedSlice] = []
    names: dict[Param, str] = {}
    seen: set[int] = set()
    for i, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            if id(param) in seen:
                continue
            seen.add(id(param))
            local = param.to_local() if dtensors.is_dtensor(param) else param
            if local.numel() == 0:
                continue
            slots.append(OwnedSlice(cast(Param, local), 0, local.numel(), param, True))
            names[cast(Param, local)] = f"param_groups[{i}]['params'][{j}]"
    return slots, names


def _placements(
    optimizer: torch.optim.Optimizer, model_sharded_state_dict: Mapping[str, Any]
) -> tuple[list[OwnedSlice], dict[Param, Placement]]:
    slots, names = _slots(optimizer)
    return slots, state_keys.placements(model_sharded_state_dict, slots, names)


def optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Mapping[str, Any],
    is_loading: bool = False,
    prefix: str = "optimizer.",
) -> dict[str, Any]:
    """``optimizer``'s state for DCP in ShardedOptimizer's keys (module notes).

    Args:
        optimizer: a ``torch.optim`` optimizer over the model's params (FSDP2's DTensor
            params, or whole params it steps in place).
        model_sharded_state_dict: the model's DCP state dict
            (``mc_tp_layers.model_sharded_state_dict``), viewing every param the optimizer
            steps.
        is_loading: True to build a dict to load into: params without state first get the
            optimizer's own (one lr = 0 step on zero grads, which leaves every param
            unchanged), so DCP has tensors to load into; then pass the loaded dict to
            :func:`load_optimizer_sharded_state_dict`. False (saving) needs state for every
            param (after the first step).
        prefix: the keys' prefix.

    Collective over the world (one status exchange after the checks); the tensors are views
    (``dcp.save`` reads them, ``dcp.load`` writes them in place).
    """
    with mg.fail_together(None, "optimizer_sharded_state_dict"):
        optimizer = _check_optimizer(optimizer, "optimizer_sharded_state_dict")
        checks.check_sharded_state_args(model_sharded_state_dict, is_loading, prefix)
        slots, places = _placements(optimizer, model_sharded_state_dict)
    if is_loading:
        state_keys.materialize_state(optimizer, slots)
    names = {s.param: f"'{places[s.param].key}'" for s in slots}
    return state_keys.build_state_dict(optimizer, slots, places, names, prefix)


@torch.no_grad()
def load_optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    model_sharded_state_dict: Mapping[str, Any],
    prefix: str = "optimizer.",
) -> None:
    """Finish a load: after ``dcp.load`` filled ``state_dict`` (built by
    :func:`optimizer_sharded_state_dict` with ``is_loading=True``; the tensors were loaded
    in place), write the hyperparameters and non-tensor states DCP replaced in it back into
    ``optimizer``. Each value is checked against the kind the optimizer holds first (a
    checkpoint of another optimizer is a ``TypeError`` naming the key, nothing changed).
    Collective over the world (one status exchange after the checks)."""
    with mg.fail_together(None, "load_optimizer_sharded_state_dict"):
        optimizer = _check_optimizer(optimizer, "load_optimizer_sharded_state_dict")
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(
                "state_dict must be the mapping optimizer_sharded_state_dict() returned, got "
                f"{type_name(state_dict)}"
            )
        checks.check_sharded_state_args(model_sharded_state_dict, True, prefix)
        slots, places = _placements(optimizer, model_sharded_state_dict)
        keys = CheckpointKeys(prefix, places)
        state_keys.check_loaded_values(optimizer, slots, keys, state_dict)
    state_keys.apply_loaded_values(optimizer, slots, keys, state_dict)
