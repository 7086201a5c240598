"""Tensor-parallel domain checks (divisibility by the group size, split sizes, partition
dims, a layer's input, ``main_grad``); each raises before any collective. Type and range
checks of plain arguments live in :mod:`mc_groups.argcheck`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from mc_groups import param_attrs
from mc_groups.argcheck import check_int, check_tensor
from mc_groups.errors import InputTypeError, InputValueError

__all__: list[str] = []


def check_divisible(value: object, size: int, arg: str, fix: str) -> int:
    """``value // size``, or a ``ValueError`` naming ``arg``, its value and ``fix``.

    Judged the same at every group size: ``value`` must be an int >= 1 even where ``size``
    is 1.
    """
    number = check_int(arg, value)
    if number % size:
        raise InputValueError(
            f"{arg}={number} is not divisible by the tensor-parallel size {size}; {fix}"
        )
    return number // size


def min_dims(value: torch.Tensor, ndim: int, arg: str) -> None:
    """A ``ValueError`` unless ``value`` has at least ``ndim`` dimensions."""
    if value.dim() < ndim:
        raise InputValueError(
            f"{arg} has shape {tuple(value.shape)}; it needs at least {ndim} dimension(s)"
        )


def dim_divisible(value: torch.Tensor, dim: int, size: int, arg: str, what: str) -> None:
    """A ``ValueError`` unless ``value.shape[dim]`` is a multiple of ``size``."""
    if value.shape[dim] % size:
        raise InputValueError(
            f"{arg} has shape {tuple(value.shape)}: its {what} (dim {dim}, "
            f"{value.shape[dim]}) is not divisible by the tensor-parallel size {size}; pad "
            "it to a multiple or pass split sizes"
        )


def split_sizes(sizes: object, group_size: int, arg: str) -> list[int] | None:
    """Validated per-rank split sizes (one non-negative int per rank), or None.

    A str, a tensor or anything that is not a sequence is a ``TypeError`` (a tensor of
    sizes would need a device synchronisation to read).
    """
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes, torch.Tensor)) or not isinstance(sizes, Sequence):
        raise InputTypeError(
            f"{arg}={sizes!r} must be a list of ints (one row count per rank) or None"
        )
    listed = list(sizes)
    bad = [s for s in listed if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if len(listed) != group_size or bad:
        raise InputValueError(
            f"{arg}={listed} must hold one non-negative int per rank of the group "
            f"({group_size} ranks)"
        )
    return listed


def partition_dim(value: object, ndim: int, arg: str = "partition_dim") -> int:
    """``value`` as a dimension index of a ``ndim``-D tensor, normalised to ``[0, ndim)``.

    Only ``[-ndim, ndim)`` is accepted: a dim that Python's ``%`` would wrap (5 on a 2-D
    weight reading as 1) is a ``ValueError``, not another dimension.
    """
    dim = check_int(arg, value, minimum=-sys.maxsize - 1)
    if not -ndim <= dim < ndim:
        raise InputValueError(
            f"{arg}={dim} is not a dimension of a {ndim}-D tensor; use one of "
            f"{list(range(ndim))} (or {list(range(-ndim, 0))} from the end)"
        )
    return dim % ndim


def main_grad(weight: torch.Tensor) -> None:
    """A ``ValueError`` unless ``weight.main_grad`` is a tensor of the weight's shape."""
    grad = param_attrs.main_grad_or_none(weight)
    if not isinstance(grad, torch.Tensor):
        raise InputValueError(
            f"gradient_accumulation_fusion=True but the weight (shape {tuple(weight.shape)}) "
            "has no main_grad tensor to accumulate into; wrap the model in a DDP that "
            "allocates main_grad (mc_ddp.DistributedDataParallel) or set "
            "config.gradient_accumulation_fusion=False"
        )
    if grad.shape != weight.shape:
        raise InputValueError(
            f"weight.main_grad has shape {tuple(grad.shape)} but the weight has "
            f"{tuple(weight.shape)}; main_grad must have the weight's shape"
        )
    # A fused kernel (apex, addmm_) would write through the view's data pointer: a grad
    # buffer offloaded with offload_grad_buffers() has freed its storage. Not while
    # compiling (Dynamo cannot read a storage's size): offloaded buffers belong to mc DDP,
    # whose weights get their wgrad through autograd there and DDP's hook refuses them.
    if grad.numel() and not torch.compiler.is_compiling() and grad.untyped_storage().nbytes() == 0:
        raise RuntimeError(
            f"weight.main_grad (shape {tuple(grad.shape)}) has no storage: its grad buffer is "
            "offloaded; call restore_grad_buffers() before the next forward with "
            "gradient_accumulation_fusion"
        )


def check_input(input_: object, last: int, what: str) -> torch.Tensor:
    """A 2-D or 3-D floating-point tensor whose last dimension is ``last``.

    A non-tensor or integer tensor is a ``TypeError``, a wrong shape a ``ValueError``.
    """
    x = input_ if isinstance(input_, torch.Tensor) else check_tensor("input_", input_)
    if not x.dtype.is_floating_point:
        raise InputTypeError(f"input_ holds {x.dtype}; {what} needs a floating-point input")
    if x.dim() not in (2, 3) or x.shape[-1] != last:
        raise InputValueError(
            f"{what} expects input_ of shape [sequence, batch, {last}] (or [tokens, {last}]), "
            f"got {tuple(x.shape)}"
        )
    return x


def check_sequence(x: torch.Tensor, size: int) -> None:
    """Under SP the sequence (dim 0) must split evenly over the TP ranks."""
    if size > 1 and x.shape[0] % size:
        raise InputValueError(
            f"input_ has shape {tuple(x.shape)}: under sequence_parallel its sequence length "
            f"{x.shape[0]} must be divisible by the tensor-parallel size {size}; pad the "
            "sequence"
        )
