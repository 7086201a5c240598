"""``record_collectives()``: the log of every collective mc issued inside a ``with`` block.

Tests prove schedules with it ("one reduce-scatter per bucket, on the dp group, before the
last gradient hook ran") instead of timing anything::

    with record_collectives() as log:
        loss.backward()
    assert [r.op for r in log] == ["reduce_scatter", "reduce_scatter"]

Records are appended by :mod:`mc_groups.comm.collectives`, the only module that calls
``torch.distributed`` collectives, at the moment a collective is *issued* (before an
async one completes). Collectives on single-rank groups are short-circuited and not
recorded: nothing is communicated. Collectives of a graph built by ``torch.compile``
(:mod:`mc_groups.comm.traceable`) are recorded when the compiled graph runs them, with
``compiled=True``; tracing records nothing.

The status exchange of :func:`mc_groups.fail_together` (8 bytes per rank after an entry
point's local checks) is recorded only by a recorder opened with
``record_collectives(status_exchanges=True)``, as op ``"status_exchange"``: a test counting
every synchronisation of a training step sees it; the schedule tests, which list what
moves data, do not.

The set of open recorders is process-wide rather than per thread because autograd runs
backward hooks on its own device threads on GPU; it holds nothing outside ``with`` blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mc_groups.errors import InputTypeError

__all__ = ["STATUS_EXCHANGE", "CollectiveRecord", "record_collectives"]

STATUS_EXCHANGE = "status_exchange"
"""The ``op`` of a :func:`mc_groups.fail_together` status exchange's record."""


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank.

    Attributes:
        op: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
            ``all_to_all``, ``send``, ``recv``, ``barrier``, ``all_gather_object`` or
            ``status_exchange`` (see the module notes).
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
            ``mc_groups::collective`` op when it runs; see :mod:`mc_groups.comm.traceable`).
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
        self._logs: list[tuple[list[CollectiveRecord], bool]] = []
        self.active = False  # any log open: read before every collective, kept as a plain bool

    def open(self, status_exchanges: bool) -> list[CollectiveRecord]:
        log: list[CollectiveRecord] = []
        with self._lock:
            self._logs.append((log, status_exchanges))
            self.active = True
        return log

    def close(self, log: list[CollectiveRecord]) -> None:
        with self._lock:
            self._logs = [entry for entry in self._logs if entry[0] is not log]
            self.active = bool(self._logs)

    def emit(self, record: CollectiveRecord) -> None:
        status = record.op == STATUS_EXCHANGE
        with self._lock:
            for log, wants_status in self._logs:
                if wants_status or not status:
                    log.append(record)


_REGISTRY = _RecorderRegistry()


@contextmanager
def record_collectives(*, status_exchanges: bool = False) -> Iterator[list[CollectiveRecord]]:
    """Yield a list that receives a :class:`CollectiveRecord` per collective issued
    (and, with ``status_exchanges=True``, per :func:`mc_groups.fail_together` status
    exchange, as op ``"status_exchange"``).

    Recorders nest: every open recorder receives every record it asked for.
    """
    if not isinstance(status_exchanges, bool):
        raise InputTypeError(f"status_exchanges={status_exchanges!r} must be a bool")
    log = _REGISTRY.open(status_exchanges)
    try:
        yield log
    finally:
        _REGISTRY.close(log)


def _recording() -> bool:
    return _REGISTRY.active


def _emit(record: CollectiveRecord) -> None:
    _REGISTRY.emit(record)
