"""Argument checks shared by the layouts and the buffer: each error names what is wrong,
the value, and the fix, and is raised before anything is allocated."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError

Param = torch.nn.Parameter

# A param re-pointed into a ParamAndGradBuffer's param_data records where it was put, so a
# later buffer (DDP re-wrapping the same module) may re-point it again although it is,
# strictly, a view into a larger storage. A param moved since then no longer matches.
BUFFER_VIEW_ATTR = "_mc_buffers_param_data_slot"


def describe(param: Param, names: Mapping[Param, str] | None = None) -> str:
    """``'name' (shape, dtype, device)``: how errors name a param."""
    name = names.get(param) if names is not None else None
    where = f"'{name}'" if name is not None else "param"
    dtype = str(param.dtype).removeprefix("torch.")
    return f"{where} (shape {tuple(param.shape)}, {dtype}, {param.device})"


def as_param_list(params: object, name: str = "params") -> list[Param]:
    """``params`` as a list in the given order; rejects unordered and non-tensor input."""
    if isinstance(params, (set, frozenset, Mapping)) or not isinstance(params, Iterable):
        raise InputTypeError(
            f"{name} must be an ordered sequence of parameters (list, tuple, or "
            f"module.parameters()), got {type_name(params)}: the layout follows its order"
        )
    out = list(params)
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise InputTypeError(f"{name}[{i}] has type {type_name(p)}, not a torch parameter")
        if not p.is_leaf:
            raise InputValueError(
                f"{name}[{i}] is not a leaf tensor (it was computed from another: grad_fn "
                f"{type_name(p.grad_fn)}): the buffer would re-point a temporary and its "
                "gradient never reaches the buffer; pass the nn.Parameter itself"
            )
    return out


def check_unique(params: list[Param], names: Mapping[Param, str] | None = None) -> None:
    """Each param at most once (a second copy would get a second slot in the buffer)."""
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:
            raise InputValueError(
                f"params[{i}] {describe(p, names)} repeats params[{seen[id(p)]}]: each param "
                "must appear once; deduplicate the list (e.g. tied weights are one param)"
            )
        seen[id(p)] = i


def check_non_empty_numel(params: list[Param], names: Mapping[Param, str] | None = None) -> None:
    """No 0-element params: they would open empty buckets a collective cannot shard."""
    for i, p in enumerate(params):
        if p.numel() == 0:
            raise InputValueError(
                f"params[{i}] {describe(p, names)} has no elements; leave it out of the "
                "buffer (or set requires_grad=False on it)"
            )


def check_requires_grad(params: list[Param], names: Mapping[Param, str] | None = None) -> None:
    """Only trainable params get a gradient slot."""
    for i, p in enumerate(params):
        if not p.requires_grad:
            raise InputValueError(
                f"params[{i}] {describe(p, names)} does not require grad; pass only params "
                "with requires_grad=True (frozen params need no grad buffer)"
            )


def check_same_device(params: list[Param], names: Mapping[Param, str] | None = None) -> None:
    """One buffer lives on one device, so its params must too."""
    first = params[0].device
    for i, p in enumerate(params):
        if p.device != first:
            raise InputValueError(
                f"params[{i}] {describe(p, names)} is on {p.device} but params[0] is on "
                f"{first}: move the model to one device before building its buffers"
            )


def check_same_dtype(
    params: list[Param], dtype: torch.dtype, names: Mapping[Param, str] | None = None
) -> None:
    """A buffer holds one param dtype (group params with group_params_for_buffers first)."""
    for i, p in enumerate(params):
        if p.dtype != dtype:
            raise InputTypeError(
                f"params[{i}] {describe(p, names)} is not param_dtype={dtype}; group params "
                "by dtype with group_params_for_buffers and build one buffer per key"
            )


def buffer_slot(param: torch.Tensor) -> tuple[int, int, int]:
    """Where ``param`` sits: (storage identity, storage offset, storage bytes).

    The identity is the storage object's address, which (unlike ``data_ptr``) survives
    the offload/reload resizes of the buffer.
    """
    storage = param.untyped_storage()
    return int(storage._cdata), int(param.storage_offset()), storage.nbytes()


def _is_buffer_view(param: torch.Tensor) -> bool:
    return bool(getattr(param, BUFFER_VIEW_ATTR, None) == buffer_slot(param))


def is_view(param: torch.Tensor) -> bool:
    """True when ``param`` does not own its storage alone (a slice or strided view).

    ``Parameter._base`` is always None, so the storage decides: a param that owns its
    memory starts at offset 0, is contiguous and spans its whole storage.
    """
    if param.device.type == "meta":
        return False
    owns = (
        param.storage_offset() == 0
        and param.is_contiguous()
        and param.untyped_storage().nbytes() == param.numel() * param.element_size()
    )
    return not owns and not _is_buffer_view(param)


def check_not_views(params: list[Param], names: Mapping[Param, str] | None = None) -> None:
    """Reject params that alias part of another tensor: re-pointing ``.data`` into the
    buffer would silently break that aliasing (and a main_grad would shadow it)."""
    for i, p in enumerate(params):
        if is_view(p):
            own = p.numel() * p.element_size()
            raise InputValueError(
                f"params[{i}] {describe(p, names)} is a view of another tensor (storage offset "
                f"{p.storage_offset()}, storage {p.untyped_storage().nbytes()} bytes for its "
                f"{own}, contiguous={p.is_contiguous()}); the buffer must own each param's "
                "memory: make it its own tensor, e.g. torch.nn.Parameter(t.detach().clone())"
            )
