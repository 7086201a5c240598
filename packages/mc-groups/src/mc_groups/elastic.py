"""Join the world once per restart attempt: every attempt gets a key space of its own.

Why: since torch 2.5, torchrun's c10d rendezvous shares its TCP store with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; ``MASTER_ADDR:MASTER_PORT`` is the agent's store,
which lives as long as the agent). ``init_process_group("env://")`` connects to it without
any per-attempt prefix, so after ``--max-restarts`` restarts the group, the new workers
find the failed attempt's keys: gloo reads the dead peers' addresses (``connectFullMesh
failed ... Connection refused``), NCCL a stale unique id, and store-based barriers count
the old arrivals (pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids
it with a fresh store per attempt; schedulers rarely let users set it.

``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own restarts,
and an agent that restarts its workers because another node re-joined (a membership change)
does not count it, so nodes disagree. What every worker of one attempt can agree on is a
number drawn from the store itself; :func:`attempt_store` draws it (the schedule below)
and returns the store under the prefix ``mc/attempt/<g>/``, from which the process group
takes all its keys.

The schedule (``n`` ranks; every key under ``mc/attempt/``):

1. rank 0: ``g = add("gen", 1)`` (a number no earlier attempt had), ``set("latest", g)``;
2. rank r > 0: reads ``latest`` (maybe a dead attempt's), writes a fresh random token to
   ``<g>/hello/<r>`` and polls ``<g>/ok/<r>`` until it holds that token, re-reading
   ``latest`` meanwhile: a stale ``g`` belongs to a dead rank 0 that never answers, and the
   live rank 0's ``latest`` replaces it;
3. rank 0 waits for each ``<g>/hello/<r>`` (a key no earlier attempt wrote, so only live
   ranks write it) and copies its token to ``<g>/ok/<r>``.

It needs only what torchrun guarantees: every worker of the failed attempt is stopped
before any worker of the next one starts. Cost: 3 store round trips per rank at start-up
(rank 0: 3 per peer), nothing afterwards.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, rendezvous  # type: ignore[attr-defined]

from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["ATTEMPT_PREFIX", "JOIN_TIMEOUT", "attempt_store", "init_process_group"]

ATTEMPT_PREFIX = "mc/attempt/"
"""Where :func:`attempt_store` keeps its keys, and the prefix of every attempt's keys."""

JOIN_TIMEOUT = timedelta(minutes=5)
"""The least time :func:`init_process_group` waits for every rank to join (torch's store
default); ``timeout`` is the collectives' and applies when longer."""
_POLL_S = 0.005


def init_process_group(
    backend: str,
    *,
    timeout: timedelta,
    device_id: torch.device | None = None,
) -> int:
    """``torch.distributed.init_process_group`` from torchrun's environment (``env://``:
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), in a key space of this
    attempt's own, so that ``torchrun --max-restarts K`` restarts with the store shared
    (torch's default) as well as without (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
    Returns the attempt's number (1 for the first attempt on a fresh store).

    Collective over the world: every rank calls it. ``timeout`` becomes the default group's
    timeout (every collective); joining (the store, the agreement on the attempt, the
    backend's connections) waits ``max(timeout, JOIN_TIMEOUT)`` for the slowest rank.
    """
    _check_timeout(timeout)
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    # Joining waits for the slowest worker to start (imports, a loaded host): never less
    # than JOIN_TIMEOUT, even when collectives get a short timeout.
    join = max(timeout, JOIN_TIMEOUT)
    base, rank, world_size = next(rendezvous("env://", rank, world_size, timeout=join))
    base.set_timeout(join)
    store, attempt = attempt_store(base, rank, world_size, join)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return attempt


def attempt_store(
    store: Store, rank: int, world_size: int, timeout: timedelta
) -> tuple[PrefixStore, int]:
    """``store`` under this attempt's own prefix, and the attempt's number (module
    docstring: the schedule). Collective over the ``world_size`` ranks sharing ``store``;
    ``TimeoutError`` naming the missing ranks after ``timeout``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise InputValueError(f"world_size={world_size!r} must be an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputValueError(f"rank={rank!r} must be an int in [0, {world_size})")
    _check_timeout(timeout)
    root = PrefixStore(ATTEMPT_PREFIX, store)
    deadline = time.monotonic() + timeout.total_seconds()
    attempt = _lead(root, world_size, deadline) if rank == 0 else _follow(root, rank, deadline)
    return PrefixStore(f"{ATTEMPT_PREFIX}{attempt}/", store), attempt


def _lead(root: Store, world_size: int, deadline: float) -> int:
    attempt: int = root.add("gen", 1)
    root.set("latest", str(attempt))
    for peer in range(1, world_size):
        hello = f"{attempt}/hello/{peer}"
        while not root.check([hello]):
            _wait_or_raise(deadline, f"rank {peer} of attempt {attempt} did not join")
        root.set(f"{attempt}/ok/{peer}", root.get(hello).decode())
    return attempt


def _follow(root: Store, rank: int, deadline: float) -> int:
    token = uuid.uuid4().hex
    attempt = None
    while True:
        if root.check(["latest"]):
            latest = int(root.get("latest"))
            if latest != attempt:
                attempt = latest
                root.set(f"{attempt}/hello/{rank}", token)
            ok = f"{attempt}/ok/{rank}"
            if root.check([ok]) and root.get(ok) == token.encode():
                return attempt
        _wait_or_raise(deadline, f"rank {rank} heard nothing from rank 0 of this attempt")


def _wait_or_raise(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"joining the world's store: {what} within the timeout")
    time.sleep(_POLL_S)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise InputValueError(
            f"environment variable {name}={value!r} must be a non-negative int: "
            "init_process_group reads the world from torchrun's environment (run under "
            "torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
        )
    return int(value)


def _check_timeout(timeout: object) -> None:
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise InputTypeError(f"timeout={timeout!r} must be a positive datetime.timedelta")
