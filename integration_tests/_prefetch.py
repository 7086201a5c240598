"""The suite's few whole-program jobs, started in the background when collection ends.

Some tests launch whole programs: torchrun jobs that train, lose a rank and restart, the
chaos run, ``scripts/gpu_check.py``'s dry run. Each is a chain of fresh interpreters that
import torch one after the other and wait on each other, so it keeps about one of the two
cores busy for 15-40 s while the other idles. A test module lists such jobs in a
module-level ``PREFETCH`` mapping (job name -> a function of an empty folder returning what
the test asserts on). When the session has collected a test of that module,
``integration_tests/conftest.py`` starts one background thread that runs every listed job
of the collected modules, one at a time in collection order, while the suite goes on; the
test takes its job's result with :func:`take` (waiting for it if it is still running) and
asserts exactly what it asserted before. The same commands and the same checks: only the
start moves earlier. A job whose module was not collected at session start (or any job,
with ``MC_TEST_PREFETCH=0``) runs in the foreground when its test asks for it.

A job's exception (an assertion in it, a timeout) is raised by :func:`take`, in its test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

Job = Callable[[Path], Any]
WAIT_S = 1200.0  # a job bounds its own programs (240-300 s each); this only bounds the wait
_KEY = pytest.StashKey["_Prefetcher"]()


class _Prefetcher:
    """The background thread, its jobs in order, and their results."""

    def __init__(self, jobs: list[tuple[tuple[str, str], Job]]) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="mc-prefetch-"))
        self._jobs = jobs
        self._futures: dict[tuple[str, str], Future[tuple[Path, Any]]] = {
            key: Future() for key, _ in jobs
        }
        self._thread = threading.Thread(target=self._run, name="mc-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for index, (key, job) in enumerate(self._jobs):
            future = self._futures[key]
            if not future.set_running_or_notify_cancel():
                continue
            folder = self._root / f"{index}-{key[1].replace(' ', '-')}"
            folder.mkdir()
            try:
                future.set_result((folder, job(folder)))
            except BaseException as err:  # handed to the test that takes it
                err.add_note(f"(in prefetched job {key[1]!r}:\n{traceback.format_exc()})")
                future.set_exception(err)

    def future(self, key: tuple[str, str]) -> Future[tuple[Path, Any]] | None:
        return self._futures.get(key)

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()  # the not yet started ones; a running job ends on its own bound
        if not self._thread.is_alive():
            shutil.rmtree(self._root, ignore_errors=True)


def _jobs_of(module: ModuleType) -> Mapping[str, Job]:
    jobs: Mapping[str, Job] = getattr(module, "PREFETCH", {})
    return jobs


def start(session: pytest.Session) -> None:
    """Start the background thread for the ``PREFETCH`` jobs of the collected modules."""
    if os.environ.get("MC_TEST_PREFETCH", "1") == "0":
        return
    jobs: list[tuple[tuple[str, str], Job]] = []
    seen: set[str] = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        jobs += [((module.__name__, name), job) for name, job in _jobs_of(module).items()]
    if jobs:
        session.config.stash[_KEY] = _Prefetcher(jobs)


def stop(session: pytest.Session) -> None:
    """Cancel the jobs not started yet; remove the folders when nothing runs any more."""
    prefetcher = session.config.stash.get(_KEY, None)
    if prefetcher is not None:
        prefetcher.close()


def take(request: pytest.FixtureRequest, name: str, folder: Path) -> tuple[Path, Any]:
    """The job ``name`` of the requesting test's module: ``(its folder, its result)``,
    waiting for the background run; run here, in ``folder``, when it was not prefetched."""
    module = request.module
    prefetcher = request.config.stash.get(_KEY, None)
    future = None if prefetcher is None else prefetcher.future((module.__name__, name))
    if future is None or future.cancelled():
        return folder, _jobs_of(module)[name](folder)
    return future.result(timeout=WAIT_S)
