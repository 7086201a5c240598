"""Argument checks every mc package shares: one home, one message shape.

Each check returns the checked value (normalised: ``int(...)``, ``float(...)``) or raises
before anything changes or communicates:

- ``TypeError`` for a wrong type: ``"<name>=<value!r> must be <what>"``. Bools are bools
  (``True`` is not the count 1, ``'no'`` is not False: a truthy object in a flag's place is
  usually a misplaced positional argument);
- ``ValueError`` for a value of the right type outside its range, with the same shape and
  the fix where there is one.

The checks' own keyword arguments (``minimum``, ``positive``, ...) are checked the same way.

Process groups are arguments too: :func:`check_group` (a live ``ProcessGroup``; a
destroyed one is a ``RuntimeError``) and :func:`check_optional_group`; a collection is
checked where it is defined (:func:`mc_groups.collection.check_collection`). Their
``what=`` names the caller when the argument's name alone would not say where it failed.

Domain checks (divisibility by a group size, shapes against a layout) stay with their
package; they use these for the types. Cheap: ``isinstance``, comparisons and a dictionary
lookup (a group's liveness) only, nothing that synchronises a device or communicates, so
the checks may run on hot paths.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from numbers import Integral, Real

import torch
import torch.distributed as dist

from mc_groups.collection import is_group_live
from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "check_flag",
    "check_float_dtype",
    "check_group",
    "check_int",
    "check_optional_group",
    "check_optional_int",
    "check_optional_str",
    "check_patterns",
    "check_real",
    "check_str",
    "check_tensor",
    "type_name",
]


def type_name(value: object) -> str:
    """The type of ``value`` as a message names it: ``module.QualName`` (builtins bare), so
    two classes of one name from different libraries are told apart (mc's and Megatron's
    ``FullParamLayout``)."""
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def check_flag(name: str, value: object) -> bool:
    """``value`` when it is a bool (``True``/``False``), else a ``TypeError``."""
    if not isinstance(value, bool):
        raise InputTypeError(f"{name}={value!r} must be a bool (True or False)")
    return value


def check_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int ``>= minimum`` (and ``<= maximum`` when given); bools and floats
    are ``TypeError``."""
    if type(value) is int and type(minimum) is int and maximum is None and value >= minimum:
        return value  # the common case, without the ``Integral`` ABC check (per-call paths)
    _check_bound("minimum", minimum)
    if maximum is not None:
        _check_bound("maximum", maximum)
    if isinstance(value, bool) or not isinstance(value, Integral):
        why = " (a bool is not a number)" if isinstance(value, bool) else ""
        raise InputTypeError(f"{name}={value!r} must be an int{why}")
    number = int(value)
    if number < minimum:
        raise InputValueError(f"{name}={value} must be >= {minimum}")
    if maximum is not None and number > maximum:
        raise InputValueError(f"{name}={value} must be <= {maximum}")
    return number


def _check_bound(name: str, bound: object) -> None:
    # A check's own arguments: a wrong bound would compare an int with a str, or pass 1.5.
    if isinstance(bound, bool) or not isinstance(bound, int):
        raise InputTypeError(f"{name}={bound!r} must be an int")


def check_optional_int(
    name: str, value: object, *, minimum: int = 1, maximum: int | None = None
) -> int | None:
    """``None``, or ``value`` checked by :func:`check_int`."""
    if value is None:
        return None
    return check_int(name, value, minimum=minimum, maximum=maximum)


