"""Field checks of :class:`~mc_ddp.DistributedDataParallelConfig`: each error names the
field, the value and the fix."""

from __future__ import annotations

from collections.abc import Collection


def check_flag(name: str, value: object) -> None:
    """A real bool: a truthy object is usually a misplaced positional argument."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool (True or False)")


def check_optional_count(name: str, value: object, *, allow_none: bool = True) -> None:
    """An int >= 1 (or None when allowed); a bool is rejected, not read as 0 or 1."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        why = " (a bool is not a count)" if isinstance(value, bool) else ""
        none = " or None" if allow_none else ""
        raise TypeError(f"{name}={value!r} must be an int{none}{why}")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")


def check_patterns(patterns: object) -> None:
    """A list/tuple of fnmatch patterns; a bare str would be iterated per character."""
    name = "param_name_patterns_for_fp32_local_accumulation"
    if isinstance(patterns, str) or not isinstance(patterns, Collection):
        raise TypeError(
            f"{name}={patterns!r} must be a list of fnmatch patterns, e.g. ['all'] or "
            "['*.layernorm.weight']"
        )
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{name} holds {pattern!r}; every pattern must be a str")


def need(condition: bool, message: str) -> None:
    """``ValueError(message)`` unless ``condition``."""
    if not condition:
        raise ValueError(message)
