"""Opt-in collective-schedule check: before each collective, the ranks of its group compare
what they are about to run, and a mismatch is an error on every rank instead of a hang or
silently mixed data.

Why: a collective only works when every rank of the group issues the same one, in the same
order, with the same sizes. Ranks whose models registered params in a different order
all-reduce one bucket's gradients into another's; a rank that skips a layer sends a
tensor its peers do not expect. Without a check that is a hang (until the group's
timeout), a backend error far from the cause, or wrong numbers with no error at all.

Enable it with the environment variable ``MC_CHECK_COLLECTIVE_SCHEDULE=1`` (read at every
collective, so it can be set after import) or for a block::

    with mc_groups.check_collective_schedule():
        loss.backward()

Mechanism, per collective on a group of more than one rank (after the call's own input
checks, before it is recorded or issued):

1. fingerprint = 64-bit BLAKE2b digest of ``op(reduce op) | numel × dtype | label |
   detail`` (``detail`` is the caller's words for what the tensor holds, e.g. a DDP
   bucket's param layout);
2. one synchronous all-gather of the fingerprints (8 bytes per rank) over the group (on
   gloo as point-to-point sends on their own tag, which do not wait in the group's work
   queue behind collectives still in flight);
3. equal → the collective is issued as usual; different → the ranks all-gather their
   descriptions (only then) and every rank raises :class:`CollectiveScheduleError`
   listing which ranks were about to run what. Nothing of the mismatched collective
   was issued, so the group stays usable.

A coalesced batch is checked once, as a whole, when its ``with`` block closes (its
collectives are issued after the check). Not checked: ``send`` / ``recv`` (point to
point), single-rank groups (nothing is communicated). The exchange is not recorded by
:func:`mc_groups.record_collectives`, so counting tests see the same log with the check on.

Cost: one small synchronous collective per collective; it also makes the ranks wait for
each other at each collective, which removes some overlap (measured in
``benchmarks/schedule_check.py``). On NCCL the fingerprint travels on the collective's
device and is read back on the host (a device synchronisation per collective).

Limits: ranks that issue collectives on *different* groups cannot compare; each waits
for its own group's peers and raises :class:`CollectiveError` ("schedule check … failed")
after the group's timeout. Two collectives that look alike (same op, size, dtype, label
and detail) are indistinguishable, e.g. two identical TP layers of which one rank skips
one: the check then fires at the first collective that differs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag
from mc_groups.comm._errors import CollectiveError
from mc_groups.comm._p2p_all_gather import exchange_rows
from mc_groups.comm._shims import all_gather_flat
from mc_groups.errors import InputValueError

__all__ = [
    "SCHEDULE_CHECK_ENV",
    "CollectiveScheduleError",
    "PlannedCollective",
    "RankPlan",
    "ScheduleVariant",
    "check_collective_schedule",
    "exchange_plans",
    "schedule_check_enabled",
    "verify_schedule",
]

SCHEDULE_CHECK_ENV = "MC_CHECK_COLLECTIVE_SCHEDULE"
"""Environment variable that turns the check on (``1``/``true``/``yes``/``on``)."""

_ENV_KEY = os.fsencode(SCHEDULE_CHECK_ENV)
"""The variable's name as POSIX ``os.environ`` keys its byte mapping (see :func:`_switch`)."""

_ENVIRON_BYTES: dict[bytes, bytes] | None = (
    getattr(os.environ, "_data", None)
    if os.name == "posix" and type(getattr(os.environ, "_data", None)) is dict
    else None
)
"""The byte mapping behind POSIX CPython's ``os.environ`` (the same dict for the process's
life: every write through ``os.environ`` updates it in place), read, never written, by
:func:`schedule_check_enabled`; None elsewhere."""

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def schedule_check_enabled() -> bool:
    """Whether collectives are checked now (reads ``MC_CHECK_COLLECTIVE_SCHEDULE``).

    Raises ``ValueError`` for a value that is neither on nor off, so a typo does not
    silently disable the check.
    """
    if _ENVIRON_BYTES is not None and _ENV_KEY not in _ENVIRON_BYTES:
        return False  # unset, the usual case: one lookup per collective
    value = _switch()
    if not value:
        return False
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise InputValueError(
        f"{SCHEDULE_CHECK_ENV}={value!r} is not a switch: use 1/true/yes/on to check "
        "collective schedules, 0/false/no/off (or unset it) not to"
    )


