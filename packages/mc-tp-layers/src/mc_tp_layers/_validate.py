"""Argument checks shared by the layers and functions; each raises before any collective."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__: list[str] = []


def positive_int(value: object, arg: str) -> int:
    """``value`` when it is an int >= 1, else a ``TypeError``/``ValueError`` naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg}={value!r} must be an int")
    if value < 1:
        raise ValueError(f"{arg}={value} must be >= 1")
    return value


def check_divisible(value: int, size: int, arg: str, fix: str) -> int:
    """``value // size``, or a ``ValueError`` naming ``arg``, its value and ``fix``."""
    positive_int(value, arg)
    if value % size:
        raise ValueError(
            f"{arg}={value} is not divisible by the tensor-parallel size {size}; {fix}"
        )
    return value // size


def tensor(value: object, arg: str) -> torch.Tensor:
    """``value`` when it is a tensor, else a ``TypeError`` naming ``arg``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(value).__name__}")
    return value


def min_dims(value: torch.Tensor, ndim: int, arg: str) -> None:
    """A ``ValueError`` unless ``value`` has at least ``ndim`` dimensions."""
    if value.dim() < ndim:
        raise ValueError(
            f"{arg} has shape {tuple(value.shape)}; it needs at least {ndim} dimension(s)"
        )


def dim_divisible(value: torch.Tensor, dim: int, size: int, arg: str, what: str) -> None:
    """A ``ValueError`` unless ``value.shape[dim]`` is a multiple of ``size``."""
    if value.shape[dim] % size:
        raise ValueError(
            f"{arg} has shape {tuple(value.shape)}: its {what} (dim {dim}, "
            f"{value.shape[dim]}) is not divisible by the tensor-parallel size {size}; pad "
            "it to a multiple or pass split sizes"
        )


def split_sizes(sizes: Sequence[int] | None, group_size: int, arg: str) -> list[int] | None:
    """Validated per-rank split sizes (one non-negative int per rank), or None."""
    if sizes is None:
        return None
    listed = list(sizes)
    bad = [s for s in listed if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if len(listed) != group_size or bad:
        raise ValueError(
            f"{arg}={listed} must hold one non-negative int per rank of the group "
            f"({group_size} ranks)"
        )
    return listed


def main_grad(weight: torch.Tensor) -> None:
    """A ``ValueError`` unless ``weight.main_grad`` is a tensor of the weight's shape."""
    grad = getattr(weight, "main_grad", None)
    if not isinstance(grad, torch.Tensor):
        raise ValueError(
            f"gradient_accumulation_fusion=True but the weight (shape {tuple(weight.shape)}) "
            "has no main_grad tensor to accumulate into; wrap the model in a DDP that "
            "allocates main_grad (mc_ddp.DistributedDataParallel) or set "
            "config.gradient_accumulation_fusion=False"
        )
    if grad.shape != weight.shape:
        raise ValueError(
            f"weight.main_grad has shape {tuple(grad.shape)} but the weight has "
            f"{tuple(weight.shape)}; main_grad must have the weight's shape"
        )
