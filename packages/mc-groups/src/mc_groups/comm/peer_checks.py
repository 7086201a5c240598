"""One rank's failed check is every rank's error: the local checks of a collective entry
point end in one small status exchange, so no rank goes on into a collective that a peer
will never join.

Why: an entry point checks its arguments on each rank before its first collective. When
the input is bad on one rank only (a file one rank cannot read, a tensor on the wrong
device, a second ``step()`` on one rank), that rank raises at once and its peers wait in
the entry point's first collective until the group's timeout (minutes with defaults), then
fail with a timeout that does not say what went wrong.

Mechanism (:func:`fail_together`)::

    block      the entry point's local checks (no collective), on every rank
    exchange   one 8-byte status per rank over the group (a fingerprint of the entry point
               and "passed" or "failed"), through the schedule check's exchange (point to
               point on its own tag on gloo, one all-gather elsewhere; not recorded by
               :func:`mc_groups.record_collectives`)
    all passed the entry point goes on
    any failed the ranks all-gather the failures' messages (only then); a failing rank
               re-raises its own error, every other rank raises :class:`PeerCheckError`
               naming the failing global ranks and their messages

Cost: one 8-byte exchange per call (at an entry point that communicates anyway); the ranks
also meet there, which a per-step entry point pays as one more synchronisation per step.
:func:`mc_groups.record_collectives` lists it (op ``"status_exchange"``) when opened with
``status_exchanges=True``.

Carried instead of exchanged (:class:`CarriedStatus`): an entry point whose next step is a
reduction over the same ranks anyway (a gradient norm, an overflow flag) adds its status to
that reduction as one more element (1.0 failed, 0.0 passed; summed or maxed, either way
> 0 when any rank failed) and settles it after: no exchange of its own::

    status = CarriedStatus("ShardedOptimizer.step")
    with status.checks():
        ...                                    # the local checks (no collective)
    payload = torch.tensor([local_norm, status.flag])   # a failed rank sends what it can
    all_reduce(payload, group)                 # the reduction the entry point runs anyway
    status.settle(group, payload[1].item())    # every rank raises when any rank failed

Failing ranks skip the work the checks guard but still join the carrying reduction.
A dead or hung peer makes the exchange fail as any collective does: ``CollectiveError``
within the group's timeout; a peer about to run another collective under the schedule
check gets ``CollectiveScheduleError`` on both sides. Groups of one rank exchange nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mc_groups.comm._common import key_device
from mc_groups.comm._errors import CollectiveError
from mc_groups.comm.recorder import STATUS_EXCHANGE, CollectiveRecord, _emit, _recording
from mc_groups.comm.schedule_check import (
    PlannedCollective,
    RankPlan,
    _mismatch_error,
    exchange_plans,
)
from mc_groups.errors import InputValueError

__all__ = ["CarriedStatus", "PeerCheckError", "fail_together"]

_KIND = "status after the local checks"
_FAILED = "[failed]: "


class PeerCheckError(InputValueError):
    """Another rank's checks failed at the entry point this rank was in; every rank of the
    group raises (the failing ones their own error), nothing was allocated or changed.
    ``failures`` maps each failing global rank to its error's text."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


@contextmanager
def fail_together(group: dist.ProcessGroup | None, where: str) -> Iterator[None]:
    """Run the block (``where``'s local checks: no collective in it) on every rank of
    ``group`` (None: the world), then one status exchange: when the block raised on any
    rank, every rank raises (module notes). Collective over ``group``."""
    if group is None:
        group = dist.group.WORLD
    if group is None or not dist.is_initialized() or group.size() == 1:
        yield
        return
    failure: BaseException | None = None
    try:
        yield
    except Exception as err:  # any failed check: the peers must hear of it
        failure = err
    ranks = list(dist.get_process_group_ranks(group))
    planned = PlannedCollective(_KIND, where, detail="passed" if failure is None else "failed")
    mine = RankPlan(planned, "" if failure is None else _text(failure))
    try:
        plans = exchange_plans(group, mine, key_device(group, None))
    except CollectiveError as err:
        if failure is not None:
            raise failure from err  # its own error says more than the dead peer's
        raise CollectiveError(
            f"{where}: the status exchange after the local checks on group ranks {ranks} "
            f"failed: {err.__cause__} (a peer is dead, hung, or in another collective)"
        ) from err.__cause__
    _record_exchange(ranks, where)
    if failure is not None:
        raise failure
    if plans is None:
        return
    failures = _failures(ranks, plans, where)
    if not failures or not all(plan.planned.kind == _KIND for plan in plans):
        # a peer was about to run another collective, or to pass another entry point
        raise _mismatch_error(ranks, plans)
    listed = "; ".join(f"rank {r}: {text}" for r, text in failures.items())
    raise PeerCheckError(
        f"{where} failed its checks on rank(s) {list(failures)} of group ranks {ranks}, so "
        f"no rank went on (nothing was allocated or changed here): {listed}",
        failures,
    )


