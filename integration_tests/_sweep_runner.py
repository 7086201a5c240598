"""Run bad-input cases in worker processes and classify what happened to each.

Used by ``scripts/sweep_bad_inputs.py`` (the sweep) and ``integration_tests/
test_fuzz_bad_inputs.py`` (the fuzz test); the cases themselves live in
:mod:`integration_tests._sweep_cases`.

Outcomes, per case (the worst over the ranks of a two-rank case, in this order):

``crash``   a process died (segfault, abort, killed for memory);
``hang``    no answer within the bound (10 s for one process, 5 s for two ranks);
``raw``     an AttributeError / KeyError / IndexError or any other type than the four
            below, an error raised inside torch (or anywhere outside the mc packages, or
            by an operation inside mc code rather than by its own ``raise`` statement,
            e.g. torch's shape error from a matmul), or a message that names none of the
            case's words (the argument or the misuse);
``silent``  the call was accepted: no error;
``clear``   a TypeError / ValueError / NotImplementedError / RuntimeError (or an mc error
            type deriving from them) raised by mc code whose message names the argument or
            the misuse.

Workers are forked from a forkserver that imported torch and the five packages once, so a
new worker costs milliseconds: a one-process batch keeps its worker until a case crashes or
hangs (then a fresh worker takes the rest), and every two-rank case gets a fresh pair that
forms its own gloo world. Each worker's address space is capped (``MEMORY_LIMIT``) so a
case that allocates without bound dies with MemoryError instead of taking the machine.
"""

from __future__ import annotations

import contextlib
import dis
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

ONE_PROCESS_BOUND_S = 10.0
TWO_RANK_BOUND_S = 5.0
PG_TIMEOUT_S = 8.0  # two-rank worlds: gloo gives up after the 5 s bound has passed
MEMORY_LIMIT = 6 * 2**30
OUTCOMES = ("clear", "raw", "silent", "crash", "hang")
_WORST = {o: i for i, o in enumerate(("clear", "silent", "raw", "hang", "crash", "broken"))}
_CLEAR_TYPES = (TypeError, ValueError, NotImplementedError, RuntimeError)
_RAW_TYPES = (AttributeError, KeyError, IndexError)
_MC_DIRS = ("mc_groups", "mc_buffers", "mc_ddp", "mc_tp_layers", "mc_finalize", "mc_moe")
_CASES_MODULE = "integration_tests._sweep_cases"


@dataclass
class Result:
    """What happened to one case (``detail``: the exception and where it was raised)."""

    case_id: str
    package: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    ranks: list[str] = field(default_factory=list)


def classify(error: BaseException | None, names: Sequence[str]) -> tuple[str, str]:
    """``(outcome, detail)`` for what a call raised (``None``: it returned)."""
    if error is None:
        return "silent", "accepted: no error"
    where, by_raise = _raised_in(error)
    text = f"{type(error).__name__}: {error}"[:600]
    if isinstance(error, _RAW_TYPES) or not isinstance(error, _CLEAR_TYPES):
        return "raw", f"{text} [at {where}]"
    if not any(part in where for part in _MC_DIRS):
        return "raw", f"{text} [raised outside mc, at {where}]"
    if not by_raise:
        return "raw", f"{text} [raised by an operation inside mc, not by a raise, at {where}]"
    message = str(error).lower()
    if not any(name.lower() in message for name in names):
        return "raw", f"{text} [names none of {list(names)}]"
    return "clear", text


_RAISE_OPS = frozenset(
    dis.opmap[name] for name in ("RAISE_VARARGS", "RERAISE") if name in dis.opmap
)


def _raised_in(error: BaseException) -> tuple[str, bool]:
    """Where ``error`` was raised (``package/module.py:line``), and whether by a ``raise``
    statement there (the instruction the innermost frame stopped at) rather than by an
    operation that failed inside it (a torch call, ``a < b`` on a str, ...)."""
    tb = error.__traceback__
    if tb is None:
        return "?", False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    by_raise = code.co_code[tb.tb_lasti] in _RAISE_OPS
    return f"{_short(code.co_filename)}:{tb.tb_lineno}", by_raise


def _short(path: str) -> str:
    """``mc_groups/_core.py`` or ``torch/nn/functional.py``: the path inside its package."""
    for marker in ("/src/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# -- the worker side ---------------------------------------------------------------------


def _limit_memory() -> None:
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _join_world(rank: int, world: int, store_path: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import FileStore  # type: ignore[attr-defined]

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def worker_main(
    conn: Connection, rank: int, world: int, store_path: str, env: dict[str, str]
) -> None:
    """A worker: join a gloo world, then run the cases the parent names, one at a time.

    Messages to the parent: ``("start", index)`` before a case, ``("done", index, outcome,
    detail)`` after it. Cases (``("case", index, case_id)`` or ``("value", index, slot_key,
    value)`` for a drawn value) come until ``("stop",)``.
    """
    import gc
    import importlib

    gc.freeze()  # the fork server's objects: never walked by this worker's collections
    _limit_memory()
    os.environ.update(env)
    cases = importlib.import_module(_CASES_MODULE)
    timeout = PG_TIMEOUT_S if world > 1 else ONE_PROCESS_BOUND_S * 3
    _join_world(rank, world, store_path, timeout)
    ctx = cases.Ctx(rank, world, store_path)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        index = message[1]
        conn.send(("start", index))
        try:
            if message[0] == "case":
                case = cases.case_by_id(message[2])
            else:
                case = cases.case_for(message[2], message[3])
        except Exception:  # the sweep's own fault: say so, do not count it as a crash
            conn.send(("done", index, "broken", traceback.format_exc()))
            continue
        error = ctx.run(case)
        outcome, detail = classify(error, case.names)
        conn.send(("done", index, outcome, detail))
        ctx.after_case()


# -- the parent side ---------------------------------------------------------------------


def _context() -> Any:
    # multiprocessing keeps one fork server per process: under pytest, mc_groups.testing's
    # RankPool has usually started it already (with torch, DTensor and DCP preloaded), and
    # then this list changes nothing; the sweep script starts it with this list.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "mc_groups",
            "mc_buffers",
            "mc_ddp",
            "mc_tp_layers",
            "mc_finalize",
            "mc_moe",
            _CASES_MODULE,
        ]
    )
    return ctx


