"""``record_collectives()``: the log of every collective mc issued inside a ``with`` block.

Tests prove schedules with it ("one reduce-scatter per bucket, on the dp group, before the
last gradient hook ran") instead of timing anything::

    with record_collectives() as log:
        loss.backward()
    assert [r.op for r in log] == ["reduce_scatter", "reduce_scatter"]

Records are appended by :mod:`mc_groups.collectives`, the only module that calls
``torch.distributed`` collectives, at the moment a collective is *issued* (before an
async one completes). Collectives on single-rank groups are short-circuited and not
recorded: nothing is communicated. Collectives of a graph built by ``torch.compile``
(:mod:`mc_groups.traceable`) are recorded when the compiled graph runs them, with
``compiled=True``; tracing records nothing.

The set of open recorders is process-wide rather than per thread because autograd runs
backward hooks on its own device threads on GPU; it holds nothing outside ``with`` blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["CollectiveRecord", "record_collectives"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank.

    Attributes:
        op: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
            ``all_to_all``, ``send``, ``recv``, ``barrier`` or ``all_gather_object``.
        reduce_op: ``sum``/``avg``/``max``/``min`` for reductions, else ``None``.
        group_ranks: global ranks of the group, in group-rank order.
        dtype: element type of the data this rank sends (``None`` for object/barrier ops).
        numel: elements this rank sends (the full input for a reduce-scatter, the local
            shard for an all-gather).
        bytes: ``numel`` × element size.
        async_op: issued asynchronously (the caller waits on a handle later).
        coalesced: issued inside a coalesced batch.
        label: free text the caller attached (e.g. ``"bucket_group 0"``).
        compiled: issued by a graph that ``torch.compile`` built (recorded by the graph's
            ``mc_groups::collective`` op when it runs; see :mod:`mc_groups.traceable`).
    """

    op: str
    reduce_op: str | None
    group_ranks: tuple[int, ...]
    dtype: torch.dtype | None
    numel: int
    bytes: int
    async_op: bool
    coalesced: bool = False
    label: str = ""
    compiled: bool = False


class _RecorderRegistry:
    """The open recorders of this process (a lock guards appends from autograd threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logs: list[list[CollectiveRecord]] = []

    @property
    def active(self) -> bool:
        return bool(self._logs)

    def open(self) -> list[CollectiveRecord]:
        log: list[CollectiveRecord] = []
        with self._lock:
            self._logs.append(log)
        return log

    def close(self, log: list[CollectiveRecord]) -> None:
        with self._lock:
            self._logs = [other for other in self._logs if other is not log]

    def emit(self, record: CollectiveRecord) -> None:
        with self._lock:
            for log in self._logs:
                log.append(record)


_REGISTRY = _RecorderRegistry()


@contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Yield a list that receives a :class:`CollectiveRecord` per collective issued.

    Recorders nest: every open recorder receives every record.
    """
    log = _REGISTRY.open()
    try:
        yield log
    finally:
        _REGISTRY.close(log)


def _recording() -> bool:
    return _REGISTRY.active


def _emit(record: CollectiveRecord) -> None:
    _REGISTRY.emit(record)