def _switch() -> str | None:
    """``os.environ.get(SCHEDULE_CHECK_ENV)``, read per collective. On POSIX CPython from
    the byte mapping behind ``os.environ`` (``os.environ._data``, which every write through
    ``os.environ`` updates): the same value, without ``Mapping.get``'s ``KeyError`` for an
    unset variable (~0.7 µs, the common case, against ~0.05 µs)."""
    if _ENVIRON_BYTES is not None:
        raw = _ENVIRON_BYTES.get(_ENV_KEY)
        return None if raw is None else os.fsdecode(raw)
    return os.environ.get(SCHEDULE_CHECK_ENV)


@contextmanager
def check_collective_schedule(enabled: bool = True) -> Iterator[None]:
    """Check (or, with ``enabled=False``, do not check) every collective in the block.

    Sets ``MC_CHECK_COLLECTIVE_SCHEDULE`` for the block and restores the previous value on
    exit: the switch lives in the process environment, not in module state. Every rank of
    a group must be in the same mode (a checking rank waits for its peers' fingerprints).
    """
    check_flag("enabled", enabled)
    previous = os.environ.get(SCHEDULE_CHECK_ENV)
    os.environ[SCHEDULE_CHECK_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(SCHEDULE_CHECK_ENV, None)
        else:
            os.environ[SCHEDULE_CHECK_ENV] = previous


class PlannedCollective(NamedTuple):
    """What this rank is about to run on a group.

    ``kind`` (``"all_reduce(sum)"``), ``payload`` (``"8 × float32"``), ``label`` and
    ``detail`` form the fingerprint; ``shape`` is only shown.
    """

    kind: str
    payload: str
    label: str = ""
    detail: str = ""
    shape: str = ""

    def key(self) -> int:
        """The 64-bit fingerprint (stable across processes, unlike ``hash``)."""
        text = "|".join((self.kind, self.payload, self.label, self.detail))
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def describe(self) -> str:
        """``all_reduce(sum) 'label' of 8 × float32, shape (2, 4) [detail]``."""
        label = f" '{self.label}'" if self.label else ""
        shape = f", shape {self.shape}" if self.shape else ""
        detail = f" [{self.detail}]" if self.detail else ""
        return f"{self.kind}{label} of {self.payload}{shape}{detail}"


class RankPlan(NamedTuple):
    """What one rank was about to run, as its peers learn it when the fingerprints differ.

    ``note`` is shown after the description (a failed check's error, from
    :func:`mc_groups.fail_together`); ``payload`` travels along unshown (the values
    :func:`mc_groups.agree` compares).
    """

    planned: PlannedCollective
    note: str = ""
    payload: object = None

    def describe(self) -> str:
        """The planned collective's description, then ``: note`` when there is one."""
        text = self.planned.describe()
        return f"{text}: {self.note}" if self.note else text


class ScheduleVariant(NamedTuple):
    """One of the different things the ranks of a group were about to run: the global
    ``ranks`` that were about to run it, and the :class:`RankPlan` of the first of them."""

    ranks: tuple[int, ...]
    plan: RankPlan


class CollectiveScheduleError(CollectiveError):
    """The ranks of a group were about to run different collectives (the opt-in schedule
    check found it before anything was issued); every rank of the group raises it.

    ``group_ranks`` (the group's global ranks) and ``variants`` (each
    :class:`ScheduleVariant`, the most common first) say the same as the message, for
    code that reacts to them."""

    def __init__(
        self,
        message: str,
        group_ranks: Sequence[int] = (),
        variants: Sequence[ScheduleVariant] = (),
    ) -> None:
        super().__init__(message)
        self.group_ranks = tuple(group_ranks)
        self.variants = tuple(variants)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.group_ranks, self.variants))


