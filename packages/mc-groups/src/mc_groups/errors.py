"""The error types of mc, shared by every package: bad input, failed collectives, and ranks
that disagree.

**Bad input.** mc checks its arguments and raises a ``ValueError`` / ``TypeError`` naming the
argument, the value and the fix, before anything changes or communicates. Megatron-Core
states most of the same conditions as ``assert`` statements, so code written for Megatron
(its own unit tests, a user's ``except AssertionError``) expects an ``AssertionError``. These
types are both: :class:`InputValueError` is a ``ValueError`` and an ``AssertionError``,
:class:`InputTypeError` a ``TypeError`` and an ``AssertionError``, and
:class:`InputStateError` (a call in a state that forbids it, e.g. a grad sync finished
before its grads are ready) a ``RuntimeError`` and an ``AssertionError``. Catching any one
of the three base types works.

**Collectives.** :class:`CollectiveError`: a collective failed or did not finish in time; the
message names the op, the group's global ranks and the caller's label.

**Ranks that disagree** (raised on every rank of the group by :mod:`mc_groups.comm.cross_rank`,
each with the same message): :class:`PeerCheckError` (another rank's checks failed at the
point this rank was at), :class:`AgreementError` (the ranks hold different values where they
must agree; its :class:`Difference` s name each field), :class:`CollectiveScheduleError`
(the ranks were about to run different collectives or checks; its
:class:`ScheduleVariant` s say which ranks were about to run what).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "ABSENT",
    "AgreementError",
    "CollectiveError",
    "CollectiveScheduleError",
    "Difference",
    "InputStateError",
    "InputTypeError",
    "InputValueError",
    "PeerCheckError",
    "ScheduleVariant",
]


class InputValueError(ValueError, AssertionError):
    """An argument of the right type with a value that cannot work (also an
    ``AssertionError``, as Megatron-Core's ``assert`` on the same condition)."""


class InputTypeError(TypeError, AssertionError):
    """An argument of the wrong type (also an ``AssertionError``, as Megatron-Core's
    ``assert isinstance(...)``)."""


class InputStateError(RuntimeError, AssertionError):
    """A call the object's state forbids (also an ``AssertionError``, as Megatron-Core's
    ``assert`` on the same state)."""


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time; the message names op and group."""


class ScheduleVariant(NamedTuple):
    """One of the different things the ranks of a group were about to run: the global
    ``ranks`` that were about to run it and its ``description`` (what the first of them
    was about to run, with its failed check's message when there was one)."""

    ranks: tuple[int, ...]
    description: str


class CollectiveScheduleError(CollectiveError):
    """The ranks of a group were about to run different collectives or cross-rank checks
    (found before anything of them was issued); every rank of the group raises it.

    ``group_ranks`` (the group's global ranks) and ``variants`` (each
    :class:`ScheduleVariant`, the most common first) say the same as the message, for code
    that reacts to them."""

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


class PeerCheckError(InputValueError):
    """Another rank's checks failed at the point this rank was at; every rank of the group
    raises (the failing ones their own error), nothing was allocated or changed.
    ``failures`` maps each failing global rank to its error's text."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failures))


ABSENT = "(absent)"
"""How a field that some ranks did not pass is shown among its values."""


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
