"""``RankPool``: run a function on N ranks of a real torch.distributed world, repeatedly.

Design, for test suites on small CPUs:
- N worker processes are started once, each joins the world (gloo by default) through a
  ``FileStore`` in a private temporary folder: no port is fixed, so parallel sessions never
  collide.
- Ranks are forked from multiprocessing's fork server, which imports torch and the worker
  module once per session (on Linux; spawn elsewhere): a spawned rank
  imports torch itself, so every pool start and every restart after a failure paid one
  torch start-up per rank. Each rank then takes the parent's environment as it is when the
  pool starts (plus the pool's ``env``), exactly as a spawned rank would; only what torch
  reads while it is imported comes from the fork server's environment. CUDA is never
  initialised before the fork (importing torch does not initialise it).
- ``pool.run(fn, *args)`` sends ``fn`` (by module and name) to every rank and returns the
  per-rank results in rank order. Workers are reused across calls.
- Every call has a deadline. A rank that raises fails the call with its traceback; the
  others get ``failure_grace_s`` to finish (they may be blocked in a collective with the
  failed rank), then the pool is torn down and respawned on the next call. A rank that
  neither answers nor dies is named in a :class:`RankTimeout`. Nothing is left hung.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, ParamSpec, TypeVar

from mc_groups.argcheck import check_int, check_real
from mc_groups.errors import InputTypeError
from mc_groups.testing._worker import worker_main

__all__ = ["RankFailure", "RankOutcome", "RankPool", "RankTimeout"]

P = ParamSpec("P")
R = TypeVar("R")

_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class RankOutcome:
    """What one rank produced for a call: a result, an error text, or nothing yet."""

    rank: int
    ok: bool
    result: object = None
    error: str = ""


class RankFailure(RuntimeError):
    """At least one rank raised, died or missed the deadline.

    ``outcomes`` maps each rank to its :class:`RankOutcome` (ranks that finished keep their
    results, so a test can inspect what the survivors saw).
    """

    def __init__(self, message: str, outcomes: dict[int, RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes

    def failed_ranks(self) -> list[int]:
        """Ranks that raised, died or did not answer."""
        return sorted(r for r, o in self.outcomes.items() if not o.ok)


class RankTimeout(RankFailure):
    """Some ranks did not answer before the call's deadline; they are named."""


def _default_env() -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1"}
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


# What the fork server imports once: the worker, and the torch modules that mc's packages
# import (DTensor and DCP alone take over a second to import).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    worker_main.__module__,
)


def _context(preload: tuple[str, ...] = ()) -> ForkServerContext | SpawnContext:
    """The fork server (torch imported there once) on Linux, spawn elsewhere (macOS system
    libraries that torch loads may start threads, which makes forking unsafe there).

    The preload list (``_PRELOAD`` and the pool's ``preload``) is the process's
    (multiprocessing keeps one fork server per process) and only takes effect when the
    fork server starts; if the process already runs one, the ranks import what that one did
    not (slower, same behaviour)."""
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(dict.fromkeys((*_PRELOAD, *preload))))
    return ctx


def start_fork_server(preload: tuple[str, ...] = ()) -> None:
    """Start the process's fork server now (Linux; elsewhere nothing), with ``preload``:
    it returns at once and the server imports while the caller goes on, so the first pool
    forks from a server that is (nearly) ready instead of waiting for its imports (the
    ``rank_pools`` plugin calls it when the session has collected a test that uses pools).
    A server already running is kept as it is."""
    if sys.platform.startswith("linux"):
        _context(preload)
        forkserver.ensure_running()


def check_preload(preload: object) -> tuple[str, ...]:
    """``preload`` as a tuple of module names (a ``TypeError`` for anything else)."""
    if isinstance(preload, str) or not isinstance(preload, (list, tuple)):
        raise InputTypeError(
            f"preload={preload!r} must be a list or tuple of module names, e.g. ['transformers']"
        )
    if not all(isinstance(m, str) and m for m in preload):
        raise InputTypeError(f"preload={preload!r} must hold module names (non-empty str)")
    return tuple(preload)


def check_times(
    pg_timeout_s: object,
    call_deadline_s: object,
    start_deadline_s: object = 90.0,
    failure_grace_s: object = 2.0,
) -> None:
    """Timeouts and deadlines are finite seconds > 0 (the grace period >= 0): the harness
    exists to bound every call."""
    for name, value in (
        ("pg_timeout_s", pg_timeout_s),
        ("call_deadline_s", call_deadline_s),
        ("start_deadline_s", start_deadline_s),
    ):
        check_real(name, value, positive=True, allow_zero=False)
    check_real("failure_grace_s", failure_grace_s, positive=True)


def check_env(env: object) -> dict[str, str]:
    """``env`` as a dict of str to str (None: empty)."""
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError(f"env={env!r} must be a dict of str to str (environment variables)")
    return dict(env)


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module is None or qualname is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"fn={fn!r} must be a module-level function (ranks import it by name); "
            "lambdas and nested functions cannot be sent"
        )
    path = getattr(sys.modules.get(module), "__file__", None)
    return module, qualname, path


