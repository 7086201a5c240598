r"""Sequence parallelism around blocks of a model whose activations may be batch-first.

mc's mappings split and gather dim 0 (Megatron's ``[s, b, h]``); a ``[b, s, h]`` model keeps
its sequence in dim 1. :func:`along` moves the sequence dim to the front around a mapping
and back, so one mechanism serves both layouts::

    gather  [b, s/W, h] --all-gather(seq)-->  [b, s, h]    backward: reduce-scatter (sum of
                                                           the TP ranks' partial grads)
    leave   [b, s/W, h] --all-gather(seq)-->  [b, s, h]    backward: keep rank r's part of
                                                           the (replicated) grad
    scatter [b, s, h]   --keep rank r's part--> [b, s/W, h]   backward: all-gather

Without sequence parallelism the same plan entry is Megatron's ``f`` for the whole block
(identity forward; backward one all-reduce of the block's input grad, where each
column-parallel layer would otherwise all-reduce its own). The tensor that enters a block
is marked, so a column-parallel layer that relies on it refuses an input that did not
enter that way (its grads would silently miss the TP sum).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mc_groups.errors import InputValueError
from mc_tp_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__: list[str] = []

_ENTERED = "_mc_entered_tp_block"


def along(dim: int, op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``op`` (a dim-0 mapping) applied along ``dim`` of ``x``; along dim 0 of a 2-D ``x``
    (``[tokens, h]``: batch and sequence flattened, this rank's tokens, as a MoE block hands
    them to its shared experts)."""
    if dim == 0 or x.dim() < 3:
        return op(x)
    return op(x.transpose(0, dim).contiguous()).transpose(0, dim).contiguous()


def enter(
    x: torch.Tensor, group: dist.ProcessGroup, dim: int, sequence_parallel: bool
) -> torch.Tensor:
    """``x`` entering a block of column-parallel layers, marked: under sequence parallelism
    all-gathered along ``dim`` (backward: reduce-scatter), else copied (backward: all-reduce)."""
    if sequence_parallel:
        out = along(dim, lambda t: gather_from_sequence_parallel_region(t, True, group), x)
    else:
        out = copy_to_tensor_model_parallel_region(x, group)
    setattr(out, _ENTERED, True)
    return out


def leave(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """``x`` leaving the split residual stream whole: all-gathered along ``dim``; backward
    keeps this rank's part of the (replicated) gradient, without communicating."""
    return along(dim, lambda t: gather_from_sequence_parallel_region(t, False, group), x)


def output_hook(name: str, transform: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """A ``register_forward_hook`` hook that applies ``transform`` to the module's output,
    which must be a tensor."""

    def hook(_module: torch.nn.Module, _args: tuple[Any, ...], output: Any) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise InputValueError(
                f"{name} returned {type(output).__name__}, not a tensor: "
                "SequenceParallelNorm(gather_output=True) gathers one output tensor; put it on "
                "the module that returns the hidden states"
            )
        return transform(output)

    return hook


def scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's part of ``x`` along the sequence ``dim`` (backward: all-gather)."""
    return along(dim, lambda t: scatter_to_sequence_parallel_region(t, group), x)


def is_block_input(x: torch.Tensor) -> bool:
    """Whether ``x`` came out of :func:`enter`."""
    return bool(getattr(x, _ENTERED, False))


def input_hook(
    name: str, kwarg: str, transform: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]:
    """A ``register_forward_pre_hook(with_kwargs=True)`` hook that applies ``transform`` to
    the module's input: its first positional argument, else the keyword ``kwarg``."""

    def hook(
        _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (transform(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get(kwarg), torch.Tensor):
            return args, {**kwargs, kwarg: transform(kwargs[kwarg])}
        raise InputValueError(
            f"{name} was called without a tensor as its first argument or as {kwarg}=; its "
            f"sequence style cannot find the input: name the keyword in the style, e.g. "
            f"SequenceGather(kwarg='x')"
        )

    return hook
