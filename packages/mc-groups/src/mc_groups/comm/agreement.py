"""Agreement: the ranks of a group compare named values once, and a difference is the same
error on every rank, naming each field that differs, its values and the ranks holding each.

Why: some settings must be equal on every rank of a group or the collectives that follow
hang, abort inside the backend, or mix data silently (a bucket size, a layer's width, a
vocabulary size). A check on each rank alone cannot see it; a check that fails on one rank
only leaves its peers waiting. mc's checks of that kind (the DDP construction,
:func:`mc_tp_layers.check_tp_agreement`, the vocabulary-parallel cross-entropy's per-call
arguments) are clients of this module.

Mechanism (:func:`agree`)::

    fingerprint   BLAKE2b of the fields (names and values), 8 bytes per rank exchanged
                  over the group through the schedule check's exchange
                  (:func:`mc_groups.comm.schedule_check.exchange_plans`: point to point on its
                  own tag on gloo, one all-gather elsewhere; not recorded by
                  :func:`mc_groups.record_collectives`)
    all equal     return; nothing else is communicated
    different     the ranks all-gather their fields (only then) and every rank raises the
                  same :class:`AgreementError`: its ``differences`` list each field that
                  differs (:class:`Difference`: the field, each value as shown, the global
                  ranks holding it), in the order the fields were given

A peer that was about to run something else on the group (a collective under the opt-in
schedule check, a :func:`mc_groups.fail_together` status exchange, an agreement on another
``what``) makes both sides raise :class:`~mc_groups.CollectiveScheduleError` naming what
each was about to run. A dead or hung peer: :class:`~mc_groups.CollectiveError` within the
group's timeout. Groups of one rank compare nothing.

Values are strings, numbers, booleans, None and tuples of those (compared by ``repr``, so
they must be the same objects' text on every rank). A tuple that differs is reported at its
first differing entry (``Difference.entry``), or by its length when the lengths differ.
:func:`differences` is the comparison alone, for a check whose values travelled another way
(the cross-entropy's ride along a reduction it runs anyway).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch.distributed as dist

from mc_groups.argcheck import check_group, check_str, type_name
from mc_groups.comm._common import key_device
from mc_groups.comm.schedule_check import (
    PlannedCollective,
    RankPlan,
    _mismatch_error,
    exchange_plans,
)
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["ABSENT", "AgreementError", "Difference", "Value", "agree", "differences"]

Value: TypeAlias = str | int | float | bool | tuple[object, ...] | None
"""What a field may hold, compared by ``repr`` across the ranks (a tuple holds these too,
checked at the call)."""

ABSENT = "(absent)"
"""How a field that some ranks did not pass is shown among its values."""

_KIND = "agreement"


class Difference(NamedTuple):
    """One field that the ranks of a group hold differently.

    ``values``: each distinct value as shown (a string as itself, anything else by its
    ``repr``; :data:`ABSENT` where a rank lacks the field; ``"N entries"`` when tuples
    differ in length) with the global ranks holding it, in the order of the first rank
    holding each. ``entry``: for tuples of equal length, the index of the first entry that
    differs (``values`` then shows that entry); None otherwise.
    """

    field: str
    values: tuple[tuple[str, tuple[int, ...]], ...]
    entry: int | None = None

    def values_text(self, separator: str = "; ") -> str:
        """``8 on rank(s) [0]; 6 on rank(s) [1]``."""
        return separator.join(f"{value} on rank(s) {list(ranks)}" for value, ranks in self.values)

    def describe(self, separator: str = "; ") -> str:
        """``field: 8 on rank(s) [0]; 6 on rank(s) [1]`` (``field, entry #i: ...`` for a
        tuple's entry)."""
        where = self.field if self.entry is None else f"{self.field}, entry #{self.entry}"
        return f"{where}: {self.values_text(separator)}"


class AgreementError(InputValueError):
    """The ranks of a group hold different values where they must agree; every rank of the
    group raises it, with the same message.

    ``what`` names what was compared, ``group_ranks`` are the group's global ranks and
    ``differences`` each :class:`Difference`. The packages' own agreement errors
    (:class:`mc_ddp.DataParallelAgreementError`,
    :class:`mc_tp_layers.TensorParallelAgreementError`) are subclasses with their own
    wording.
    """

    def __init__(
        self,
        message: str,
        what: str,
        group_ranks: Sequence[int],
        differences: Sequence[Difference],
    ) -> None:
        super().__init__(message)
        self.what = what
        self.group_ranks = tuple(group_ranks)
        self.differences = tuple(differences)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.what, self.group_ranks, self.differences))


def agree(group: dist.ProcessGroup, what: str, fields: Mapping[str, Value]) -> None:
    """Every rank of ``group`` holds the same ``fields``, else every rank raises the same
    :class:`AgreementError` (module notes).

    Collective over ``group``: every rank must call it, with the same ``what``. Cost: one
    8-byte exchange; on a difference, one all-gather of the fields. Nothing is compared on
    a group of one rank.

    Args:
        group: the ranks that must agree.
        what: what is compared, in the words of an error (``"DistributedDataParallel over
            dp_cp"``); part of the fingerprint, so two different checks never pass for one.
        fields: name → value, in the order an error lists them.
    """
    check_group("group", group)
    check_str("what", what)
    values = _checked_fields(fields)
    if group.size() == 1:
        return
    planned = PlannedCollective(_KIND, f"{len(values)} field(s)", what, _digest(values))
    plans = exchange_plans(group, RankPlan(planned, payload=values), key_device(group, None))
    if plans is None:
        return
    ranks = list(dist.get_process_group_ranks(group))
    if not all(p.planned.kind == _KIND and p.planned.label == what for p in plans):
        raise _mismatch_error(ranks, plans)  # a peer was about to run something else
    rows = [p.payload if isinstance(p.payload, dict) else {} for p in plans]
    found = differences(ranks, rows)
    lines = [f"  {difference.describe()}" for difference in found]
    raise AgreementError(
        "\n".join(
            [
                f"{what}: the ranks {ranks} of the group hold different values where they "
                "must agree (compared before anything that depends on them ran):",
                *lines,
                "Pass the same values on every rank of the group.",
            ]
        ),
        what,
        ranks,
        found,
    )


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


def _digest(values: Mapping[str, Value]) -> str:
    """16 bytes of BLAKE2b over the fields in name order (the order they were given in
    does not matter)."""
    text = "\n".join(f"{name}={values[name]!r}" for name in sorted(values))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


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
