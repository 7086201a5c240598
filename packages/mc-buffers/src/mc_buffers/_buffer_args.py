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
