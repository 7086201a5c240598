"""Test parallel code on CPU: run a function on N ranks of a real gloo world.

::

    from mc_groups.testing import RankPool

    def _sum_of_ranks() -> float:          # module level: ranks import it by name
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    with RankPool(2) as pool:
        assert pool.run(_sum_of_ranks) == [1.0, 1.0]

In pytest, the ``rank_pools`` fixture (installed with mc-groups as a plugin) keeps one pool
per world size for the whole session: ``rank_pools.get(4).run(fn, ...)``.

The pool pays process start-up (an interpreter importing torch per rank) once; each rank
runs with one torch thread, a short process-group timeout bounds every collective, every
call has a deadline, and a failing or hung rank fails the call with its traceback or its
name instead of hanging the suite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mc_groups.argcheck import check_int
from mc_groups.errors import InputStateError, InputTypeError, InputValueError
from mc_groups.testing._pool import (
    RankFailure,
    RankOutcome,
    RankPool,
    RankTimeout,
    check_preload,
    check_times,
)

__all__ = [
    "RankFailure",
    "RankOutcome",
    "RankPool",
    "RankPools",
    "RankTimeout",
    "error_kind",
    "gpu_skip_reason",
]


def gpu_skip_reason(count: int) -> str | None:
    """``None`` when ``count`` CUDA devices are visible, else the reason to skip."""
    check_int("count", count)
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available >= count:
        return None
    return (
        f"needs {count} CUDA device(s), found {available} (no GPU on this machine)"
        if available == 0
        else f"needs {count} CUDA device(s), found {available}"
    )


class RankPools:
    """One lazily started :class:`RankPool` per (world size, backend); close them together.

    ``preload`` is every pool's :class:`RankPool` ``preload``: modules the fork server imports
    once, so that the ranks of every world size (and every pool restarted after a failure)
    start with them instead of importing them each (the ``rank_pools`` fixture takes them
    from the ``mc_rank_pool_preload`` ini option)."""

    def __init__(
        self,
        *,
        pg_timeout_s: float = 20.0,
        call_deadline_s: float = 120.0,
        failure_grace_s: float = 2.0,
        preload: Sequence[str] = (),
    ) -> None:
        check_times(pg_timeout_s, call_deadline_s, failure_grace_s=failure_grace_s)
        self._preload = check_preload(preload)
        self._pg_timeout_s = pg_timeout_s
        self._call_deadline_s = call_deadline_s
        self._failure_grace_s = failure_grace_s
        self._pools: dict[tuple[int, str], RankPool] = {}

    def get(self, world_size: int, backend: str = "gloo") -> RankPool:
        """The pool for ``world_size`` ranks on ``backend`` (created on first use)."""
        key = (world_size, backend)
        if key not in self._pools:
            self._pools[key] = RankPool(
                world_size,
                backend=backend,
                pg_timeout_s=self._pg_timeout_s,
                call_deadline_s=self._call_deadline_s,
                failure_grace_s=self._failure_grace_s,
                preload=self._preload,
            )
        return self._pools[key]

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def error_kind(err: BaseException) -> str:
    """An error's type as tests and catalogues name it: mc's generic bad-input types are
    reported as the built-in they extend (``InputValueError`` → ``ValueError``; each is also
    an ``AssertionError``), every other error, named ones included, by its own name."""
    generic = (InputValueError, InputTypeError, InputStateError)
    return next(c.__name__ for c in type(err).__mro__ if c not in generic)
