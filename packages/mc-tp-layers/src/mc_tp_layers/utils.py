"""Small helpers with Megatron-Core's names (``core.tensor_parallel.utils``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag, check_int, check_tensor
from mc_groups.errors import InputValueError
from mc_tp_layers import _comm
from mc_tp_layers._tp_groups import resolve_tp_group

__all__ = [
    "VocabUtility",
    "divide",
    "gather_split_1d_tensor",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``; a ``ValueError`` when it does not divide evenly.

    ``numerator`` must be an int >= 0 and ``denominator`` an int >= 1 (``TypeError`` for
    other types, bools included).
    """
    check_int("numerator", numerator, minimum=0)
    check_int("denominator", denominator)
    if numerator % denominator:
        raise InputValueError(
            f"{numerator} is not divisible by {denominator} (numerator={numerator}, "
            f"denominator={denominator})"
        )
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal chunks of its last dimension."""
    check_tensor("tensor", tensor)
    if tensor.dim() < 1:
        raise InputValueError("tensor is 0-D; it needs a last dimension to split")
    check_int("num_partitions", num_partitions)
    check_flag("contiguous_split_chunks", contiguous_split_chunks)
    last = tensor.shape[-1]
    if last % num_partitions:
        raise InputValueError(
            f"{last} is not divisible by {num_partitions}: the last dimension of the tensor "
            f"(shape {tuple(tensor.shape)}) does not split into num_partitions="
            f"{num_partitions} equal chunks"
        )
    size = last // num_partitions
    chunks = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This tensor-parallel rank's equal 1-D part of ``tensor`` (no communication).

    With W ranks in ``tp_group`` and n = ``tensor.numel()``, rank r gets the flat elements
    ``[r·n/W, (r+1)·n/W)``: a view of ``tensor`` (which must then be contiguous), or with
    ``new_buffer`` a fresh copy on ``tensor``'s device. :func:`gather_split_1d_tensor`
    undoes it. ``tp_group=None`` uses the default collection's ``tp`` group.

    n must divide by W (``ValueError``): Megatron floors n/W, and the gather of such parts
    silently drops the last ``n mod W`` elements.
    """
    x = check_tensor("tensor", tensor)
    check_flag("new_buffer", new_buffer)
    group = resolve_tp_group(tp_group, None, what="split_tensor_into_1d_equal_chunks")
    size, numel = group.size(), x.numel()
    if numel % size:
        raise InputValueError(
            f"tensor has {numel} elements (shape {tuple(x.shape)}), which do not split into "
            f"{size} equal parts over tp_group's {size} ranks; pad it to a multiple of {size}"
        )
    if not new_buffer and not x.is_contiguous():
        raise InputValueError(
            f"tensor (shape {tuple(x.shape)}, strides {x.stride()}) is not contiguous, so no "
            "1-D view of it exists; pass new_buffer=True (a copy) or tensor.contiguous()"
        )
    part = numel // size
    flat = x.reshape(-1).narrow(0, group.rank() * part, part)
    return flat.clone() if new_buffer else flat


def gather_split_1d_tensor(
    tensor: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every tensor-parallel rank's ``tensor`` flattened and concatenated in rank order: a
    new 1-D tensor of ``W · tensor.numel()`` elements (one all-gather over ``tp_group``).

    The inverse of :func:`split_tensor_into_1d_equal_chunks` (``view`` the result with the
    original shape); every rank must pass the same number of elements. ``tp_group=None``
    uses the default collection's ``tp`` group.
    """
    x = check_tensor("tensor", tensor)
    group = resolve_tp_group(tp_group, None, what="gather_split_1d_tensor")
    flat = x.reshape(-1)
    if group.size() == 1:
        return flat.clone()
    return _comm.gather_first_dim(flat, group)


def _check_rank(rank: object, world_size: object) -> None:
    size = check_int("world_size", world_size)
    if check_int("rank", rank, minimum=0) >= size:
        raise InputValueError(f"rank={rank} must be < world_size={size}")


class VocabUtility:
    """Vocabulary ranges ``[first, last)`` owned by a tensor-parallel rank.

    The vocabulary is split into ``world_size`` contiguous, equal ranges (rank r owns
    ``[r·V/W, (r+1)·V/W)``).
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """``[rank·p, (rank+1)·p)`` for a partition size ``p`` (``rank`` in
        ``[0, world_size)``)."""
        check_int("per_partition_vocab_size", per_partition_vocab_size)
        _check_rank(rank, world_size)
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """The range of ``rank`` when ``global_vocab_size`` is split over ``world_size``."""
        check_int("global_vocab_size", global_vocab_size)
        _check_rank(rank, world_size)
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
