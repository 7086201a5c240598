"""Tensor-level communication for the TP region: no autograd, one collective each.

Every collective goes through :mod:`mc_groups` (recorded, bounded, and labelled
``"tp …"`` so that a failure or a schedule mismatch names the tensor-parallel group's
role). torch's flat
collectives work on dim 0, so last-dim gathers and scatters move the rank axis to dim 0
locally. gloo cannot all-gather or reduce-scatter uneven sizes, so uneven splits along dim 0
are padded to the largest split and sliced afterwards. A group of one rank returns its
input unchanged and communicates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.errors import InputValueError
from mc_tp_layers import _validate

__all__: list[str] = []


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous chunk of the last dimension (no communication)."""
    size = group.size()
    if size == 1:
        return x
    _validate.dim_divisible(x, -1, size, "input", "last dimension")
    chunk = x.shape[-1] // size
    return x.narrow(-1, group.rank() * chunk, chunk).contiguous()


def split_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's slice of dim 0: equal parts, or ``split_sizes[rank]`` rows."""
    size, rank = group.size(), group.rank()
    if size == 1:
        return x
    sizes = _validate.split_sizes(split_sizes, size, "split_sizes")
    if sizes is None:
        _validate.dim_divisible(x, 0, size, "input", "first dimension")
        sizes = [x.shape[0] // size] * size
    _check_total(x, sizes, "split_sizes")
    start = sum(sizes[:rank])
    return x.narrow(0, start, sizes[rank]).contiguous()


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (one all-gather)."""
    size = group.size()
    if size == 1:
        return x
    stacked = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
    mg.all_gather(_flat(stacked), _flat(x), group, label="tp gather last dim")
    return torch.cat(stacked.unbind(0), dim=-1)


def gather_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
) -> tuple[torch.Tensor, mg.CollectiveHandle]:
    """Concatenate every rank's ``x`` along dim 0 (one all-gather).

    With ``output_split_sizes`` rank r contributes ``output_split_sizes[r]`` rows: each
    contribution is padded to the largest and the padding dropped after the gather (the
    result is then only valid once the handle was waited on, which the synchronous call
    does). Returns the output and the handle (already complete unless ``async_op``).
    """
    size, rank = group.size(), group.rank()
    if size == 1:
        return x, mg.CollectiveHandle()
    sizes = _validate.split_sizes(output_split_sizes, size, "output_split_sizes")
    if sizes is None or len(set(sizes)) == 1:
        if sizes is not None and sizes[rank] != x.shape[0]:
            _mismatch(x, sizes, rank, "output_split_sizes")
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        handle = mg.all_gather(
            _flat(out), _flat(x), group, async_op=async_op, label="tp gather dim 0"
        )
        return out, handle
    if sizes[rank] != x.shape[0]:
        _mismatch(x, sizes, rank, "output_split_sizes")
    return _gather_uneven(x, group, sizes), mg.CollectiveHandle()


def _gather_uneven(x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    widest = max(sizes)
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    stacked = x.new_empty((len(sizes), widest, *x.shape[1:]))
    mg.all_gather(_flat(stacked), _flat(padded), group, label="tp gather dim 0 (uneven)")
    return torch.cat([stacked[r, :n] for r, n in enumerate(sizes)], dim=0)


def reduce_scatter_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    input_split_sizes: Sequence[int] | None = None,
    *,
    async_op: bool = False,
) -> tuple[torch.Tensor, mg.CollectiveHandle]:
    """Sum ``x`` over ranks; rank r keeps its part of dim 0 (one reduce-scatter).

    Equal parts, or ``input_split_sizes[r]`` rows for rank r (each part padded with zeros
    to the largest, so the padding adds nothing).
    """
    size, rank = group.size(), group.rank()
    if size == 1:
        return x, mg.CollectiveHandle()
    sizes = _validate.split_sizes(input_split_sizes, size, "input_split_sizes")
    if sizes is None or len(set(sizes)) == 1:
        _validate.dim_divisible(x, 0, size, "input", "first dimension")
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        handle = mg.reduce_scatter(
            _flat(out), _flat(x), group, async_op=async_op, label="tp reduce-scatter dim 0"
        )
        return out, handle
    _check_total(x, sizes, "input_split_sizes")
    widest = max(sizes)
    padded = x.new_zeros((size, widest, *x.shape[1:]))
    for r, part in enumerate(torch.split(x, sizes, dim=0)):
        padded[r, : sizes[r]] = part
    out = x.new_empty((widest, *x.shape[1:]))
    mg.reduce_scatter(_flat(out), _flat(padded), group, label="tp reduce-scatter dim 0 (uneven)")
    return out[: sizes[rank]], mg.CollectiveHandle()


def reduce_scatter_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks; rank r keeps chunk r of the last dimension."""
    size = group.size()
    if size == 1:
        return x
    _validate.dim_divisible(x, -1, size, "input", "last dimension")
    stacked = torch.stack(x.chunk(size, dim=-1), dim=0)
    out = x.new_empty(stacked.shape[1:])
    mg.reduce_scatter(_flat(out), _flat(stacked), group, label="tp reduce-scatter last dim")
    return out


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks into a new tensor (``x`` may be saved by autograd elsewhere)."""
    if group.size() == 1:
        return x
    out = x.contiguous().clone()
    mg.all_reduce(out, group, label="tp all-reduce")
    return out


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Exchange dim-0 splits: rank r sends its split j to rank j (one all-to-all)."""
    size = group.size()
    if size == 1:
        return x
    outs = _validate.split_sizes(output_split_sizes, size, "output_split_sizes")
    ins = _validate.split_sizes(input_split_sizes, size, "input_split_sizes")
    if ins is None:
        _validate.dim_divisible(x, 0, size, "input", "first dimension")
    else:
        _check_total(x, ins, "input_split_sizes")
    rows = x.shape[0] if outs is None else sum(outs)
    out = x.new_empty((rows, *x.shape[1:]))
    mg.all_to_all(
        out,
        x.contiguous(),
        group,
        output_split_sizes=outs,
        input_split_sizes=ins,
        label="tp all-to-all",
    )
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """A 1-D view (a contiguous copy when needed): gloo's flat collectives split dim 0."""
    return x.contiguous().view(-1)


def _check_total(x: torch.Tensor, sizes: list[int], arg: str) -> None:
    if sum(sizes) != x.shape[0]:
        raise InputValueError(
            f"{arg}={sizes} sum to {sum(sizes)} but the input has {x.shape[0]} rows "
            f"(shape {tuple(x.shape)}); the sizes must add up to dim 0"
        )


def _mismatch(x: torch.Tensor, sizes: list[int], rank: int, arg: str) -> None:
    raise InputValueError(
        f"{arg}={sizes} gives rank {rank} {sizes[rank]} rows but its input has "
        f"{x.shape[0]} (shape {tuple(x.shape)})"
    )