class RankPool:
    """A reusable world of ``world_size`` rank processes.

    Args:
        world_size: number of ranks (>= 1).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        pg_timeout_s: timeout of the world's process group: bounds every collective.
        call_deadline_s: default deadline of :meth:`run`.
        start_deadline_s: how long spawning and joining the world may take.
        failure_grace_s: after the first rank fails, how long the others may still finish.
        env: extra environment variables for the ranks.
        preload: modules the fork server imports once before forking the ranks (on Linux,
            when this pool starts the process's fork server): each rank then starts with
            them imported instead of importing them itself (``transformers`` costs seconds
            per rank).

    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        pg_timeout_s: float = 20.0,
        call_deadline_s: float = 120.0,
        start_deadline_s: float = 90.0,
        failure_grace_s: float = 2.0,
        env: dict[str, str] | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        check_int("world_size", world_size)
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {_BACKENDS}")
        check_times(pg_timeout_s, call_deadline_s, start_deadline_s, failure_grace_s)
        self._env = {**_default_env(), **check_env(env)}
        self._preload = check_preload(preload)
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.call_deadline_s = call_deadline_s
        self.start_deadline_s = start_deadline_s
        self.failure_grace_s = failure_grace_s
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._tmpdir: str | None = None
        self._calls = 0

    # lifecycle -----------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """True while rank processes are alive."""
        return bool(self._procs)

    def start(self) -> None:
        """Spawn the ranks and wait until each joined the world (idempotent)."""
        if self._procs:
            return
        ctx = _context(self._preload)
        env = {**os.environ, **self._env}
        self._tmpdir = tempfile.mkdtemp(prefix="mc-rank-pool-")
        store = os.path.join(self._tmpdir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    store,
                    child,
                    self.pg_timeout_s,
                    env,
                ),
                daemon=True,
                name=f"mc-rank-{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        outcomes = self._collect(-1, time.monotonic() + self.start_deadline_s, "start-up")
        if not all(o.ok for o in outcomes.values()):
            self.close()
            raise RankFailure(_failure_text("joining the world", outcomes), outcomes)

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and delete the rendezvous folder."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps(("stop",)))
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self.close()

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # calls ---------------------------------------------------------------------------
    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises :class:`RankFailure` (with each failing rank's traceback) or
        :class:`RankTimeout` after ``call_deadline_s``.
        """
        return self.run_with_deadline(self.call_deadline_s, fn, *args, **kwargs)

    def run_with_deadline(
        self, deadline_s: float, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """:meth:`run` with an explicit deadline in seconds (checked, with ``fn`` and the
        arguments' picklability, before any rank is started)."""
        check_real("deadline_s", deadline_s, positive=True, allow_zero=False)
        ref = _function_ref(fn)
        try:
            payload = pickle.dumps((list(sys.path), ref, args, kwargs))
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(
                f"the arguments of {ref[0]}.{ref[1]} must be picklable (they travel to the "
                f"ranks by value): {err}"
            ) from None
        del payload
        self.start()
        self._calls += 1
        call_id = self._calls
        message = pickle.dumps(("call", call_id, list(sys.path), ref, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        outcomes = self._collect(call_id, time.monotonic() + deadline_s, ref[1])
        if all(o.ok for o in outcomes.values()):
            return [outcomes[r].result for r in range(self.world_size)]  # type: ignore[misc]
        self._kill()  # ranks may be stuck in a collective: start afresh next call
        text = _failure_text(f"{ref[0]}.{ref[1]}", outcomes)
        silent = [o for o in outcomes.values() if not o.ok and o.error.startswith("no answer")]
        if silent and len(silent) == len(outcomes) - sum(o.ok for o in outcomes.values()):
            raise RankTimeout(text, outcomes)
        raise RankFailure(text, outcomes)

    def _collect(self, call_id: int, deadline: float, what: str) -> dict[int, RankOutcome]:
        pending = dict(enumerate(self._conns))
        outcomes: dict[int, RankOutcome] = {}
        failed_at: float | None = None
        while pending:
            limit = (
                deadline if failed_at is None else min(deadline, failed_at + self.failure_grace_s)
            )
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for ready in wait(list(pending.values()), timeout=remaining):
                rank = next(r for r, c in pending.items() if c is ready)
                outcome = self._receive(rank, pending[rank], call_id)
                if outcome is None:
                    continue  # a stale answer from an earlier call
                outcomes[rank] = outcome
                del pending[rank]
                if not outcome.ok and failed_at is None:
                    failed_at = time.monotonic()
        waited = "the deadline" if failed_at is None else "the grace period after a failure"
        for rank in pending:
            outcomes[rank] = RankOutcome(
                rank, ok=False, error=f"no answer to {what} within {waited}"
            )
        return outcomes

    def _receive(self, rank: int, conn: Connection, call_id: int) -> RankOutcome | None:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc = self._procs[rank]
            proc.join(1.0)
            return RankOutcome(rank, ok=False, error=f"process exited (exit code {proc.exitcode})")
        kind = message[0]
        if kind == "ready":
            return RankOutcome(rank, ok=True, result=message[2])
        if message[1] not in (call_id, -1):
            return None
        if kind == "ok":
            return RankOutcome(rank, ok=True, result=message[2])
        return RankOutcome(rank, ok=False, error=message[2])


def _failure_text(what: str, outcomes: dict[int, RankOutcome]) -> str:
    bad = sorted(r for r, o in outcomes.items() if not o.ok)
    lines = [f"{what} failed on rank(s) {bad} of {len(outcomes)}:"]
    for rank in bad:
        lines.append(f"--- rank {rank}: {outcomes[rank].error.rstrip()}")
    return "\n".join(lines)
