"""Padding arithmetic of the distributed-optimizer layout (element counts, not bytes).

Two rules, both from Megatron-Core's ``_ParamAndGradBuffer``:

- every param starts on a multiple of 64 elements: 64 elements of a >= 16-bit dtype are
  128 bytes, the alignment cuBLAS/TE kernels want for the param and grad views;
- every bucket ends on a multiple of ``lcm(dp, 128)`` so that it splits into ``dp`` equal
  shards (one per data-parallel rank for the reduce-scatter / all-gather) whose starts are
  256-byte aligned; with ``pad_for_high_nccl_busbw`` also on a multiple of ``2**16``,
  because NCCL's ring bus bandwidth drops when the per-rank message is not a large power
  of two.
"""

from __future__ import annotations

import math

from mc_groups.argcheck import check_flag, check_int

__all__ = [
    "PARAM_START_ALIGNMENT",
    "bucket_end_divisor",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
]

PARAM_START_ALIGNMENT = 64
"""Elements a param start is aligned to in the distributed-optimizer layout."""

_BUCKET_ALIGNMENT = 128
_HIGH_BUSBW_ALIGNMENT = 2**16


def pad_to_divisor(n: int, d: int) -> int:
    """Smallest multiple of ``d`` that is ``>= n``: ``ceil(n / d) · d`` (exact integers)."""
    n = check_int("n", n, minimum=0)
    d = check_int("d", d)
    return -(-n // d) * d


def pad_param_start(n: int) -> int:
    """Next multiple of 64 elements at or after ``n`` (where a param may start)."""
    return pad_to_divisor(n, PARAM_START_ALIGNMENT)


def bucket_end_divisor(data_parallel_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """``lcm(dp, 128)``, or ``lcm(dp, 128, 2**16)`` with ``pad_for_high_nccl_busbw``."""
    dp = check_int("data_parallel_size", data_parallel_size)
    check_flag("pad_for_high_nccl_busbw", pad_for_high_nccl_busbw)
    if pad_for_high_nccl_busbw:
        return math.lcm(dp, _BUCKET_ALIGNMENT, _HIGH_BUSBW_ALIGNMENT)
    return math.lcm(dp, _BUCKET_ALIGNMENT)


def pad_bucket_end(n: int, data_parallel_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """Next multiple of :func:`bucket_end_divisor` at or after ``n`` (where a bucket ends)."""
    return pad_to_divisor(n, bucket_end_divisor(data_parallel_size, pad_for_high_nccl_busbw))
