"""``mc_groups.elastic.attempt_store``: every restart attempt on one shared store agrees on
a number no earlier attempt had, whatever the earlier attempts left in the store.

Localizes the agreement without torchrun or processes: the ranks of an attempt are threads
on one in-process ``HashStore`` (torchrun's shared TCP store has the same operations).
The cases are the ways a restart meets stale keys: a clean second attempt; followers of
the new attempt that start before its rank 0 and read the dead attempt's ``latest``; an
attempt whose rank 0 died before answering anyone. Independent reference: the attempt
numbers are the count of rank-0 arrivals (1, 2, 3, ...), and keys written through one
attempt's prefix are invisible through another's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed import HashStore, PrefixStore, Store  # type: ignore[attr-defined]

from mc_groups.elastic import ATTEMPT_PREFIX, attempt_store

TIMEOUT = timedelta(seconds=10)


def _attempt(
    store: Store, world_size: int, delay_rank0_s: float = 0.0
) -> list[tuple[PrefixStore, int]]:
    """One attempt: ``world_size`` threads join; rank 0 optionally starts late."""

    def join(rank: int) -> tuple[PrefixStore, int]:
        if rank == 0:
            time.sleep(delay_rank0_s)
        return attempt_store(store, rank, world_size, TIMEOUT)

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(join, range(world_size)))


def test_each_attempt_gets_its_own_number_and_key_space() -> None:
    store = HashStore()
    first = _attempt(store, 3)
    assert [a for _, a in first] == [1, 1, 1]
    first[1][0].set("gloo/rank_1", "dead address")
    # The next attempt's followers start first and read attempt 1's "latest".
    second = _attempt(store, 3, delay_rank0_s=0.3)
    assert [a for _, a in second] == [2, 2, 2]
    assert not second[0][0].check(["gloo/rank_1"])  # attempt 1's keys are not seen
    second[2][0].set("gloo/rank_1", "live address")
    assert first[0][0].get("gloo/rank_1") == b"dead address"
    assert second[0][0].get("gloo/rank_1") == b"live address"


def test_a_rank_0_that_died_before_answering_is_passed_over() -> None:
    store = HashStore()
    root = PrefixStore(ATTEMPT_PREFIX, store)
    # Attempt 1's rank 0 drew its number and published it, then died.
    assert root.add("gen", 1) == 1
    root.set("latest", "1")
    follower_ready = threading.Event()

    def follower() -> int:
        follower_ready.set()
        return attempt_store(store, 1, 2, TIMEOUT)[1]

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(follower)
        follower_ready.wait()
        time.sleep(0.2)  # the follower greets the dead rank 0 first
        assert attempt_store(store, 0, 2, TIMEOUT)[1] == 2
        assert result.result(timeout=10) == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: attempt_store(s, 2, 2, TIMEOUT), "rank=2 must be an int in [0, 2)"),
        (lambda s: attempt_store(s, 0, 0, TIMEOUT), "world_size=0 must be an int >= 1"),
        (
            lambda s: attempt_store(s, 0, 1, 5),  # type: ignore[arg-type]
            "timeout=5 must be a positive datetime",
        ),
    ],
)
def test_bad_arguments_are_named(call: Callable[[Store], object], message: str) -> None:
    with pytest.raises(
        (ValueError, TypeError), match=message.replace("[", r"\[").replace(")", r"\)")
    ):
        call(HashStore())


def test_a_missing_peer_times_out_naming_it() -> None:
    with pytest.raises(TimeoutError, match="rank 1 of attempt 1 did not join"):
        attempt_store(HashStore(), 0, 2, timedelta(seconds=0.2))
