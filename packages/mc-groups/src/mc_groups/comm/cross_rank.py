"""Cross-rank verification: the ranks of a group confirm that they are at the same point,
that their checks passed and that they hold the same values, with one primitive.

Why: a collective works only when every rank of the group issues the same one with the same
sizes. A check that fails on one rank only stops that rank and leaves its peers waiting in
the next collective until the group's timeout; settings that differ across ranks (a bucket
size, a layer's width, params registered in another order) hang, abort inside the backend
or mix data silently. A check on each rank alone cannot see either.

The primitive, :func:`cross_check` ``(group, where, fields, failure=)``::

    each rank  an entry: ``where`` (the point it is at: an entry point, a construction, a
               collective), whether its local checks failed (and the message), and the
               ``fields`` it must agree on (names → values)
    exchange   one 8-byte BLAKE2b fingerprint of the entry per rank over the group (point to
               point on its own tag on gloo, which does not queue behind collectives in
               flight on the group; one all-gather elsewhere, read back on the host)
    all equal  return (nothing else is communicated)
    different  the ranks all-gather their entries (only then) and every rank raises:
               its own error on a rank whose checks failed, :class:`PeerCheckError` naming
               the failing ranks elsewhere; else :class:`CollectiveScheduleError` when the
               ranks were at different points (which rank was about to run what); else
               :class:`AgreementError` naming each field that differs, its values and the
               global ranks holding each

Call sites (each explicit, each at a boundary, none per step by default):

- :func:`fail_together` (the block's local checks, then one :func:`cross_check` with the
  failure), over the world: ``initialize_model_parallel``, DDP's build, the optimizer's
  checkpoint calls, mc-train's entry points; per step only where asked
  (``finalize_model_grads(peer_checks=True)``, ``ShardedOptimizer(peer_checks=True)``);
- :func:`cross_check` with ``fields``: DDP's build over ``dp_cp`` / ``expt_dp`` (the config,
  the layout, the params' values), the TP layers' construction;
- :class:`CarriedStatus`: the status rides in a reduction the step runs anyway (the norm's
  all-reduce of a step that clips or scales; the vocab-parallel cross-entropy's MAX
  all-reduce); :func:`settle_carried` raises as above;
- every collective when ``MC_CHECK_COLLECTIVE_SCHEDULE=1`` (a debug switch: one exchange per
  collective): the collective layer's schedule check (:mod:`mc_groups.comm.collectives`),
  a :func:`cross_check` whose ``where`` is the collective (op, payload, label, detail).

A dead or hung peer makes the exchange fail as any collective does: ``CollectiveError``
within the group's timeout (a rank whose own checks failed raises its own error instead).
Groups of one rank compare nothing. Each exchange is recorded by
:func:`mc_groups.record_collectives` only when asked (``status_exchanges=True``, op
``"status_exchange"``), so collective counts do not change. Cost per call: one 8-byte
exchange (on NCCL: a device-to-host read, i.e. a synchronisation); docs/faults.md lists
what each call site costs per step.

Values are strings, numbers, booleans, None and tuples of those (compared by ``repr``, so
they must be the same objects' text on every rank). A tuple that differs is reported at its
first differing entry (``Difference.entry``), or by its length when the lengths differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple, TypeAlias

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_group, check_str, type_name
from mc_groups.comm.recorder import STATUS_EXCHANGE, CollectiveRecord, _emit, _recording
from mc_groups.errors import (
    ABSENT,
    AgreementError,
    CollectiveError,
    CollectiveScheduleError,
    Difference,
    InputTypeError,
    PeerCheckError,
    ScheduleVariant,
)

__all__ = ["CarriedStatus", "Value", "cross_check", "differences", "fail_together"]

Value: TypeAlias = str | int | float | bool | tuple[object, ...] | None
"""What a field may hold, compared by ``repr`` across the ranks (a tuple holds these too,
checked at the call)."""

# -- the entries and their exchange --------------------------------------------------------


class _Entry(NamedTuple):
    """What one rank brings to a check: ``where`` it is, its failed check's message
    (``failure``, empty when its checks passed) and the ``fields`` it must agree on; ``shown``
    is displayed after ``where`` and not compared (a collective's shape)."""

    where: str
    failure: str = ""
    fields: Mapping[str, Value] = {}
    shown: str = ""

    def key(self) -> int:
        """The 64-bit fingerprint (stable across processes, unlike ``hash``)."""
        values = "\n".join(f"{n}={self.fields[n]!r}" for n in sorted(self.fields))
        text = "\0".join((self.where, "failed" if self.failure else "passed", values))
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def describe(self) -> str:
        text = self.where + self.shown
        return f"{text}: {self.failure}" if self.failure else text


_TAG = 0x6D64
"""The point-to-point tag of the fingerprint exchange on gloo (apart from user ``send``/
``recv`` on tag 0, so neither can take the other's message)."""


def key_device(group: dist.ProcessGroup, tensor: torch.Tensor | None = None) -> torch.device:
    """Where the fingerprint travels: the host on gloo, else the collective's device (NCCL
    takes device tensors only)."""
    backend = dist.get_backend(group)
    if tensor is not None and backend != "gloo":
        return tensor.device
    if backend in ("gloo", "mpi") or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _exchange_keys(group: dist.ProcessGroup, key: int, device: torch.device) -> list[int]:
    """Every rank's fingerprint, in group-rank order. On gloo by point-to-point messages on
    :data:`_TAG` (each rank sends its key to every other rank), which progress while
    collectives issued earlier on the group are still running (a gloo all-gather would wait
    behind an overlapped bucket reduction); elsewhere one all-gather."""
    size, me = group.size(), group.rank()
    keys = torch.empty(size, dtype=torch.int64, device=device)
    keys[me] = key
    if dist.get_backend(group) == "gloo":
        works = []
        for peer in range(size):
            if peer != me:
                works.append(dist.isend(keys[me : me + 1], group=group, group_dst=peer, tag=_TAG))
                works.append(
                    dist.irecv(keys[peer : peer + 1], group=group, group_src=peer, tag=_TAG)
                )
        for work in works:
            if work is not None:
                work.wait()
    else:
        mine = keys[me : me + 1].clone()
        dist.all_gather_into_tensor(keys, mine, group=group)
    return [int(v) for v in keys.tolist()]


def _record_exchange(ranks: Sequence[int], where: str) -> None:
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


def _text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# -- the primitive -------------------------------------------------------------------------


def cross_check(
    group: dist.ProcessGroup,
    where: str,
    fields: Mapping[str, Value] | None = None,
    *,
    failure: BaseException | None = None,
    shown: str = "",
    device: torch.device | None = None,
) -> None:
    """Every rank of ``group`` is at ``where``, passed its checks and holds the same
    ``fields``, else every rank raises (module notes). Collective over ``group``: every rank
    calls it at the same point.

    Args:
        group: the ranks that compare (live).
        where: the point this rank is at, in the words of an error
            (``"DistributedDataParallel over dp_cp"``); part of the fingerprint.
        fields: name → value that the ranks must hold alike, in the order an error lists
            them (None: nothing to compare).
        failure: this rank's failed check (raised again here after the exchange, so that
            its peers learn of it); None: its checks passed.
        shown: text shown after ``where`` in a schedule error, not compared.
        device: where the fingerprint travels (default: the host on gloo, the current CUDA
            device elsewhere).

    Raises:
        ``failure``: on the rank whose checks failed.
        PeerCheckError: on the other ranks, when some rank's checks failed.
        CollectiveScheduleError: the ranks were at different points.
        AgreementError: the ranks hold different ``fields``.
        CollectiveError: the exchange failed (a dead or hung peer), within the group's
            timeout.
    """
    check_group("group", group)
    check_str("where", where)
    values = {} if fields is None else _checked_fields(fields)
    if group.size() == 1:
        if failure is not None:
            raise failure
        return
    mine = _Entry(where, "" if failure is None else _text(failure), values, shown)
    ranks = list(dist.get_process_group_ranks(group))
    try:
        keys = _exchange_keys(group, mine.key(), device or key_device(group))
        entries = None if len(set(keys)) == 1 else _gather(group, mine)
    except RuntimeError as err:
        if failure is not None:
            raise failure from err  # its own error says more than the dead peer's
        raise CollectiveError(
            f"{where}: the cross-rank check on group ranks {ranks} failed: {err} (the other "
            "ranks did not reach it: dead, hung, or waiting on another group)"
        ) from err
    _record_exchange(ranks, where)
    if failure is not None:
        raise failure
    if entries is not None:
        _raise_for(ranks, mine, entries)


def _gather(group: dist.ProcessGroup, mine: _Entry) -> list[_Entry]:
    """Every rank's entry, in group-rank order (only when the fingerprints differ)."""
    found: list[object] = [None] * group.size()
    dist.all_gather_object(found, tuple(mine), group=group)
    return [_Entry(*e) if isinstance(e, tuple) else _Entry("(an unknown point)") for e in found]


def _raise_for(ranks: list[int], mine: _Entry, entries: list[_Entry]) -> None:
    """The error every rank raises when the entries differ (this rank's own checks passed):
    a peer's failure first, then a different point, then different fields."""
    failures = {
        rank: e.failure if e.where == mine.where else f"(at {e.where}) {e.failure}"
        for rank, e in zip(ranks, entries, strict=True)
        if e.failure
    }
    if failures:
        listed = "; ".join(f"rank {r}: {text}" for r, text in failures.items())
        raise PeerCheckError(
            f"{mine.where} failed its checks on rank(s) {list(failures)} of group ranks "
            f"{ranks}, so no rank went on (nothing was allocated or changed here): {listed}",
            failures,
        )
    if any(e.where != mine.where for e in entries):
        raise _schedule_error(ranks, entries)
    found = differences(ranks, [e.fields for e in entries])
    lines = [f"  {difference.describe()}" for difference in found]
    raise AgreementError(
        "\n".join(
            [
                f"{mine.where}: the ranks {ranks} of the group hold different values where "
                "they must agree (compared before anything that depends on them ran):",
                *lines,
                "Pass the same values on every rank of the group.",
            ]
        ),
        mine.where,
        ranks,
        found,
    )


def _schedule_error(ranks: Sequence[int], entries: Sequence[_Entry]) -> CollectiveScheduleError:
    """One variant per point, the most common first, each described by its first rank's
    entry."""
    members: dict[str, list[int]] = {}
    for group_rank, entry in enumerate(entries):
        members.setdefault(entry.where, []).append(group_rank)
    variants = [
        ScheduleVariant(tuple(ranks[i] for i in who), entries[who[0]].describe())
        for who in sorted(members.values(), key=len, reverse=True)
    ]
    lines = [
        f"collective schedule mismatch on group ranks {list(ranks)}: the ranks were about to "
        f"run {len(variants)} different collectives or checks (none was issued):",
        *(f"  rank(s) {list(v.ranks)}: {v.description}" for v in variants),
        "Every rank must issue the same collectives on a group in the same order: build "
        "the same model on every rank (same params, registered in the same order) and run "
        "the same layers.",
    ]
    return CollectiveScheduleError("\n".join(lines), ranks, variants)


@contextmanager
def fail_together(group: dist.ProcessGroup | None, where: str) -> Iterator[None]:
    """Run the block (``where``'s local checks: no collective in it) on every rank of
    ``group`` (None: the world), then :func:`cross_check` with the block's exception: when
    the block raised on any rank, every rank raises (its own error, or
    :class:`PeerCheckError`). Collective over ``group``; nothing on one rank or without
    ``torch.distributed``."""
    if group is None:
        group = dist.group.WORLD
    if group is None or not dist.is_initialized() or group.size() == 1:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as err:  # any failed check: the peers must hear of it
        failure = err
    cross_check(group, where, failure=failure)


class CarriedStatus:
    """The outcome of ``where``'s local checks, carried to the peers by a reduction the
    entry point runs anyway instead of by an exchange of its own::

        status = CarriedStatus("ShardedOptimizer.step")
        with status.checks():
            ...                                     # the local checks (no collective)
        payload = torch.tensor([local_norm, status.flag])   # a failed rank sends what it can
        all_reduce(payload, group)                  # the reduction the entry point runs anyway
        status.settle(group, payload[1].item())     # every rank raises when any rank failed

    Failing ranks skip the work the checks guard but still join the carrying reduction.
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
        nothing when no rank failed; else the ranks all-gather their entries (only then) and
        every rank raises as :func:`cross_check` does. Collective only on failure."""
        if reduced_flag == 0.0 and self.failure is None:
            return
        if group is None:
            group = dist.group.WORLD
        if group is None or not dist.is_initialized() or group.size() == 1:
            if self.failure is not None:
                raise self.failure
            return
        mine = _Entry(self.where, "" if self.failure is None else _text(self.failure))
        settle_carried(group, mine, self.failure)


def settle_carried(
    group: dist.ProcessGroup, mine: _Entry, failure: BaseException | None = None
) -> None:
    """The slow path of a check whose verdict rode in a reduction (a :class:`CarriedStatus`,
    or values compared by a MAX/MIN all-reduce): gather every rank's entry and raise as
    :func:`cross_check` does. Collective over ``group``."""
    ranks = list(dist.get_process_group_ranks(group))
    try:
        entries = _gather(group, mine)
    except RuntimeError as err:
        if failure is not None:
            raise failure from err
        raise CollectiveError(
            f"{mine.where}: gathering the failed checks on group ranks {ranks} failed: {err}"
        ) from err
    if failure is not None:
        raise failure
    _raise_for(ranks, mine, entries)


def carried_entry(where: str, fields: Mapping[str, Value]) -> _Entry:
    """This rank's entry for :func:`settle_carried` when values, not a status, rode in the
    reduction (the cross-entropy's vocabulary slice)."""
    return _Entry(where, "", _checked_fields(fields))


# -- comparing fields ------------------------------------------------------------------------


def differences(
    ranks: Sequence[int], rows: Sequence[Mapping[str, object]]
) -> tuple[Difference, ...]:
    """The fields that differ among ``rows`` (one per rank, ``ranks`` their global ranks),
    in first-seen field order (each rank's fields in its order, the first rank's first)."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    found = []
    for name in names:
        held = [(row.get(name, ABSENT), rank) for row, rank in zip(rows, ranks, strict=True)]
        difference = _difference(name, held)
        if difference is not None:
            found.append(difference)
    return tuple(found)


def _show(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def _by_value(held: Sequence[tuple[str, int]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    merged: dict[str, list[int]] = {}
    for value, rank in held:
        merged.setdefault(value, []).append(rank)
    return tuple((value, tuple(ranks)) for value, ranks in merged.items())


def _difference(name: str, held: Sequence[tuple[object, int]]) -> Difference | None:
    if len({_show(value) for value, _ in held}) == 1:
        return None
    tuples = [(value, rank) for value, rank in held if isinstance(value, tuple)]
    if len(tuples) < len(held):
        return Difference(name, _by_value([(_show(value), rank) for value, rank in held]))
    lengths = {len(value) for value, _ in tuples}
    if len(lengths) > 1:
        return Difference(
            name, _by_value([(f"{len(value)} entries", rank) for value, rank in tuples])
        )
    index = next(i for i in range(len(tuples[0][0])) if len({_show(v[i]) for v, _ in tuples}) > 1)
    return Difference(
        name, _by_value([(_show(value[index]), rank) for value, rank in tuples]), index
    )


_SCALARS = (str, int, float, bool, type(None))


def _checked_fields(fields: object) -> dict[str, Value]:
    if not isinstance(fields, Mapping):
        raise InputTypeError(
            f"fields must be a mapping of names to values, got {type_name(fields)}"
        )
    for name, value in fields.items():
        if not isinstance(name, str):
            raise InputTypeError(f"fields: the name {name!r} must be a str")
        if not _is_value(value):
            raise InputTypeError(
                f"fields[{name!r}]={value!r} must be a str, int, float, bool, None or a tuple "
                "of those (compared by repr on every rank): pass its text instead"
            )
    return dict(fields)


def _is_value(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_is_value(item) for item in value)
    return isinstance(value, _SCALARS)