def verify_schedule(
    group: dist.ProcessGroup, planned: PlannedCollective, device: torch.device
) -> None:
    """Compare ``planned`` with every rank of ``group``; raise on a mismatch (every rank).

    Raises:
        CollectiveScheduleError: the ranks' fingerprints differ (the message lists each
            variant and the global ranks that were about to run it).
        CollectiveError: the exchange itself failed (a peer is dead, hung, or waiting on
            a collective of another group), after at most the group's timeout.
    """
    plans = exchange_plans(group, RankPlan(planned), device)
    if plans is not None:
        raise _mismatch_error(list(dist.get_process_group_ranks(group)), plans)


def exchange_plans(
    group: dist.ProcessGroup, mine: RankPlan, device: torch.device
) -> list[RankPlan] | None:
    """The exchange under every cross-rank check of the layer (:func:`verify_schedule`,
    :func:`mc_groups.fail_together`, :func:`mc_groups.agree`): the ranks of ``group``
    exchange the 8-byte fingerprint of ``mine.planned``; None when every rank's is the
    same, else every rank's :class:`RankPlan` in group-rank order (all-gathered only then).

    Checks that meet on one group understand each other: whatever each was about to do,
    every rank learns every rank's plan. Not recorded by
    :func:`mc_groups.record_collectives`.

    Raises:
        CollectiveError: the exchange failed (a peer is dead, hung, or waiting on a
            collective of another group), after at most the group's timeout.
    """
    try:
        keys = _exchange_keys(group, mine.planned.key(), device)
        if len(set(keys)) == 1:
            return None
        plans: list[object] = [None] * group.size()
        dist.all_gather_object(plans, mine, group=group)
    except RuntimeError as err:
        ranks = list(dist.get_process_group_ranks(group))
        raise CollectiveError(
            f"schedule check before {mine.planned.describe()} on group ranks {ranks} "
            f"failed: {err} (the other ranks did not reach a collective on this group: dead, "
            "hung, or waiting on another group)"
        ) from err
    return [plan if isinstance(plan, RankPlan) else RankPlan(_UNKNOWN) for plan in plans]


_UNKNOWN = PlannedCollective("(an unknown plan)", "nothing")


_SCHEDULE_TAG = 0x6D64
"""The point-to-point tag of the fingerprint exchange on gloo (apart from user
``send``/``recv`` and the all-gather exchange)."""


def _exchange_keys(group: dist.ProcessGroup, key: int, device: torch.device) -> list[int]:
    """Every rank's fingerprint, in group-rank order. On gloo by point-to-point exchange,
    which does not queue behind the group's in-flight collectives (a gloo all-gather would
    wait for an overlapped bucket reduction issued just before); elsewhere one all-gather."""
    mine = torch.tensor([key], dtype=torch.int64, device=device)
    out = torch.empty(group.size(), dtype=torch.int64, device=device)
    if dist.get_backend(group) == "gloo":
        for work in exchange_rows(out, mine, group, tag=_SCHEDULE_TAG):
            work.wait()
    else:
        all_gather_flat(out, mine, group=group)
    return [int(v) for v in out.tolist()]


def _mismatch_error(ranks: Sequence[int], plans: Sequence[RankPlan]) -> CollectiveScheduleError:
    """The :class:`CollectiveScheduleError` of ``plans`` (every rank's, in group-rank order;
    ``ranks`` the group's global ranks): one variant per fingerprint, the most common
    first, each described by its first rank's plan."""
    members: dict[int, list[int]] = {}
    for group_rank, plan in enumerate(plans):
        members.setdefault(plan.planned.key(), []).append(group_rank)
    variants = [
        ScheduleVariant(tuple(ranks[i] for i in who), plans[who[0]])
        for who in sorted(members.values(), key=len, reverse=True)
    ]
    lines = [
        f"collective schedule mismatch on group ranks {list(ranks)}: the ranks were about to "
        f"run {len(variants)} different collectives (none was issued):"
    ]
    lines += [f"  rank(s) {list(v.ranks)}: {v.plan.describe()}" for v in variants]
    lines.append(
        "Every rank must issue the same collectives on a group in the same order: build "
        "the same model on every rank (same params, registered in the same order) and run "
        "the same layers."
    )
    return CollectiveScheduleError("\n".join(lines), ranks, variants)