class _Worker:
    def __init__(self, ctx: Any, rank: int, world: int, store_path: str, env: dict[str, str]):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main, args=(child, rank, world, store_path, env), daemon=True
        )
        self.proc.start()
        child.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError, BrokenPipeError):
            self.conn.send(("stop",))
        self.proc.join(2)
        self.kill()

    def is_alive(self) -> bool:
        """Alive after a short grace (a dying process may still look alive at first)."""
        self.proc.join(0.5)
        return bool(self.proc.is_alive())

    def exit_text(self) -> str:
        self.proc.join(2)
        code = self.proc.exitcode
        if code is not None and code < 0:
            import signal

            with contextlib.suppress(ValueError):
                return f"process died by {signal.Signals(-code).name}"
        return f"process exited (exit code {code})"


def _await(worker: _Worker, kind: str, index: int, deadline: float) -> tuple[str, ...] | None:
    """The worker's next message of ``kind`` for ``index``; None when it died or timed out."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not wait([worker.conn], timeout=remaining):
            return None
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return None
        if message[0] == kind and message[1] == index:
            return tuple(message)


class OneProcessRunner:
    """Runs one-process cases in a reused worker (replaced after a crash or hang)."""

    def __init__(self, env: dict[str, str] | None = None, start_bound_s: float = 120.0):
        self._ctx = _context()
        self._env = dict(env or {})
        self._start_bound_s = start_bound_s
        self._tmp = tempfile.mkdtemp(prefix="mc-sweep-")
        self._worker: _Worker | None = None
        self._spawned = 0

    def _fresh(self) -> _Worker:
        self._spawned += 1
        store = os.path.join(self._tmp, f"store-{self._spawned}")
        return _Worker(self._ctx, 0, 1, store, self._env)

    def run(self, message: tuple[Any, ...], case_id: str, package: str) -> Result:
        """Send ``message`` (``("case", i, id)`` or ``("value", i, key, value)``)."""
        started = time.monotonic()
        if self._worker is None:
            self._worker = self._fresh()
            first_bound = self._start_bound_s
        else:
            first_bound = ONE_PROCESS_BOUND_S
        worker = self._worker
        index = message[1]
        try:
            worker.conn.send(message)
        except (OSError, BrokenPipeError):
            self._drop()
            return Result(case_id, package, "crash", "worker gone before the case")
        begun = _await(worker, "start", index, time.monotonic() + first_bound)
        if begun is None:
            text = worker.exit_text() if not worker.is_alive() else "worker did not start"
            self._drop()
            return Result(case_id, package, "crash", text, time.monotonic() - started)
        began = time.monotonic()
        done = _await(worker, "done", index, began + ONE_PROCESS_BOUND_S)
        seconds = time.monotonic() - began
        if done is None:
            alive = worker.is_alive()
            text = worker.exit_text() if not alive else f"no answer in {ONE_PROCESS_BOUND_S} s"
            self._drop()
            return Result(case_id, package, "hang" if alive else "crash", text, seconds)
        return Result(case_id, package, str(done[2]), str(done[3]), seconds)

    def _drop(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def close(self) -> None:
        """Stop the worker and remove the rendezvous files."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> OneProcessRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_two_rank(case_id: str, package: str, env: dict[str, str] | None = None) -> Result:
    """Run a two-rank case on a fresh pair of workers (its own gloo world)."""
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="mc-sweep-2-")
    store = os.path.join(tmp, "store")
    workers = [_Worker(ctx, r, 2, store, dict(env or {})) for r in range(2)]
    started = time.monotonic()
    try:
        for w in workers:
            w.conn.send(("case", 0, case_id))
        for w in workers:
            if _await(w, "start", 0, started + 120.0) is None:
                return Result(case_id, package, "crash", "a rank did not start: " + w.exit_text())
        began = time.monotonic()
        deadline = began + TWO_RANK_BOUND_S
        per_rank: list[tuple[str, str]] = []
        for rank, w in enumerate(workers):
            done = _await(w, "done", 0, deadline)
            if done is None:
                alive = w.is_alive()
                text = f"no answer in {TWO_RANK_BOUND_S} s" if alive else w.exit_text()
                per_rank.append(("hang" if alive else "crash", f"rank {rank}: {text}"))
            else:
                per_rank.append((str(done[2]), f"rank {rank}: {done[3]}"))
        seconds = time.monotonic() - began
        worst = max(per_rank, key=lambda p: _WORST[p[0]])
        return Result(
            case_id, package, worst[0], worst[1], seconds, ranks=[f"{o}: {d}" for o, d in per_rank]
        )
    finally:
        for w in workers:
            w.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def summarise(results: Iterable[Result]) -> dict[str, dict[str, int]]:
    """``{package: {"cases": n, outcome: n, ...}}`` plus an ``"all"`` row."""
    table: dict[str, dict[str, int]] = {}
    for result in results:
        for key in (result.package, "all"):
            row = table.setdefault(key, {"cases": 0, "broken": 0, **dict.fromkeys(OUTCOMES, 0)})
            row["cases"] += 1
            row[result.outcome] += 1
    return table
