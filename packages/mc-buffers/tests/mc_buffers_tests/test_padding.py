"""Padding arithmetic against hand-computed multiples.

Exact integer arithmetic: no tolerance. Each expectation is worked out in its comment.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mc_buffers import bucket_end_divisor, pad_bucket_end, pad_param_start, pad_to_divisor


@pytest.mark.parametrize(
    ("n", "d", "expected"),
    [(0, 7, 0), (1, 7, 7), (7, 7, 7), (8, 7, 14), (9025, 64, 9088), (18113, 128, 18176)],
)
def test_pad_to_divisor(n: int, d: int, expected: int) -> None:
    # 9025 = 141·64 + 1 -> 142·64 = 9088; 18113 = 141·128 + 65 -> 142·128 = 18176
    assert pad_to_divisor(n, d) == expected


def test_pad_param_start_is_next_multiple_of_64() -> None:
    assert [pad_param_start(n) for n in (0, 1, 63, 64, 65, 128)] == [0, 64, 64, 64, 128, 128]


@pytest.mark.parametrize(
    ("dp", "busbw", "divisor"),
    [
        (1, False, 128),
        (2, False, 128),
        (8, False, 128),
        (3, False, 384),  # lcm(3, 128) = 3·128
        (6, False, 384),  # lcm(2·3, 2**7) = 3·2**7
        (512, False, 512),
        (1, True, 65536),  # lcm(1, 128, 2**16) = 2**16
        (3, True, 196608),  # 3·2**16
        (2**17, True, 2**17),
    ],
)
def test_bucket_end_divisor(dp: int, busbw: bool, divisor: int) -> None:
    assert bucket_end_divisor(dp, busbw) == divisor
    assert pad_bucket_end(1, dp, busbw) == divisor
    assert pad_bucket_end(divisor, dp, busbw) == divisor
    assert pad_bucket_end(divisor + 1, dp, busbw) == 2 * divisor


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda: pad_to_divisor(5, 0), ValueError, "d=0"),
        (lambda: pad_to_divisor(-1, 4), ValueError, "n=-1"),
        (lambda: pad_to_divisor(5, True), TypeError, "d=True"),
        (lambda: pad_bucket_end(5, 0, False), ValueError, "data_parallel_size=0"),
        (lambda: bucket_end_divisor(2.0, False), TypeError, "data_parallel_size=2.0"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_name_themselves(
    call: Callable[[], object], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        call()
