"""Small helpers with Megatron-Core's names (``core.tensor_parallel.utils``)."""

from __future__ import annotations

import torch

from mc_groups.argcheck import check_flag, check_int, check_tensor
from mc_groups.errors import InputValueError

__all__ = ["VocabUtility", "divide", "split_tensor_along_last_dim"]


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
