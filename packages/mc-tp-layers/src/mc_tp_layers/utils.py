"""Small helpers with Megatron-Core's names (``core.tensor_parallel.utils``)."""

from __future__ import annotations

import torch

__all__ = ["VocabUtility", "divide", "split_tensor_along_last_dim"]


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``; a ``ValueError`` when it does not divide evenly."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal chunks of its last dimension."""
    last = tensor.shape[-1]
    size = divide(last, num_partitions)
    chunks = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


class VocabUtility:
    """Vocabulary ranges ``[first, last)`` owned by a tensor-parallel rank.

    The vocabulary is split into ``world_size`` contiguous, equal ranges (rank r owns
    ``[r·V/W, (r+1)·V/W)``).
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """``[rank·p, (rank+1)·p)`` for a partition size ``p``."""
        del world_size  # kept for Megatron's signature
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """The range of ``rank`` when ``global_vocab_size`` is split over ``world_size``."""
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
