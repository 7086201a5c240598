"""The ShardedOptimizer's argument checks and the slices a bucket group lets a rank step
(nothing here communicates)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import mc_groups as mg
from mc_ddp import grad_norm
from mc_ddp._optimizer_state import OwnedSlice
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp.distributed_data_parallel import DistributedDataParallel
from mc_ddp.grad_scaler import DynamicGradScaler
from mc_groups.argcheck import check_flag, type_name
from mc_groups.collection import check_collection
from mc_groups.errors import InputTypeError, InputValueError

Param = torch.nn.Parameter


def as_chunks(model_chunks: object) -> list[DistributedDataParallel]:
    chunks = [model_chunks] if isinstance(model_chunks, DistributedDataParallel) else model_chunks
    if not isinstance(chunks, Sequence) or not chunks:
        raise InputTypeError(
            "model_chunks must be a DistributedDataParallel or a non-empty list of them, "
            f"got {type_name(model_chunks)}"
        )
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise InputTypeError(
                f"model_chunks[{i}] is a {type_name(chunk)}; wrap each model chunk in "
                "mc_ddp.DistributedDataParallel first"
            )
    return list(chunks)


def check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(
            f"optimizer={type_name(optimizer)} must be a torch.optim.Optimizer built over "
            "the model's params, e.g. torch.optim.AdamW(ddp.parameters(), lr=1e-3)"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputTypeError("optimizer=LBFGS caches its params when built and cannot be sharded")
    if optimizer.state:
        raise InputValueError(
            "optimizer already holds state: build the ShardedOptimizer before the first step "
            "(its state lives on the fp32 shard masters)"
        )
    return optimizer


def owned_ranges(group: ParamAndGradBucketGroup) -> list[tuple[Param, int, int]]:
    rank, size = group.shard.rank, group.shard.size
    if not group.ddp_config.use_distributed_optimizer:
        rank, size = 0, 1
    return [
        (s.param, s.param_range[0], s.param_range[1])
        for bucket in group.buckets
        for s in bucket.shard_param_slices(rank, size)
    ]


def check_step_dispatch(flag: object, chunks: list[DistributedDataParallel]) -> bool:
    check_flag("overlap_param_gather_with_optimizer_step", flag)
    if flag and not all(c.ddp_config.overlap_param_gather for c in chunks):
        raise InputValueError(
            "overlap_param_gather_with_optimizer_step=True needs every model chunk built with "
            "ddp_config.overlap_param_gather=True (and use_distributed_optimizer=True)"
        )
    return bool(flag)


def check_saved_masters(masters: object, slots: Sequence[OwnedSlice]) -> list[torch.Tensor]:
    expected = [tuple(s.master.shape) for s in slots]
    shapes = None
    if isinstance(masters, list) and all(isinstance(m, torch.Tensor) for m in masters):
        shapes = [tuple(m.shape) for m in masters]
    if shapes != expected:
        got = shapes if shapes is not None else type(masters).__name__
        raise InputValueError(
            "state_dict['master_params'] does not match this rank's shard layout (same "
            "model, data-parallel size and bucket layout needed): expected tensors of shapes "
            f"{expected}, got {got}"
        )
    assert isinstance(masters, list)  # checked above
    for i, master in enumerate(masters):
        if not master.is_floating_point():
            raise InputTypeError(
                f"state_dict['master_params'][{i}] is {master.dtype}, not floating-point"
            )
    return masters


def check_max_norm(value: object, name: str, *, optional: bool = False) -> float | None:
    """A finite max norm > 0 (None too, when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(
            f"{name}={value!r} must be a number > 0 (the largest global grad norm, e.g. 1.0)"
            + ("; None turns clipping off" if optional else "")
        )
    number = float(value)
    if not (math.isfinite(number) and number > 0.0):
        raise InputValueError(
            f"{name}={value!r} must be a finite number > 0 (the largest global grad norm, "
            "e.g. 1.0)" + ("; None turns clipping off" if optional else "")
        )
    return number


def check_norm_type(value: object) -> float:
    """The norm's order (:func:`mc_ddp.grad_norm.check_norm_type`)."""
    return grad_norm.check_norm_type(value)


def check_scaler(
    scaler: object, chunks: Sequence[DistributedDataParallel]
) -> DynamicGradScaler | None:
    """None, or a :class:`DynamicGradScaler` over a model without bf16 params."""
    if scaler is None:
        return None
    if not isinstance(scaler, DynamicGradScaler):
        raise InputTypeError(
            f"grad_scaler={type_name(scaler)} must be an mc_ddp.DynamicGradScaler (or None); "
            "torch.amp.GradScaler steps the optimizer itself and cannot agree its overflow "
            "flag across the ranks"
        )
    for chunk in chunks:
        for param, name in chunk.param_to_name.items():
            if param.dtype == torch.bfloat16:
                raise InputValueError(
                    f"grad_scaler was given but param '{name}' is bfloat16: bf16 has fp32's "
                    "exponent range and needs no loss scaling (grads do not underflow as fp16's "
                    "do); drop grad_scaler, or train in fp16"
                )
    return scaler


def check_optional_collection(value: object) -> mg.ProcessGroupCollection | None:
    """None, or a live ``ProcessGroupCollection``."""
    if value is None:
        return None
    return check_collection("pg_collection", value, what="ShardedOptimizer")


def check_saved_state(
    state_dict: object, slots: Sequence[OwnedSlice]
) -> tuple[list[torch.Tensor], Mapping[str, Any]]:
    """``ShardedOptimizer.state_dict()``'s shape: ``master_params`` (this rank's shapes) and
    the wrapped optimizer's ``optimizer`` dict."""
    if not isinstance(state_dict, Mapping):
        raise InputTypeError(
            "state_dict must be the mapping ShardedOptimizer.state_dict() returned, got "
            f"{type_name(state_dict)}"
        )
    missing = [k for k in ("master_params", "optimizer") if k not in state_dict]
    if missing:
        raise InputValueError(
            f"state_dict has no {missing}: pass what ShardedOptimizer.state_dict() returned"
        )
    masters = check_saved_masters(state_dict["master_params"], slots)
    inner = state_dict["optimizer"]
    if not isinstance(inner, Mapping) or not {"state", "param_groups"} <= set(inner):
        raise InputTypeError(
            "state_dict['optimizer'] must be the wrapped optimizer's state dict (with "
            f"'state' and 'param_groups'), got {type_name(inner)}"
        )
    return masters, inner


def check_sharded_state_args(
    model_sharded_state_dict: object, is_loading: object, prefix: object
) -> None:
    """The arguments of ``ShardedOptimizer.sharded_state_dict``."""
    if not isinstance(model_sharded_state_dict, Mapping):
        raise InputTypeError(
            "model_sharded_state_dict must be a mapping {key: DTensor or tensor} (the "
            f"model's sharded_state_dict()), got {type_name(model_sharded_state_dict)}"
        )
    if not isinstance(is_loading, bool):
        raise InputTypeError(f"is_loading={is_loading!r} must be a bool")
    if not isinstance(prefix, str):
        raise InputTypeError(f"prefix={prefix!r} must be a str, e.g. 'optimizer.'")