def _record_exchange(ranks: list[int], where: str) -> None:
    if _recording():
        _emit(
            CollectiveRecord(
                op=STATUS_EXCHANGE,
                reduce_op=None,
                group_ranks=tuple(ranks),
                dtype=torch.int64,
                numel=1,
                bytes=8,
                async_op=False,
                label=where,
            )
        )


class CarriedStatus:
    """The outcome of ``where``'s local checks, carried to the peers by a reduction the
    entry point runs anyway instead of by an exchange of its own (module notes).

    Use: run the checks inside :meth:`checks` (a failure is kept, not raised), put
    :attr:`flag` into the reduction's payload, then call :meth:`settle` with the reduced
    flag on every rank of the reduction's group, before using anything else it returned.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.failure: Exception | None = None

    @contextmanager
    def checks(self) -> Iterator[None]:
        """Run the local checks; an exception is kept for :meth:`settle`."""
        try:
            yield
        except Exception as err:  # any failed check: the peers must hear of it
            self.failure = err

    @property
    def passed(self) -> bool:
        """This rank's checks passed (so far)."""
        return self.failure is None

    @property
    def flag(self) -> float:
        """1.0 when this rank's checks failed, else 0.0 (its element of the reduction)."""
        return 0.0 if self.failure is None else 1.0

    def settle(self, group: dist.ProcessGroup | None, reduced_flag: float) -> None:
        """After the reduction over ``group`` (None: the world) that carried :attr:`flag`:
        nothing when no rank failed; else the ranks all-gather the failures' messages (only
        then) and a failing rank re-raises its own error, every other rank raises
        :class:`PeerCheckError` naming the failing ranks. Collective only on failure."""
        if reduced_flag == 0.0 and self.failure is None:
            return
        if group is None:
            group = dist.group.WORLD
        if group is None or not dist.is_initialized() or group.size() == 1:
            if self.failure is not None:
                raise self.failure
            return
        ranks = list(dist.get_process_group_ranks(group))
        mine = None if self.failure is None else f"{_FAILED}{_text(self.failure)}"
        seen: list[object] = [None] * group.size()
        try:
            dist.all_gather_object(seen, mine, group=group)
        except RuntimeError as err:
            if self.failure is not None:
                raise self.failure from err
            raise CollectiveError(
                f"{self.where}: gathering the failed checks' messages on group ranks {ranks} "
                f"failed: {err}"
            ) from err
        if self.failure is not None:
            raise self.failure
        failures = {
            rank: str(text).removeprefix(_FAILED)
            for rank, text in zip(ranks, seen, strict=True)
            if text is not None
        }
        listed = "; ".join(f"rank {r}: {text}" for r, text in failures.items())
        raise PeerCheckError(
            f"{self.where} failed its checks on rank(s) {list(failures)} of group ranks "
            f"{ranks}, so no rank went on (nothing was changed here): {listed}",
            failures,
        )


def _failures(ranks: list[int], plans: list[RankPlan], where: str) -> dict[int, str]:
    """Each failing global rank's error text (``"(at <entry point>) "`` first when it failed
    at another entry point than ``where``)."""
    out = {}
    for rank, plan in zip(ranks, plans, strict=True):
        if plan.planned.kind == _KIND and plan.note:
            theirs = plan.planned.payload
            out[rank] = plan.note if theirs == where else f"(at {theirs}) {plan.note}"
    return out


def _text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
