"""Tensor-level communication for the TP region: no autograd, one collective each.

Every collective goes through :mod:`mc_groups.comm.traceable` (recorded, bounded, and labelled
``"tp …"`` so that a failure or a schedule mismatch names the tensor-parallel group's
role): mc's in-place collectives in eager mode, torch's functional collectives while
``torch.compile`` traces, so the mappings and linear functions compile without graph
breaks. torch's flat collectives work on dim 0, so last-dim gathers and scatters move the
rank axis to dim 0 locally. gloo cannot all-gather or reduce-scatter uneven sizes, so
uneven splits along dim 0 are padded to the largest split and sliced afterwards. A group
of one rank returns its input unchanged and communicates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mc_groups.comm import traceable
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
    if group.size() == 1:
        return x
    stacked = traceable.all_gather_tensor(x.unsqueeze(0), group, label="tp gather last dim")
    return torch.cat(stacked.unbind(0), dim=-1)


def gather_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, output_split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (one all-gather).

    With ``output_split_sizes`` rank r contributes ``output_split_sizes[r]`` rows: each
    contribution is padded to the largest and the padding dropped after the gather.
    """
    size = group.size()
    if size == 1:
        return x
    if output_split_sizes is None:
        return traceable.all_gather_tensor(x, group, label="tp gather dim 0")
    rank = group.rank()
    sizes = _validate.split_sizes(output_split_sizes, size, "output_split_sizes")
    if sizes is not None and sizes[rank] != x.shape[0]:
        _mismatch(x, sizes, rank, "output_split_sizes")
    if sizes is None or len(set(sizes)) == 1:
        return traceable.all_gather_tensor(x, group, label="tp gather dim 0")
    widest = max(sizes)
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    stacked = traceable.all_gather_tensor(padded, group, label="tp gather dim 0 (uneven)")
    parts = stacked.view(size, widest, *x.shape[1:])
    return torch.cat([parts[r, :n] for r, n in enumerate(sizes)], dim=0)


def start_gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> traceable.PendingTensor:
    """Start :func:`gather_first_dim` (equal parts); ``wait()`` returns the gathered rows."""
    return traceable.start_all_gather(x, group, label="tp gather dim 0")


def reduce_scatter_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, input_split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Sum ``x`` over ranks; rank r keeps its part of dim 0 (one reduce-scatter).

    Equal parts, or ``input_split_sizes[r]`` rows for rank r (each part padded with zeros
    to the largest, so the padding adds nothing).
    """
    size = group.size()
    if size == 1:
        return x
    sizes = (
        None
        if input_split_sizes is None
        else _validate.split_sizes(input_split_sizes, size, "input_split_sizes")
    )
    if sizes is None or len(set(sizes)) == 1:
        _validate.dim_divisible(x, 0, size, "input", "first dimension")
        return traceable.reduce_scatter_tensor(x, group, label="tp reduce-scatter dim 0")
    _check_total(x, sizes, "input_split_sizes")
    widest = max(sizes)
    padded = x.new_zeros((size, widest, *x.shape[1:]))
    for r, part in enumerate(torch.split(x, sizes, dim=0)):
        padded[r, : sizes[r]] = part
    out = traceable.reduce_scatter_tensor(
        padded.view(size * widest, *x.shape[1:]), group, label="tp reduce-scatter dim 0 (uneven)"
    )
    return out[: sizes[group.rank()]]


def start_reduce_scatter_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup
) -> traceable.PendingTensor:
    """Start :func:`reduce_scatter_first_dim` (equal parts); ``wait()`` returns this rank's
    rows of the sum."""
    _validate.dim_divisible(x, 0, group.size(), "input", "first dimension")
    return traceable.start_reduce_scatter(x, group, label="tp reduce-scatter dim 0")


def reduce_scatter_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks; rank r keeps chunk r of the last dimension."""
    size = group.size()
    if size == 1:
        return x
    _validate.dim_divisible(x, -1, size, "input", "last dimension")
    stacked = torch.stack(x.chunk(size, dim=-1), dim=0)
    out = traceable.reduce_scatter_tensor(stacked, group, label="tp reduce-scatter last dim")
    return out.view(stacked.shape[1:])


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, *, inplace: bool = False) -> torch.Tensor:
    """Sum ``x`` over ranks into a new tensor (``x`` may be saved by autograd elsewhere);
    ``inplace``: into ``x`` itself (eager), for a tensor nothing else holds."""
    if group.size() == 1:
        return x
    return traceable.all_reduce_tensor(x, group, label="tp all-reduce", inplace=inplace)


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
    return traceable.all_to_all_tensor(
        x, group, output_split_sizes=outs, input_split_sizes=ins, label="tp all-to-all"
    )


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
