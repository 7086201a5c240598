"""Validation of ``ParamAndGradBuffer``'s arguments, gathered in one frozen record."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mc_buffers._param_checks import (
    Param,
    as_param_list,
    check_non_empty_numel,
    check_not_views,
    check_requires_grad,
    check_same_device,
    check_same_dtype,
    check_unique,
    describe,
)
from mc_groups.argcheck import (
    check_flag,
    check_float_dtype,
    check_int,
    check_optional_int,
    check_patterns,
    check_real,
    type_name,
)
from mc_groups.errors import InputTypeError, InputValueError

Scale = float | torch.Tensor


@dataclass(frozen=True)
class BufferArgs:
    """The buffer's inputs after every check passed."""

    params: list[Param]
    names: dict[Param, str]
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    bucket_size: int | None
    use_distributed_optimizer: bool
    data_parallel_size: int
    pad_buckets_for_high_nccl_busbw: bool
    patterns: tuple[str, ...]
    param_indices: list[int] | None
    gradient_scaling_factor: float


def check_scale(value: object, name: str) -> Scale:
    """A finite real number, or a one-element floating-point tensor (e.g. ``1 / num_tokens``
    kept on device: its value is not read, so a NaN there is not caught: no device sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InputValueError(
                f"{name} must be a scalar; got a tensor of shape {tuple(value.shape)} (pass "
                "a float or a one-element tensor)"
            )
        if not value.is_floating_point():
            raise InputTypeError(f"{name} is a {value.dtype} tensor; it must be floating-point")
        return value
    return check_real(name, value)


def check_scaling_factor(value: object, name: str) -> float:
    """A buffer's or bucket's ``gradient_scaling_factor``: a finite float > 0 (0 would
    zero every gradient; NaN/inf would poison them)."""
    if isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be a float when building a buffer, got a tensor")
    return check_real(name, value, positive=True, allow_zero=False)


def _names(param_to_name: object) -> dict[Param, str]:
    if param_to_name is None:
        return {}
    if not isinstance(param_to_name, Mapping):
        raise InputTypeError(
            f"param_to_name must map params to names (dict), got {type_name(param_to_name)}"
        )
    for name in param_to_name.values():
        if not isinstance(name, str):
            raise InputTypeError(
                f"param_to_name maps a param to {name!r}; every name must be a str"
            )
    return dict(param_to_name)


def _dtype(value: object, name: str, default: torch.dtype) -> torch.dtype:
    checked = check_float_dtype(name, value, allow_none=True)
    return default if checked is None else checked


def _indices(value: object, count: int) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != count:
        raise InputValueError(
            f"param_indices must be a sequence with one index per param ({count}), got "
            f"{value!r}; take them from group_params_for_buffers"
        )
    return [check_int(f"param_indices[{i}]", v, minimum=0) for i, v in enumerate(value)]


def _check_names_for_patterns(
    params: list[Param], names: dict[Param, str], patterns: tuple[str, ...]
) -> None:
    if all(p == "all" for p in patterns):
        return
    for i, p in enumerate(params):
        if p not in names:
            raise InputValueError(
                f"param_name_patterns_for_fp32_local_accumulation={patterns!r} matches by "
                f"name, but param_to_name has no name for params[{i}] {describe(p)}; pass "
                "param_to_name={p: n for n, p in module.named_parameters()}"
            )


def _checked_params(params: Iterable[Param], names: dict[Param, str]) -> list[Param]:
    plist = as_param_list(params)
    if not plist:
        raise InputValueError("params is empty: a ParamAndGradBuffer needs at least one param")
    for check in (
        check_unique,
        check_requires_grad,
        check_non_empty_numel,
        check_same_device,
        check_not_views,
    ):
        check(plist, names)
    return plist


def check_buffer_args(
    params: Iterable[Param],
    *,
    param_dtype: object,
    grad_dtype: object,
    bucket_size: object,
    use_distributed_optimizer: object,
    data_parallel_size: object,
    pad_buckets_for_high_nccl_busbw: object,
    param_to_name: object,
    patterns: object,
    param_indices: object,
    gradient_scaling_factor: object,
) -> BufferArgs:
    """Every argument checked, in the order a reader would fix them."""
    names = _names(param_to_name)
    plist = _checked_params(params, names)
    p_dtype = _dtype(param_dtype, "param_dtype", plist[0].dtype)
    check_same_dtype(plist, p_dtype, names)
    checked_patterns = check_patterns("param_name_patterns_for_fp32_local_accumulation", patterns)
    _check_names_for_patterns(plist, names, checked_patterns)
    scale = check_scaling_factor(gradient_scaling_factor, "gradient_scaling_factor")
    return BufferArgs(
        params=plist,
        names=names,
        param_dtype=p_dtype,
        grad_dtype=_dtype(grad_dtype, "grad_dtype", p_dtype),
        bucket_size=check_optional_int("bucket_size", bucket_size),
        use_distributed_optimizer=check_flag(
            "use_distributed_optimizer", use_distributed_optimizer
        ),
        data_parallel_size=check_int("data_parallel_size", data_parallel_size),
        pad_buckets_for_high_nccl_busbw=check_flag(
            "pad_buckets_for_high_nccl_busbw", pad_buckets_for_high_nccl_busbw
        ),
        patterns=checked_patterns,
        param_indices=_indices(param_indices, len(plist)),
        gradient_scaling_factor=scale,
    )


@dataclass(frozen=True)
class GivenArgs:
    """The arguments that Megatron-Core's keywords can also carry, in mc's form."""

    params: Iterable[Param]
    use_distributed_optimizer: object
    data_parallel_size: object
    pad_buckets_for_high_nccl_busbw: object
    param_to_name: object
    patterns: object


_FROM_DDP_CONFIG = (
    ("use_distributed_optimizer", False),
    ("pad_buckets_for_high_nccl_busbw", False),
    ("param_name_patterns_for_fp32_local_accumulation", ()),
)
"""What a Megatron ``ddp_config`` sets, with mc's default for each (a value passed to the
buffer directly must be that default or equal the config's)."""