def check_real(
    name: str, value: object, *, positive: bool = False, allow_zero: bool = True
) -> float:
    """``value`` as a finite float (NaN and ±inf are ``ValueError``; bools ``TypeError``).

    ``positive``: also ``> 0`` (``>= 0`` with ``allow_zero``).
    """
    check_flag("positive", positive)
    check_flag("allow_zero", allow_zero)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InputTypeError(f"{name}={value!r} must be a real number")
    number = float(value)
    if not math.isfinite(number):
        raise InputValueError(f"{name}={value!r} must be finite (not NaN or ±inf)")
    if positive and (number < 0 or (number == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise InputValueError(f"{name}={value!r} must be {bound}")
    return number


def check_float_dtype(name: str, value: object, *, allow_none: bool = False) -> torch.dtype | None:
    """A floating-point ``torch.dtype`` (or None when allowed); ``torch.int64`` or a string
    such as ``'bf16'`` is a ``TypeError``."""
    if check_flag("allow_none", allow_none) and value is None:
        return None
    if not isinstance(value, torch.dtype):
        none = " or None" if allow_none else ""
        raise InputTypeError(
            f"{name}={value!r} must be a floating-point torch.dtype (e.g. torch.bfloat16){none}"
        )
    if not value.is_floating_point:
        raise InputTypeError(f"{name}={value} must be a floating-point dtype (e.g. torch.bfloat16)")
    return value


def check_str(name: str, value: object, *, allow_empty: bool = True) -> str:
    """``value`` when it is a ``str`` (non-empty unless ``allow_empty``), else a
    ``TypeError`` (``ValueError`` for an empty one)."""
    if not isinstance(value, str):
        raise InputTypeError(f"{name}={value!r} must be a str")
    if not value and not check_flag("allow_empty", allow_empty):
        raise InputValueError(f"{name}='' must be a non-empty str")
    return value


def check_optional_str(name: str, value: object) -> str | None:
    """``None``, or ``value`` checked by :func:`check_str`."""
    return None if value is None else check_str(name, value)


def check_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` when it is a ``torch.Tensor``, else a ``TypeError`` naming its type."""
    if not isinstance(value, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type_name(value)}")
    return value


def check_patterns(name: str, value: object) -> tuple[str, ...]:
    """A collection of ``fnmatch`` pattern strings; a bare str would be iterated per
    character, so it is a ``TypeError`` suggesting the list."""
    if isinstance(value, str) or not isinstance(value, Collection):
        raise InputTypeError(
            f"{name}={value!r} must be a list of fnmatch patterns, e.g. ['all'] or "
            "['*.layernorm.weight']"
        )
    for pattern in value:
        if not isinstance(pattern, str):
            raise InputTypeError(f"{name} holds {pattern!r}; every pattern must be a str")
    return tuple(value)


def check_group(name: str, value: object, *, what: str = "") -> dist.ProcessGroup:
    """``value`` when it is a live ``torch.distributed.ProcessGroup``: another type is a
    ``TypeError``, a group destroyed since (``destroy_model_parallel()``,
    ``torch.distributed.destroy_process_group()``) a ``RuntimeError``. ``what`` names the
    caller (``"embedding grads: embd_group=..."``)."""
    if isinstance(value, dist.ProcessGroup) and is_group_live(value):
        return value  # the common case in one call (layers and collectives check per call)
    return _live_group(name, value, what, "")


def check_optional_group(name: str, value: object, *, what: str = "") -> dist.ProcessGroup | None:
    """``None``, or ``value`` checked by :func:`check_group`."""
    if value is None:
        return None
    return _live_group(name, value, what, " or None")


def _live_group(name: str, value: object, what: str, or_none: str) -> dist.ProcessGroup:
    caller = f"{what}: " if what else ""
    if not isinstance(value, dist.ProcessGroup):
        raise InputTypeError(
            f"{caller}{name}={value!r} must be a torch.distributed.ProcessGroup{or_none} (e.g. "
            "a field of the ProcessGroupCollection that initialize_model_parallel() returns)"
        )
    if not is_group_live(value):
        raise RuntimeError(
            f"{caller}{name} (a process group of {value.size()} rank(s)) was destroyed "
            "(destroy_model_parallel() or torch.distributed.destroy_process_group()) or "
            "torch.distributed is no longer initialised; build new groups "
            "(initialize_model_parallel()) and new objects on them"
        )
    return value
