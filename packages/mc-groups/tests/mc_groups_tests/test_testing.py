"""The public harness: results in rank order, reuse, and every failure mode bounded."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mc_groups import testing
from mc_groups.testing import (
    RankFailure,
    RankPool,
    RankPools,
    RankTimeout,
    _pool,  # the package's own private helper
    gpu_skip_reason,
)


def _rank_pid_threads(x: int) -> tuple[int, int, int, int]:
    return dist.get_rank(), os.getpid(), torch.get_num_threads(), x * 10


def test_results_in_rank_order_and_workers_reused(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    first = pool.run(_rank_pid_threads, 1)
    second = pool.run(_rank_pid_threads, 2)
    assert [r[0] for r in first] == [0, 1]
    assert [r[3] for r in second] == [20, 20]
    assert [r[1] for r in first] == [r[1] for r in second]  # same processes
    assert all(r[2] == 1 for r in first)  # one torch thread per rank


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise KeyError("only rank one")
    return 5


def test_a_raising_rank_fails_the_call_with_its_traceback(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on_rank_one)
    assert info.value.failed_ranks() == [1]
    assert "rank 1" in str(info.value)
    assert "KeyError: 'only rank one'" in str(info.value)
    assert info.value.outcomes[0].result == 5
    assert [r[0] for r in pool.run(_rank_pid_threads, 0)] == [0, 1]  # usable again


def _block_in_collective_unless_rank_one() -> int:
    if dist.get_rank() == 1:
        raise RuntimeError("rank one gives up")
    t = torch.ones(1)
    dist.all_reduce(t)  # waits for rank 1, which never joins
    return 0


def test_peers_blocked_on_a_failed_rank_are_not_left_hung(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_block_in_collective_unless_rank_one)
    assert time.monotonic() - started < pool.failure_grace_s + 10
    assert 1 in info.value.failed_ranks()
    assert pool.run(_rank_pid_threads, 3)[1][3] == 30


def _sleep_on_rank_zero(seconds: float) -> int:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def test_a_hung_rank_is_named_within_the_deadline(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    started = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run_with_deadline(2.0, _sleep_on_rank_zero, 60.0)
    assert time.monotonic() - started < 10
    assert info.value.failed_ranks() == [0]
    assert "rank(s) [0]" in str(info.value)
    assert info.value.outcomes[1].result == 1


def _exit_on_rank_zero() -> int:
    if dist.get_rank() == 0:
        os._exit(7)
    return 1


def test_a_dying_rank_is_reported_with_its_exit_code(rank_pools: RankPools) -> None:
    with pytest.raises(RankFailure) as info:
        rank_pools.get(2).run(_exit_on_rank_zero)
    assert "exit code 7" in info.value.outcomes[0].error


def _env_probe() -> tuple[str | None, str | None, str | None]:
    return (
        os.environ.get("MC_TEST_SET_LATER"),
        os.environ.get("MC_TEST_REMOVED"),
        os.environ.get("MC_TEST_POOL_ONLY"),
    )


def test_ranks_take_the_environment_of_the_parent_when_the_pool_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks are forked from a fork server started once per process, with the environment
    the parent had then; a spawned rank inherits the parent's environment of the moment,
    and the harness keeps that meaning: a variable set since is seen, one removed since is
    not (when this test is the one that started the server), the pool's ``env`` on top."""
    monkeypatch.setenv("MC_TEST_REMOVED", "old")
    with RankPool(2) as pool:  # the fork server is up from here on
        assert pool.run(_env_probe) == [(None, "old", None)] * 2
    monkeypatch.delenv("MC_TEST_REMOVED")
    monkeypatch.setenv("MC_TEST_SET_LATER", "new")
    with RankPool(2, env={"MC_TEST_POOL_ONLY": "pool"}) as pool:
        assert pool.run(_env_probe) == [("new", None, "pool")] * 2
    assert "MC_TEST_POOL_ONLY" not in os.environ


@pytest.mark.parametrize(("platform", "method"), [("linux", "forkserver"), ("darwin", "spawn")])
def test_ranks_fork_from_the_fork_server_on_linux_only(
    platform: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forking is unsafe where system libraries that torch loads start threads (macOS: the
    reason Python made spawn its default there); Linux forks from the fork server."""
    monkeypatch.setattr(sys, "platform", platform)
    assert _pool._context().get_start_method() == method


def test_every_pool_of_a_session_takes_its_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RankPools(preload=)`` (the ``rank_pools`` fixture's ``mc_rank_pool_preload``) reaches
    the pool of every world size: whichever starts the fork server, it preloads them."""
    made: list[tuple[int, object]] = []

    class Recorder:
        def __init__(self, world_size: int, **kwargs: object) -> None:
            made.append((world_size, kwargs["preload"]))

    monkeypatch.setattr(testing, "RankPool", Recorder)
    pools = RankPools(preload=["json", "transformers"])
    assert isinstance(pools.get(2), Recorder)
    pools.get(4)
    pools.get(2)  # the same pool: not built again
    assert made == [(2, ("json", "transformers")), (4, ("json", "transformers"))]


def test_the_session_preload_is_the_ini_option(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.getini("mc_rank_pool_preload") == [
        "transformers.models.llama.modeling_llama",
        "torch._inductor.compile_fx",
    ]


def test_functions_must_be_importable(rank_pools: RankPools) -> None:
    with pytest.raises(TypeError, match="module-level"):
        rank_pools.get(2).run(lambda: 1)


def test_gpu_skip_reason_names_the_count() -> None:
    reason = gpu_skip_reason(10_000)
    assert reason is not None
    assert "10000" in reason
