"""The optional process default collection, and the one fallback to it.

mc passes groups explicitly. For code ported from Megatron-Core, which reads its groups
from ``parallel_state``, one :class:`~mc_groups.ProcessGroupCollection` may be registered
as the process default (:func:`set_default_collection`, or
``initialize_model_parallel(..., set_default=True)``); nothing in mc requires it.

Every mc function that accepts ``pg_collection=None`` (or a group argument that may be
None) resolves it through :func:`collection_or_default`, so the fallback behaves, and
fails, the same everywhere:

- a ``ProcessGroupCollection``: returned as is (a destroyed one is a ``RuntimeError``);
- ``None``: the registered default, or :class:`NoDefaultCollectionError` (a
  :class:`~mc_groups.collection.MissingGroupError`, so a ``ValueError``) saying how to pass groups
  or register a default; with ``required=False`` None is returned instead;
- anything else: ``TypeError``.

Messages share one shape: ``"<what> got no process group and no default
ProcessGroupCollection is registered: pass <explicit>, or register a default with ..."``,
``"<what>: pg_collection=<value> must be a mc_groups.ProcessGroupCollection or None ..."``
and ``"<what>: pg_collection was destroyed by destroy_model_parallel() ..."``.
"""

from __future__ import annotations

from typing import Literal, overload

from mc_groups.argcheck import check_collection
from mc_groups.collection import MissingGroupError, ProcessGroupCollection

__all__ = [
    "NoDefaultCollectionError",
    "clear_default_collection",
    "collection_or_default",
    "get_default_collection",
    "set_default_collection",
]

_PASS_COLLECTION = "pg_collection=initialize_model_parallel(...)"


class NoDefaultCollectionError(MissingGroupError):
    """A caller passed no groups and no default collection is registered."""


class _DefaultSlot:
    """Holds the optional process default collection (the one permitted global)."""

    collection: ProcessGroupCollection | None = None


def set_default_collection(collection: ProcessGroupCollection) -> None:
    """Register ``collection`` for callers that pass ``pg_collection=None``."""
    _DefaultSlot.collection = check_collection(
        "collection", collection, what="set_default_collection()"
    )


def get_default_collection() -> ProcessGroupCollection | None:
    """The registered default collection, or ``None`` when none was registered."""
    return _DefaultSlot.collection


def clear_default_collection() -> None:
    """Forget the registered default collection."""
    _DefaultSlot.collection = None


@overload
def collection_or_default(
    pg_collection: object,
    what: str,
    *,
    explicit: str = ...,
    required: Literal[True] = ...,
) -> ProcessGroupCollection: ...


@overload
def collection_or_default(
    pg_collection: object,
    what: str,
    *,
    explicit: str = ...,
    required: bool,
) -> ProcessGroupCollection | None: ...


def collection_or_default(
    pg_collection: object,
    what: str,
    *,
    explicit: str = _PASS_COLLECTION,
    required: bool = True,
) -> ProcessGroupCollection | None:
    """``pg_collection``, or the registered default when it is None.

    Args:
        pg_collection: the caller's argument: a ``ProcessGroupCollection`` (mc's, or another
            library's such as Megatron-Core's, adopted by its group attributes) or None.
        what: the caller, as its errors name it (``"DistributedDataParallel"``).
        explicit: how the caller's user passes groups explicitly, for the error without a
            default (``"tp_group=<ProcessGroup> or pg_collection=<ProcessGroupCollection>"``,
            ``"pp_group=pg_collection.pp"``).
        required: with False, None and no default registered returns None (callers that
            fall back further, e.g. to rank 0 of a single process).

    Raises:
        TypeError: ``pg_collection`` is neither None nor a collection.
        RuntimeError: the collection was destroyed by ``destroy_model_parallel()``.
        NoDefaultCollectionError: None, no default registered, and ``required``.
    """
    collection = _DefaultSlot.collection if pg_collection is None else pg_collection
    if collection is None:
        if not required:
            return None
        raise NoDefaultCollectionError(
            f"{what} got no process group and no default ProcessGroupCollection is "
            f"registered: pass {explicit}, or register a default with "
            "initialize_model_parallel(..., set_default=True) or "
            "mc_groups.set_default_collection(collection)"
        )
    return check_collection("pg_collection", collection, what=what)
