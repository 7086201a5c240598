"""The error types of bad input, shared by every mc package.

mc checks its arguments and raises a ``ValueError`` / ``TypeError`` naming the argument,
the value and the fix, before anything changes or communicates. Megatron-Core states most
of the same conditions as ``assert`` statements, so code written for Megatron (its own unit
tests, a user's ``except AssertionError``) expects an ``AssertionError``. These types are
both: :class:`InputValueError` is a ``ValueError`` and an ``AssertionError``,
:class:`InputTypeError` a ``TypeError`` and an ``AssertionError``, and
:class:`InputStateError` (a call in a state that forbids it, e.g. a grad sync finished
before its grads are ready) a ``RuntimeError`` and an ``AssertionError``. Catching any one
of the three base types works.
"""

from __future__ import annotations

__all__ = ["InputStateError", "InputTypeError", "InputValueError"]


class InputValueError(ValueError, AssertionError):
    """An argument of the right type with a value that cannot work (also an
    ``AssertionError``, as Megatron-Core's ``assert`` on the same condition)."""


class InputTypeError(TypeError, AssertionError):
    """An argument of the wrong type (also an ``AssertionError``, as Megatron-Core's
    ``assert isinstance(...)``)."""


class InputStateError(RuntimeError, AssertionError):
    """A call the object's state forbids (also an ``AssertionError``, as Megatron-Core's
    ``assert`` on the same state)."""
