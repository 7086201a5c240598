"""Conformance with Megatron-LM's ``tests/unit_tests/tensor_parallel/test_tensor_parallel_utils.py``.

``split_tensor_into_1d_equal_chunks`` and ``gather_split_1d_tensor``
(``test_split_tensor_into_1d_equal_chunks``, ``test_gather_split_1d_tensor``) are held by
``test_mapping_functions.py::test_1d_split_and_gather`` (TP = 2 inside a world of 4, the
default collection's group and an explicit one).
"""  # noqa: E501

from __future__ import annotations

import pytest
import torch

from mc_tp_layers.utils import VocabUtility, split_tensor_along_last_dim


def test_split_tensor_along_last_dim() -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_tensor_parallel_utils.py::test_split_tensor_along_last_dim``.

    A ``[3, 4]`` tensor split in 2 gives columns 0-1 and 2-3 (views unless
    ``contiguous_split_chunks``, then contiguous copies with the same values).
    """  # noqa: E501
    t = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    first, second = split_tensor_along_last_dim(t, 2)
    assert torch.equal(first, t[:, 0:2])
    assert torch.equal(second, t[:, 2:4])
    assert first.data_ptr() == t.data_ptr()  # a view
    chunks = split_tensor_along_last_dim(t, 2, contiguous_split_chunks=True)
    assert all(c.is_contiguous() for c in chunks)
    assert torch.equal(torch.cat(chunks, dim=-1), t)
    with pytest.raises(ValueError, match="4 is not divisible by 3"):
        split_tensor_along_last_dim(t, 3)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_vocab(world_size: int) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_tensor_parallel_utils.py::test_vocab``.

    Upstream checks its own rank of the launch's world size; here every rank of worlds 1,
    2, 4 and 8: rank r of W owns ``[r·1600/W, (r+1)·1600/W)`` of a 1600-entry vocabulary,
    from the per-partition size and from the global size alike.
    """
    per_partition = 1600 // world_size
    for rank in range(world_size):
        expected = (rank * per_partition, (rank + 1) * per_partition)
        assert (
            VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
            == expected
        )
        assert VocabUtility.vocab_range_from_global_vocab_size(1600, rank, world_size) == (expected)