def megatron_form(
    params: object,
    *,
    ddp_config: object,
    params_with_names: object,
    data_parallel_group: object,
    nccl_ub: object,
    use_distributed_optimizer: object,
    data_parallel_size: object,
    pad_buckets_for_high_nccl_busbw: object,
    param_to_name: object,
    patterns: object,
) -> GivenArgs:
    """mc's arguments from Megatron-Core main's ``_ParamAndGradBuffer`` keywords
    (``ddp_config``, ``params_with_names``, ``data_parallel_group``, ``nccl_ub``) where they
    are given; a setting given both ways must agree (``InputValueError`` otherwise)."""
    if check_flag("nccl_ub", nccl_ub):
        raise InputValueError(
            "nccl_ub=True asks for NCCL user-buffer registration, which mc's buffers do not "
            "do; pass nccl_ub=False"
        )
    given = {
        "use_distributed_optimizer": use_distributed_optimizer,
        "pad_buckets_for_high_nccl_busbw": pad_buckets_for_high_nccl_busbw,
        "param_name_patterns_for_fp32_local_accumulation": patterns,
    }
    if ddp_config is not None:
        for field, default in _FROM_DDP_CONFIG:
            if not hasattr(ddp_config, field):
                raise InputTypeError(
                    f"ddp_config={type_name(ddp_config)} has no field {field!r}; pass a "
                    "DistributedDataParallelConfig (mc's or Megatron-Core's)"
                )
            value = getattr(ddp_config, field)
            passed = given[field]
            if passed != default and _plain(passed) != _plain(value):
                raise InputValueError(
                    f"{field}={passed!r} differs from ddp_config.{field}={value!r}; give it one way"
                )
            given[field] = value
    if data_parallel_group is not None:
        size = getattr(data_parallel_group, "size", None)
        if not callable(size):
            raise InputTypeError(
                f"data_parallel_group={type_name(data_parallel_group)} must be a process "
                "group (its size() is the number of shards)"
            )
        group_size = size()
        if data_parallel_size not in (1, group_size):
            raise InputValueError(
                f"data_parallel_size={data_parallel_size!r} differs from the "
                f"data_parallel_group's size {group_size!r}; give it one way"
            )
        data_parallel_size = group_size
    return GivenArgs(
        params=_params_of(params, params_with_names),
        use_distributed_optimizer=given["use_distributed_optimizer"],
        data_parallel_size=data_parallel_size,
        pad_buckets_for_high_nccl_busbw=given["pad_buckets_for_high_nccl_busbw"],
        param_to_name=_names_of(param_to_name, params_with_names),
        patterns=given["param_name_patterns_for_fp32_local_accumulation"],
    )


def _plain(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _pairs(params_with_names: object) -> list[tuple[Param, str]]:
    if isinstance(params_with_names, str) or not isinstance(params_with_names, Sequence):
        raise InputTypeError(
            f"params_with_names={type_name(params_with_names)} must be a list of "
            "(param, name) pairs"
        )
    pairs = list(params_with_names)
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[1], str):
            raise InputTypeError(f"params_with_names[{i}]={pair!r} must be a (param, name) pair")
    return pairs


def _params_of(params: object, params_with_names: object) -> Iterable[Param]:
    if params_with_names is None:
        if params is None:
            raise InputTypeError(
                "ParamAndGradBuffer needs params (an iterable of params) or "
                "params_with_names ((param, name) pairs, Megatron-Core's keyword)"
            )
        return params  # type: ignore[return-value]  # checked by check_buffer_args
    if params is not None:
        raise InputValueError("params and params_with_names name the same params: pass one")
    return [param for param, _ in _pairs(params_with_names)]


def _names_of(param_to_name: object, params_with_names: object) -> object:
    if params_with_names is None or param_to_name is not None:
        return param_to_name
    return dict(_pairs(params_with_names))
