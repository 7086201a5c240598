r"""Autograd mappings between the tensor-parallel and sequence-parallel regions.

Names follow Megatron-Core (``core.tensor_parallel.mappings``) and the Megatron paper's
``f`` / ``g`` operators. Each mapping takes an explicit ``group`` (``None`` falls back to
the default collection's ``tp``); a group of one rank makes every mapping the identity
and communicates nothing. Outputs are allocated on the input's device.

Tensor-parallel region (split on the **last** dim, h = hidden size, W = group size)::

    mapping                                  forward                    backward
    copy_to_tensor_model_parallel_region     identity            (f)    all-reduce
    reduce_from_tensor_model_parallel_region all-reduce          (g)    identity
    scatter_to_tensor_model_parallel_region  [.., h] -> [.., h/W]       all-gather last dim
    gather_from_tensor_model_parallel_region [.., h/W] -> [.., h]       split last dim
    all_gather_last_dim_from_tensor_...      [.., h/W] -> [.., h]       reduce-scatter last dim
    reduce_scatter_last_dim_to_tensor_...    [.., h] -> [.., h/W] (sum) all-gather last dim

Sequence-parallel region (split on dim 0, the sequence, s)::

    scatter_to_sequence_parallel_region      [s, ..] -> [s/W, ..]       all-gather dim 0
    gather_from_sequence_parallel_region     [s/W, ..] -> [s, ..]       reduce-scatter dim 0
                                                                        (or split, see below)
    reduce_scatter_to_sequence_parallel_...  [s, ..] -> [s/W, ..] (sum) all-gather dim 0

All-to-all: :func:`all_to_all` exchanges dim-0 splits (backward: the reverse exchange);
:func:`all_to_all_sp2hp` turns ``[tokens/W, H]`` into ``[tokens, H/W]`` and
:func:`all_to_all_hp2sp` does the reverse.

Dim-0 mappings accept uneven per-rank split sizes; gloo cannot all-gather uneven sizes,
so each part is padded to the largest and the padding dropped (see :mod:`._comm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_tensor
from mc_groups.errors import InputValueError
from mc_tp_layers import _comm, _validate
from mc_tp_layers._autograd import apply
from mc_tp_layers._groups import resolve_tp_group

__all__ = [
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]


_Op = Callable[[torch.Tensor], torch.Tensor]
_GroupOp = Callable[[torch.Tensor, dist.ProcessGroup], torch.Tensor]


class _Mapping(torch.autograd.Function):
    """``forward_op`` on the input; ``backward_op`` on the output's gradient.

    Every mapping is such a pair of tensor-level operations of :mod:`._comm` (bound to
    their group and split sizes), so one autograd function serves them all.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_op: _Op, backward_op: _Op) -> torch.Tensor:
        ctx.backward_op = backward_op
        return forward_op(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.backward_op(grad), None, None


def _mapped(x: torch.Tensor, forward_op: _Op, backward_op: _Op) -> torch.Tensor:
    return apply(_Mapping, x, forward_op, backward_op)


def _identity(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    del group
    return x


def _tp_region(
    x: torch.Tensor,
    g: dist.ProcessGroup,
    forward_op: _GroupOp,
    backward_op: _GroupOp,
    *,
    splits: bool = False,
) -> torch.Tensor:
    """A tensor-parallel-region mapping of ``x``: ``forward_op`` over ``g``, ``backward_op``
    on the gradient (``splits``: the forward splits the last dim, which must divide)."""
    if g.size() == 1:
        return x
    if splits:
        _validate.dim_divisible(x, -1, g.size(), "input_", "last dimension")
    return _mapped(x, lambda t: forward_op(t, g), lambda t: backward_op(t, g))


def _split_dim0(group: dist.ProcessGroup, sizes: list[int] | None) -> _Op:
    return lambda t: _comm.split_first_dim(t, group, sizes)


def _gather_dim0(group: dist.ProcessGroup, sizes: list[int] | None) -> _Op:
    return lambda t: _comm.gather_first_dim(t, group, sizes)[0]


def _reduce_scatter_dim0(group: dist.ProcessGroup, sizes: list[int] | None) -> _Op:
    return lambda t: _comm.reduce_scatter_first_dim(t, group, sizes)[0]


def _exchange(group: dist.ProcessGroup, outs: list[int] | None, ins: list[int] | None) -> _Op:
    return lambda t: _comm.all_to_all(t, group, outs, ins)


def _prepare(
    input_: object, group: dist.ProcessGroup | None, what: str, min_ndim: int = 1
) -> tuple[torch.Tensor, dist.ProcessGroup]:
    x = check_tensor("input_", input_)
    _validate.min_dims(x, min_ndim, "input_")
    return x, resolve_tp_group(group, None, what=what)


def _sizes(sizes: Sequence[int] | None, group: dist.ProcessGroup, arg: str) -> list[int] | None:
    return _validate.split_sizes(sizes, group.size(), arg)


def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``f``: identity forward; backward all-reduces (sums) the gradient over ``group``."""
    x, g = _prepare(input_, group, "copy_to_tensor_model_parallel_region")
    return _tp_region(x, g, _identity, _comm.all_reduce)


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``g``: forward all-reduces (sums) over ``group`` into a new tensor; backward identity."""
    x, g = _prepare(input_, group, "reduce_from_tensor_model_parallel_region")
    return _tp_region(x, g, _comm.all_reduce, _identity)


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Keep chunk ``rank`` of the last dim (no communication); backward all-gathers it."""
    x, g = _prepare(input_, group, "scatter_to_tensor_model_parallel_region")
    return _tp_region(x, g, _comm.split_last_dim, _comm.gather_last_dim, splits=True)


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along the last dim (rank order); backward keeps chunk ``rank``."""
    x, g = _prepare(input_, group, "gather_from_tensor_model_parallel_region")
    return _tp_region(x, g, _comm.gather_last_dim, _comm.split_last_dim)


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Keep this rank's part of dim 0 (no communication); backward all-gathers dim 0.

    Parts are equal (dim 0 must divide by the group size) or ``split_sizes[rank]`` rows.
    """
    x, g = _prepare(input_, group, "scatter_to_sequence_parallel_region")
    sizes = _sizes(split_sizes, g, "split_sizes")
    if sizes is None:
        _validate.dim_divisible(x, 0, g.size(), "input_", "sequence length")
    elif sum(sizes) != x.shape[0]:
        raise InputValueError(
            f"split_sizes={sizes} sum to {sum(sizes)} but input_ has shape {tuple(x.shape)}; "
            "they must add up to dim 0"
        )
    if g.size() == 1:
        return x
    return _mapped(x, _split_dim0(g, sizes), _gather_dim0(g, sizes))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group: dist.ProcessGroup | None = None,
    output_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """All-gather along dim 0 (rank r contributes ``output_split_sizes[r]`` rows if given).

    Backward: when ``tensor_parallel_output_grad`` (the output feeds a tensor-parallel
    computation, so each rank holds a partial gradient) the gradient is reduce-scattered
    (summed, rank r keeps its rows); otherwise each rank already holds the full gradient
    and keeps its rows without communicating. ``use_global_buffer`` is accepted for
    Megatron compatibility; mc allocates a fresh output.
    """
    check_flag("tensor_parallel_output_grad", tensor_parallel_output_grad)
    check_flag("use_global_buffer", use_global_buffer)
    x, g = _prepare(input_, group, "gather_from_sequence_parallel_region")
    sizes = _sizes(output_split_sizes, g, "output_split_sizes")
    if sizes is not None and sizes[g.rank()] != x.shape[0]:
        raise InputValueError(
            f"output_split_sizes={sizes} gives rank {g.rank()} {sizes[g.rank()]} rows but "
            f"input_ has shape {tuple(x.shape)}"
        )
    if g.size() == 1:
        return x
    if tensor_parallel_output_grad:
        return _mapped(x, _gather_dim0(g, sizes), _reduce_scatter_dim0(g, sizes))
    return _mapped(x, _gather_dim0(g, sizes), _split_dim0(g, sizes))


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    input_split_sizes: Sequence[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's part of dim 0; backward all-gathers dim 0.

    Parts are equal (dim 0 must divide by the group size) or ``input_split_sizes[r]`` rows
    for rank r. ``use_global_buffer`` is accepted for Megatron compatibility.
    """
    check_flag("use_global_buffer", use_global_buffer)
    x, g = _prepare(input_, group, "reduce_scatter_to_sequence_parallel_region")
    sizes = _sizes(input_split_sizes, g, "input_split_sizes")
    if sizes is None:
        _validate.dim_divisible(x, 0, g.size(), "input_", "sequence length")
    elif sum(sizes) != x.shape[0]:
        raise InputValueError(
            f"input_split_sizes={sizes} sum to {sum(sizes)} but input_ has shape "
            f"{tuple(x.shape)}; they must add up to dim 0"
        )
    if g.size() == 1:
        return x
    return _mapped(x, _reduce_scatter_dim0(g, sizes), _gather_dim0(g, sizes))


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along the last dim; backward reduce-scatters (sums) the last dim."""
    x, g = _prepare(input_, group, "all_gather_last_dim_from_tensor_parallel_region")
    return _tp_region(x, g, _comm.gather_last_dim, _comm.reduce_scatter_last_dim)


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum over ``group`` and keep chunk ``rank`` of the last dim; backward all-gathers."""
    x, g = _prepare(input_, group, "reduce_scatter_last_dim_to_tensor_parallel_region")
    return _tp_region(x, g, _comm.reduce_scatter_last_dim, _comm.gather_last_dim, splits=True)


def all_to_all(
    group: dist.ProcessGroup | None,
    input_: torch.Tensor,
    output_split_sizes_: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rank r sends split j of dim 0 to rank j and receives split r of every rank.

    Without split sizes dim 0 is split evenly. Backward runs the reverse exchange (the
    split sizes swap roles).
    """
    x, g = _prepare(input_, group, "all_to_all")
    outs = _sizes(output_split_sizes_, g, "output_split_sizes_")
    ins = _sizes(input_split_sizes, g, "input_split_sizes")
    if ins is None:
        _validate.dim_divisible(x, 0, g.size(), "input_", "first dimension")
    elif sum(ins) != x.shape[0]:
        raise InputValueError(
            f"input_split_sizes={ins} sum to {sum(ins)} but input_ has shape {tuple(x.shape)}"
        )
    if g.size() == 1:
        if outs is not None and outs != [x.shape[0]]:
            raise InputValueError(
                f"output_split_sizes_={outs} on a group of one rank must be [{x.shape[0]}] "
                "(the rows this rank keeps)"
            )
        return x
    # Backward is the reverse exchange: what this rank received from j goes back to j.
    return _mapped(x, _exchange(g, outs, ins), _exchange(g, ins, outs))


def all_to_all_sp2hp(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[tokens/W, H]`` (sequence-split) → ``[tokens, H/W]`` (hidden-split).

    The input is viewed as 2-D ``[-1, H]``; chunk j of the hidden dim goes to rank j, and
    rank r's result stacks every rank's chunk r in rank order.
    """
    x, g = _prepare(input_, group, "all_to_all_sp2hp", min_ndim=2)
    size = g.size()
    if size == 1:
        return x
    _validate.dim_divisible(x, -1, size, "input_", "hidden dimension")
    flat = x.reshape(-1, x.shape[-1])
    by_destination = torch.cat(torch.split(flat, flat.shape[-1] // size, dim=1), dim=0)
    return all_to_all(g, by_destination)


def all_to_all_hp2sp(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[tokens, H/W]`` (hidden-split) → ``[tokens/W, H]`` (sequence-split).

    The inverse of :func:`all_to_all_sp2hp`: rows ``[j·t/W, (j+1)·t/W)`` go to rank j, and
    the received chunks are concatenated along the hidden dim in rank order.
    """
    x, g = _prepare(input_, group, "all_to_all_hp2sp", min_ndim=2)
    size = g.size()
    if size == 1:
        return x
    flat = x.reshape(-1, x.shape[-1])
    _validate.dim_divisible(flat, 0, size, "input_", "token count")
    exchanged = all_to_all(g, flat)
    return torch.cat(torch.split(exchanged, exchanged.shape[0] // size, dim=0), dim=-1)
