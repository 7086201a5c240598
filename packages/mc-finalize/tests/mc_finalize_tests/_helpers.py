"""Hand-made model chunks, configs and layouts shared by the mc-finalize tests.

A :class:`Chunk` is an ``nn.Module`` whose params carry ``main_grad`` (or ``grad``) set by the
test to rank-dependent values, whose ``finish_grad_sync`` only records its argument, and
whose ``scale_gradients`` multiplies every grad, so each finalize step's effect is visible
on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.collection import clear_default_collection

TIMEOUT = timedelta(seconds=30)


@dataclass
class Cfg:
    """Every config attribute finalize reads, and the rest of ``mc_groups.TransformerConfigLike``
    (what the packages require of a config), with Megatron-Core's defaults."""

    sequence_parallel: bool = False
    calculate_per_token_loss: bool = False
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    gradient_accumulation_fusion: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    qk_layernorm: bool = False
    has_cond_embedder: bool = False
    flextron: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    moe_router_quantile_balancing_ema: float = 0.0
    mtp_num_layers: int | None = None
    gtp_remat_size: int = 1
    expert_gtp_remat_size: int = 1


class Chunk(torch.nn.Module):
    """One model chunk; ``finish_grad_sync`` and ``scale_gradients`` record their calls."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config: Any = config
        self.sync_calls: list[bool] = []
        self.scale_calls: list[float] = []

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.sync_calls.append(force_all_reduce)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.scale_calls.append(scaling_factor)
        for param in self.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grad.mul_(scaling_factor)


def add_param(
    module: torch.nn.Module,
    name: str,
    value: float | None,
    *,
    shape: tuple[int, ...] = (3,),
    dtype: torch.dtype = torch.float32,
    main_grad: bool = True,
    requires_grad: bool = True,
    **attrs: Any,
) -> torch.nn.Parameter:
    """Register ``module.<name>`` (dots make submodules) with its grad filled with ``value``.

    ``main_grad=False`` stores the value in ``param.grad`` instead; ``value=None`` leaves the
    grad (``main_grad`` attribute set to None) empty. ``attrs`` are set on the param.
    """
    *path, leaf = name.split(".")
    owner = module
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=requires_grad)
    grad = None if value is None else torch.full(shape, float(value), dtype=dtype)
    if main_grad:
        param.main_grad = grad  # type: ignore[attr-defined]
    else:
        param.grad = grad
    for key, attr in attrs.items():
        setattr(param, key, attr)
    owner.register_parameter(leaf, param)
    return param


def grad_of(param: torch.nn.Parameter) -> list[float]:
    """The param's grad (main_grad when present) as a flat list of floats."""
    grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
    assert grad is not None
    return [float(v) for v in grad.float().reshape(-1)]


def first(param: torch.nn.Parameter) -> float:
    """First element of the param's grad (tests fill grads with one value)."""
    return grad_of(param)[0]


def records(log: list[mg.CollectiveRecord]) -> list[tuple[Any, ...]]:
    """What a test compares: op, reduce op, group ranks, dtype name, numel, label."""
    return [
        (r.op, r.reduce_op, r.group_ranks, str(r.dtype).removeprefix("torch."), r.numel, r.label)
        for r in log
    ]


@contextmanager
def layout(**sizes: Any) -> Iterator[mg.ProcessGroupCollection]:
    """``initialize_model_parallel(**sizes)`` with a short timeout, destroyed afterwards."""
    pgc = mg.initialize_model_parallel(timeout=TIMEOUT, **sizes)
    try:
        yield pgc
    finally:
        clear_default_collection()
        mg.destroy_model_parallel(pgc)


@contextmanager
def extra_group(ranks: list[int]) -> Iterator[dist.ProcessGroup | None]:
    """A hand-made group (every rank must call this); None on ranks outside ``ranks``."""
    group = dist.new_group(ranks, timeout=TIMEOUT)
    world = dist.group.WORLD
    assert world is not None
    # Same race as mc_groups.initialize_model_parallel: let every peer finish the gloo
    # handshake before anyone uses or destroys the new group.
    mg.barrier(world)
    try:
        yield group if dist.get_rank() in ranks else None
    finally:
        mg.barrier(world)
        if dist.get_rank() in ranks:
            dist.destroy_process_group(group)


def rank() -> int:
    """This process's global rank."""
    return dist.get_rank()
