"""The schedules' arithmetic and the loss helpers, without a world: what ``check_schedule``
refuses (each message names the fix), the chunk-forwards each schedule keeps in flight
(derived by hand from torch 2.13's warm-up counts; the pipeline tests measure the same
numbers on running schedules), the ``InFlight`` counter, and the per-token losses against
``F.cross_entropy``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mc_groups.errors import InputTypeError, InputValueError
from mc_train import (
    IGNORE_INDEX,
    InFlight,
    causal_targets,
    check_schedule,
    in_flight_forwards,
    token_cross_entropy,
)


@pytest.mark.parametrize(
    ("schedule", "pp", "chunks", "m", "needle"),
    [
        ("zbv", 2, 2, 4, "(ScheduleZBVZeroBubble) is not offered: it splits each backward"),
        ("DualPipeV", 2, 2, 4, "(ScheduleDualPipeV) is not offered"),
        ("interleaved_zero_bubble", 2, 2, 4, "(ScheduleInterleavedZeroBubble) is not offered"),
        ("looped_bfs", 2, 1, 4, "is not one of 1f1b, gpipe, interleaved"),
        ("gpipe", 1, 1, 4, "needs pp >= 2 pipeline ranks (got pp=1); use '1f1b'"),
        ("1f1b", 4, 1, 2, "microbatches=2 < pp=4: the 1f1b schedule fills every stage"),
        ("interleaved", 2, 2, 3, "microbatches=3 is not a multiple of pp=2"),
        ("interleaved", 2, 1, 4, "runs several chunks per rank (got 1)"),
        ("gpipe", 2, 2, 4, "schedule='gpipe' runs one chunk per rank (got 2)"),
    ],
)
def test_check_schedule_refuses_with_the_fix(
    schedule: str, pp: int, chunks: int, m: int, needle: str
) -> None:
    with pytest.raises(InputValueError) as err:
        check_schedule(schedule, pp=pp, chunks=chunks, microbatches=m)
    assert needle in str(err.value), str(err.value)


def test_check_schedule_accepts_what_runs() -> None:
    check_schedule("gpipe", pp=4, chunks=1, microbatches=1)  # GPipe needs no full pipeline
    check_schedule("1f1b", pp=2, chunks=1, microbatches=2)
    check_schedule("1f1b", pp=1, chunks=1, microbatches=3)  # no pipeline: one stage
    check_schedule("interleaved", pp=2, chunks=3, microbatches=6)
    with pytest.raises(InputTypeError, match=r"microbatches=2\.0 must be an int"):
        check_schedule("1f1b", pp=2, chunks=1, microbatches=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schedule", "vpp", "expected"),
    [
        ("gpipe", 1, [8, 8, 8, 8]),
        ("1f1b", 1, [4, 3, 2, 1]),
        # 2·(P − p − 1) + (V − 1)·P + 1 chunk-forwards, at most M·V = 16
        ("interleaved", 2, [11, 9, 7, 5]),
    ],
)
def test_in_flight_forwards_by_hand(schedule: str, vpp: int, expected: list[int]) -> None:
    assert [in_flight_forwards(schedule, p, 4, 8, vpp) for p in range(4)] == expected
    assert in_flight_forwards("1f1b", 0, 4, 2, 1) == 2  # fewer micro-batches than stages
    assert in_flight_forwards("1f1b", 0, 1, 8, 1) == 1  # no pipeline


def test_in_flight_counter_keeps_the_peak() -> None:
    count = InFlight()
    for event in "FFBFFBBB":
        count.forward() if event == "F" else count.backward()
    assert (count.now, count.peak) == (0, 3)
    count.reset()
    assert (count.now, count.peak) == (0, 0)


def test_causal_targets_shift_by_one() -> None:
    ids = torch.tensor([[5, 6, 7], [1, 2, 3]])
    assert causal_targets(ids).tolist() == [[6, 7, IGNORE_INDEX], [2, 3, IGNORE_INDEX]]


@pytest.mark.parametrize("sequence_first", [False, True])
def test_token_cross_entropy_is_per_token(sequence_first: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    target = torch.randint(0, 7, (2, 5), generator=gen)
    target[1, 3] = IGNORE_INDEX
    loss = token_cross_entropy(sequence_first=sequence_first)
    given = logits.transpose(0, 1) if sequence_first else logits
    got = loss(given, target)
    want = F.cross_entropy(logits.reshape(10, 7), target.reshape(10), reduction="none")
    assert got.shape == target.shape
    assert torch.equal(got.reshape(10), want)
    assert got[1, 3] == 0
    with pytest.raises(InputValueError, match="do not match"):
        loss(given[:, :4] if not sequence_first else given[:4], target)
