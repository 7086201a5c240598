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
so each part is padded to the largest and the padding dropped. Every collective goes
through :mod:`mc_groups.comm.traceable` (recorded, bounded, labelled ``"tp …"`` so that a
failure or a schedule mismatch names the tensor-parallel group's role): mc's in-place
collectives in eager mode, torch's functional collectives while ``torch.compile`` traces,
so the mappings compile without graph breaks. torch's flat collectives work on dim 0, so
last-dim gathers and scatters move the rank axis to dim 0 locally.

Each mapping is one ``torch.autograd.Function`` with Megatron's name, signature and
``ctx`` attributes, importable from here because Megatron's users and tests call them
directly (``_X.apply(input_, group)``, ``_X.backward(ctx, grad)`` with a ``ctx`` that holds
only ``group`` and the mapping's recorded arguments, ``_X.symbolic(graph, input_, group)``,
which computes the forward without autograd)::

    _CopyToModelParallelRegion        _ReduceFromModelParallelRegion
    _ScatterToModelParallelRegion     _GatherFromModelParallelRegion
    _ScatterToSequenceParallelRegion  _GatherFromSequenceParallelRegion
    _ReduceScatterToSequenceParallelRegion
    _AllGatherFromTensorParallelRegion  _ReduceScatterToTensorParallelRegion
    _AllToAll (forward(ctx, group, input, output_split_sizes, input_split_sizes,
               use_nccl_stream=False); no symbolic, as in Megatron)

They take a live ``group`` (never None) and check nothing else; the functions below check
their input first and are the entry points to prefer. Their names keep Megatron's leading
underscore, so they stay out of ``__all__`` (and out of ``from ... import *``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_group, check_tensor
from mc_groups.comm import traceable
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.utils import _resolve_tp_group

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


def _apply(function: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """``function.apply(*args)`` for functions returning one tensor (torch's is untyped)."""
    out: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return out


# -- tensor-level communication of the TP region (no autograd, one collective each) --


def _own(part: torch.Tensor) -> torch.Tensor:
    """``part`` (a slice of a Function's input) as a tensor of its own, even where the slice
    is contiguous (``.contiguous()`` would return the view: dim 0 of ``[s, b, h]``, a
    batch of one). Under ``torch.compile`` (torch 2.13) the view's gradient replaced the
    Function's backward where Dynamo traced the scatter in a compiled module's pre-hook
    as a graph of its own (AOTAutograd regenerates an output that aliases an input as a
    view of it): the all-gather of the other ranks' grads was lost, with no error."""
    return part.clone(memory_format=torch.contiguous_format)


def _split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous chunk of the last dimension (no communication)."""
    size = group.size()
    if size == 1:
        return x
    _dim_divisible(x, -1, size, "input", "last dimension")
    chunk = x.shape[-1] // size
    return _own(x.narrow(-1, group.rank() * chunk, chunk))


def _split_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's slice of dim 0: equal parts, or ``split_sizes[rank]`` rows."""
    size, rank = group.size(), group.rank()
    if size == 1:
        return x
    sizes = _split_sizes_of(split_sizes, size, "split_sizes")
    if sizes is None:
        _dim_divisible(x, 0, size, "input", "first dimension")
        sizes = [x.shape[0] // size] * size
    _check_total(x, sizes, "split_sizes")
    start = sum(sizes[:rank])
    return _own(x.narrow(0, start, sizes[rank]))


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (one all-gather)."""
    if group.size() == 1:
        return x
    stacked = traceable.all_gather_tensor(x.unsqueeze(0), group, label="tp gather last dim")
    return torch.cat(stacked.unbind(0), dim=-1)


def _gather_first_dim(
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
    sizes = _split_sizes_of(output_split_sizes, size, "output_split_sizes")
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


def _reduce_scatter_first_dim(
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
        else _split_sizes_of(input_split_sizes, size, "input_split_sizes")
    )
    if sizes is None or len(set(sizes)) == 1:
        _dim_divisible(x, 0, size, "input", "first dimension")
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


def _reduce_scatter_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks; rank r keeps chunk r of the last dimension."""
    size = group.size()
    if size == 1:
        return x
    _dim_divisible(x, -1, size, "input", "last dimension")
    stacked = torch.stack(x.chunk(size, dim=-1), dim=0)
    out = traceable.reduce_scatter_tensor(stacked, group, label="tp reduce-scatter last dim")
    return out.view(stacked.shape[1:])


def _all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup, *, inplace: bool = False
) -> torch.Tensor:
    """Sum ``x`` over ranks into a new tensor (``x`` may be saved by autograd elsewhere);
    ``inplace``: into ``x`` itself (eager), for a tensor nothing else holds."""
    if group.size() == 1:
        return x
    return traceable.all_reduce_tensor(x, group, label="tp all-reduce", inplace=inplace)


def _all_to_all_rows(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Exchange dim-0 splits: rank r sends its split j to rank j (one all-to-all)."""
    size = group.size()
    if size == 1:
        return x
    outs = _split_sizes_of(output_split_sizes, size, "output_split_sizes")
    ins = _split_sizes_of(input_split_sizes, size, "input_split_sizes")
    if ins is None:
        _dim_divisible(x, 0, size, "input", "first dimension")
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


def _min_dims(value: torch.Tensor, ndim: int, arg: str) -> None:
    """A ``ValueError`` unless ``value`` has at least ``ndim`` dimensions."""
    if value.dim() < ndim:
        raise InputValueError(
            f"{arg} has shape {tuple(value.shape)}; it needs at least {ndim} dimension(s)"
        )


def _dim_divisible(value: torch.Tensor, dim: int, size: int, arg: str, what: str) -> None:
    """A ``ValueError`` unless ``value.shape[dim]`` is a multiple of ``size``."""
    if value.shape[dim] % size:
        raise InputValueError(
            f"{arg} has shape {tuple(value.shape)}: its {what} (dim {dim}, "
            f"{value.shape[dim]}) is not divisible by the tensor-parallel size {size}; pad "
            "it to a multiple or pass split sizes"
        )


def _split_sizes_of(sizes: object, group_size: int, arg: str) -> list[int] | None:
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


# -- the autograd mappings -----------------------------------------------------------


def _group(group: object, who: str) -> dist.ProcessGroup:
    """``group`` checked where a Function is applied directly (Megatron's callers do)."""
    return check_group("group", group, what=who)


class _CopyToModelParallelRegion(torch.autograd.Function):
    """``f``: identity forward; backward all-reduces (sums) the gradient over ``ctx.group``."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd (Megatron's tracing hook): ``input_`` itself."""
        del graph
        _group(group, "_CopyToModelParallelRegion")
        return input_

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = _group(group, "_CopyToModelParallelRegion")
        return input_

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """``g``: forward all-reduces (sums) over ``group`` into a new tensor (``input_`` is never
    changed, unlike Megatron's in-place reduce); backward is the identity."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd: the sum over ``group``."""
        del graph
        return _all_reduce(input_, _group(group, "_ReduceFromModelParallelRegion"))

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        del ctx
        return _all_reduce(input_, _group(group, "_ReduceFromModelParallelRegion"))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class _ReduceLayerOutput(_ReduceFromModelParallelRegion):
    """``g`` on a row-parallel layer's fresh GEMM output, which nothing else holds (its
    Function saved its input and weight, not its output): reduced in place, as Megatron's
    ``_reduce`` does, which saves a copy per call."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        del ctx
        return _all_reduce(input_, group, inplace=True)


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep chunk ``rank`` of the last dim (no communication); backward all-gathers the
    gradient along the last dim."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd: this rank's chunk of the last dim."""
        del graph
        return _split_last_dim(input_, _group(group, "_ScatterToModelParallelRegion"))

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = _group(group, "_ScatterToModelParallelRegion")
        return _split_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dim in rank order; backward keeps chunk ``rank``."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd: the last-dim concatenation over ``group``."""
        del graph
        return _gather_last_dim(input_, _group(group, "_GatherFromModelParallelRegion"))

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = _group(group, "_GatherFromModelParallelRegion")
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's equal part of dim 0 (no communication); backward all-gathers dim 0."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd: this rank's rows of dim 0."""
        del graph
        return _split_first_dim(input_, _group(group, "_ScatterToSequenceParallelRegion"))

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = _group(group, "_ScatterToSequenceParallelRegion")
        return _split_first_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first_dim(grad_output, ctx.group), None


class _ScatterUnevenToSequenceParallelRegion(torch.autograd.Function):
    """mc's uneven :func:`scatter_to_sequence_parallel_region`: rank r keeps
    ``split_sizes[r]`` rows; backward all-gathers those parts (padded for gloo)."""

    @staticmethod
    def forward(
        ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup, split_sizes: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.split_sizes = group, split_sizes
        return _split_first_dim(input_, group, split_sizes)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_first_dim(grad_output, ctx.group, ctx.split_sizes), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along dim 0 (rank r gives ``output_split_sizes[r]`` rows when given).

    Backward: reduce-scatter the gradient along dim 0 when ``tensor_parallel_output_grad``
    (each rank holds a partial gradient), else keep this rank's rows without communicating.
    ``use_global_buffer`` is recorded for Megatron's callers; mc allocates fresh outputs.
    """

    @staticmethod
    def symbolic(
        graph: object,
        input_: torch.Tensor,
        group: dist.ProcessGroup,
        tensor_parallel_output_grad: bool = True,
        output_split_sizes: Sequence[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        """The forward without autograd: the dim-0 concatenation over ``group``."""
        del graph, tensor_parallel_output_grad, use_global_buffer
        g = _group(group, "_GatherFromSequenceParallelRegion")
        return _gather_first_dim(input_, g, output_split_sizes)

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        group: dist.ProcessGroup,
        tensor_parallel_output_grad: bool = True,
        output_split_sizes: Sequence[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group = _group(group, "_GatherFromSequenceParallelRegion")
        ctx.output_split_sizes = output_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return _gather_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        sizes = ctx.output_split_sizes
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter_first_dim(grad_output, ctx.group, sizes)
        else:
            grad = _split_first_dim(grad_output, ctx.group, sizes)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum over ``group`` and keep this rank's part of dim 0 (equal parts, or
    ``input_split_sizes[r]`` rows); backward all-gathers dim 0."""

    @staticmethod
    def symbolic(
        graph: object,
        input_: torch.Tensor,
        group: dist.ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        """The forward without autograd: this rank's rows of the sum over ``group``."""
        del graph, use_global_buffer
        g = _group(group, "_ReduceScatterToSequenceParallelRegion")
        return _reduce_scatter_first_dim(input_, g, input_split_sizes)

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        group: dist.ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        ctx.group = _group(group, "_ReduceScatterToSequenceParallelRegion")
        ctx.input_split_sizes = input_split_sizes
        ctx.use_global_buffer = use_global_buffer
        return _reduce_scatter_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = _gather_first_dim(grad_output, ctx.group, ctx.input_split_sizes)
        return grad, None, None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dim; backward reduce-scatters (sums) the last dim."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd: the last-dim concatenation over ``group``."""
        del graph
        return _gather_last_dim(input_, _group(group, "_AllGatherFromTensorParallelRegion"))

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = _group(group, "_AllGatherFromTensorParallelRegion")
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_last_dim(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Sum over ``group`` and keep chunk ``rank`` of the last dim; backward all-gathers it."""

    @staticmethod
    def symbolic(graph: object, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The forward without autograd: chunk ``rank`` of the last dim of the sum."""
        del graph
        g = _group(group, "_ReduceScatterToTensorParallelRegion")
        return _reduce_scatter_last_dim(input_, g)

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = _group(group, "_ReduceScatterToTensorParallelRegion")
        return _reduce_scatter_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """Rank r sends split j of dim 0 to rank j; backward runs the reverse exchange (the
    split sizes swap roles) through this Function again, so it is differentiable twice.
    ``use_nccl_stream`` is recorded for Megatron's callers: mc's collective layer decides
    the stream."""

    @staticmethod
    def forward(
        ctx: Any,
        group: dist.ProcessGroup,
        input: torch.Tensor,  # Megatron's parameter name
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
        use_nccl_stream: bool = False,
    ) -> torch.Tensor:
        ctx.group = _group(group, "_AllToAll")
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        ctx.use_nccl_stream = use_nccl_stream
        return _all_to_all_rows(input, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(
        ctx: Any, *grad_output: torch.Tensor
    ) -> tuple[None, torch.Tensor, None, None, None]:
        grad = _apply(
            _AllToAll,
            ctx.group,
            *grad_output,
            ctx.input_split_sizes,
            ctx.output_split_sizes,
            ctx.use_nccl_stream,
        )
        return None, grad, None, None, None


def _tp_region(
    x: torch.Tensor, g: dist.ProcessGroup, function: type[torch.autograd.Function]
) -> torch.Tensor:
    """``function`` applied to ``x`` over ``g``; a group of one rank is the identity (no
    autograd node, nothing communicated)."""
    if g.size() == 1:
        return x
    return _apply(function, x, g)


def _prepare(
    input_: object, group: dist.ProcessGroup | None, what: str, min_ndim: int = 1
) -> tuple[torch.Tensor, dist.ProcessGroup]:
    x = check_tensor("input_", input_)
    _min_dims(x, min_ndim, "input_")
    return x, _resolve_tp_group(group, None, what=what)


def _sizes(sizes: Sequence[int] | None, group: dist.ProcessGroup, arg: str) -> list[int] | None:
    return _split_sizes_of(sizes, group.size(), arg)


def copy_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``f``: identity forward; backward all-reduces (sums) the gradient over ``group``."""
    x, g = _prepare(input_, group, "copy_to_tensor_model_parallel_region")
    return _tp_region(x, g, _CopyToModelParallelRegion)


def reduce_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``g``: forward all-reduces (sums) over ``group`` into a new tensor; backward identity."""
    x, g = _prepare(input_, group, "reduce_from_tensor_model_parallel_region")
    return _tp_region(x, g, _ReduceFromModelParallelRegion)


def _reduce_layer_output(output: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`reduce_from_tensor_model_parallel_region` of a layer's own GEMM output over
    its checked TP group, summed in place (see :class:`_ReduceLayerOutput`)."""
    return _tp_region(output, group, _ReduceLayerOutput)


def _reduce_scatter_layer_output(output: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`reduce_scatter_to_sequence_parallel_region` of a layer's own output over its
    checked TP group (its sequence checked divisible by the group's size)."""
    return _tp_region(output, group, _ReduceScatterToSequenceParallelRegion)


def scatter_to_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Keep chunk ``rank`` of the last dim (no communication); backward all-gathers it."""
    x, g = _prepare(input_, group, "scatter_to_tensor_model_parallel_region")
    _dim_divisible(x, -1, g.size(), "input_", "last dimension")
    return _tp_region(x, g, _ScatterToModelParallelRegion)


def gather_from_tensor_model_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along the last dim (rank order); backward keeps chunk ``rank``."""
    x, g = _prepare(input_, group, "gather_from_tensor_model_parallel_region")
    return _tp_region(x, g, _GatherFromModelParallelRegion)


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
        _dim_divisible(x, 0, g.size(), "input_", "sequence length")
    elif sum(sizes) != x.shape[0]:
        raise InputValueError(
            f"split_sizes={sizes} sum to {sum(sizes)} but input_ has shape {tuple(x.shape)}; "
            "they must add up to dim 0"
        )
    if g.size() == 1:
        return x
    if sizes is None:
        return _apply(_ScatterToSequenceParallelRegion, x, g)
    return _apply(_ScatterUnevenToSequenceParallelRegion, x, g, sizes)


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
    return _apply(
        _GatherFromSequenceParallelRegion,
        x,
        g,
        tensor_parallel_output_grad,
        sizes,
        use_global_buffer,
    )


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
        _dim_divisible(x, 0, g.size(), "input_", "sequence length")
    elif sum(sizes) != x.shape[0]:
        raise InputValueError(
            f"input_split_sizes={sizes} sum to {sum(sizes)} but input_ has shape "
            f"{tuple(x.shape)}; they must add up to dim 0"
        )
    if g.size() == 1:
        return x
    return _apply(_ReduceScatterToSequenceParallelRegion, x, g, sizes, use_global_buffer)


def all_gather_last_dim_from_tensor_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along the last dim; backward reduce-scatters (sums) the last dim."""
    x, g = _prepare(input_, group, "all_gather_last_dim_from_tensor_parallel_region")
    return _tp_region(x, g, _AllGatherFromTensorParallelRegion)


def reduce_scatter_last_dim_to_tensor_parallel_region(
    input_: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum over ``group`` and keep chunk ``rank`` of the last dim; backward all-gathers."""
    x, g = _prepare(input_, group, "reduce_scatter_last_dim_to_tensor_parallel_region")
    _dim_divisible(x, -1, g.size(), "input_", "last dimension")
    return _tp_region(x, g, _ReduceScatterToTensorParallelRegion)


def all_to_all(
    group: dist.ProcessGroup | None,
    input_: torch.Tensor,
    output_split_sizes_: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    use_nccl_stream: bool = False,
) -> torch.Tensor:
    """Rank r sends split j of dim 0 to rank j and receives split r of every rank.

    Without split sizes dim 0 is split evenly. Backward runs the reverse exchange (the
    split sizes swap roles). ``use_nccl_stream`` is accepted for Megatron compatibility
    (mc's collective layer picks the stream).
    """
    check_flag("use_nccl_stream", use_nccl_stream)
    x, g = _prepare(input_, group, "all_to_all")
    outs = _sizes(output_split_sizes_, g, "output_split_sizes_")
    ins = _sizes(input_split_sizes, g, "input_split_sizes")
    if ins is None:
        _dim_divisible(x, 0, g.size(), "input_", "first dimension")
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
    return _apply(_AllToAll, g, x, outs, ins, use_nccl_stream)


def all_to_all_sp2hp(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[tokens/W, H]`` (sequence-split) → ``[tokens, H/W]`` (hidden-split).

    The input is viewed as 2-D ``[-1, H]``; chunk j of the hidden dim goes to rank j, and
    rank r's result stacks every rank's chunk r in rank order.
    """
    x, g = _prepare(input_, group, "all_to_all_sp2hp", min_ndim=2)
    size = g.size()
    if size == 1:
        return x
    _dim_divisible(x, -1, size, "input_", "hidden dimension")
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
    _dim_divisible(flat, 0, size, "input_", "token count")
    exchanged = all_to_all(g, flat)
    return torch.cat(torch.split(exchanged, exchanged.shape[0] // size, dim=0), dim=-1)
